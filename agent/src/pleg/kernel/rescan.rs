//! When the reader rescans the cgroup tree: one home for the rescan policy.
//!
//! A task record from a cgroup the index does not know (its mkdir was lost or its
//! path truncated), or a cgroup created below a root the kernel filter does not
//! hold (the root's mkdir was lost), asks for a rescan, at most one per
//! [`RESCAN_MIN_INTERVAL`] so that a storm of such records does not walk the tree
//! for each. A reconcile that
//! lists a running container the tracker does not know always rescans: the
//! tracker then remembers what the rescan did not find, so this cannot repeat for
//! the same container. The kubelet has no counterpart (it never indexes cgroups).

use std::time::Duration;

/// The shortest time between two rescans asked for by records.
pub const RESCAN_MIN_INTERVAL: Duration = Duration::from_millis(20);

/// Why a rescan is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RescanCause {
    /// A task record from an unknown cgroup.
    UnknownCgroup,
    /// A cgroup created below a root missing from the kernel filter.
    MissingRoot,
    /// The runtime lists a running container whose cgroup is not indexed.
    Reconcile,
}

/// Rate limit of rescans, in CLOCK_MONOTONIC ns.
#[derive(Debug)]
pub struct RescanPolicy {
    min_interval_ns: u64,
    last_ns: Option<u64>,
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
            last_ns: None,
        }
    }

    /// Whether to rescan now for `cause`; a yes is recorded as a rescan at `now_ns`.
    pub fn allow(&mut self, cause: RescanCause, now_ns: u64) -> bool {
        let due = match cause {
            RescanCause::Reconcile => true,
            RescanCause::UnknownCgroup | RescanCause::MissingRoot => self
                .last_ns
                .is_none_or(|t| now_ns.saturating_sub(t) >= self.min_interval_ns),
        };
        if due {
            self.last_ns = Some(now_ns);
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn records_are_rate_limited_reconciles_are_not() {
        let mut p = RescanPolicy::new(Duration::from_millis(20));
        // (cause, now in ms, allowed)
        let rows = [
            (RescanCause::UnknownCgroup, 100, true),
            (RescanCause::UnknownCgroup, 105, false),
            (RescanCause::UnknownCgroup, 119, false),
            (RescanCause::UnknownCgroup, 120, true),
            (RescanCause::Reconcile, 121, true),
            // The reconcile's rescan counts: records wait 20 ms after it.
            (RescanCause::UnknownCgroup, 130, false),
            (RescanCause::UnknownCgroup, 141, true),
            (RescanCause::Reconcile, 141, true),
            (RescanCause::MissingRoot, 150, false),
            (RescanCause::MissingRoot, 161, true),
        ];
        for (i, (cause, now, allowed)) in rows.into_iter().enumerate() {
            assert_eq!(p.allow(cause, now * MS), allowed, "row {i}");
        }
    }
}
