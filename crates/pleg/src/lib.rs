//! The Pod Lifecycle Event Generator.
//!
//! Reproduces the kubelet's `pkg/kubelet/pleg`: a stream of [`PodLifecycleEvent`]s
//! that tells pod workers which pod changed. Where the kubelet's generic PLEG learns
//! of a change at its next one-second relist, evpleg's [`kernel`] PLEG learns it from
//! eBPF programs the moment the kernel sees it.

pub mod evented_cri;
pub mod evented_payload;
pub mod kernel;
pub mod latency;
pub mod merge;
pub mod on_demand;
pub mod relist;
pub mod stages;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicU64, Ordering};

use evpleg_core::lifecycle::{PodLifecycleEvent, RelistSignal};
use evpleg_cri::runtime::CriRuntime;

/// Which PLEG drives the pod workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlegMode {
    /// Kernel events (eBPF), merged with a slow reconciling relist (300 s).
    Ebpf,
    /// The kubelet's generic PLEG: a relist every second.
    Generic,
    /// For comparison: the kubelet 1.37 Evented PLEG, "events are hints"
    /// (kubernetes/kubernetes#139262): the 1 s relist always runs, each
    /// CONTAINER_STOPPED of the CRI event stream relists its pod
    /// ([`evented_cri`]). Needs containerd 1.7 or later; with 1.6 it is the
    /// generic PLEG.
    EventedCri,
    /// For comparison: the Evented PLEG of kubelets 1.26 to 1.36: each event's
    /// payload is the pod's status, a 300 s relist, the generic 1 s relist
    /// after 5 failed streams ([`evented_payload`]).
    EventedCriPayload,
}

/// Errors of starting the PLEG.
#[derive(Debug, thiserror::Error)]
pub enum PlegError {
    #[error("kernel pleg: {0}")]
    Kernel(#[from] kernel::KernelPlegError),
}

/// A part of the kernel path that stopped, and since when (contract clause 5).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Degradation {
    /// `ring-buffer reader` (which also runs the merge).
    pub part: &'static str,
    /// CLOCK_MONOTONIC ns.
    pub since_ns: u64,
    pub reason: String,
}

/// The kernel path's health as the supervisor last saw it.
#[derive(Debug, Default)]
pub struct PathHealth {
    degraded: std::sync::Mutex<Option<Degradation>>,
    /// How many times the kernel path degraded (`evpleg_pleg_kernel_degradations_total`).
    pub degradations: AtomicU64,
}

impl PathHealth {
    pub fn degraded(&self) -> Option<Degradation> {
        self.degraded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set(&self, d: Degradation) -> bool {
        let mut slot = self.degraded.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_some() {
            return false;
        }
        *slot = Some(d);
        self.degradations.fetch_add(1, Ordering::Relaxed);
        true
    }
}

/// Waits for the kernel path to degrade (the reader thread, which also runs
/// the merge, stopped without being asked to: its stop guard wakes this task;
/// or it is blocked past its heartbeat bound); then says so (log, metric, `/healthz`), asks for a relist at
/// once and moves the relist to the kubelet's 1 s period for good.
async fn supervise(
    kernel: std::sync::Arc<kernel::KernelPleg>,
    health: std::sync::Arc<PathHealth>,
    period: tokio::sync::watch::Sender<std::time::Duration>,
    relist: std::sync::Arc<RelistSignal>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    // A stopped reader wakes this task through its stop guard; a blocked one
    // is found by its heartbeat, checked every 5 s.
    let mut heartbeat = tokio::time::interval(std::time::Duration::from_secs(5));
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = kernel.degraded() => break,
            _ = heartbeat.tick() => {
                if kernel.check_heartbeat(evpleg_core::clock::monotonic_ns()) {
                    break;
                }
            }
        }
    }
    if let kernel::KernelHealth::Degraded {
        part,
        since_ns,
        reason,
    } = kernel.health()
    {
        let d = Degradation {
            part,
            since_ns,
            reason,
        };
        if health.set(d.clone()) {
            tracing::error!(part = d.part, reason = %d.reason,
                "kernel pleg degraded: falling back to the generic relist every {}s",
                relist::GENERIC_PERIOD.as_secs());
            let _ = period.send(relist::GENERIC_PERIOD);
            relist.request("kernel pleg degraded");
        }
    }
}

/// The running PLEG: its tasks, the cache it writes and the events it sends.
#[derive(Debug)]
pub struct Pleg {
    pub mode: PlegMode,
    period: std::time::Duration,
    pub cache: std::sync::Arc<evpleg_core::cache::PodStatusCache>,
    pub relist_stats: std::sync::Arc<relist::RelistStats>,
    pub relist_signal: std::sync::Arc<RelistSignal>,
    /// Asks for an on-demand relist of one pod.
    pub pod_relist: std::sync::Arc<on_demand::PodRelistQueue>,
    pub kernel: Option<std::sync::Arc<kernel::KernelPleg>>,
    pub merge_stats: Option<std::sync::Arc<merge::MergeStats>>,
    /// The kernel path's health, in `ebpf` mode.
    pub path_health: std::sync::Arc<PathHealth>,
    /// The CRI event stream's counters, in the `evented-cri` modes.
    pub evented_stats: Option<std::sync::Arc<evented_cri::EventedCriStats>>,
    /// The relist task's (and the CRI event stream's) health: one that stops
    /// before [`Pleg::stop`] fails `/healthz` at once.
    pub task_health: std::sync::Arc<evpleg_core::tasks::TaskHealth>,
    /// `pleg_event_latency_seconds`, observed by the events' consumer.
    pub event_latency: std::sync::Arc<latency::EventLatency>,
    shutdown: tokio_util::sync::CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Pleg {
    /// Starts the PLEG of `mode` over the CRI runtime `runtime` (whose client
    /// also serves `evented-cri` mode's event stream); lifecycle events go to
    /// `events`. In `ebpf` mode the kernel programs are loaded with
    /// `kernel_config`.
    pub fn start(
        mode: PlegMode,
        runtime: CriRuntime,
        kernel_config: kernel::KernelPlegConfig,
        events: tokio::sync::mpsc::Sender<PodLifecycleEvent>,
        clock: evpleg_core::clock::SharedClock,
        relist_period: Option<std::time::Duration>,
    ) -> Result<Self, PlegError> {
        use std::sync::Arc;
        let cache = Arc::new(evpleg_core::cache::PodStatusCache::new());
        let reports = Arc::new(relist::KernelReports::default());
        let relist_signal = Arc::new(RelistSignal::new());
        let shutdown = tokio_util::sync::CancellationToken::new();
        let pod_relist = Arc::new(on_demand::PodRelistQueue::new(clock.clone()));
        let path_health = Arc::new(PathHealth::default());
        let task_health = evpleg_core::tasks::TaskHealth::new(clock.clone());
        let period = relist_period.unwrap_or(match mode {
            PlegMode::Ebpf => relist::EBPF_PERIOD,
            PlegMode::Generic | PlegMode::EventedCri => relist::GENERIC_PERIOD,
            PlegMode::EventedCriPayload => evented_payload::RELIST_PERIOD,
        });
        // ebpf mode inspects a pod at each start and death the kernel reports:
        // its exited containers' statuses are read once (the rivals, the
        // kubelet's designs, read them all each time).
        let runtime = if mode == PlegMode::Ebpf {
            runtime.remembering_exited()
        } else {
            runtime
        };
        let (period_tx, period_rx) = tokio::sync::watch::channel(period);
        let mut tasks = Vec::new();
        let mut evented_stats = None;
        let (kernel, merge_stats) = match mode {
            PlegMode::Ebpf => {
                let stats = Arc::new(merge::MergeStats::default());
                let merge = merge::KernelMerge {
                    cache: cache.clone(),
                    reports: reports.clone(),
                    out: events.clone(),
                    pod_relist: pod_relist.clone(),
                    relist: relist_signal.clone(),
                    stats: stats.clone(),
                };
                // The merge runs on the reader thread: no wake-up of another
                // thread between the ring buffer and the workers' channel.
                let kernel = Arc::new(kernel::KernelPleg::start_merged(
                    kernel_config,
                    merge,
                    relist_signal.clone(),
                )?);
                tasks.push(tokio::spawn(supervise(
                    kernel.clone(),
                    path_health.clone(),
                    period_tx,
                    relist_signal.clone(),
                    shutdown.clone(),
                )));
                (Some(kernel), Some(stats))
            }
            PlegMode::Generic => (None, None),
            PlegMode::EventedCri | PlegMode::EventedCriPayload => {
                let client = runtime.client().clone();
                let stats = Arc::new(evented_cri::EventedCriStats::default());
                let design = if mode == PlegMode::EventedCri {
                    evented_cri::Design::Hints
                } else {
                    let evented_in_use = shutdown.child_token();
                    tasks.push(tokio::spawn(evented_payload::update_global_cache(
                        cache.clone(),
                        clock.clone(),
                        evented_in_use.clone(),
                        shutdown.clone(),
                    )));
                    evented_cri::Design::Payload(evented_payload::PayloadSink {
                        cache: cache.clone(),
                        events: events.clone(),
                        reports: reports.clone(),
                        period: period_tx,
                        evented_in_use,
                    })
                };
                let stream = evented_cri::EventedCri::new(
                    client,
                    pod_relist.clone(),
                    relist_signal.clone(),
                    stats.clone(),
                    clock.clone(),
                    evented_cri::EventedCriConfig::default(),
                    design,
                );
                tasks.push(task_health.spawn(
                    "cri event stream",
                    shutdown.clone(),
                    stream.run(shutdown.clone()),
                ));
                evented_stats = Some(stats);
                (None, None)
            }
        };
        let mut relister = relist::RelistPleg::new(runtime, cache.clone(), events, clock, reports);
        if let Some(k) = &kernel {
            let k = k.clone();
            relister = relister.with_reconciler(Box::new(move |view| k.reconcile(view)));
        }
        let relist_stats = relister.stats();
        tasks.push(task_health.spawn(
            "pleg relist",
            shutdown.clone(),
            relister.run(
                period_rx,
                relist_signal.clone(),
                pod_relist.clone(),
                shutdown.clone(),
            ),
        ));
        Ok(Self {
            mode,
            period,
            cache,
            relist_stats,
            relist_signal,
            pod_relist,
            kernel,
            merge_stats,
            path_health,
            evented_stats,
            task_health,
            event_latency: Arc::default(),
            shutdown,
            tasks,
        })
    }

    /// The kubelet's PLEG health rule (the last relist recent enough, or "pleg has
    /// yet to be successful"). A degraded kernel path is reported by
    /// [`Pleg::degraded`], not here: the fallback relist keeps the agent correct.
    pub fn healthy(&self, now_ns: u64, threshold: std::time::Duration) -> Result<(), String> {
        self.relist_stats.healthy(now_ns, threshold)
    }

    /// The kernel path's degradation, if a part of it stopped.
    pub fn degraded(&self) -> Option<Degradation> {
        self.path_health.degraded()
    }

    /// The full relist's configured period (the fallback may have shortened it:
    /// see `relist_stats.period_ns`).
    pub fn relist_period(&self) -> std::time::Duration {
        self.period
    }

    /// Stops every task and detaches the kernel programs.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
        // The relist task held the other reference; it has ended.
        if let Some(k) = self.kernel.take()
            && let Ok(k) = std::sync::Arc::try_unwrap(k)
        {
            k.stop();
        }
    }
}
