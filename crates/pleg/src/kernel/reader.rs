//! The ring-buffer reader: a dedicated thread blocked in `epoll_wait` on the ring
//! buffer's fd, running SCHED_FIFO when allowed.
//!
//! Measured on these machines (`docs/pleg.md`), a reader inside tokio waits about
//! 100 us for a halted vCPU to wake, while a real-time thread blocked in epoll sees
//! an exit at p50 about 25 us. The thread decodes each record as it reads it (at
//! most [`BATCH`] before it looks at its commands, counters and stop flag again),
//! runs the [`Tracker`] and hands lifecycle events to the async side with
//! `try_send`: it never blocks. Policies live in their own types: when to rescan
//! ([`RescanPolicy`]), what the kernel filter holds ([`RootFilterUpdates`]), and
//! every loss's relist request ([`RelistRequests`]). The thread never stops
//! silently: a [`StopGuard`] marks the kernel path degraded on any stop that was
//! not asked for.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};
use std::sync::{Arc, mpsc as std_mpsc};
use std::time::{Duration, Instant};

use aya::maps::{MapData, PerCpuArray};
use evpleg_events::counter;
use tokio::sync::mpsc::{self, error::TrySendError};

use super::event::{DecodeError, KernelEvent, decode, record_cpu};
use super::health::{HealthCell, StopGuard};
use super::histogram::AtomicHistogram;
use super::loader::{Loaded, RootsMap};
use super::offload::{FilterFailure, HandoffCounts, LogLine, Offload};
use super::proc::Reconciliation;
use super::relist_requests::{RelistCounts, RelistReason, RelistRequests};
use super::rescan::RescanPolicy;
use super::roots::{FilterChange, RootFilterUpdates};
use super::rt_budget::{CHECK_EVERY, RtBudget, RtBudgetConfig, Switch};
use super::scan::Scanner;
use super::tracker::{Handled, Output, ReconcileOutcome, Reconciling, Tracker};
use super::walker::{Refused, Walk, WalkRequests};
use crate::merge::KernelMerge;
use crate::stages;
use crate::stages::Stage;
use evpleg_core::clock::{monotonic_ns, thread_cpu_ns};
use evpleg_core::ids::{ContainerId, PodUid};
use evpleg_core::lifecycle::PodLifecycleEvent;

/// How soon after a record the kernel's counters are read (a drop is seen
/// within this of the last record read: drops happen only while records come).
const POLL_INTERVAL: Duration = Duration::from_millis(100);
/// How often they are read when no record came since the last read (only the
/// metrics wait for it: a drop needs records, which wake the reader): the
/// reader sleeps otherwise (commands and the stop wake it through its
/// [`Wake`] eventfd), so an idle node costs one wake-up every 5 s. At 1 s,
/// that wake-up was most of the agent's idle CPU in `ebpf` mode (the
/// benchmark's idle workload).
const IDLE_POLL_INTERVAL: Duration = Duration::from_secs(5);
/// Records handled before the commands, counters and stop flag are looked at
/// again (commands are also read before each record).
pub const BATCH: usize = 256;

/// How many of a full relist's containers the reader reconciles between two
/// reads of the ring ([`Reconciling`]): each costs 1 to 4 us (lookups, a
/// `/proc` identity compared, a transition), so the records behind a part
/// wait about 0.1 ms (docs/pleg.md, clause 4).
pub const RECONCILE_PART: usize = 32;

/// How long a lazy command ([`KernelPleg::reconcile`](super::KernelPleg::reconcile))
/// may wait for the reader to look at it: a reader whose wait ends within
/// this is not woken for it (records came within the last [`POLL_INTERVAL`]:
/// the relist's view after a death, most of them). It is applied before any
/// later record either way (after a full view under way,
/// [`Reconciling`]). At 1 000 exits/s, a wake-up for each death's
/// view was 0.85 of the reader's 1.85 wake-ups a death (issue #29).
pub const LAZY_BOUND: Duration = POLL_INTERVAL;

/// When the reader's current wait ends (CLOCK_MONOTONIC ns), for the senders
/// of lazy commands. The reader publishes it, then looks at its commands,
/// then waits; a sender queues its command, then reads it: either the reader
/// sees the command before it waits, or the sender sees the deadline (both
/// sides fence between their two steps).
#[derive(Debug, Default)]
pub struct Deadline(AtomicU64);

impl Deadline {
    fn publish(&self, at_ns: u64) {
        self.0.store(at_ns, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// After a lazy command was queued at `now_ns`: whether the reader must be
    /// woken for it to be looked at within [`LAZY_BOUND`] (a deadline past,
    /// or near, is a reader that looks at its commands before it waits
    /// again).
    pub fn wake_needed(&self, now_ns: u64) -> bool {
        fence(Ordering::SeqCst);
        wake_needed(self.0.load(Ordering::SeqCst), now_ns)
    }
}

/// [`Deadline::wake_needed`]'s rule, on the values.
fn wake_needed(deadline_ns: u64, now_ns: u64) -> bool {
    deadline_ns.saturating_sub(now_ns) > LAZY_BOUND.as_nanos() as u64
}

/// Counters of the kernel PLEG, shared with metrics.
#[derive(Debug)]
pub struct KernelStats {
    /// Delay from the kernel's timestamp to the reader's receipt
    /// (`pleg_kernel_event_latency_seconds`): buckets from 1 us, atomic (a
    /// scrape never holds the reader).
    pub latency_seconds: AtomicHistogram,
    /// How long the reader took to apply each relist's view, or each part of
    /// a full relist's view ([`RECONCILE_PART`] containers, the last part
    /// with the prune) (`pleg_kernel_reconcile_duration_seconds`): no record
    /// is read meanwhile.
    pub reconcile_seconds: AtomicHistogram,
    /// Records read from the ring buffer.
    pub records: AtomicU64,
    /// Records rejected by the decoder.
    pub malformed: AtomicU64,
    /// Lifecycle events handed to the channel.
    pub events: AtomicU64,
    /// Lifecycle events discarded because the channel was full.
    pub discarded: AtomicU64,
    /// Kernel counters (sums over CPUs), as last read.
    pub kernel_reported: AtomicU64,
    pub kernel_filtered: AtomicU64,
    pub kernel_dropped: AtomicU64,
    pub kernel_read_errors: AtomicU64,
    pub kernel_thread_exits: AtomicU64,
    /// Program runs the kernel skipped (`recursion_misses`, summed over the
    /// programs): each may be a lost record.
    pub kernel_missed: AtomicU64,
    /// Task records whose cgroup stayed unknown after a rescan.
    pub unattributed: AtomicU64,
    /// Rescans of the cgroup tree.
    pub rescans: AtomicU64,
    /// Rescans for waiting views the reader ran itself because the walker
    /// thread was gone (it stopped: a panic).
    pub walker_fallbacks: AtomicU64,
    /// Times the reader thread stopped without being asked to.
    pub reader_failures: Arc<AtomicU64>,
    /// Relist requests by reason.
    pub relist_requests: Arc<RelistCounts>,
    /// The tracker's counters, as of the last poll (100 ms) or reconcile.
    pub hints: AtomicU64,
    pub removed_before_death: AtomicU64,
    pub confirmed: AtomicU64,
    pub corrected: AtomicU64,
    pub unconfirmed: AtomicU64,
    pub pruned: AtomicU64,
    /// Containers demoted to uncertain because records were lost.
    pub demoted: AtomicU64,
    /// Kernel deaths the runtime contradicted, told to the tracker.
    pub contradicted: AtomicU64,
    /// Running containers the runtime lists whose cgroup no rescan found (a
    /// misconfigured root: their deaths wait for a relist), as last counted.
    pub unfound: AtomicU64,
    /// CLOCK_MONOTONIC ns of the reader loop's last pass (at least every 5 s):
    /// the supervisor's heartbeat.
    pub heartbeat_ns: AtomicU64,
    /// Events the merge handed to the normal-priority helper, by cause (a
    /// lock it needed was held, or an earlier event was still there).
    pub handoffs: HandoffCounts,
    /// Events the helper's queue could not take: a full relist was requested.
    pub handoff_failures: AtomicU64,
    /// Reader log lines dropped because their queue was full.
    pub log_lines_dropped: AtomicU64,
    /// Times the reader spent its real-time budget and ran at normal
    /// priority for the rest of its window.
    pub rt_throttled: AtomicU64,
}

impl Default for KernelStats {
    fn default() -> Self {
        Self {
            // 1 us doubling 24 times: up to about 8 s.
            latency_seconds: AtomicHistogram::doubling(1_000, 24),
            reconcile_seconds: AtomicHistogram::doubling(1_000, 24),
            records: AtomicU64::new(0),
            malformed: AtomicU64::new(0),
            events: AtomicU64::new(0),
            discarded: AtomicU64::new(0),
            kernel_reported: AtomicU64::new(0),
            kernel_filtered: AtomicU64::new(0),
            kernel_dropped: AtomicU64::new(0),
            kernel_read_errors: AtomicU64::new(0),
            kernel_thread_exits: AtomicU64::new(0),
            kernel_missed: AtomicU64::new(0),
            unattributed: AtomicU64::new(0),
            rescans: AtomicU64::new(0),
            walker_fallbacks: AtomicU64::new(0),
            reader_failures: Arc::new(AtomicU64::new(0)),
            relist_requests: Arc::new(RelistCounts::default()),
            hints: AtomicU64::new(0),
            removed_before_death: AtomicU64::new(0),
            confirmed: AtomicU64::new(0),
            corrected: AtomicU64::new(0),
            unconfirmed: AtomicU64::new(0),
            demoted: AtomicU64::new(0),
            contradicted: AtomicU64::new(0),
            unfound: AtomicU64::new(0),
            heartbeat_ns: AtomicU64::new(0),
            pruned: AtomicU64::new(0),
            handoffs: HandoffCounts::default(),
            handoff_failures: AtomicU64::new(0),
            log_lines_dropped: AtomicU64::new(0),
            rt_throttled: AtomicU64::new(0),
        }
    }
}

/// Called on the reader thread with every decoded record and its delay from the
/// kernel's timestamp to receipt, in ns (metrics, tests, the benchmark).
pub type RecordTap = Arc<dyn Fn(&KernelEvent, u64) + Send + Sync>;

/// Where the reader hands its lifecycle events.
#[derive(Debug)]
pub enum Sink {
    /// A channel (tests, `evpleg observe --cri-endpoint none`): a full one is a loss.
    Channel(mpsc::Sender<PodLifecycleEvent>),
    /// The merge, run on the reader thread itself: the event reaches the cache
    /// and the pod workers' channel without a wake-up of another thread
    /// (`ebpf` mode). Its own delivery rules apply (contract clause 4).
    Merge(Arc<KernelMerge>),
}

/// Commands to the reader thread, applied before the next record is handled.
#[derive(Debug)]
pub enum Command {
    AddSandbox(ContainerId),
    /// The runtime's view after a relist, its pids resolved against `/proc`.
    Reconcile(Reconciliation),
    /// A walk of the tree the reader asked the walker for ([`super::walker`]).
    Walked(Walk),
    /// Makes the reader stop as if it had failed (tests of the degradation).
    FailForTest,
}

/// Everything the reader thread owns.
pub(super) struct Reader {
    pub loaded: Loaded,
    pub tracker: Tracker,
    pub scanner: Scanner,
    pub roots: RootFilterUpdates,
    pub rescans: RescanPolicy,
    /// Views that listed a running container the tracker does not know, waiting
    /// for the next rescan to be applied again (one per scope: the newest).
    pub awaiting_rescan: HashMap<Option<PodUid>, Reconciliation>,
    /// Asks the walker thread for the rescans of waiting views.
    pub walker: WalkRequests,
    /// A walk was asked for and has not reported.
    pub walking: bool,
    pub events: Sink,
    pub relist: RelistRequests,
    pub stats: Arc<KernelStats>,
    pub stop: Arc<AtomicBool>,
    pub health: Arc<HealthCell>,
    pub commands: std_mpsc::Receiver<Command>,
    /// Views set aside until the record being handled is delivered
    /// ([`Reader::apply_commands_before`]); empty between records.
    pub set_aside: Vec<Reconciliation>,
    /// A full relist's view being applied a part at a time, between reads
    /// of the ring ([`Reconciling`]); the commands after it wait for it.
    pub reconciling: Option<Reconciling>,
    pub realtime_priority: Option<i32>,
    /// The real-time budget ([`super::rt_budget`]).
    pub realtime_budget: RtBudgetConfig,
    pub tap: Option<RecordTap>,
    /// Written by whoever sends a command or asks the reader to stop.
    pub wake: Arc<Wake>,
    /// When the current wait ends, for lazy commands' senders.
    pub deadline: Arc<Deadline>,
    /// Log lines, counters to log and busy merges, for the normal-priority
    /// helper thread: the reader never logs nor waits for a lock.
    pub offload: Offload,
}

/// An eventfd that wakes the reader from `epoll_wait`.
#[derive(Debug)]
pub struct Wake(std::os::fd::OwnedFd);

impl Wake {
    pub fn new() -> std::io::Result<Self> {
        // SAFETY: plain syscall.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a new fd we own.
        Ok(Self(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }))
    }

    /// Wakes the reader (never blocks: the counter saturates at 2^64-2).
    pub fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our fd.
        unsafe { libc::write(self.0.as_raw_fd(), (&raw const one).cast(), 8) };
    }

    /// Blocks until the counter is non-zero (the helper thread; the reader
    /// waits in `epoll_wait`).
    pub(super) fn wait(&self) {
        let mut fd = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; EINTR just returns (the caller loops).
        unsafe { libc::poll(&mut fd, 1, -1) };
    }

    /// Resets the counter (non-blocking).
    pub(super) fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a valid u64 from our non-blocking fd.
        unsafe { libc::read(self.0.as_raw_fd(), (&raw mut v).cast(), 8) };
    }
}

/// Tries to make the calling thread SCHED_FIFO at `priority`.
fn set_realtime(priority: i32) -> std::io::Result<()> {
    set_policy(libc::SCHED_FIFO, priority)
}

/// Makes the calling thread SCHED_OTHER (normal priority).
fn set_normal() -> std::io::Result<()> {
    set_policy(libc::SCHED_OTHER, 0)
}

fn set_policy(policy: libc::c_int, priority: i32) -> std::io::Result<()> {
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param.
    let rc = unsafe { libc::sched_setscheduler(0, policy, &param) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

struct Epoll(RawFd);

impl Epoll {
    fn new(fds: &[RawFd]) -> std::io::Result<Self> {
        // SAFETY: plain syscall.
        let epfd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epfd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let epoll = Self(epfd);
        for (i, &fd) in fds.iter().enumerate() {
            let mut ev = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: i as u64,
            };
            // SAFETY: both fds are open; `ev` is valid for the call.
            if unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(epoll)
    }

    /// Waits for a record or a wake-up, at most `timeout`; returns whether
    /// the [`Wake`] (the second fd) was written, so that it is read only
    /// then (one syscall less per record).
    fn wait(&self, timeout: Duration) -> bool {
        let mut ev = [libc::epoll_event { events: 0, u64: 0 }; 2];
        // Rounded up: a timeout of 0.5 ms must not spin with 0.
        let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        // SAFETY: two valid event slots; EINTR and timeouts both just return.
        let n = unsafe { libc::epoll_wait(self.0, ev.as_mut_ptr(), 2, ms) };
        ev.iter().take(n.max(0) as usize).any(|e| e.u64 == 1)
    }
}

impl Drop for Epoll {
    fn drop(&mut self) {
        // SAFETY: we own the fd.
        unsafe { libc::close(self.0) };
    }
}

fn sum(counters: &PerCpuArray<MapData, u64>, index: u32) -> u64 {
    counters
        .get(&index, 0)
        .map(|values| values.iter().sum())
        .unwrap_or(0)
}

/// Applies changes to the kernel filter, a line for `log` each. Returns the
/// roots the filter did not hold before: tasks below them went unreported
/// until now ([`Tracker::filter_opened`]).
pub(super) fn apply_filter_changes(
    roots: &mut RootsMap,
    changes: Vec<FilterChange>,
    log: &mut dyn FnMut(LogLine),
) -> Vec<String> {
    let mut opened = Vec::new();
    for change in changes {
        match change {
            FilterChange::Add {
                cgroup_id,
                level,
                path,
            } => match roots.add(cgroup_id, level) {
                Ok(added) => {
                    log(LogLine::RootAdded { cgroup_id, level });
                    if added {
                        opened.push(path);
                    }
                }
                Err(e) => log(LogLine::RootAddFailed {
                    cgroup_id,
                    failure: FilterFailure::of(&e),
                }),
            },
            FilterChange::Remove { cgroup_id } => {
                if let Err(e) = roots.remove(cgroup_id) {
                    log(LogLine::RootRemoveFailed {
                        cgroup_id,
                        failure: FilterFailure::of(&e),
                    });
                }
            }
        }
    }
    opened
}

impl Reader {
    pub(super) fn run(mut self) {
        let mut guard = StopGuard {
            health: self.health.clone(),
            stop: self.stop.clone(),
            failures: self.stats.reader_failures.clone(),
            relist: self.relist.clone(),
            reason: None,
            now_ns: monotonic_ns,
        };
        guard.reason = self.run_loop().err();
        // The guard logs a failure: not at real-time priority.
        let _ = set_normal();
    }

    /// Runs until `stop`; an `Err` says why it stopped otherwise.
    fn run_loop(&mut self) -> Result<(), String> {
        // Only a reader that runs SCHED_FIFO has a budget to keep.
        let mut budget = None;
        let line = match self.realtime_priority {
            Some(priority) => match set_realtime(priority) {
                Ok(()) => {
                    let b = RtBudget::new(self.realtime_budget, monotonic_ns(), thread_cpu_ns());
                    budget = Some((b, priority));
                    LogLine::RealtimeOn { priority }
                }
                Err(error) => LogLine::RealtimeRefused { priority, error },
            },
            None => LogLine::RealtimeDisabled,
        };
        self.offload.log(line);
        let epoll = Epoll::new(&[self.loaded.ring.as_raw_fd(), self.wake.0.as_raw_fd()])
            .map_err(|e| format!("epoll on the ring buffer failed: {e}"))?;
        let mut last_poll = Instant::now();
        // Records were read since the counters were last read.
        let mut recent = false;
        // Records handled since the budget's last CPU sample.
        let mut unsampled = 0;
        let mut out = Output::default();
        while !self.stop.load(Ordering::Relaxed) {
            let every = if recent {
                POLL_INTERVAL
            } else {
                IDLE_POLL_INTERVAL
            };
            let mut timeout = every.saturating_sub(last_poll.elapsed());
            self.keep_budget(&mut budget, &mut unsampled);
            if let Some(until) = budget.as_ref().and_then(|(b, _)| b.throttled_until_ns()) {
                // Back at SCHED_FIFO before the next record after the window.
                let until = Duration::from_nanos(until.saturating_sub(monotonic_ns()));
                timeout = timeout.min(until);
            }
            if !self.awaiting_rescan.is_empty()
                && !self.walking
                && let Some(next) = self.rescans.next_ns()
            {
                let until = Duration::from_nanos(next.saturating_sub(monotonic_ns()));
                timeout = timeout.min(until);
            }
            let now = monotonic_ns();
            self.stats.heartbeat_ns.store(now, Ordering::Relaxed);
            // Published before the last look at the commands: a lazy command
            // sent after that look sees this deadline ([`Deadline`]).
            self.deadline
                .publish(now.saturating_add(timeout.as_nanos() as u64));
            // Commands applied now may want a shorter wait (a rescan's
            // time): the ring is looked at without waiting, the next pass
            // waits.
            if self.apply_commands()? || self.reconciling.is_some() {
                timeout = Duration::ZERO;
            }
            if epoll.wait(timeout) {
                self.wake.drain();
            }
            self.rescan_for_reconciles();
            for _ in 0..BATCH {
                if unsampled >= CHECK_EVERY {
                    self.keep_budget(&mut budget, &mut unsampled);
                }
                let Some(item) = self.loaded.ring.next() else {
                    break;
                };
                recent = true;
                unsampled += 1;
                let now = monotonic_ns();
                let decoded = decode(&item);
                let cpu = record_cpu(&item).unwrap_or(stages::NO_CPU);
                drop(item);
                // A command sent before this record was written is in the channel
                // now: it is applied before the record, unless it cannot
                // change how the record is handled (set aside until after it).
                self.apply_commands_before(decoded.as_ref().ok())?;
                self.stats.records.fetch_add(1, Ordering::Relaxed);
                self.on_record(decoded, now, &mut out);
                self.deliver(&mut out, now, cpu)?;
                self.apply_set_aside();
            }
            self.continue_reconciling();
            self.apply_commands()?;
            let every = if recent {
                POLL_INTERVAL
            } else {
                IDLE_POLL_INTERVAL
            };
            if last_poll.elapsed() >= every {
                last_poll = Instant::now();
                recent = false;
                self.poll_counters();
            }
        }
        Ok(())
    }

    /// Checks the real-time budget and switches the thread's policy when it
    /// says so (a failed switch leaves the policy as it was: the budget
    /// decides again at the next check).
    /// `unsampled`: records handled since the last CPU sample, reset by a
    /// sample (taken only when [`RtBudget::sample_due`]).
    fn keep_budget(&self, budget: &mut Option<(RtBudget, i32)>, unsampled: &mut usize) {
        let Some((b, priority)) = budget else {
            return;
        };
        let now = monotonic_ns();
        if !b.sample_due(now, *unsampled) {
            return;
        }
        *unsampled = 0;
        match b.check(now, thread_cpu_ns()) {
            Switch::Stay => {}
            Switch::ToNormal => {
                let _ = set_normal();
                self.stats.rt_throttled.fetch_add(1, Ordering::Relaxed);
                self.offload.note_counters();
            }
            Switch::ToRealtime => {
                let _ = set_realtime(*priority);
            }
        }
    }

    /// Applies the commands queued; returns whether there were any.
    fn apply_commands(&mut self) -> Result<bool, String> {
        let mut any = false;
        while self.reconciling.is_none()
            && let Ok(cmd) = self.commands.try_recv()
        {
            any = true;
            self.apply(cmd)?;
        }
        Ok(any)
    }

    /// Applies the commands queued before `record` is handled, except the
    /// views that cannot change how it is handled ([`Tracker::view_may_follow`]:
    /// one pod's view, the record another pod's): those are set aside for
    /// [`Reader::apply_set_aside`] after the record is delivered, so that the
    /// relist's view after one death does not delay the next death's event
    /// (at 1 000 deaths/s, nearly every record had one before it: up to 0.1 ms
    /// each, issue #29). Commands keep their order among themselves: one
    /// applied now first applies those set aside before it. While a full
    /// view is applied in parts, the commands after it wait in the channel.
    fn apply_commands_before(&mut self, record: Option<&KernelEvent>) -> Result<(), String> {
        while self.reconciling.is_none()
            && let Ok(cmd) = self.commands.try_recv()
        {
            match cmd {
                Command::Reconcile(r)
                    if record.is_some_and(|ev| self.tracker.view_may_follow(ev, &r.view)) =>
                {
                    self.set_aside.push(r)
                }
                cmd => {
                    self.apply_set_aside();
                    self.apply(cmd)?;
                }
            }
        }
        Ok(())
    }

    /// Applies the views set aside, in the order they came.
    fn apply_set_aside(&mut self) {
        if self.set_aside.is_empty() {
            return;
        }
        // Taken and put back: the vector keeps its capacity (no allocation).
        let mut views = std::mem::take(&mut self.set_aside);
        for r in views.drain(..) {
            self.reconcile(r, false);
        }
        self.rescan_for_reconciles();
        self.set_aside = views;
    }

    fn apply(&mut self, cmd: Command) -> Result<(), String> {
        match cmd {
            Command::AddSandbox(id) => self.tracker.add_sandbox(id),
            Command::Reconcile(r) => {
                self.reconcile(r, false);
                self.rescan_for_reconciles();
            }
            Command::Walked(walk) => self.walked(walk),
            Command::FailForTest => return Err("failed by a test hook".into()),
        }
        Ok(())
    }

    fn on_record(&mut self, decoded: Result<KernelEvent, DecodeError>, now: u64, out: &mut Output) {
        let ev = match decoded {
            Ok(ev) => ev,
            Err(_) => {
                self.stats.malformed.fetch_add(1, Ordering::Relaxed);
                self.offload.note_counters();
                return;
            }
        };
        let delay = now.saturating_sub(ev.at_ns());
        self.stats.latency_seconds.observe_ns(delay);
        if let Some(tap) = &self.tap {
            tap(&ev, delay);
        }
        let changes = match &ev {
            KernelEvent::CgroupMkdir(c) => self.roots.on_mkdir(c),
            KernelEvent::CgroupRmdir(c) => self.roots.on_rmdir(c),
            _ => Vec::new(),
        };
        if !changes.is_empty() && self.change_filter(changes) {
            // A root made after the programs were loaded: tasks below it were
            // not reported until now. What its containers ran meanwhile is
            // read from the tree at once, whatever the rescan policy says.
            self.rescan(None);
        } else if let KernelEvent::CgroupMkdir(c) = &ev
            && self.roots.below_unknown_root(&c.path)
            && self.rescans.allows(monotonic_ns())
        {
            self.rescan(None);
        }
        if let KernelEvent::Exec(exec) = &ev
            && self.tracker.exec_would_start(exec)
        {
            // A start makes the main process certain only if no record was lost
            // before it (the entrypoint's own exec may have been): the drop
            // counter is read first (once per container start).
            self.check_drops();
        }
        if let Handled::UnknownCgroup { .. } = self.tracker.handle(&ev, out) {
            let pending = match &ev {
                KernelEvent::Exec(exec) => Some(exec.process),
                _ => None,
            };
            let attributed = self.rescans.allows(monotonic_ns()) && {
                self.rescan(pending);
                self.tracker.handle(&ev, out) == Handled::Done
            };
            if !attributed {
                self.stats.unattributed.fetch_add(1, Ordering::Relaxed);
                self.offload.note_counters();
                self.relist.request(RelistReason::Unattributed);
            }
        }
        for (cgroup_id, _) in out.malformed.drain(..) {
            self.offload.log(LogLine::NotAttributed { cgroup_id });
        }
        for _ in out.relists.drain(..) {
            self.relist.request(RelistReason::ExitMissed);
        }
    }

    /// Rescans the cgroup tree on this thread (a task record waits for it),
    /// then applies again the views that waited for a rescan.
    fn rescan(&mut self, pending: Option<super::event::ProcessKey>) {
        self.stats.rescans.fetch_add(1, Ordering::Relaxed);
        let at = monotonic_ns();
        match self.scanner.scan_into(&mut self.tracker, pending, at) {
            Ok(report) => self.scanned(report),
            Err(e) => self.offload.log(LogLine::rescan_failed(&e)),
        }
        self.rescans.ran(at, monotonic_ns());
        self.reapply_waiting(at);
    }

    /// Learns from what the walker found the cgroups of the running
    /// containers the waiting views list, then applies those views again
    /// (those listed before the walk began are told it ran). Other cgroups
    /// the tracker does not know are left to their records: the walk is
    /// older than the records still unread.
    fn walked(&mut self, walk: Walk) {
        self.walking = false;
        self.stats.rescans.fetch_add(1, Ordering::Relaxed);
        match &walk.cgroups {
            Ok(cgroups) => {
                let wanted: HashSet<&ContainerId> = (self.awaiting_rescan.values())
                    .flat_map(|r| r.view.containers.iter())
                    .filter(|c| c.running)
                    .map(|c| &c.id)
                    .collect();
                let now = monotonic_ns();
                let report =
                    (self.scanner).learn(&mut self.tracker, cgroups, None, Some(&wanted), now);
                self.scanned(report);
            }
            Err(e) => self.offload.log(LogLine::rescan_failed(e)),
        }
        self.rescans.ran(walk.started_ns, walk.ended_ns);
        self.reapply_waiting(walk.started_ns);
    }

    /// What a rescan found beyond the cgroups learned: roots for the kernel
    /// filter, exits that were never read, malformed paths.
    fn scanned(&mut self, report: super::scan::ScanReport) {
        if report.exited_unseen > 0 {
            self.relist.request(RelistReason::ExitedUnseen);
        }
        let changes = self.roots.on_scan(&report.roots);
        self.change_filter(changes);
        for (cgroup_id, _) in report.malformed {
            self.offload.log(LogLine::NotAttributed { cgroup_id });
        }
    }

    /// Applies again the views waiting for a rescan. Those listed before the
    /// rescan began (at `scanned_at_ns`) are told it ran: what it did not
    /// find stays not found. A later one still waits if it asks for another.
    fn reapply_waiting(&mut self, scanned_at_ns: u64) {
        for (_, r) in std::mem::take(&mut self.awaiting_rescan) {
            let after_rescan = r.view.listed_at_ns <= scanned_at_ns;
            self.reconcile(r, after_rescan);
        }
    }

    /// Applies changes to the kernel filter. A root it did not hold yet was
    /// made (or found) after the programs were loaded: the containers already
    /// known below it may have lost records, and are demoted as after a drop
    /// (a relist confirms them), and cgroups made below it before now are not
    /// `Fresh` when their mkdir is read. Returns whether a root was added.
    fn change_filter(&mut self, changes: Vec<FilterChange>) -> bool {
        if changes.is_empty() {
            return false;
        }
        let offload = &self.offload;
        let opened = apply_filter_changes(&mut self.loaded.roots, changes, &mut |l| offload.log(l));
        let at = monotonic_ns();
        let demoted: usize = opened
            .iter()
            .map(|root| self.tracker.filter_opened(root, at))
            .sum();
        if demoted > 0 {
            self.relist.request(RelistReason::RootOpened);
            self.store_tracker_stats();
            self.offload.note_counters();
        }
        !opened.is_empty()
    }

    /// Asks the walker for a rescan for the views waiting for one, once the
    /// policy allows it and no walk is under way (rescans on this thread if
    /// the walker is gone).
    fn rescan_for_reconciles(&mut self) {
        if self.awaiting_rescan.is_empty() || self.walking || !self.rescans.allows(monotonic_ns()) {
            return;
        }
        match self.walker.request() {
            Ok(()) | Err(Refused::Pending) => self.walking = true,
            Err(Refused::Gone) => {
                // A degradation: each such rescan holds the records behind it.
                if self.stats.walker_fallbacks.fetch_add(1, Ordering::Relaxed) == 0 {
                    self.offload.log(LogLine::WalkerGone);
                }
                self.rescan(None)
            }
        }
    }

    /// Applies a relist's view. One that lists a running container the tracker
    /// does not know is applied again after the next rescan (asked for at once
    /// if the rescan policy allows one now, by the caller). A full relist's view is
    /// applied [`RECONCILE_PART`] containers at a time, the loop reading the
    /// ring between two parts ([`Reader::continue_reconciling`]), unless one
    /// is already under way (a view reapplied after a rescan): then at once.
    fn reconcile(&mut self, r: Reconciliation, after_rescan: bool) {
        if r.view.scope.is_none() && self.reconciling.is_none() {
            let rec = self.tracker.start_reconcile(r, after_rescan);
            self.reconcile_part(rec);
            return;
        }
        let started = monotonic_ns();
        let outcome = self.tracker.reconcile(&r, after_rescan);
        (self.stats.reconcile_seconds).observe_ns(monotonic_ns().saturating_sub(started));
        self.view_applied(r, &outcome);
    }

    /// Applies the next part of the full view under way, if any.
    fn continue_reconciling(&mut self) {
        if let Some(rec) = self.reconciling.take() {
            self.reconcile_part(rec);
            self.rescan_for_reconciles();
        }
    }

    fn reconcile_part(&mut self, mut rec: Reconciling) {
        let started = monotonic_ns();
        let done = self.tracker.reconcile_part(&mut rec, RECONCILE_PART);
        (self.stats.reconcile_seconds).observe_ns(monotonic_ns().saturating_sub(started));
        match done {
            None => self.reconciling = Some(rec),
            Some(outcome) => self.view_applied(rec.into_view(), &outcome),
        }
    }

    /// A view is applied: what it found is logged and counted, and it waits
    /// for a rescan if it listed a running container the tracker does not
    /// know (the newest view of its scope).
    fn view_applied(&mut self, r: Reconciliation, outcome: &ReconcileOutcome) {
        self.reconciled(outcome);
        let newer_waits = (self.awaiting_rescan.get(&r.view.scope))
            .is_some_and(|w| w.view.listed_at_ns > r.view.listed_at_ns);
        if outcome.rescan_due && !newer_waits {
            self.awaiting_rescan.insert(r.view.scope.clone(), r);
        }
    }

    fn reconciled(&mut self, outcome: &ReconcileOutcome) {
        for id in &outcome.unfound {
            self.offload.log(LogLine::Unfound(id.clone()));
        }
        for id in &outcome.corrected {
            self.offload.log(LogLine::Corrected(id.clone()));
        }
        self.store_tracker_stats();
    }

    /// Hands the events to the sink. Into a channel, a full channel is a loss
    /// (relist) and a closed one stops the reader; the merge applies its own
    /// rules. `read_ns`: when the record was taken from the ring, `cpu`: the
    /// CPU whose program wrote it (stages).
    fn deliver(&mut self, out: &mut Output, read_ns: u64, cpu: u32) -> Result<(), String> {
        for event in out.events.drain(..) {
            if stages::log().is_some()
                && let Some(id) = event.died()
            {
                stages::record_on(Stage::Kernel, id, event.at_ns, cpu);
                stages::record_on(Stage::Read, id, read_ns, stages::current_cpu());
                stages::record_now(Stage::Attributed, id);
            }
            let sender = match &self.events {
                Sink::Merge(merge) => {
                    self.offload.merge(merge, event, &self.relist);
                    self.stats.events.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Sink::Channel(sender) => sender,
            };
            match sender.try_send(event) {
                Ok(()) => {
                    self.stats.events.fetch_add(1, Ordering::Relaxed);
                }
                Err(TrySendError::Full(_)) => {
                    self.stats.discarded.fetch_add(1, Ordering::Relaxed);
                    self.offload.note_counters();
                    self.relist.request(RelistReason::ChannelFull);
                }
                Err(TrySendError::Closed(_)) => {
                    if self.stop.load(Ordering::Relaxed) {
                        return Ok(());
                    }
                    return Err("the lifecycle event channel closed (its reader stopped)".into());
                }
            }
        }
        Ok(())
    }

    fn store_tracker_stats(&self) {
        let t = self.tracker.stats;
        let s = &self.stats;
        s.hints.store(t.hints, Ordering::Relaxed);
        s.removed_before_death
            .store(t.removed_before_death, Ordering::Relaxed);
        s.confirmed.store(t.confirmed, Ordering::Relaxed);
        s.corrected.store(t.corrected, Ordering::Relaxed);
        s.unconfirmed.store(t.unconfirmed, Ordering::Relaxed);
        s.pruned.store(t.pruned, Ordering::Relaxed);
        s.demoted.store(t.demoted, Ordering::Relaxed);
        s.contradicted.store(t.contradicted, Ordering::Relaxed);
        s.unfound
            .store(self.tracker.sizes().2 as u64, Ordering::Relaxed);
    }

    /// Reads the kernel's drop counter and the programs' skipped runs: records
    /// lost since the last read end the certainty that rested on them (every
    /// container is demoted until the runtime's pid confirms its main process)
    /// and request a relist.
    fn check_drops(&mut self) {
        let dropped = sum(&self.loaded.counters, counter::DROPPED);
        let missed = self.loaded.recursion_misses();
        let dropped_before = self.stats.kernel_dropped.swap(dropped, Ordering::Relaxed);
        let missed_before = self.stats.kernel_missed.swap(missed, Ordering::Relaxed);
        let mut lost = false;
        for (grew, reason) in [
            (dropped > dropped_before, RelistReason::KernelDrop),
            (missed > missed_before, RelistReason::KernelMiss),
        ] {
            if grew {
                lost = true;
                self.relist.request(reason);
            }
        }
        if lost {
            self.tracker.records_lost(monotonic_ns());
            self.store_tracker_stats();
            self.offload.note_counters();
        }
    }

    fn poll_counters(&mut self) {
        self.store_tracker_stats();
        self.check_drops();
        self.offload.flush_counters();
        let c = &self.loaded.counters;
        self.stats
            .kernel_reported
            .store(sum(c, counter::REPORTED), Ordering::Relaxed);
        self.stats
            .kernel_filtered
            .store(sum(c, counter::FILTERED), Ordering::Relaxed);
        self.stats
            .kernel_read_errors
            .store(sum(c, counter::READ_ERRORS), Ordering::Relaxed);
        self.stats
            .kernel_thread_exits
            .store(sum(c, counter::THREAD_EXITS), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// Each row: (the reader's deadline ms, now ms, woken).
    #[test]
    fn a_lazy_command_wakes_only_a_reader_that_would_sleep_past_the_bound() {
        let bound = LAZY_BOUND.as_nanos() as u64 / MS;
        let rows: &[(u64, u64, bool)] = &[
            (1000 + bound, 1000, false), // records came: it looks within the bound
            (1000 + bound + 1, 1000, true),
            (6000, 1000, true), // idle: asleep for 5 s
            (900, 1000, false), // awake (its deadline passed): it looks before it waits
            (1000, 1000, false),
        ];
        for (i, &(deadline, now, woken)) in rows.iter().enumerate() {
            assert_eq!(wake_needed(deadline * MS, now * MS), woken, "row {i}");
        }
    }
}
