//! When the reader rescans the cgroup tree: one home for the rescan policy.
//!
//! Three things ask for a rescan: a task record from a cgroup the index does not
//! know (its mkdir was lost or its path truncated), a cgroup created below a root
//! the kernel filter does not hold (the root's mkdir was lost), and a reconcile
//! whose view lists a running container the tracker does not know. A rescan walks
//! the whole tree below the roots: tens of milliseconds at a thousand cgroups,
//! about a second at 21 000. The first two run on the real-time reader thread,
//! where no record is read meanwhile (the record is handled again with what
//! was found); the third on the walker thread ([`super::walker`]). All three are
//! rate-limited alike: the next rescan waits at least [`RESCAN_MIN_INTERVAL`]
//! and at least [`RESCAN_SPACING`] times as long as the last one took, so that
//! rescans take at most a tenth of a core whatever the tree's size.
//!
//! A record refused a rescan is a loss like any other (a relist is requested); a
//! reconcile refused one waits for the next rescan ([`super::reader`] keeps its
//! view and applies it again after that rescan), so a wave of pod relists each
//! listing an unknown container costs one rescan per interval, not one each. The
//! tracker remembers what a rescan did not find, so the same container does not
//! ask again. The kubelet has no counterpart (it never indexes cgroups).

use std::time::Duration;

/// The shortest time between two rescans.
pub const RESCAN_MIN_INTERVAL: Duration = Duration::from_millis(20);
/// After a rescan that took `d`, the next waits at least `d` times this.
pub const RESCAN_SPACING: u64 = 10;

/// Rate limit of rescans, in CLOCK_MONOTONIC ns.
#[derive(Debug)]
pub struct RescanPolicy {
    min_interval_ns: u64,
    /// When the last rescan started and how long it took.
    last: Option<(u64, u64)>,
}

impl Default for RescanPolicy {
    fn default() -> Self {
        Self::new(RESCAN_MIN_INTERVAL)
    }
}

impl RescanPolicy {
    pub fn new(min_interval: Duration) -> Self {
        Self {
            min_interval_ns: min_interval.as_nanos() as u64,
            last: None,
        }
    }

    /// When the next rescan is allowed (`None`: now).
    pub fn next_ns(&self) -> Option<u64> {
        self.last.map(|(at, took)| {
            at + self
                .min_interval_ns
                .max(took.saturating_mul(RESCAN_SPACING))
        })
    }

    /// Whether to rescan at `now_ns`.
    pub fn allows(&self, now_ns: u64) -> bool {
        self.next_ns().is_none_or(|next| now_ns >= next)
    }

    /// Records a rescan that started at `at_ns` and ended at `end_ns`.
    pub fn ran(&mut self, at_ns: u64, end_ns: u64) {
        self.last = Some((at_ns, end_ns.saturating_sub(at_ns)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn rescans_are_spaced_by_the_minimum_or_ten_times_the_last_one() {
        let mut p = RescanPolicy::new(Duration::from_millis(20));
        // (now in ms, allowed, if allowed: how long it takes in ms)
        let rows = [
            (100, true, 1),
            (105, false, 0),
            (119, false, 0),
            // 20 ms after the start of a 1 ms rescan.
            (120, true, 15),
            // A 15 ms rescan: the next waits 150 ms from its start.
            (140, false, 0),
            (269, false, 0),
            (270, true, 2),
            (289, false, 0),
            (290, true, 0),
        ];
        for (i, (now, allowed, took)) in rows.into_iter().enumerate() {
            assert_eq!(p.allows(now * MS), allowed, "row {i}");
            if allowed {
                p.ran(now * MS, (now + took) * MS);
            }
        }
        assert_eq!(p.next_ns(), Some(310 * MS));
    }
}
