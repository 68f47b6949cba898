//! What the real-time reader hands to a normal-priority thread (issue #25,
//! item 8): its log lines, the counters worth a log line, and the merges
//! whose locks were busy. The kubelet has no real-time thread; this is what
//! keeps ours from ever waiting on one of the agent's locks or on stderr.
//!
//! - **Logging.** The reader never logs: a `tracing` event writes to stderr
//!   synchronously, and a slow terminal or a full pipe held the SCHED_FIFO
//!   thread (`warn!` per malformed record, per full channel). Frequent
//!   conditions are counted in [`KernelStats`] and logged by the helper
//!   thread from the counts' growth; rare ones that name something (a
//!   container id, a cgroup path, a root added to the kernel filter) are
//!   [`LogLine`]s in a bounded queue (a full queue counts the line as
//!   dropped).
//! - **Merges.** The merge runs on the reader ([`KernelMerge::try_handle`]),
//!   taking the cache's, the delivered transitions' and the relist queue's
//!   locks only if they are free now. When one is held (a relist storing a
//!   snapshot, a scrape counting the cache's pods, a worker reading its pod),
//!   the event goes to the helper, which handles it waiting for the locks;
//!   later events follow it there while any is in flight, so a pod's events
//!   keep their order. A full hand-off queue ([`HANDOFF_CAPACITY`]) is a lost
//!   event: a full relist is requested at once (with the loss follow-ups of
//!   `docs/pleg.md` clause 4), counted in
//!   [`KernelStats::handoff_failures`].
//!
//! The queues are `std::sync::mpsc::sync_channel`s: a `try_send` is a
//! compare-and-swap on the slot and never takes the channel's lock while no
//! receiver is blocked in `recv`, and the helper only calls `try_recv`: it
//! sleeps on its own eventfd ([`Wake`]), which the reader writes (a
//! non-blocking syscall). What locks remain on the reader's path are tokio's
//! own for waking a task (the workers' channel, the relist's `Notify`), held
//! for a list operation and never across user code.

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};

use tracing::{debug, info, warn};

use super::index::ScanError;
use super::loader::LoadError;
use super::reader::{KernelStats, Wake};
use super::relist_requests::{RelistReason, RelistRequests};
use crate::merge::{Busy, KernelMerge, MergeStats};
use aya::maps::MapError;
use evpleg_core::ids::ContainerId;
use evpleg_core::lifecycle::PodLifecycleEvent;

/// Events the reader may hand to the helper before a hand-off fails.
pub const HANDOFF_CAPACITY: usize = 1024;
/// Log lines queued before one is dropped (counted).
pub const LOG_CAPACITY: usize = 64;

/// Why the reader handed a merge to the helper.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandoffCause {
    /// A lock the merge needed was busy.
    Busy(Busy),
    /// An earlier event was still with the helper (a pod's events keep their
    /// order).
    Behind,
}

impl HandoffCause {
    pub const ALL: [Self; 4] = [
        Self::Busy(Busy::Cache),
        Self::Busy(Busy::Reports),
        Self::Busy(Busy::RelistQueue),
        Self::Behind,
    ];

    fn index(self) -> usize {
        match self {
            Self::Busy(Busy::Cache) => 0,
            Self::Busy(Busy::Reports) => 1,
            Self::Busy(Busy::RelistQueue) => 2,
            Self::Behind => 3,
        }
    }

    /// Its metric label and log name.
    pub fn label(self) -> &'static str {
        match self {
            Self::Busy(Busy::Cache) => "cache",
            Self::Busy(Busy::Reports) => "reports",
            Self::Busy(Busy::RelistQueue) => "relist_queue",
            Self::Behind => "behind",
        }
    }
}

/// Merges handed to the helper, by cause.
#[derive(Debug, Default)]
pub struct HandoffCounts([AtomicU64; HandoffCause::ALL.len()]);

impl HandoffCounts {
    fn add(&self, cause: HandoffCause) {
        self.0[cause.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self, cause: HandoffCause) -> u64 {
        self.0[cause.index()].load(Ordering::Relaxed)
    }

    pub fn total(&self) -> u64 {
        HandoffCause::ALL.iter().map(|&c| self.get(c)).sum()
    }
}

/// Why the kernel filter refused a root, in a fixed size (built on the
/// real-time reader: no `String`, issue #25 item 8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FilterFailure {
    /// The filter holds `MAX_ROOTS` roots already.
    Full,
    /// Writing the kernel map failed with this errno (0: no errno).
    Map { errno: i32 },
}

impl FilterFailure {
    pub fn of(error: &LoadError) -> Self {
        match error {
            LoadError::Filter(_) => Self::Full,
            LoadError::Map {
                source: MapError::SyscallError(e),
                ..
            } => Self::Map {
                errno: e.io_error.raw_os_error().unwrap_or(0),
            },
            _ => Self::Map { errno: 0 },
        }
    }
}

impl std::fmt::Display for FilterFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Full => write!(f, "the kernel filter is full"),
            Self::Map { errno } => write!(
                f,
                "writing the kernel filter map failed: {}",
                std::io::Error::from_raw_os_error(*errno)
            ),
        }
    }
}

impl LogLine {
    /// The line for a rescan that failed (the errno only: fixed size).
    pub fn rescan_failed(error: &ScanError) -> Self {
        let ScanError::Read { source, .. } = error;
        Self::RescanFailed {
            errno: source.raw_os_error().unwrap_or(0),
        }
    }
}

/// A line the reader has the helper log: fixed-size data (ids, inode
/// numbers, errnos), so that building one allocates nothing on the
/// real-time thread (`tests/no_alloc.rs`).
#[derive(Debug)]
pub enum LogLine {
    RealtimeOn {
        priority: i32,
    },
    RealtimeRefused {
        priority: i32,
        error: std::io::Error,
    },
    RealtimeDisabled,
    RootAdded {
        cgroup_id: u64,
        level: u32,
    },
    RootAddFailed {
        cgroup_id: u64,
        failure: FilterFailure,
    },
    RootRemoveFailed {
        cgroup_id: u64,
        failure: FilterFailure,
    },
    /// A cgroup (by id: its inode number) under a root whose path names no
    /// pod or container.
    NotAttributed {
        cgroup_id: u64,
    },
    /// A rescan of the cgroup tree failed (`errno`: the directory read's
    /// error, 0 when it had none).
    RescanFailed {
        errno: i32,
    },
    /// The walker thread is gone: the views' rescans run on the reader.
    WalkerGone,
    /// A running container the runtime lists whose cgroup no rescan found.
    Unfound(ContainerId),
    /// The runtime's main pid differs from the one the kernel saw.
    Corrected(ContainerId),
}

impl LogLine {
    pub fn emit(&self) {
        match self {
            Self::RealtimeOn { priority } => info!(priority, "ring-buffer reader runs SCHED_FIFO"),
            Self::RealtimeRefused { priority, error } => warn!(
                priority,
                %error,
                "cannot run the ring-buffer reader SCHED_FIFO (needs CAP_SYS_NICE); \
                 reading at normal priority, event latency will be higher"
            ),
            Self::RealtimeDisabled => {
                info!("ring-buffer reader runs at normal priority (real-time disabled)")
            }
            Self::RootAdded { cgroup_id, level } => {
                info!(cgroup_id, level, "root cgroup now in the kernel filter")
            }
            Self::RootAddFailed { cgroup_id, failure } => {
                warn!(%failure, cgroup_id, "cannot add root cgroup to the kernel filter")
            }
            Self::RootRemoveFailed { cgroup_id, failure } => {
                warn!(%failure, cgroup_id, "cannot remove root cgroup from the kernel filter")
            }
            Self::NotAttributed { cgroup_id } => warn!(
                cgroup_id,
                "cgroup not attributed: its path under a kernel pleg root names no pod or \
                 container (find it by inode: find /sys/fs/cgroup -inum <cgroup_id>)"
            ),
            Self::RescanFailed { errno } => warn!(
                error = %std::io::Error::from_raw_os_error(*errno),
                "rescan of the cgroup tree failed"
            ),
            Self::WalkerGone => warn!(
                "the cgroup walker thread stopped; rescans for relist views now run on the \
                 ring-buffer reader and delay the records behind them \
                 (evpleg_pleg_kernel_walker_fallbacks_total)"
            ),
            Self::Unfound(id) => warn!(
                container = %id,
                "the runtime lists a running container whose cgroup is under no kernel pleg root; \
                 its death waits for a relist (check --cgroup-root)"
            ),
            Self::Corrected(id) => warn!(
                container = %id,
                "the runtime's main pid differs from the one the kernel saw; the runtime's wins"
            ),
        }
    }
}

/// The reader's end.
pub(super) struct Offload {
    lines: SyncSender<LogLine>,
    merges: SyncSender<PodLifecycleEvent>,
    in_flight: Arc<AtomicUsize>,
    wake: Arc<Wake>,
    stats: Arc<KernelStats>,
    /// A counter worth a log line grew since the helper was last woken.
    dirty: Cell<bool>,
}

/// The helper thread's end.
pub(super) struct Helper {
    lines: Receiver<LogLine>,
    merges: Receiver<PodLifecycleEvent>,
    in_flight: Arc<AtomicUsize>,
    wake: Arc<Wake>,
    stop: Arc<AtomicBool>,
    stats: Arc<KernelStats>,
    merge: Option<Arc<KernelMerge>>,
    logged: Logged,
}

/// Both ends, sharing `stats` and woken through `wake`.
pub(super) fn pair(
    stats: Arc<KernelStats>,
    merge: Option<Arc<KernelMerge>>,
    wake: Arc<Wake>,
    stop: Arc<AtomicBool>,
) -> (Offload, Helper) {
    let (lines_tx, lines) = sync_channel(LOG_CAPACITY);
    let (merges_tx, merges) = sync_channel(HANDOFF_CAPACITY);
    let in_flight = Arc::new(AtomicUsize::new(0));
    let offload = Offload {
        lines: lines_tx,
        merges: merges_tx,
        in_flight: in_flight.clone(),
        wake: wake.clone(),
        stats: stats.clone(),
        dirty: Cell::new(false),
    };
    let helper = Helper {
        lines,
        merges,
        in_flight,
        wake,
        stop,
        stats,
        merge,
        logged: Logged::default(),
    };
    (offload, helper)
}

impl Offload {
    /// Queues a line for the helper (never blocks; a full queue drops it,
    /// counted).
    pub fn log(&self, line: LogLine) {
        match self.lines.try_send(line) {
            Ok(()) => self.wake.wake(),
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.stats.log_lines_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// A counter worth a log line grew: the helper is woken at the next
    /// [`Offload::flush_counters`] (the reader's counter poll, 100 ms after
    /// a record), not once per record.
    pub fn note_counters(&self) {
        self.dirty.set(true);
    }

    /// Wakes the helper if a counter grew since the last flush.
    pub fn flush_counters(&self) {
        if self.dirty.replace(false) {
            self.wake.wake();
        }
    }

    /// Merges `event` on this thread if nothing is in flight on the helper
    /// and every lock is free, else hands it to the helper; a full hand-off
    /// queue requests a full relist at once.
    pub fn merge(&self, merge: &KernelMerge, event: PodLifecycleEvent, relist: &RelistRequests) {
        let cause = if self.in_flight.load(Ordering::Acquire) != 0 {
            HandoffCause::Behind
        } else {
            match merge.try_handle(&event) {
                Ok(()) => return,
                Err(busy) => HandoffCause::Busy(busy),
            }
        };
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        match self.merges.try_send(event) {
            Ok(()) => {
                self.stats.handoffs.add(cause);
                self.wake.wake();
            }
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.in_flight.fetch_sub(1, Ordering::AcqRel);
                self.stats.handoff_failures.fetch_add(1, Ordering::Relaxed);
                relist.request(RelistReason::HandOffFull);
                self.wake.wake();
            }
        }
    }
}

/// The counters' values as last logged.
#[derive(Debug, Default)]
struct Logged {
    malformed: u64,
    unattributed: u64,
    discarded: u64,
    dropped: u64,
    missed: u64,
    handoff_failures: u64,
    lines_dropped: u64,
    rt_throttled: u64,
    merge_discarded: u64,
}

/// What grew since `*last`, which becomes `now`.
fn grew(last: &mut u64, now: u64) -> Option<u64> {
    let d = now.saturating_sub(*last);
    *last = now.max(*last);
    (d > 0).then_some(d)
}

impl Helper {
    /// Runs until the stop flag, then drains what is left.
    pub fn run(mut self) {
        loop {
            let stopping = self.stop.load(Ordering::Acquire);
            self.wake.drain();
            self.pass();
            if stopping {
                return;
            }
            self.wake.wait();
        }
    }

    /// Handles the handed-off merges, logs the queued lines and the counters'
    /// growth.
    fn pass(&mut self) {
        while let Ok(event) = self.merges.try_recv() {
            if let Some(merge) = &self.merge {
                merge.handle(event);
            }
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
        while let Ok(line) = self.lines.try_recv() {
            line.emit();
        }
        self.log_counters();
    }

    fn log_counters(&mut self) {
        let s = &self.stats;
        let l = &mut self.logged;
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        if let Some(n) = grew(&mut l.malformed, load(&s.malformed)) {
            warn!(records = n, "malformed ring-buffer records rejected");
        }
        if let Some(n) = grew(&mut l.unattributed, load(&s.unattributed)) {
            debug!(
                records = n,
                "tasks in unknown cgroups below a root: relist requested"
            );
        }
        if let Some(n) = grew(&mut l.discarded, load(&s.discarded)) {
            warn!(
                events = n,
                "event channel full: events discarded, relist requested"
            );
        }
        if let Some(n) = grew(&mut l.dropped, load(&s.kernel_dropped)) {
            warn!(
                lost = n,
                demoted_total = load(&s.demoted),
                "kernel ring buffer full: records lost, containers demoted to uncertain, relist requested"
            );
        }
        if let Some(n) = grew(&mut l.missed, load(&s.kernel_missed)) {
            warn!(
                skipped = n,
                demoted_total = load(&s.demoted),
                "kernel program runs skipped (the program was already running on that CPU): \
                 records may be lost, containers demoted to uncertain, relist requested"
            );
        }
        if let Some(n) = grew(&mut l.handoff_failures, load(&s.handoff_failures)) {
            warn!(
                events = n,
                "kernel events not handed to the merge thread (its queue was full): relist requested"
            );
        }
        if let Some(n) = grew(&mut l.lines_dropped, load(&s.log_lines_dropped)) {
            warn!(
                lines = n,
                "ring-buffer reader log lines dropped (queue full)"
            );
        }
        if let Some(n) = grew(&mut l.rt_throttled, load(&s.rt_throttled)) {
            info!(
                times = n,
                "the ring-buffer reader spent its real-time budget: normal priority until its window ended"
            );
        }
        let merge_stats: Option<&MergeStats> = self.merge.as_ref().map(|m| &*m.stats);
        if let Some(m) = merge_stats
            && let Some(n) = grew(&mut l.merge_discarded, load(&m.discarded))
        {
            warn!(
                events = n,
                "pod worker channel full: kernel events discarded; the relist sends them"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::relist_requests::RelistCounts;
    use crate::on_demand::PodRelistQueue;
    use crate::relist::KernelReports;
    use evpleg_core::cache::{KernelExit, PodStatusCache};
    use evpleg_core::clock::ManualClock;
    use evpleg_core::container::{ContainerState, ContainerStatus, PodStatus};
    use evpleg_core::ids::PodUid;
    use evpleg_core::lifecycle::{EventKind, EventSource, ExitStatus, RelistSignal};
    use std::sync::mpsc;
    use std::time::Duration;

    const BOUND: Duration = Duration::from_secs(10);

    fn uid() -> PodUid {
        PodUid::parse(&"a".repeat(32)).unwrap()
    }

    fn cid(c: char) -> ContainerId {
        ContainerId::parse(&c.to_string().repeat(64)).unwrap()
    }

    fn died(c: char, code: u32) -> PodLifecycleEvent {
        PodLifecycleEvent {
            pod_uid: Some(uid()),
            kind: EventKind::ContainerDied,
            container_id: Some(cid(c)),
            at_ns: 500,
            source: EventSource::Kernel,
            exit: Some(ExitStatus::from_wait_status(code << 8, false)),
            pid: Some(10),
        }
    }

    /// Runs `f` on a thread of its own; panics unless it returns within
    /// [`BOUND`].
    fn within<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(BOUND).expect("blocked past the bound")
    }

    /// Issue #25 item 8: the merge on the real-time reader took the cache's
    /// std mutex, waiting for whichever normal-priority thread held it. Now
    /// the reader goes on (the event goes to the helper, later ones follow
    /// it there, a full queue is a relist) and the helper delivers it once
    /// the lock is free: nothing is lost.
    #[test]
    fn the_reader_never_waits_for_the_cache_lock_and_nothing_is_lost() {
        let (out, mut rx) = tokio::sync::mpsc::channel(10);
        let cache = Arc::new(PodStatusCache::new());
        let merge = Arc::new(KernelMerge {
            cache: cache.clone(),
            reports: Arc::new(KernelReports::default()),
            out,
            pod_relist: Arc::new(PodRelistQueue::new(Arc::new(ManualClock::new(1)))),
            relist: Arc::new(RelistSignal::new()),
            stats: Arc::new(MergeStats::default()),
        });
        let mut status = PodStatus {
            uid: Some(uid()),
            ..PodStatus::default()
        };
        status.containers.push(ContainerStatus::new(
            cid('c'),
            "app",
            ContainerState::Running,
            EventSource::Relist,
        ));
        cache.set(&uid(), status, 100);
        // An exit to prune, so that the holder's closure runs under the lock.
        let exit = KernelExit {
            status: ExitStatus::from_wait_status(0, false),
            at_ns: 50,
        };
        cache.record_exit(&uid(), &cid('e'), exit);
        let stats = Arc::new(KernelStats::default());
        let wake = Arc::new(Wake::new().unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let (offload, mut helper) = pair(stats.clone(), Some(merge.clone()), wake, stop);
        let (held, held_rx) = mpsc::channel();
        let (release, release_rx) = mpsc::channel::<()>();
        let holder = {
            let cache = cache.clone();
            std::thread::spawn(move || {
                cache.prune_exits(None, 0, |_| {
                    let _ = held.send(());
                    let _ = release_rx.recv();
                    true
                })
            })
        };
        held_rx.recv_timeout(BOUND).expect("the cache's lock held");
        let signal = Arc::new(RelistSignal::new());
        let counts = Arc::new(RelistCounts::default());
        let relist = RelistRequests::new(signal.clone(), counts.clone());
        let (offload, merge) = within(move || {
            // The death, then as many as the helper's queue takes, and one more.
            for _ in 0..=HANDOFF_CAPACITY {
                offload.merge(&merge, died('c', 7), &relist);
            }
            (offload, merge)
        });
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        assert_eq!(
            (stats.handoffs.total(), load(&stats.handoff_failures)),
            (HANDOFF_CAPACITY as u64, 1),
            "handed off while the lock was held, the one past the queue a relist"
        );
        let by_cause = HandoffCause::ALL.map(|c| (c.label(), stats.handoffs.get(c)));
        assert_eq!(
            by_cause,
            [
                ("cache", 1),
                ("reports", 0),
                ("relist_queue", 0),
                ("behind", HANDOFF_CAPACITY as u64 - 1)
            ],
            "the first for the cache's lock, the others behind it"
        );
        assert_eq!(
            (signal.count(), counts.get(RelistReason::HandOffFull)),
            (1, 1)
        );
        assert!(
            rx.try_recv().is_err(),
            "not delivered while the lock is held"
        );
        let helper_done = std::thread::spawn(move || {
            helper.pass();
            helper
        });
        release.send(()).unwrap();
        holder.join().unwrap();
        let _helper = within(move || helper_done.join().unwrap());
        let got = rx.try_recv().expect("the death delivered by the helper");
        assert_eq!(
            (got.kind, got.exit.map(|e| e.code)),
            (EventKind::ContainerDied, Some(7))
        );
        assert!(rx.try_recv().is_err(), "delivered once");
        let entry = cache.get(&uid()).unwrap();
        assert_eq!(
            entry.status.container(&cid('c')).unwrap().exit_code,
            Some(7)
        );
        assert_eq!(offload.in_flight.load(Ordering::Acquire), 0);
        // Nothing in flight and the locks free: merged on the reader again.
        let mut start = died('c', 0);
        start.kind = EventKind::ContainerStarted;
        start.exit = None;
        offload.merge(&merge, start, &RelistRequests::new(signal, counts));
        assert_eq!(stats.handoffs.total(), HANDOFF_CAPACITY as u64);
    }

    #[test]
    fn growth_is_reported_once() {
        let mut last = 0;
        assert_eq!(grew(&mut last, 0), None);
        assert_eq!(grew(&mut last, 3), Some(3));
        assert_eq!(grew(&mut last, 3), None);
        assert_eq!(grew(&mut last, 5), Some(2));
    }
}
