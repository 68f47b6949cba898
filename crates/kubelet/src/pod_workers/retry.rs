//! When a pod worker may sync again after a failed sync: the kubelet's error
//! back-off, and how soon a PLEG event may cut it short.
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
    /// Transition: a sync failed at `now`. The back-off doubles from
    /// `initial` with each failure in a row, up to `max`.
    pub fn failed(self, now: Instant, initial: Duration, max: Duration) -> Self {
        let failures = match self {
            Self::Clear => 1,
            Self::BackingOff { failures, .. } => failures.saturating_add(1),
        };
        let backoff = initial
            .saturating_mul(1 << failures.min(16).saturating_sub(1))
            .min(max);
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

    #[test]
    fn the_back_off_doubles_up_to_its_cap_and_clears_on_success() {
        let t0 = Instant::now();
        let mut r = Retry::Clear;
        let mut seen = Vec::new();
        for _ in 0..8 {
            r = r.failed(t0, ms(500), ms(30_000));
            seen.push(r.backoff().unwrap().as_millis());
        }
        assert_eq!(seen, [500, 1000, 2000, 4000, 8000, 16000, 30000, 30000]);
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
