//! CrashLoopBackOff: the kubelet's per-container restart back-off
//! (`flowcontrol.Backoff` as `kuberuntime` uses it): 10 s doubling to 5 min by
//! default, keyed by pod UID and container name; an entry idle for twice the cap
//! starts over. Times are Unix nanoseconds (container finish times are wall-clock).

use std::collections::HashMap;
use std::time::Duration;

use crate::pleg::PodUid;

/// The kubelet's defaults.
pub const INITIAL_BACKOFF: Duration = Duration::from_secs(10);
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);

#[derive(Clone, Copy, Debug)]
struct Entry {
    backoff: Duration,
    last_update_ns: i64,
}

/// Restart back-off of containers.
#[derive(Clone, Debug)]
pub struct CrashBackoff {
    initial: Duration,
    max: Duration,
    entries: HashMap<(PodUid, String), Entry>,
}

impl Default for CrashBackoff {
    fn default() -> Self {
        Self::new(INITIAL_BACKOFF, MAX_BACKOFF)
    }
}

impl CrashBackoff {
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            entries: HashMap::new(),
        }
    }

    /// If the container that finished at `finished_ns` must still wait, how long.
    pub fn remaining(
        &self,
        pod: &PodUid,
        name: &str,
        finished_ns: i64,
        now_ns: i64,
    ) -> Option<Duration> {
        let e = self.entries.get(&(pod.clone(), name.to_owned()))?;
        let until = finished_ns.saturating_add(e.backoff.as_nanos() as i64);
        (now_ns < until).then(|| Duration::from_nanos((until - now_ns) as u64))
    }

    /// Records a restart at `now_ns`: the next wait doubles, up to the cap.
    pub fn restarted(&mut self, pod: &PodUid, name: &str, now_ns: i64) {
        let key = (pod.clone(), name.to_owned());
        let expired =
            |e: &Entry| now_ns.saturating_sub(e.last_update_ns) > 2 * self.max.as_nanos() as i64;
        let backoff = match self.entries.get(&key) {
            Some(e) if !expired(e) => (e.backoff * 2).min(self.max),
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

    /// Forgets a pod's entries (it was removed).
    pub fn forget(&mut self, pod: &PodUid) {
        self.entries.retain(|(p, _), _| p != pod);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000_000_000;

    #[test]
    fn doubles_to_the_cap_and_expires() {
        let pod = PodUid::parse(&"a".repeat(32)).unwrap();
        let mut b = CrashBackoff::default();
        assert_eq!(
            b.remaining(&pod, "app", 0, 1),
            None,
            "the first restart is immediate"
        );
        b.restarted(&pod, "app", 0);
        assert_eq!(
            b.remaining(&pod, "app", 5 * S, 6 * S),
            Some(Duration::from_secs(9))
        );
        assert_eq!(b.remaining(&pod, "app", 5 * S, 15 * S), None);
        let mut waits = Vec::new();
        let mut t = 0;
        for _ in 0..8 {
            t += 1000 * S / 100;
            b.restarted(&pod, "app", t);
            waits.push(b.remaining(&pod, "app", t, t).unwrap().as_secs());
        }
        assert_eq!(waits, [20, 40, 80, 160, 300, 300, 300, 300]);
        // Idle for more than twice the cap: starts over.
        t += 601 * S;
        b.restarted(&pod, "app", t);
        assert_eq!(b.remaining(&pod, "app", t, t), Some(INITIAL_BACKOFF));
        b.forget(&pod);
        assert_eq!(b.remaining(&pod, "app", t, t), None);
    }
}
