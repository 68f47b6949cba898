//! The ring-buffer reader: a dedicated thread blocked in `epoll_wait` on the ring
//! buffer's fd, running SCHED_FIFO when allowed.
//!
//! Measured on these machines (`docs/pleg.md`), a reader inside tokio waits about
//! 100 us for a halted vCPU to wake, while a real-time thread blocked in epoll sees
//! an exit at p50 about 25 us. The thread decodes each record, runs the
//! [`Tracker`] and hands lifecycle events to the async side with `try_send`: it never
//! blocks. A full channel or a kernel drop is counted and raises a relist request.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc as std_mpsc};
use std::time::{Duration, Instant};

use aya::maps::{MapData, PerCpuArray};
use evpleg_events::counter;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use tokio::sync::mpsc::{self, error::TrySendError};
use tracing::{debug, info, warn};

use super::event::{KernelEvent, decode};
use super::loader::Loaded;
use super::scan::Scanner;
use super::tracker::{Notice, Tracker};
use crate::pleg::{ContainerId, PodLifecycleEvent, RelistSignal};

/// How often the kernel's counters are read, and the stop flag checked.
const POLL_INTERVAL: Duration = Duration::from_millis(100);
/// The shortest time between two rescans of the cgroup tree for unknown cgroups.
const RESCAN_MIN_INTERVAL: Duration = Duration::from_millis(20);

/// Counters of the kernel PLEG, shared with metrics.
#[derive(Debug)]
pub struct KernelStats {
    /// Delay from the kernel's timestamp to the reader's receipt
    /// (`pleg_kernel_event_latency_seconds`): buckets from 1 us.
    pub latency_seconds: Histogram,
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
    /// Task records whose cgroup stayed unknown after a rescan.
    pub unattributed: AtomicU64,
    /// Rescans of the cgroup tree.
    pub rescans: AtomicU64,
}

impl Default for KernelStats {
    fn default() -> Self {
        Self {
            // 1 us doubling 24 times: up to about 8 s.
            latency_seconds: Histogram::new(exponential_buckets(1e-6, 2.0, 24)),
            records: AtomicU64::new(0),
            malformed: AtomicU64::new(0),
            events: AtomicU64::new(0),
            discarded: AtomicU64::new(0),
            kernel_reported: AtomicU64::new(0),
            kernel_filtered: AtomicU64::new(0),
            kernel_dropped: AtomicU64::new(0),
            kernel_read_errors: AtomicU64::new(0),
            kernel_thread_exits: AtomicU64::new(0),
            unattributed: AtomicU64::new(0),
            rescans: AtomicU64::new(0),
        }
    }
}

/// Called on the reader thread with every decoded record and its delay from the
/// kernel's timestamp to receipt, in ns (metrics, tests, the benchmark).
pub type RecordTap = Box<dyn Fn(&KernelEvent, u64) + Send>;

/// Commands to the reader thread.
#[derive(Debug)]
pub enum Command {
    AddSandbox(ContainerId),
    /// The runtime's view after a relist ([`super::RuntimeView`]).
    Reconcile(super::RuntimeView),
}

/// Everything the reader thread owns.
pub(super) struct Reader {
    pub loaded: Loaded,
    pub tracker: Tracker,
    pub scanner: Scanner,
    pub events: mpsc::Sender<PodLifecycleEvent>,
    pub relist: Arc<RelistSignal>,
    pub stats: Arc<KernelStats>,
    pub stop: Arc<AtomicBool>,
    pub commands: std_mpsc::Receiver<Command>,
    pub realtime_priority: Option<i32>,
    pub tap: Option<RecordTap>,
}

/// Tries to make the calling thread SCHED_FIFO at `priority`.
fn set_realtime(priority: i32) -> std::io::Result<()> {
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// CLOCK_MONOTONIC now, in ns: the clock of `bpf_ktime_get_ns`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec pointer; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

struct Epoll(RawFd);

impl Epoll {
    fn new(fd: RawFd) -> std::io::Result<Self> {
        // SAFETY: plain syscall.
        let epfd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epfd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let epoll = Self(epfd);
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: 0,
        };
        // SAFETY: both fds are open; `ev` is valid for the call.
        if unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(epoll)
    }

    fn wait(&self, timeout: Duration) {
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: one valid event slot; EINTR and timeouts both just return.
        unsafe { libc::epoll_wait(self.0, &mut ev, 1, timeout.as_millis() as i32) };
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

impl Reader {
    pub(super) fn run(mut self) {
        match self.realtime_priority {
            Some(priority) => match set_realtime(priority) {
                Ok(()) => info!(priority, "ring-buffer reader runs SCHED_FIFO"),
                Err(e) => warn!(
                    error = %e,
                    "cannot run the ring-buffer reader SCHED_FIFO (needs CAP_SYS_NICE); \
                     reading at normal priority, event latency will be higher"
                ),
            },
            None => info!("ring-buffer reader runs at normal priority (real-time disabled)"),
        }
        let epoll = match Epoll::new(self.loaded.ring.as_raw_fd()) {
            Ok(e) => e,
            Err(e) => {
                warn!(error = %e, "epoll on the ring buffer failed; the kernel PLEG stops");
                self.relist.request("kernel pleg reader failed");
                return;
            }
        };
        let mut last_poll = Instant::now();
        let mut last_rescan: Option<Instant> = None;
        let mut events = Vec::new();
        let mut notices = Vec::new();
        let mut records = Vec::new();
        while !self.stop.load(Ordering::Relaxed) {
            epoll.wait(POLL_INTERVAL);
            while let Ok(cmd) = self.commands.try_recv() {
                match cmd {
                    Command::AddSandbox(id) => self.tracker.add_sandbox(id),
                    Command::Reconcile(_view) => {}
                }
            }
            // Drain into owned records first: an item borrows the ring buffer.
            while let Some(item) = self.loaded.ring.next() {
                let now = monotonic_ns();
                self.stats.records.fetch_add(1, Ordering::Relaxed);
                match decode(&item) {
                    Ok(ev) => {
                        let delay = now.saturating_sub(ev.at_ns());
                        self.stats.latency_seconds.observe(delay as f64 / 1e9);
                        if let Some(tap) = &self.tap {
                            tap(&ev, delay);
                        }
                        records.push(ev);
                    }
                    Err(e) => {
                        self.stats.malformed.fetch_add(1, Ordering::Relaxed);
                        warn!(error = %e, "malformed ring-buffer record rejected");
                    }
                }
            }
            for ev in records.drain(..) {
                self.tracker.handle(&ev, &mut events, &mut notices);
                self.act(&ev, &mut events, &mut notices, &mut last_rescan);
                self.send(&mut events);
            }
            if last_poll.elapsed() >= POLL_INTERVAL {
                last_poll = Instant::now();
                self.poll_counters();
            }
        }
        debug!("ring-buffer reader stopped");
    }

    fn act(
        &mut self,
        ev: &KernelEvent,
        events: &mut Vec<PodLifecycleEvent>,
        notices: &mut Vec<Notice>,
        last_rescan: &mut Option<Instant>,
    ) {
        while let Some(notice) = notices.pop() {
            match notice {
                Notice::UnknownCgroup { cgroup_id } => {
                    let due = last_rescan.is_none_or(|t| t.elapsed() >= RESCAN_MIN_INTERVAL);
                    if due {
                        *last_rescan = Some(Instant::now());
                        self.stats.rescans.fetch_add(1, Ordering::Relaxed);
                        if let Err(e) = self.scanner.scan_into(&mut self.tracker) {
                            warn!(error = %e, cgroup_id, "rescan of the cgroup tree failed");
                        }
                    }
                    let before = self.tracker.stats.unattributed;
                    self.tracker.retry(ev, events, notices);
                    if self.tracker.stats.unattributed > before {
                        self.stats.unattributed.fetch_add(1, Ordering::Relaxed);
                        debug!(cgroup_id, "task in an unknown cgroup below a root");
                    }
                }
                Notice::RootCreated {
                    cgroup_id,
                    level,
                    path,
                } => match self.loaded.roots.add(cgroup_id, level) {
                    Ok(()) => info!(path, cgroup_id, "root cgroup appeared; now filtered in"),
                    Err(e) => {
                        warn!(error = %e, path, "cannot add root cgroup to the kernel filter")
                    }
                },
                Notice::RootRemoved { cgroup_id, path } => {
                    if let Err(e) = self.loaded.roots.remove(cgroup_id) {
                        warn!(error = %e, path, "cannot remove root cgroup from the kernel filter");
                    }
                }
                Notice::Malformed(e) => warn!(error = %e, "cgroup not attributed"),
                Notice::RelistNeeded { reason } => self.relist.request(&reason),
            }
        }
    }

    fn send(&self, events: &mut Vec<PodLifecycleEvent>) {
        for event in events.drain(..) {
            match self.events.try_send(event) {
                Ok(()) => {
                    self.stats.events.fetch_add(1, Ordering::Relaxed);
                }
                Err(TrySendError::Full(event)) => {
                    self.stats.discarded.fetch_add(1, Ordering::Relaxed);
                    warn!(kind = ?event.kind, pod = ?event.pod_uid, "event channel full: event discarded, relist requested");
                    self.relist.request("pleg event channel full");
                }
                Err(TrySendError::Closed(_)) => {
                    self.stop.store(true, Ordering::Relaxed);
                }
            }
        }
    }

    fn poll_counters(&mut self) {
        let c = &self.loaded.counters;
        let dropped = sum(c, counter::DROPPED);
        let before = self.stats.kernel_dropped.swap(dropped, Ordering::Relaxed);
        if dropped > before {
            warn!(
                lost = dropped - before,
                "kernel ring buffer full: records lost, relist requested"
            );
            self.relist.request("kernel ring buffer full");
        }
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
