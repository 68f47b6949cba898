//! When a pod worker may sync again after a failed sync: the kubelet's error
//! back-off, and how soon a PLEG event may cut it short.
//!
//! The back-off is the kubelet's `completeWork` (`pod_workers.go`): a failed
//! sync is requeued after `backOffPeriod` (10 s, `kubelet.go`) with
//! `wait.Jitter` 0.5, so 10 to 15 s, every time (it does not grow); one that
//! failed because the network is not ready ("network is not ready") after
//! 1 s with the same jitter (`backOffOnTransientErrorPeriod`).
//!
//! The kubelet requeues a pod whose sync failed after its back-off period, but
//! any PLEG event for the pod wakes the worker at once. Its PLEG relists once a
//! second, so after a failure the next event, and the retry, comes at the
//! earliest at the next relist. Here a PLEG event comes within milliseconds, and
//! a failure can make its own event: a RunPodSandbox refused by the network
//! leaves a sandbox the runtime lists as not ready, whose discovery by the pod
//! relist that follows every sync woke the worker for another attempt at once
//! (seven a second in one run). So the kubelet's cadence is kept explicitly:
//! after a failed sync, a PLEG event (or a probe result) brings the retry
//! forward to no sooner than [`EVENT_RETRY_FLOOR`] after the failure; a new
//! spec or a kill still syncs at once, and the back-off's own timer fires as
//! before.

use std::time::Duration;

use tokio::time::Instant;

/// How soon after a failed sync a PLEG event may cause the retry: the
/// kubelet's relist period, the soonest its PLEG can report anything after a
/// failure.
pub const EVENT_RETRY_FLOOR: Duration = Duration::from_secs(1);

/// The kubelet's `backOffPeriod`: the requeue after a failed sync.
pub const BACK_OFF_PERIOD: Duration = Duration::from_secs(10);

/// The kubelet's `backOffOnTransientErrorPeriod`: the requeue after a sync
/// that failed because the node's network is not ready.
pub const TRANSIENT_BACK_OFF_PERIOD: Duration = Duration::from_secs(1);

/// The kubelet's `workerBackOffPeriodJitterFactor`.
pub const BACK_OFF_JITTER: f64 = 0.5;

/// The kubelet's `NetworkNotReadyErrorMsg`: a sync error containing it backs
/// off for [`TRANSIENT_BACK_OFF_PERIOD`].
pub const NETWORK_NOT_READY: &str = "network is not ready";

/// Go's `wait.Jitter(d, factor)` with `unit` its random number in `[0, 1)`:
/// `d` plus up to `factor` times `d`.
pub fn go_jitter(d: Duration, factor: f64, unit: f64) -> Duration {
    d + d.mul_f64(factor * unit.clamp(0.0, 1.0))
}

/// A random number in `[0, 1)` (std's per-instance random hash keys: enough
/// to spread retries, nothing more).
pub fn random_unit() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let bits = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

/// The back-off after a sync failed with `error` (`completeWork`), `unit`
/// the jitter's random number: `period` for any error, 1 s for a network not
/// ready, each with 0.5 jitter.
pub fn backoff_after(error: &str, period: Duration, unit: f64) -> Duration {
    let base = if error.contains(NETWORK_NOT_READY) {
        TRANSIENT_BACK_OFF_PERIOD
    } else {
        period
    };
    go_jitter(base, BACK_OFF_JITTER, unit)
}

/// What woke a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    /// Its requeue timer (back-off, CrashLoopBackOff, periodic resync).
    Timer,
    /// A PLEG event or a probe result.
    Event,
    /// A new pod, a new spec, or a kill.
    Update,
}

/// The worker's retry state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    /// The last sync succeeded: every wake-up syncs at once.
    Clear,
    /// The last `failures` syncs failed, the last one at `failed_at`; the
    /// timer fires `backoff` after it.
    BackingOff {
        failures: u32,
        failed_at: Instant,
        backoff: Duration,
    },
}

impl Retry {
    /// Transition: a sync failed at `now`; the timer fires `backoff` later
    /// ([`backoff_after`]).
    pub fn failed(self, now: Instant, backoff: Duration) -> Self {
        let failures = match self {
            Self::Clear => 1,
            Self::BackingOff { failures, .. } => failures.saturating_add(1),
        };
        Self::BackingOff {
            failures,
            failed_at: now,
            backoff,
        }
    }

    /// Transition: a sync succeeded.
    pub fn succeeded(self) -> Self {
        Self::Clear
    }

    /// The back-off before the timer syncs again (`None` when clear).
    pub fn backoff(&self) -> Option<Duration> {
        match self {
            Self::Clear => None,
            Self::BackingOff { backoff, .. } => Some(*backoff),
        }
    }

    /// When a worker woken by `wake` at `now` may sync: `None` at once,
    /// `Some(t)` not before `t` (an update arriving meanwhile syncs at once).
    pub fn hold(&self, wake: Wake, now: Instant) -> Option<Instant> {
        let Self::BackingOff {
            failed_at, backoff, ..
        } = *self
        else {
            return None;
        };
        if wake != Wake::Event {
            return None;
        }
        let from = failed_at + backoff.min(EVENT_RETRY_FLOOR);
        (now < from).then_some(from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// `completeWork`: 10 s plus up to half of it for any error, every
    /// time; 1 s plus up to half for a network not ready.
    #[test]
    fn the_back_off_is_the_kubelet_s_ten_seconds_with_jitter() {
        // (error, jitter's random number, back-off in ms)
        let cases: &[(&str, f64, u128)] = &[
            ("runtime unavailable", 0.0, 10_000),
            ("runtime unavailable", 0.5, 12_500),
            ("runtime unavailable", 0.999, 14_995),
            (
                "network is not ready: container runtime network not ready",
                0.0,
                1_000,
            ),
            (
                "network is not ready: container runtime network not ready",
                0.5,
                1_250,
            ),
        ];
        for (error, unit, want) in cases {
            let got = backoff_after(error, BACK_OFF_PERIOD, *unit).as_millis();
            assert_eq!(got, *want, "{error} at {unit}");
        }
        for _ in 0..100 {
            let u = random_unit();
            assert!((0.0..1.0).contains(&u), "{u}");
        }
        // It does not grow with the failures in a row.
        let t0 = Instant::now();
        let mut r = Retry::Clear;
        for _ in 0..5 {
            r = r.failed(t0, ms(10_000));
            assert_eq!(r.backoff(), Some(ms(10_000)));
        }
        assert_eq!(r.succeeded(), Retry::Clear);
        assert_eq!(Retry::Clear.backoff(), None);
    }

    #[test]
    fn hold_table() {
        let t0 = Instant::now();
        let backing_off = |backoff_ms: u64| Retry::BackingOff {
            failures: 3,
            failed_at: t0,
            backoff: ms(backoff_ms),
        };
        // (state, wake, ms after the failure, held until ms after the failure)
        let cases: &[(Retry, Wake, u64, Option<u64>)] = &[
            (Retry::Clear, Wake::Event, 0, None),
            (Retry::Clear, Wake::Timer, 0, None),
            (Retry::Clear, Wake::Update, 0, None),
            // An event 80 ms after the failure waits for the floor.
            (backing_off(4000), Wake::Event, 80, Some(1000)),
            (backing_off(4000), Wake::Event, 999, Some(1000)),
            (backing_off(4000), Wake::Event, 1000, None),
            (backing_off(4000), Wake::Event, 2500, None),
            // A back-off shorter than the floor bounds the hold.
            (backing_off(500), Wake::Event, 80, Some(500)),
            (backing_off(500), Wake::Event, 600, None),
            // A new spec or a kill, and the timer, never wait.
            (backing_off(4000), Wake::Update, 80, None),
            (backing_off(4000), Wake::Timer, 80, None),
        ];
        for (i, (state, wake, at, want)) in cases.iter().enumerate() {
            let got = state.hold(*wake, t0 + ms(*at));
            assert_eq!(
                got,
                want.map(|n| t0 + ms(n)),
                "case {i}: {state:?} {wake:?} at {at} ms"
            );
        }
    }
}
