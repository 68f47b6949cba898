//! The Pod Lifecycle Event Generator.
//!
//! Reproduces the kubelet's `pkg/kubelet/pleg`: a stream of [`PodLifecycleEvent`]s
//! that tells pod workers which pod changed. Where the kubelet's generic PLEG learns
//! of a change at its next one-second relist, evpleg's [`kernel`] PLEG learns it from
//! eBPF programs the moment the kernel sees it.

pub mod cache;
pub mod evented_cri;
pub mod kernel;
pub mod latency;
pub mod merge;
#[cfg(test)]
mod model_tests;
pub mod on_demand;
pub mod relist;
pub mod stages;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::Notify;

/// Requests for a relist of the runtime, raised whenever an event may have been
/// lost (a kernel ring-buffer drop, a full event channel, an exit never seen). The
/// relist PLEG waits on it; nothing that is lost goes unnoticed.
#[derive(Debug, Default)]
pub struct RelistSignal {
    requested: AtomicU64,
    notify: Notify,
}

impl RelistSignal {
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks for a relist; cheap and non-blocking, callable from any thread.
    pub fn request(&self, reason: &str) {
        self.requested.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(reason, "relist requested");
        self.notify.notify_one();
    }

    /// How many relists were requested so far.
    pub fn count(&self) -> u64 {
        self.requested.load(Ordering::Relaxed)
    }

    /// Waits until a relist is requested (a request made while nobody waited is
    /// kept for the next waiter).
    pub async fn requested(&self) {
        self.notify.notified().await;
    }
}

/// A pod's UID, normalised: lowercase, with `-` separators (systemd cgroup names
/// write them as `_`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodUid(String);

impl PodUid {
    /// Normalises a UID as found in a cgroup name or an API object. Returns `None`
    /// when it is empty, longer than 64 bytes or holds anything but hex digits and
    /// `-`/`_` separators (static pods have 32-hex UIDs without separators).
    pub fn parse(raw: &str) -> Option<Self> {
        if raw.is_empty() || raw.len() > 64 {
            return None;
        }
        let mut out = String::with_capacity(raw.len());
        for c in raw.chars() {
            match c {
                '0'..='9' | 'a'..='f' => out.push(c),
                'A'..='F' => out.push(c.to_ascii_lowercase()),
                '-' | '_' => out.push('-'),
                _ => return None,
            }
        }
        if out.starts_with('-') || out.ends_with('-') {
            return None;
        }
        Some(Self(out))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PodUid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A 64-hex container (or sandbox) id, as CRI runtimes name them.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContainerId(String);

impl ContainerId {
    /// Accepts exactly 64 hex digits (lowercased).
    pub fn parse(raw: &str) -> Option<Self> {
        (raw.len() == 64 && raw.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| Self(raw.to_ascii_lowercase()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ContainerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The kubelet's `PodLifecycleEventType`, with sandboxes told apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventKind {
    ContainerStarted,
    ContainerDied,
    ContainerRemoved,
    SandboxStarted,
    SandboxDied,
    SandboxRemoved,
    /// Something about the pod changed; re-inspect it (the kubelet's PodSync).
    PodSync,
}

/// Who observed the event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventSource {
    Kernel,
    Relist,
    Cri,
}

/// How a process ended, from its wait status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExitStatus {
    /// The exit code, as the CRI reports it: the code passed to `exit`, or
    /// 128 + the signal number for a death by signal.
    pub code: i32,
    /// The terminating signal, if any.
    pub signal: Option<i32>,
    /// A core dump was written.
    pub core_dumped: bool,
    /// The OOM killer chose this process.
    pub oom_killed: bool,
}

impl ExitStatus {
    /// Decodes a wait status (`task_struct.exit_code`).
    pub fn from_wait_status(status: u32, oom_killed: bool) -> Self {
        let signal = (status & 0x7f) as i32;
        if signal == 0 {
            Self {
                code: ((status >> 8) & 0xff) as i32,
                signal: None,
                core_dumped: false,
                oom_killed,
            }
        } else {
            Self {
                code: 128 + signal,
                signal: Some(signal),
                core_dumped: status & 0x80 != 0,
                oom_killed,
            }
        }
    }
}

/// A lifecycle event for one pod: the contract between every PLEG and the pod
/// workers (`design.md`: "Contracts worth fixing early").
///
/// From the kernel (`source == Kernel`, docs/pleg.md "The contract"): Started and
/// Died kinds only for a main process whose identity is certain, Died always with
/// its `exit`; `PodSync` is a *hint* (something happened in this pod that the
/// kernel cannot vouch for: an uncertain main process, a cgroup removed before its
/// main process was seen to exit) that relists the pod and writes nothing to the
/// cache. The kernel never sends the Removed kinds: a cgroup's removal is not the
/// runtime forgetting the container; only the relist reports removal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodLifecycleEvent {
    /// `None` only when the cgroup layout does not name the pod (containerd without
    /// a cgroup parent: `/k8s.io/<id>`); the runtime side fills it in.
    pub pod_uid: Option<PodUid>,
    pub kind: EventKind,
    pub container_id: Option<ContainerId>,
    /// CLOCK_MONOTONIC nanoseconds (the clock of `bpf_ktime_get_ns`).
    pub at_ns: u64,
    pub source: EventSource,
    /// Set for the Died kinds.
    pub exit: Option<ExitStatus>,
    /// The container's main process, when known.
    pub pid: Option<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uid_normalisation() {
        assert_eq!(
            PodUid::parse("1B4E28BA_2FA1_11D2_883F_0016D3CCA427")
                .unwrap()
                .as_str(),
            "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
        );
        assert_eq!(
            PodUid::parse("6f0e1b0c2a3d4e5f60718293a4b5c6d7")
                .unwrap()
                .as_str(),
            "6f0e1b0c2a3d4e5f60718293a4b5c6d7"
        );
        for bad in ["", "-abc", "abc-", "xyz", "1234/5678", &"a".repeat(65)] {
            assert_eq!(PodUid::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn container_id() {
        let id = "A".repeat(64);
        assert_eq!(ContainerId::parse(&id).unwrap().as_str(), "a".repeat(64));
        assert!(ContainerId::parse(&"a".repeat(63)).is_none());
        assert!(ContainerId::parse(&"g".repeat(64)).is_none());
    }

    #[test]
    fn wait_status() {
        let exit7 = ExitStatus::from_wait_status(0x700, false);
        assert_eq!(
            (exit7.code, exit7.signal, exit7.core_dumped),
            (7, None, false)
        );
        let kill = ExitStatus::from_wait_status(9, true);
        assert_eq!(
            (kill.code, kill.signal, kill.oom_killed),
            (137, Some(9), true)
        );
        let segv_core = ExitStatus::from_wait_status(0x80 | 11, false);
        assert_eq!(
            (segv_core.code, segv_core.signal, segv_core.core_dumped),
            (139, Some(11), true)
        );
    }
}

/// Which PLEG drives the pod workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PlegMode {
    /// Kernel events (eBPF), merged with a slow reconciling relist (300 s).
    Ebpf,
    /// The kubelet's generic PLEG: a relist every second.
    Generic,
    /// For comparison: the CRI event stream (`GetContainerEvents`) as hints
    /// that relist one pod, as the 2026 KEP-3386 redesign does, with the 1 s
    /// relist kept ([`evented_cri`]). Needs containerd 1.7 or later; with 1.6
    /// it is the generic PLEG.
    EventedCri,
}

/// Errors of starting the PLEG.
#[derive(Debug, thiserror::Error)]
pub enum PlegError {
    #[error("kernel pleg: {0}")]
    Kernel(#[from] kernel::KernelPlegError),
    /// `evented-cri` mode over a runtime that is not the CRI.
    #[error("evented-cri pleg: the runtime is not a CRI runtime (runtime::CriRuntime)")]
    EventedCriNeedsCri,
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
/// the merge, stopped without being asked to: its stop guard wakes this task,
/// no polling); then says so (log, metric, `/healthz`), asks for a relist at
/// once and moves the relist to the kubelet's 1 s period for good.
async fn supervise(
    kernel: std::sync::Arc<kernel::KernelPleg>,
    health: std::sync::Arc<PathHealth>,
    period: tokio::sync::watch::Sender<std::time::Duration>,
    relist: std::sync::Arc<RelistSignal>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    tokio::select! {
        () = shutdown.cancelled() => return,
        () = kernel.degraded() => {}
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
    pub cache: std::sync::Arc<cache::PodStatusCache>,
    pub relist_stats: std::sync::Arc<relist::RelistStats>,
    pub relist_signal: std::sync::Arc<RelistSignal>,
    /// Asks for an on-demand relist of one pod.
    pub pod_relist: std::sync::Arc<on_demand::PodRelistQueue>,
    pub kernel: Option<std::sync::Arc<kernel::KernelPleg>>,
    pub merge_stats: Option<std::sync::Arc<merge::MergeStats>>,
    /// The kernel path's health, in `ebpf` mode.
    pub path_health: std::sync::Arc<PathHealth>,
    /// The CRI event stream's counters, in `evented-cri` mode.
    pub evented_stats: Option<std::sync::Arc<evented_cri::EventedCriStats>>,
    /// The relist task's (and the CRI event stream's) health: one that stops
    /// before [`Pleg::stop`] fails `/healthz` at once.
    pub task_health: std::sync::Arc<crate::tasks::TaskHealth>,
    /// `pleg_event_latency_seconds`, observed by the events' consumer.
    pub event_latency: std::sync::Arc<latency::EventLatency>,
    shutdown: tokio_util::sync::CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Pleg {
    /// Starts the PLEG of `mode` over `runtime`; lifecycle events go to `events`.
    /// In `ebpf` mode the kernel programs are loaded with `kernel_config`.
    pub fn start<R: relist::PodRuntime + 'static>(
        mode: PlegMode,
        runtime: R,
        kernel_config: kernel::KernelPlegConfig,
        events: tokio::sync::mpsc::Sender<PodLifecycleEvent>,
        clock: crate::clock::SharedClock,
        relist_period: Option<std::time::Duration>,
    ) -> Result<Self, PlegError> {
        use std::sync::Arc;
        let cache = Arc::new(cache::PodStatusCache::new());
        let reports = Arc::new(relist::KernelReports::default());
        let relist_signal = Arc::new(RelistSignal::new());
        let shutdown = tokio_util::sync::CancellationToken::new();
        let pod_relist = Arc::new(on_demand::PodRelistQueue::new(clock.clone()));
        let path_health = Arc::new(PathHealth::default());
        let task_health = crate::tasks::TaskHealth::new(clock.clone());
        // evented-cri keeps the generic 1 s (see `evented_cri` for why not 300 s).
        let period = relist_period.unwrap_or(match mode {
            PlegMode::Ebpf => relist::EBPF_PERIOD,
            PlegMode::Generic | PlegMode::EventedCri => relist::GENERIC_PERIOD,
        });
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
            PlegMode::EventedCri => {
                let client = (&runtime as &dyn std::any::Any)
                    .downcast_ref::<crate::runtime::CriRuntime>()
                    .map(|r| r.client().clone())
                    .ok_or(PlegError::EventedCriNeedsCri)?;
                let stats = Arc::new(evented_cri::EventedCriStats::default());
                let stream = evented_cri::EventedCri::new(
                    client,
                    pod_relist.clone(),
                    relist_signal.clone(),
                    stats.clone(),
                    clock.clone(),
                    evented_cri::EventedCriConfig::default(),
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
