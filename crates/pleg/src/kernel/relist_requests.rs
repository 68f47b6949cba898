//! Relist requests of the kernel PLEG: one home for every loss that must end in a
//! relist (`docs/pleg.md` clause 4), counted by reason.
//!
//! The kubelet relists every second whatever happens; here a relist is asked for
//! exactly when something may have been lost. Requests are cheap and coalesce in
//! [`RelistSignal`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use evpleg_core::lifecycle::RelistSignal;

/// Why the kernel PLEG asks for a relist.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RelistReason {
    /// The kernel could not reserve ring-buffer space (`DROPPED` grew).
    KernelDrop,
    /// The kernel skipped a program's run (its `recursion_misses` grew).
    KernelMiss,
    /// The lifecycle event channel was full.
    ChannelFull,
    /// A task record's cgroup is unknown even after a rescan.
    Unattributed,
    /// A container cgroup was removed before its main process was seen to exit.
    ExitMissed,
    /// The ring-buffer reader stopped.
    ReaderStopped,
    /// A kernel event whose merge's locks were busy could not be handed to
    /// the normal-priority helper (its queue was full).
    HandOffFull,
    /// A root cgroup reached the kernel filter after containers below it
    /// were known: their records until then were not reported.
    RootOpened,
    /// A scan found a container cgroup empty after processes ran in it: their
    /// exits were not reported (they ran before the filter held its root).
    ExitedUnseen,
}

impl RelistReason {
    pub const ALL: [Self; 9] = [
        Self::KernelDrop,
        Self::KernelMiss,
        Self::ChannelFull,
        Self::Unattributed,
        Self::ExitMissed,
        Self::ReaderStopped,
        Self::HandOffFull,
        Self::RootOpened,
        Self::ExitedUnseen,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::KernelDrop => "kernel ring buffer full",
            Self::KernelMiss => "kernel program run skipped",
            Self::ChannelFull => "pleg event channel full",
            Self::Unattributed => "task in an unknown cgroup",
            Self::ExitMissed => "container cgroup removed before its main process exit was seen",
            Self::ReaderStopped => "kernel pleg reader stopped",
            Self::HandOffFull => "kernel event merge hand-off queue full",
            Self::RootOpened => {
                "root cgroup added to the kernel filter after containers below it were known"
            }
            Self::ExitedUnseen => {
                "container cgroup found empty after processes ran in it unreported"
            }
        }
    }
}

/// Counts of requests by reason (metrics).
#[derive(Debug, Default)]
pub struct RelistCounts([AtomicU64; RelistReason::ALL.len()]);

impl RelistCounts {
    pub fn get(&self, reason: RelistReason) -> u64 {
        self.0[reason as usize].load(Ordering::Relaxed)
    }
}

/// Asks for relists and counts them.
#[derive(Clone, Debug)]
pub struct RelistRequests {
    signal: Arc<RelistSignal>,
    counts: Arc<RelistCounts>,
}

impl RelistRequests {
    pub fn new(signal: Arc<RelistSignal>, counts: Arc<RelistCounts>) -> Self {
        Self { signal, counts }
    }

    /// Non-blocking and silent (the reason is counted, not logged);
    /// callable on the reader thread.
    pub fn request(&self, reason: RelistReason) {
        self.counts.0[reason as usize].fetch_add(1, Ordering::Relaxed);
        self.signal.request_silently();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_request_signals_and_counts_its_reason() {
        let signal = Arc::new(RelistSignal::new());
        let counts = Arc::new(RelistCounts::default());
        let r = RelistRequests::new(signal.clone(), counts.clone());
        r.request(RelistReason::KernelDrop);
        r.request(RelistReason::ExitMissed);
        r.request(RelistReason::ExitMissed);
        assert_eq!(signal.count(), 3);
        let got: Vec<u64> = RelistReason::ALL.iter().map(|r| counts.get(*r)).collect();
        assert_eq!(got, vec![1, 0, 0, 0, 2, 0, 0, 0, 0]);
    }
}
