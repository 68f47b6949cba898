//! CrashLoopBackOff: the kubelet's per-container restart back-off
//! (`flowcontrol.Backoff` as `kuberuntime`'s `doBackOff` uses it): 10 s doubling
//! to 5 min by default, keyed by the pod, the container's name and its spec hash
//! (a changed spec starts without back-off), measured from the exited container's
//! finish time (the runtime's `finishedAt`, or the kernel's death time, which
//! precedes it by the runtime's reaping: see [`super::actions`]). As
//! `flowcontrol.Backoff`, an entry remembers when the last restart decision
//! was taken (`Next` stores `Now()`), not the finish it was about. An entry
//! whose last decision is too old before the next finish starts over: for
//! CrashLoopBackOff that is 600 s whatever the cap (`kubelet.go` sets the
//! back-off's `HasExpiredFunc` so: [`Backoff::crash_loop`]), so a container
//! that ran 10 minutes after its restart without crashing restarts at once
//! and then waits the initial period again (one that waited out a 5 min
//! back-off and then ran 6 min does not start over); with a cap of 1 s
//! (`crashLoopBackOff.maxContainerRestartPeriod`) a container that ran 3 s
//! still waits 1 s. Times are Unix nanoseconds (container finish times are
//! wall-clock).
//!
//! The image manager's pull back-off is the same [`Backoff`], keyed by pod and
//! image and measured from the last failed pull ([`ImagePullBackoff`]), with
//! `flowcontrol.Backoff`'s own expiry: twice the cap.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::Duration;

use evpleg_core::ids::PodUid;

/// The kubelet's defaults.
pub const INITIAL_BACKOFF: Duration = Duration::from_secs(10);
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// How long after its last restart decision a CrashLoopBackOff entry starts
/// over, whatever the cap (`kubelet.go`'s `HasExpiredFunc` for
/// `crashLoopBackOff`).
pub const CRASH_LOOP_RESET: Duration = Duration::from_secs(600);

/// What a back-off entry is kept for: the kubelet's stable container key
/// (pod, container name, spec hash).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BackoffKey {
    pub pod: PodUid,
    pub container: String,
    pub hash: u64,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    backoff: Duration,
    /// When the last decision was taken (`lastUpdate`).
    last_update_ns: i64,
}

/// A container that must still wait before its restart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InBackoff {
    /// The current back-off period (stable: the status message shows it).
    pub period: Duration,
    /// Time left until the restart.
    pub left: Duration,
}

/// The kubelet's `flowcontrol.Backoff`: per-key exponential back-off.
#[derive(Clone, Debug)]
pub struct Backoff<K> {
    initial: Duration,
    max: Duration,
    /// An entry whose last decision is more than this before the event
    /// starts over (`hasExpired`).
    expire_after: Duration,
    entries: HashMap<K, Entry>,
}

/// Restart back-off of containers.
pub type CrashBackoff = Backoff<BackoffKey>;

/// The image pull back-off: (pod, image).
pub type ImagePullBackoff = Backoff<(PodUid, String)>;

impl<K: Hash + Eq> Default for Backoff<K> {
    fn default() -> Self {
        Self::new(INITIAL_BACKOFF, MAX_BACKOFF)
    }
}

impl<K: Hash + Eq> Backoff<K> {
    /// `flowcontrol.NewBackOff`: an entry expires twice the cap after its
    /// last decision (`hasExpired` without a `HasExpiredFunc`).
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            expire_after: max.saturating_mul(2),
            entries: HashMap::new(),
        }
    }

    fn expired(&self, e: &Entry, at_ns: i64) -> bool {
        at_ns.saturating_sub(e.last_update_ns) > self.expire_after.as_nanos() as i64
    }

    /// Whether the container that finished at `finished_ns` must still wait at
    /// `now_ns` (the kubelet's `IsInBackOffSince`: an entry whose last
    /// decision is more than twice the cap before that finish is over).
    pub fn in_backoff(&self, key: &K, finished_ns: i64, now_ns: i64) -> Option<InBackoff> {
        let e = self.entries.get(key)?;
        if self.expired(e, finished_ns) {
            return None;
        }
        let until = finished_ns.saturating_add(e.backoff.as_nanos() as i64);
        (now_ns < until).then(|| InBackoff {
            period: e.backoff,
            left: Duration::from_nanos((until - now_ns) as u64),
        })
    }

    /// Records, at `now_ns`, the decision to restart the container that
    /// finished at `finished_ns` (the kubelet's `Next(id, eventTime)`): the
    /// next wait doubles, up to the cap, or starts over when the last decision
    /// is more than twice the cap before this finish; the decision's time is
    /// kept.
    pub fn restarting(&mut self, key: K, finished_ns: i64, now_ns: i64) {
        let backoff = match self.entries.get(&key) {
            Some(e) if !self.expired(e, finished_ns) => (e.backoff * 2).min(self.max),
            _ => self.initial,
        };
        self.entries.insert(
            key,
            Entry {
                backoff,
                last_update_ns: now_ns,
            },
        );
    }

    /// Whether `key` is still in back-off at `now_ns`, counted from its last
    /// [`restarting`](Self::restarting) (the kubelet's `IsInBackOffSinceUpdate`).
    pub fn in_backoff_since_update(&self, key: &K, now_ns: i64) -> Option<InBackoff> {
        let e = self.entries.get(key)?;
        if self.expired(e, now_ns) {
            return None;
        }
        let until = e.last_update_ns.saturating_add(e.backoff.as_nanos() as i64);
        (now_ns < until).then(|| InBackoff {
            period: e.backoff,
            left: Duration::from_nanos((until - now_ns) as u64),
        })
    }

    /// Forgets the entries `keep` refuses.
    pub fn retain(&mut self, keep: impl Fn(&K) -> bool) {
        self.entries.retain(|k, _| keep(k));
    }

    /// Forgets `key`.
    pub fn reset(&mut self, key: &K) {
        self.entries.remove(key);
    }
}

impl CrashBackoff {
    /// The kubelet's `crashLoopBackOff` (`kubelet.go`): `NewBackOff(initial,
    /// max)` whose entries expire [`CRASH_LOOP_RESET`] after their last
    /// decision, not twice the cap.
    pub fn crash_loop(initial: Duration, max: Duration) -> Self {
        Self {
            expire_after: CRASH_LOOP_RESET,
            ..Self::new(initial, max)
        }
    }

    /// Forgets a pod's entries (it was removed).
    pub fn forget(&mut self, pod: &PodUid) {
        self.retain(|k| k.pod != *pod);
    }
}

/// A duration as Go's `time.Duration` prints it (`200ms`, `10s`, `1.5s`,
/// `2m40s`, `5m0s`), as the kubelet's back-off message shows it; microsecond
/// precision.
pub fn go_duration(d: Duration) -> String {
    // "12.500" -> "12.5", "3.000" -> "3".
    fn decimal(whole: u128, frac: u128, digits: usize) -> String {
        let f = format!("{frac:0digits$}");
        let f = f.trim_end_matches('0');
        if f.is_empty() {
            whole.to_string()
        } else {
            format!("{whole}.{f}")
        }
    }
    let us = d.as_micros();
    if us == 0 {
        return "0s".into();
    }
    if us < 1_000 {
        return format!("{us}µs");
    }
    if us < 1_000_000 {
        return format!("{}ms", decimal(us / 1_000, us % 1_000, 3));
    }
    let secs = us / 1_000_000;
    let s = decimal(secs % 60, us % 1_000_000, 6);
    match secs {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{s}s", secs / 60),
        _ => format!("{}h{}m{s}s", secs / 3600, secs % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000_000_000;

    fn key(hash: u64) -> BackoffKey {
        BackoffKey {
            pod: PodUid::parse(&"a".repeat(32)).unwrap(),
            container: "app".into(),
            hash,
        }
    }

    #[test]
    fn doubles_to_the_cap_from_each_finish() {
        let mut b = CrashBackoff::default();
        assert_eq!(
            b.in_backoff(&key(1), 0, 1),
            None,
            "the first restart is immediate"
        );
        b.restarting(key(1), 0, 0);
        // The second exit, 5 s after the first finish: 10 s from its own finish.
        assert_eq!(
            b.in_backoff(&key(1), 5 * S, 6 * S),
            Some(InBackoff {
                period: Duration::from_secs(10),
                left: Duration::from_secs(9)
            })
        );
        assert_eq!(b.in_backoff(&key(1), 5 * S, 15 * S), None);
        let mut periods = Vec::new();
        let mut t = 0;
        for _ in 0..8 {
            t += 10 * S;
            b.restarting(key(1), t, t);
            periods.push(b.in_backoff(&key(1), t, t).unwrap().period.as_secs());
        }
        assert_eq!(periods, [20, 40, 80, 160, 300, 300, 300, 300]);
    }

    /// The table of the kubelet's resets: a container that ran more than twice
    /// the cap (10 min) since the last decision, a changed spec, a removed pod.
    #[test]
    fn resets_after_ten_minutes_a_new_spec_or_the_pod_s_removal() {
        let mut b = CrashBackoff::default();
        for t in [0, 10, 30, 70] {
            b.restarting(key(1), t * S, t * S);
        }
        assert_eq!(
            b.in_backoff(&key(1), 70 * S, 70 * S)
                .unwrap()
                .period
                .as_secs(),
            80
        );
        // It ran 9 min: still doubling.
        b.restarting(key(1), (70 + 540) * S, (70 + 540) * S);
        assert_eq!(
            b.in_backoff(&key(1), 610 * S, 610 * S)
                .unwrap()
                .period
                .as_secs(),
            160
        );
        // It ran 10 min 1 s: not in back-off at its exit, and the next decision
        // starts over at 10 s.
        let finish = 610 * S + 601 * S;
        assert_eq!(b.in_backoff(&key(1), finish, finish + S), None);
        b.restarting(key(1), finish, finish);
        assert_eq!(
            b.in_backoff(&key(1), finish, finish).unwrap().period,
            INITIAL_BACKOFF
        );
        // Another spec hash has its own entry.
        assert_eq!(b.in_backoff(&key(2), finish, finish), None);
        b.forget(&key(1).pod);
        assert_eq!(b.in_backoff(&key(1), finish, finish), None);
    }

    /// Issue #27 item 9: at the 5 min cap the restart decision comes 5 min
    /// after the finish, and `flowcontrol.Backoff` keeps the decision's time:
    /// a container that then ran 6 min (11 min after its previous finish)
    /// is still in back-off and doubles at the cap; one that ran 10 min 1 s
    /// after the decision starts over. Before, the finish was kept, and 5 min
    /// of running reset it. The wait counts from the new finish, whole.
    #[test]
    fn the_reset_counts_from_the_restart_decision_not_the_finish() {
        let mut b = CrashBackoff::default();
        let mut t = 0;
        for _ in 0..6 {
            b.restarting(key(1), t, t);
            t += S;
        }
        assert_eq!(b.in_backoff(&key(1), t, t).unwrap().period, MAX_BACKOFF);
        // It finished at t and waited out the cap: the decision at t + 5 min.
        let decided = t + 300 * S;
        b.restarting(key(1), t, decided);
        // It ran 6 min: 11 min after its finish, 6 min after the decision.
        let finish = decided + 360 * S;
        assert_eq!(
            b.in_backoff(&key(1), finish, finish + S),
            Some(InBackoff {
                period: MAX_BACKOFF,
                left: MAX_BACKOFF - Duration::from_secs(1)
            })
        );
        b.restarting(key(1), finish, finish + 300 * S);
        // It ran 10 min 1 s after that decision: over.
        let finish = finish + 300 * S + 601 * S;
        assert_eq!(b.in_backoff(&key(1), finish, finish + S), None);
        b.restarting(key(1), finish, finish + S);
        assert_eq!(
            b.in_backoff(&key(1), finish, finish + S).unwrap().period,
            INITIAL_BACKOFF
        );
    }

    /// The kubelet's CrashLoopBackOff starts over 600 s after its last
    /// decision whatever the cap; the image pull back-off (plain
    /// `flowcontrol.Backoff`) twice its cap after. With a 1 s cap (the
    /// differential oracle's), a container that crashed 3 s after its restart
    /// decision still waits 1 s from its finish; before, its entry had
    /// expired (2 s) and it restarted at once. (finish after the decision s,
    /// now after the finish ms) -> in back-off.
    #[test]
    fn a_short_cap_does_not_shorten_the_crash_loop_reset() {
        let cases = [
            (1, 500, true),
            (3, 500, true),
            (3, 1_000, false),
            (599, 999, true),
            (601, 0, false),
        ];
        for (ran, after_ms, waits) in cases {
            let mut b = CrashBackoff::crash_loop(Duration::from_secs(1), Duration::from_secs(1));
            b.restarting(key(1), 0, 10 * S);
            let finish = 10 * S + ran * S;
            let now = finish + after_ms * 1_000_000;
            assert_eq!(
                b.in_backoff(&key(1), finish, now).is_some(),
                waits,
                "ran {ran} s, {after_ms} ms after its finish"
            );
        }
        // The image pull back-off keeps `flowcontrol.Backoff`'s own expiry.
        let mut pulls = ImagePullBackoff::new(Duration::from_secs(1), Duration::from_secs(1));
        let k = (key(1).pod, "img".to_owned());
        pulls.restarting(k.clone(), 0, 0);
        assert!(pulls.in_backoff(&k, S, S + 1).is_some());
        assert!(pulls.in_backoff(&k, 3 * S, 3 * S + 1).is_none());
    }

    #[test]
    fn go_durations() {
        let cases = [
            (0, "0s"),
            (5, "5µs"),
            (200_000, "200ms"),
            (1_500, "1.5ms"),
            (1_500_000, "1.5s"),
            (10_000_000, "10s"),
            (59_000_000, "59s"),
            (80_000_000, "1m20s"),
            (300_000_000, "5m0s"),
            (3_661_000_000, "1h1m1s"),
        ];
        for (us, want) in cases {
            assert_eq!(go_duration(Duration::from_micros(us)), want, "{us} µs");
        }
    }
}
