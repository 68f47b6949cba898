//! The kernel-driven PLEG: eBPF programs report execs, process exits and cgroup
//! mkdir/rmdir; this module loads them, reads their ring buffer on a dedicated
//! thread and turns the records into [`PodLifecycleEvent`](super::PodLifecycleEvent)s.
//! See `docs/pleg.md`. cgroup2 is required: task records carry cgroup2 ids, and
//! cgroup v1 hierarchies are neither reported nor indexed.

pub mod btf;

pub mod event;
pub mod health;
pub mod histogram;
pub mod index;
pub mod loader;
pub mod main_state;
pub mod offload;
pub mod proc;
pub mod reader;
pub mod relist_requests;
pub mod rescan;
pub mod roots;
pub mod rt_budget;
pub mod scan;
pub mod tracker;
pub mod walker;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc as std_mpsc};
use std::thread::JoinHandle;

use tokio::sync::mpsc;
use tracing::info;

use evpleg_core::clock::monotonic_ns;
pub use loader::{LoadError, LoaderConfig};
pub use reader::{Command, KernelStats, RecordTap};

use health::HealthCell;
use proc::{ProcFs, ProcSource};
use relist_requests::RelistRequests;

use evpleg_core::ids::{ContainerId, PodUid};
use evpleg_core::lifecycle::{PodLifecycleEvent, RelistSignal};

/// The hash maps of the reader thread's state (the tracker, the cgroup index):
/// foldhash, seeded per process, where std's SipHash was a tenth of the
/// reader's samples at 1 000 deaths/s and most of a full view's prune
/// (issue #29). Their keys are kernel cgroup ids and ids the runtime and the
/// API server made, not chosen by a pod.
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
pub(crate) type FastSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

/// Root cgroups watched by default: the kubelet's cgroupfs and systemd roots and
/// containerd's default parent. `/system.slice` (CRI-O scopes without a pod parent)
/// is opt-in: it holds every system service.
pub const DEFAULT_ROOTS: [&str; 3] = ["/kubepods", "/kubepods.slice", "/k8s.io"];

/// Default ring-buffer size: 1 MiB lost nothing at 1 000 exits/s here.
pub const DEFAULT_RING_BUFFER_BYTES: u32 = 1 << 20;

/// Default SCHED_FIFO priority of the reader thread.
pub const DEFAULT_REALTIME_PRIORITY: i32 = 10;

/// What the runtime said at a relist, handed to the tracker so that it learns the
/// containers it does not know (with their main pid), marks sandboxes, and forgets
/// containers the runtime no longer has (`docs/pleg.md`, contract clause 4).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuntimeView {
    /// CLOCK_MONOTONIC ns when the listing started: anything the tracker learned
    /// after this instant is kept even if the view does not list it.
    pub listed_at_ns: u64,
    /// `None`: the whole node (a full relist; containers not listed are gone).
    /// `Some(uid)`: that pod only.
    pub scope: Option<PodUid>,
    pub containers: Vec<RuntimeContainer>,
}

/// One sandbox or container in a [`RuntimeView`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuntimeContainer {
    pub id: ContainerId,
    pub pod: PodUid,
    pub sandbox: bool,
    /// The runtime reports it running.
    pub running: bool,
    /// The runtime's record of its main process (host pid), when the runtime
    /// gives it (containerd and CRI-O: `ContainerStatus` with `verbose`).
    pub pid: Option<u32>,
    /// This relist found the kernel's death of the container contradicted past
    /// the confirmation bound: the tracker forgets that death's main process.
    pub contradicted: bool,
}

/// Health of the kernel path: the reader thread alive, or since when it is not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelHealth {
    Running,
    /// A part stopped; the agent falls back to the generic relist.
    Degraded {
        /// Which part: `ring-buffer reader`.
        part: &'static str,
        /// CLOCK_MONOTONIC ns when it stopped.
        since_ns: u64,
        reason: String,
    },
}

/// Errors of starting the kernel PLEG.
#[derive(Debug, thiserror::Error)]
pub enum KernelPlegError {
    #[error(transparent)]
    Load(#[from] LoadError),
    /// the start-up scan failed
    #[error(transparent)]
    Scan(#[from] index::ScanError),
    /// no cgroup2 hierarchy is mounted (cgroup v1 hosts are not supported)
    #[error(
        "no cgroup2 hierarchy is mounted (see /proc/self/mountinfo); the kernel pleg needs cgroup2"
    )]
    NoCgroup2,
    /// reading /proc failed
    #[error("cannot read {path}: {source}")]
    Proc {
        path: &'static str,
        source: std::io::Error,
    },
    /// the reader thread could not be spawned
    #[error("cannot spawn the ring-buffer reader thread: {0}")]
    Spawn(std::io::Error),
    /// the reader's wake-up eventfd could not be created
    #[error("cannot create the ring-buffer reader's eventfd: {0}")]
    Wake(std::io::Error),
}

/// How to run the kernel PLEG.
#[derive(Clone)]
pub struct KernelPlegConfig {
    pub object: Option<PathBuf>,
    pub ring_buffer_bytes: u32,
    pub roots: Vec<String>,
    /// `None`: do not try real-time priority.
    pub realtime_priority: Option<i32>,
    /// CPU the reader may spend at real-time priority per window
    /// ([`rt_budget`]).
    pub realtime_budget: rt_budget::RtBudgetConfig,
    /// Sees every decoded record on the reader thread (tests, the benchmark).
    pub tap: Option<RecordTap>,
}

impl std::fmt::Debug for KernelPlegConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelPlegConfig")
            .field("object", &self.object)
            .field("ring_buffer_bytes", &self.ring_buffer_bytes)
            .field("roots", &self.roots)
            .field("realtime_priority", &self.realtime_priority)
            .field("realtime_budget", &self.realtime_budget)
            .field("tap", &self.tap.as_ref().map(|_| "set"))
            .finish()
    }
}

impl Default for KernelPlegConfig {
    fn default() -> Self {
        Self {
            object: None,
            ring_buffer_bytes: DEFAULT_RING_BUFFER_BYTES,
            roots: DEFAULT_ROOTS.iter().map(|s| s.to_string()).collect(),
            realtime_priority: Some(DEFAULT_REALTIME_PRIORITY),
            realtime_budget: rt_budget::RtBudgetConfig::default(),
            tap: None,
        }
    }
}

/// The running kernel PLEG: programs attached, reader thread running. Dropping it
/// stops the thread and detaches the programs.
#[derive(Debug)]
pub struct KernelPleg {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// The normal-priority helper ([`offload`]): stopped after the reader.
    helper: Option<JoinHandle<()>>,
    /// The walker ([`walker`]): stops when the reader does.
    walker: Option<JoinHandle<()>>,
    helper_stop: Arc<AtomicBool>,
    helper_wake: Arc<reader::Wake>,
    stats: Arc<KernelStats>,
    commands: std_mpsc::Sender<Command>,
    wake: Arc<reader::Wake>,
    deadline: Arc<reader::Deadline>,
    offsets: evpleg_events::KernelOffsets,
    health: Arc<HealthCell>,
    /// When the reader was started (CLOCK_MONOTONIC ns): its first heartbeat
    /// is due from then.
    started_ns: u64,
}

impl KernelPleg {
    /// Loads and attaches the programs, scans the existing cgroups and starts the
    /// reader. Lifecycle events go to `events` (never blocking: a full channel is
    /// counted and raises `relist`).
    pub fn start(
        config: KernelPlegConfig,
        events: mpsc::Sender<PodLifecycleEvent>,
        relist: Arc<RelistSignal>,
    ) -> Result<Self, KernelPlegError> {
        Self::start_with(config, reader::Sink::Channel(events), relist)
    }

    /// [`KernelPleg::start`] with the merge run on the reader thread: each
    /// event is merged into the cache and offered to the pod workers' channel
    /// as soon as it is attributed, with no hop through another thread.
    pub fn start_merged(
        config: KernelPlegConfig,
        merge: super::merge::KernelMerge,
        relist: Arc<RelistSignal>,
    ) -> Result<Self, KernelPlegError> {
        Self::start_with(config, reader::Sink::Merge(Arc::new(merge)), relist)
    }

    fn start_with(
        config: KernelPlegConfig,
        events: reader::Sink,
        relist: Arc<RelistSignal>,
    ) -> Result<Self, KernelPlegError> {
        let cgroup2_mount = index::cgroup2_mount()
            .map_err(|source| KernelPlegError::Proc {
                path: "/proc/self/mountinfo",
                source,
            })?
            .ok_or(KernelPlegError::NoCgroup2)?;
        let mut loaded = loader::load(&LoaderConfig {
            object: config.object.clone(),
            ring_buffer_bytes: config.ring_buffer_bytes,
            roots: config.roots.clone(),
            hierarchies: vec![index::CGROUP2_HIERARCHY],
            cgroup2_mount: cgroup2_mount.clone(),
        })?;
        let offsets = loaded.offsets;
        // Attached first, then scanned: a cgroup created in between is both in the
        // ring buffer and in the scan, and the tracker merges the two.
        let ticks = procfs::ticks_per_second();
        let mut tracker = tracker::Tracker::new(ticks);
        let scanner = scan::Scanner {
            cgroup2_mount: cgroup2_mount.clone(),
            roots: config.roots.clone(),
        };
        let report = scanner.scan_into(&mut tracker, None, monotonic_ns())?;
        let mut roots = roots::RootFilterUpdates::new(&config.roots);
        let opened = reader::apply_filter_changes(
            &mut loaded.roots,
            roots.on_scan(&report.roots),
            &mut |l| l.emit(),
        );
        // Roots made between the load and the scan: what the scan learned
        // below them may have lost records (the first relist confirms it).
        let at = monotonic_ns();
        for root in &opened {
            tracker.filter_opened(root, at);
        }
        for (cgroup_id, e) in &report.malformed {
            tracing::warn!(error = %e, cgroup_id, "cgroup found by the start-up scan not attributed");
        }
        info!(cgroups = report.learned, roots = ?config.roots, "kernel pleg attached; existing cgroups indexed");
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(KernelStats::default());
        let health = Arc::new(HealthCell::default());
        let (commands, command_rx) = std_mpsc::channel();
        let wake = Arc::new(reader::Wake::new().map_err(KernelPlegError::Wake)?);
        let deadline = Arc::new(reader::Deadline::default());
        let helper_wake = Arc::new(reader::Wake::new().map_err(KernelPlegError::Wake)?);
        let helper_stop = Arc::new(AtomicBool::new(false));
        let merge = match &events {
            reader::Sink::Merge(m) => Some(m.clone()),
            reader::Sink::Channel(_) => None,
        };
        let (offload, helper) = offload::pair(
            stats.clone(),
            merge,
            helper_wake.clone(),
            helper_stop.clone(),
        );
        let helper = std::thread::Builder::new()
            .name("evpleg-pleg-aux".into())
            .spawn(move || helper.run())
            .map_err(KernelPlegError::Spawn)?;
        let stop_helper = || {
            helper_stop.store(true, Ordering::Release);
            helper_wake.wake();
        };
        let (walker, walker_thread) = match walker::spawn(
            cgroup2_mount,
            config.roots.clone(),
            commands.clone(),
            wake.clone(),
        ) {
            Ok(w) => w,
            Err(e) => {
                stop_helper();
                return Err(KernelPlegError::Spawn(e));
            }
        };
        let reader = reader::Reader {
            loaded,
            tracker,
            scanner,
            roots,
            rescans: rescan::RescanPolicy::default(),
            awaiting_rescan: Default::default(),
            walker,
            walking: false,
            events,
            relist: RelistRequests::new(relist, stats.relist_requests.clone()),
            stats: stats.clone(),
            stop: stop.clone(),
            health: health.clone(),
            commands: command_rx,
            // Room for the views of a burst of deaths (no allocation after).
            set_aside: Vec::with_capacity(64),
            reconciling: None,
            realtime_priority: config.realtime_priority,
            realtime_budget: config.realtime_budget,
            tap: config.tap,
            wake: wake.clone(),
            deadline: deadline.clone(),
            offload,
        };
        let thread = match std::thread::Builder::new()
            .name("evpleg-ringbuf".into())
            .spawn(move || reader.run())
        {
            Ok(t) => t,
            Err(e) => {
                // The reader (and with it the walker's requests) is dropped.
                stop_helper();
                return Err(KernelPlegError::Spawn(e));
            }
        };
        Ok(Self {
            stop,
            thread: Some(thread),
            helper: Some(helper),
            walker: Some(walker_thread),
            helper_stop,
            helper_wake,
            stats,
            commands,
            wake,
            deadline,
            offsets,
            health,
            started_ns: monotonic_ns(),
        })
    }

    pub fn stats(&self) -> &Arc<KernelStats> {
        &self.stats
    }

    /// The kernel struct offsets in use (from BTF).
    pub fn offsets(&self) -> &evpleg_events::KernelOffsets {
        &self.offsets
    }

    /// Tells the tracker that `id` is a pod sandbox ([`KernelPleg::reconcile`]
    /// does this for every sandbox a view lists).
    pub fn add_sandbox(&self, id: ContainerId) {
        self.send(Command::AddSandbox(id));
    }

    /// Hands the runtime's view to the tracker. The runtime's pids are checked
    /// against `/proc` here, on the caller's thread (start time, cgroup); the
    /// tracker applies the result on the reader thread before the next record it
    /// handles, and within [`reader::LAZY_BOUND`] (the reader is woken for it
    /// only when its wait ends later). Never blocks on the reader.
    pub fn reconcile(&self, view: RuntimeView) {
        self.reconcile_with(view, &ProcFs);
    }

    /// [`KernelPleg::reconcile`] with another `/proc` (tests give a made-up
    /// one).
    pub fn reconcile_with(&self, view: RuntimeView, procs: &dyn ProcSource) {
        let _ = self
            .commands
            .send(Command::Reconcile(proc::resolve(view, procs)));
        if self.deadline.wake_needed(monotonic_ns()) {
            self.wake.wake();
        }
    }

    /// Whether the reader thread runs, or since when and why it does not.
    pub fn health(&self) -> KernelHealth {
        self.health.get()
    }

    /// Degrades the path when the reader has not finished a pass of its loop
    /// within [`health::HEARTBEAT_BOUND`] (blocked, not stopped: issue #25).
    /// Returns whether it did.
    pub fn check_heartbeat(&self, now_ns: u64) -> bool {
        health::check_heartbeat(
            &self.health,
            self.started_ns,
            self.stats.heartbeat_ns.load(Ordering::Relaxed),
            now_ns,
            health::HEARTBEAT_BOUND,
        )
    }

    /// Returns once the reader thread stopped without being asked to.
    pub async fn degraded(&self) {
        self.health.degraded().await
    }

    /// Makes the reader thread stop as if it had failed: [`KernelPleg::health`]
    /// then reports it degraded, and a relist is requested (tests of clause 5).
    #[cfg(any(test, feature = "testing"))]
    pub fn fail_reader_for_test(&self) {
        self.send(Command::FailForTest);
    }

    /// Queues a command and wakes the reader for it.
    fn send(&self, cmd: Command) {
        let _ = self.commands.send(cmd);
        self.wake.wake();
    }

    /// Stops the reader (woken at once) and detaches.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.wake.wake();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        // After the reader: what it handed off is merged before the helper
        // stops.
        self.helper_stop.store(true, Ordering::Release);
        self.helper_wake.wake();
        if let Some(helper) = self.helper.take() {
            let _ = helper.join();
        }
        if let Some(walker) = self.walker.take() {
            let _ = walker.join();
        }
    }
}

impl Drop for KernelPleg {
    fn drop(&mut self) {
        self.shutdown();
    }
}
