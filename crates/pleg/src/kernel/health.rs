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
