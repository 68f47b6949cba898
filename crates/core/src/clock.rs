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
        crate::clock::monotonic_ns()
    }
}

/// Wall time: Unix nanoseconds (`CLOCK_REALTIME`), for the timestamps written
/// to the API and served (events' first and last times). Never for ordering
/// observations: that is [`MonotonicClock`]'s job.
#[derive(Clone, Copy, Debug, Default)]
pub struct WallClock;

impl Clock for WallClock {
    fn now_ns(&self) -> u64 {
        wall_clock_ns().max(0) as u64
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

fn clock_ns(clock: libc::clockid_t) -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec pointer; every clock used here always exists.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

/// CLOCK_MONOTONIC now, in ns: the clock of `bpf_ktime_get_ns`. The real-time
/// reader calls it directly (no injected clock on its hot path).
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC) as u64
}

/// The calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID), in ns: the
/// kernel PLEG reader's real-time budget is measured with it.
pub fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID) as u64
}

/// How far CLOCK_BOOTTIME (a process's `start_boottime`) is ahead of
/// CLOCK_MONOTONIC (a kernel record's time) now, in ns: the time the machine
/// spent suspended. It only grows.
pub fn boottime_offset_ns() -> u64 {
    (clock_ns(libc::CLOCK_BOOTTIME) - clock_ns(libc::CLOCK_MONOTONIC)).max(0) as u64
}

/// The wall clock (CLOCK_REALTIME), in Unix nanoseconds: the runtime's clock.
pub fn wall_clock_ns() -> i64 {
    clock_ns(libc::CLOCK_REALTIME)
}

/// Converts a CLOCK_MONOTONIC timestamp (a kernel event's) to Unix nanoseconds,
/// with the current offset between the two clocks.
pub fn monotonic_to_unix_ns(monotonic_ns: u64) -> i64 {
    let offset = clock_ns(libc::CLOCK_REALTIME) - clock_ns(libc::CLOCK_MONOTONIC);
    monotonic_ns as i64 + offset
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_conversion_is_near_now() {
        let mono = clock_ns(libc::CLOCK_MONOTONIC) as u64;
        let unix = monotonic_to_unix_ns(mono);
        let now = clock_ns(libc::CLOCK_REALTIME);
        assert!((now - unix).abs() < 1_000_000_000, "{now} vs {unix}");
    }
}
