//! Time, injected: every state machine takes a [`Clock`] so tests run on a manual
//! one. The agent's clock is CLOCK_MONOTONIC in nanoseconds, the clock of
//! `bpf_ktime_get_ns`, so kernel events, relists and CRI events order correctly.

use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A source of CLOCK_MONOTONIC-like nanoseconds.
pub trait Clock: Send + Sync + Debug {
    fn now_ns(&self) -> u64;
}

/// The real CLOCK_MONOTONIC.
#[derive(Clone, Copy, Debug, Default)]
pub struct MonotonicClock;

impl Clock for MonotonicClock {
    fn now_ns(&self) -> u64 {
        crate::pleg::kernel::monotonic_ns()
    }
}

/// Wall time: Unix nanoseconds (`CLOCK_REALTIME`), for the timestamps written
/// to the API and served (events' first and last times). Never for ordering
/// observations: that is [`MonotonicClock`]'s job.
#[derive(Clone, Copy, Debug, Default)]
pub struct WallClock;

impl Clock for WallClock {
    fn now_ns(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    }
}

/// A clock tests move by hand.
#[derive(Clone, Debug, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    pub fn new(start_ns: u64) -> Self {
        Self(Arc::new(AtomicU64::new(start_ns)))
    }

    pub fn advance(&self, ns: u64) {
        self.0.fetch_add(ns, Ordering::SeqCst);
    }

    pub fn set(&self, ns: u64) {
        self.0.store(ns, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// The shared clock type.
pub type SharedClock = Arc<dyn Clock>;
