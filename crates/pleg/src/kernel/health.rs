//! The kernel path's health (`docs/pleg.md` clause 5): whether the ring-buffer
//! reader runs, or which part stopped, since when and why.
//!
//! The kubelet's PLEG health is the age of its last relist; the kernel path adds
//! a thread that could die on its own. A [`StopGuard`] held by the reader thread
//! records any stop that was not asked for (an error, a panic), so the reader
//! can never die silently: the health turns degraded, a counter grows, an error
//! is logged and a relist is requested, after which the relist falls back to the
//! kubelet's 1 s period.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tracing::error;

use super::KernelHealth;
use super::relist_requests::{RelistReason, RelistRequests};

/// The part of the kernel path the reader is.
pub const READER_PART: &str = "ring-buffer reader";

/// How long the reader may go without finishing a pass of its loop before it
/// counts as blocked (it wakes at least every 5 s when idle: on stderr, a
/// lock or I/O it would otherwise look healthy forever).
pub const HEARTBEAT_BOUND: std::time::Duration = std::time::Duration::from_secs(20);

/// Degrades `cell` when the reader's last heartbeat (`last_ns`, 0: none yet,
/// the start counts) is older than `bound` at `now_ns`. Returns whether it
/// did.
pub fn check_heartbeat(
    cell: &HealthCell,
    started_ns: u64,
    last_ns: u64,
    now_ns: u64,
    bound: std::time::Duration,
) -> bool {
    let last = last_ns.max(started_ns);
    let age = now_ns.saturating_sub(last);
    if age <= bound.as_nanos() as u64 || cell.get() != KernelHealth::Running {
        return false;
    }
    let reason = format!(
        "blocked: no pass of its loop for {} ms (bound {} ms)",
        age / 1_000_000,
        bound.as_millis()
    );
    error!(part = READER_PART, %reason, "kernel pleg degraded: the ring-buffer reader is blocked; the relist falls back to 1 s");
    cell.degrade(READER_PART, now_ns, reason);
    true
}

/// Shared health of the kernel path; a degradation wakes whoever waits in
/// [`HealthCell::degraded`] (no polling).
#[derive(Debug)]
pub struct HealthCell {
    health: Mutex<KernelHealth>,
    changed: tokio::sync::Notify,
}

impl Default for HealthCell {
    fn default() -> Self {
        Self {
            health: Mutex::new(KernelHealth::Running),
            changed: tokio::sync::Notify::new(),
        }
    }
}

impl HealthCell {
    pub fn get(&self) -> KernelHealth {
        self.health
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Records the first degradation (a later one does not hide it).
    pub fn degrade(&self, part: &'static str, since_ns: u64, reason: String) {
        let mut h = self.health.lock().unwrap_or_else(|e| e.into_inner());
        if *h == KernelHealth::Running {
            *h = KernelHealth::Degraded {
                part,
                since_ns,
                reason,
            };
        }
        drop(h);
        self.changed.notify_one();
    }

    /// Returns once the path is degraded (at once if it is already).
    pub async fn degraded(&self) {
        loop {
            let notified = self.changed.notified();
            if self.get() != KernelHealth::Running {
                return;
            }
            notified.await;
        }
    }
}

/// Held by the reader thread for its whole life; on drop, a stop that `stop` did
/// not ask for is recorded as a degradation.
#[derive(Debug)]
pub struct StopGuard {
    pub health: Arc<HealthCell>,
    pub stop: Arc<AtomicBool>,
    pub failures: Arc<AtomicU64>,
    pub relist: RelistRequests,
    /// Why the reader is stopping, when it knows (an error).
    pub reason: Option<String>,
    pub now_ns: fn() -> u64,
}

impl Drop for StopGuard {
    fn drop(&mut self) {
        let reason = match (self.reason.take(), std::thread::panicking()) {
            (Some(r), _) => r,
            (None, true) => "panicked".to_owned(),
            (None, false) if self.stop.load(Ordering::Relaxed) => return,
            (None, false) => "stopped unexpectedly".to_owned(),
        };
        self.failures.fetch_add(1, Ordering::Relaxed);
        error!(part = READER_PART, %reason, "kernel pleg degraded: the ring-buffer reader stopped; relisting, the relist falls back to 1 s");
        self.health.degrade(READER_PART, (self.now_ns)(), reason);
        self.relist.request(RelistReason::ReaderStopped);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::relist_requests::RelistCounts;
    use evpleg_core::lifecycle::RelistSignal;

    fn guard(stop: bool) -> (StopGuard, Arc<HealthCell>, Arc<RelistSignal>) {
        let health = Arc::new(HealthCell::default());
        let signal = Arc::new(RelistSignal::new());
        let g = StopGuard {
            health: health.clone(),
            stop: Arc::new(AtomicBool::new(stop)),
            failures: Arc::new(AtomicU64::new(0)),
            relist: RelistRequests::new(signal.clone(), Arc::new(RelistCounts::default())),
            reason: None,
            now_ns: || 42,
        };
        (g, health, signal)
    }

    /// Issue #25: a reader blocked (on stderr, a lock, I/O) looked healthy
    /// forever; past the heartbeat bound it is degraded, once.
    #[test]
    fn a_reader_without_a_heartbeat_past_the_bound_is_degraded() {
        let cell = HealthCell::default();
        let bound = std::time::Duration::from_secs(20);
        let s = 1_000_000_000;
        assert!(
            !check_heartbeat(&cell, 5 * s, 0, 24 * s, bound),
            "since the start"
        );
        assert!(
            !check_heartbeat(&cell, 5 * s, 10 * s, 30 * s, bound),
            "at the bound"
        );
        assert_eq!(cell.get(), KernelHealth::Running);
        assert!(check_heartbeat(&cell, 5 * s, 10 * s, 31 * s, bound));
        assert!(matches!(
            cell.get(),
            KernelHealth::Degraded { part: READER_PART, since_ns, ref reason }
                if since_ns == 31 * s && reason.starts_with("blocked: no pass of its loop for 21000 ms")
        ));
        assert!(
            !check_heartbeat(&cell, 5 * s, 10 * s, 40 * s, bound),
            "once"
        );
    }

    #[test]
    fn asked_stop_is_healthy() {
        let (g, health, signal) = guard(true);
        drop(g);
        assert_eq!(health.get(), KernelHealth::Running);
        assert_eq!(signal.count(), 0);
    }

    #[test]
    fn error_stop_is_degraded_counted_and_relisted() {
        let (mut g, health, signal) = guard(false);
        let failures = g.failures.clone();
        g.reason = Some("epoll failed".into());
        drop(g);
        assert_eq!(
            health.get(),
            KernelHealth::Degraded {
                part: READER_PART,
                since_ns: 42,
                reason: "epoll failed".into()
            }
        );
        assert_eq!((failures.load(Ordering::Relaxed), signal.count()), (1, 1));
    }

    #[test]
    fn panic_is_degraded() {
        let (g, health, signal) = guard(false);
        let r = std::thread::spawn(move || {
            let _g = g;
            panic!("boom");
        })
        .join();
        assert!(r.is_err());
        assert!(matches!(
            health.get(),
            KernelHealth::Degraded { reason, .. } if reason == "panicked"
        ));
        assert_eq!(signal.count(), 1);
    }
}
