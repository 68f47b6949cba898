//! The proxy's kernel path and its way back (issue #24, item 5).
//!
//! The kernel path is the kernel PLEG the proxy serves `GetContainerEvents`
//! from. The proxy's socket exists before it is loaded, and the CRI is
//! served whether or not it runs: while it cannot start (a BTF or load
//! failure after a kernel update) or after it died (its reader stopped or
//! is blocked: [`Pleg::degraded`]), the proxy is in pass-through, every call
//! forwarded untouched, `GetContainerEvents` included (the runtime's own
//! stream where it has one; containerd 1.6 answers `Unimplemented`, which
//! the proxy words as its own explicit error: [`crate::server`]); it says so
//! on `/healthz` (degraded, not down) and in
//! `evpleg_cri_proxy_pass_through`, and starts the kernel path again with
//! the project's back-off ([`evpleg_cri::Backoff`], [`RETRY`]).
//!
//! The kubelet has no such layer (its runtime endpoint is the runtime);
//! what the kubelet sees in pass-through is the runtime itself, as if the
//! proxy were not there, except that subscribers of the kernel path's
//! stream lose it when the path dies (their stream ends `UNAVAILABLE`, and a
//! kubelet subscribes again, to the runtime's stream). A subscriber of the
//! runtime's stream stays on it after the kernel path is back.
//!
//! With `--merge-runtime-events` and the runtime's stream open
//! ([`RuntimeStream`]), the proxy's stream is complete without the kernel:
//! its subscribers keep it when the path dies, and a new one is served it in
//! pass-through too. That spares a kubelet 1.37 one of the five stream
//! failures it allows over its life (docs/cri-proxy.md). The streams end
//! only when both sources are gone.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use evpleg_cri::{Backoff, BackoffConfig};
use evpleg_pleg::{Pleg, PlegError};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::hub::Hub;
use crate::merge::RuntimeStream;
use crate::stats::ProxyStats;

/// The back-off of the kernel path's restarts: 1 s, doubling, at most 60 s,
/// +-20 %.
pub const RETRY: BackoffConfig = BackoffConfig {
    base: Duration::from_secs(1),
    max: Duration::from_secs(60),
    multiplier: 2.0,
    jitter: 0.2,
};

/// How often a running kernel path is checked for death.
const WATCH: Duration = Duration::from_millis(200);

/// Whether the proxy serves events from the kernel, or why not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathState {
    /// The kernel path runs: the proxy serves `GetContainerEvents`.
    Kernel,
    /// Pass-through: every call forwarded untouched.
    PassThrough {
        /// Since when (the clock's ns).
        since_ns: u64,
        /// The last start failure or the death.
        reason: String,
        /// Failed starts since the path last ran.
        failures: u64,
    },
}

/// The running kernel path, if any, and the state the server and
/// `/healthz` read.
#[derive(Debug)]
pub struct KernelPath {
    serving: AtomicBool,
    state: Mutex<PathState>,
    pleg: Mutex<Option<Pleg>>,
    /// Bumped each time a new PLEG runs (the binary rebuilds its metrics).
    generation: AtomicU64,
    /// Unix ns when the running PLEG started: its first relist reports
    /// every container, and what it reports from before then is no event
    /// ([`crate::events`]).
    started_wall_ns: AtomicI64,
}

impl KernelPath {
    /// Pass-through until a start succeeds.
    pub fn new(now_ns: u64) -> Self {
        Self {
            serving: AtomicBool::new(false),
            state: Mutex::new(PathState::PassThrough {
                since_ns: now_ns,
                reason: "the kernel path has not started yet".to_owned(),
                failures: 0,
            }),
            pleg: Mutex::new(None),
            generation: AtomicU64::new(0),
            started_wall_ns: AtomicI64::new(0),
        }
    }

    /// Whether the kernel path runs (else: pass-through).
    pub fn serving(&self) -> bool {
        // SeqCst, as the runtime stream's flag: when both sources fail at
        // once, one of the two sides sees the other's failure and ends the
        // subscribers' streams ([`crate::merge::RuntimeStream`]).
        self.serving.load(Ordering::SeqCst)
    }

    pub fn state(&self) -> PathState {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Unix ns when the running (or last) PLEG started; 0 before the first.
    pub fn started_wall_ns(&self) -> i64 {
        self.started_wall_ns.load(Ordering::Acquire)
    }

    /// Which PLEG runs: a new value each time one starts.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// `f` with the running PLEG, if any (its stats for the metrics, tests'
    /// hooks). Do not block in `f`.
    pub fn with_pleg<R>(&self, f: impl FnOnce(Option<&Pleg>) -> R) -> R {
        f(self.pleg.lock().unwrap_or_else(|e| e.into_inner()).as_ref())
    }

    fn set_state(&self, state: PathState) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = state;
    }

    /// One start of the kernel path; returns whether it runs.
    pub fn attempt(
        &self,
        start: &dyn Fn() -> Result<Pleg, PlegError>,
        stats: &ProxyStats,
        now_ns: u64,
    ) -> bool {
        let started = evpleg_core::clock::wall_clock_ns();
        match start() {
            Ok(pleg) => {
                self.started_wall_ns.store(started, Ordering::Release);
                *self.pleg.lock().unwrap_or_else(|e| e.into_inner()) = Some(pleg);
                self.generation.fetch_add(1, Ordering::AcqRel);
                self.set_state(PathState::Kernel);
                self.serving.store(true, Ordering::Release);
                stats.pass_through.set(0);
                info!("kernel path running: GetContainerEvents served from the kernel");
                true
            }
            Err(e) => {
                stats.kernel_start_failures.inc();
                stats.pass_through.set(1);
                let reason = e.to_string();
                let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                let (since_ns, failures) = match &*state {
                    PathState::PassThrough {
                        since_ns, failures, ..
                    } => (*since_ns, failures + 1),
                    PathState::Kernel => (now_ns, 1),
                };
                warn!(error = %reason, failures,
                    "the kernel path cannot start: serving the cri in pass-through, retrying with a back-off");
                *state = PathState::PassThrough {
                    since_ns,
                    reason,
                    failures,
                };
                false
            }
        }
    }

    /// The running PLEG's death, if it died.
    fn died(&self) -> Option<String> {
        self.with_pleg(|p| p?.degraded())
            .map(|d| format!("the kernel path died: {} stopped ({})", d.part, d.reason))
    }

    /// Into pass-through after a death; returns the dead PLEG to stop.
    fn lose(&self, reason: String, stats: &ProxyStats, now_ns: u64) -> Option<Pleg> {
        self.serving.store(false, Ordering::SeqCst);
        stats.pass_through.set(1);
        stats.kernel_path_losses.inc();
        warn!(%reason, "serving the cri in pass-through, restarting the kernel path with a back-off");
        self.set_state(PathState::PassThrough {
            since_ns: now_ns,
            reason,
            failures: 0,
        });
        self.pleg.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Stops the running PLEG, if any (the proxy stops).
    pub async fn stop(&self) {
        self.serving.store(false, Ordering::Release);
        let pleg = self.pleg.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(p) = pleg {
            p.stop().await;
        }
    }
}

/// Watches the kernel path until `shutdown`: a running one for its death
/// (then pass-through: it is stopped, and its subscribers' streams end
/// unless the runtime's own stream is merged and open, `runtime`), a stopped
/// one started again after the back-off's next delay.
pub async fn supervise(
    path: Arc<KernelPath>,
    start: Box<dyn Fn() -> Result<Pleg, PlegError> + Send + Sync>,
    hub: Arc<Hub>,
    runtime: Arc<RuntimeStream>,
    stats: Arc<ProxyStats>,
    clock: evpleg_core::clock::SharedClock,
    shutdown: CancellationToken,
) {
    let mut backoff = Backoff::new(RETRY);
    loop {
        if path.serving() {
            backoff = Backoff::new(RETRY);
            let reason = loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(WATCH) => {}
                }
                if let Some(reason) = path.died() {
                    break reason;
                }
            };
            let dead = path.lose(reason, &stats, clock.now_ns());
            // With the runtime's stream merged, the proxy's goes on from it;
            // else its subscribers subscribe again, to the runtime's.
            if runtime.is_open() {
                info!("the runtime's merged stream goes on: event subscribers keep their streams");
            } else {
                hub.close(
                    "the kernel path died and the runtime has no merged stream: subscribe again",
                );
            }
            if let Some(dead) = dead {
                dead.stop().await;
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(backoff.next_delay()) => {}
        }
        path.attempt(&*start, &stats, clock.now_ns());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_starts_keep_pass_through_since_the_first_and_count() {
        let path = KernelPath::new(5);
        let stats = ProxyStats::default();
        let fail = || -> Result<Pleg, PlegError> {
            Err(PlegError::Kernel(
                evpleg_pleg::kernel::KernelPlegError::NoCgroup2,
            ))
        };
        assert!(!path.attempt(&fail, &stats, 10));
        assert!(!path.attempt(&fail, &stats, 20));
        assert!(!path.serving());
        match path.state() {
            PathState::PassThrough {
                since_ns, failures, ..
            } => assert_eq!((since_ns, failures), (5, 2)),
            s => panic!("{s:?}"),
        }
        assert_eq!(stats.kernel_start_failures.get(), 2);
        assert_eq!(stats.pass_through.get(), 1);
    }
}
