//! Per-stage timestamps of a container's death through the agent, for the
//! benchmark (issue #11): where the time from the kernel's exit to the status
//! manager goes. Opt-in and process-wide: nothing is recorded until
//! [`install`] is called (the benchmark does; the agent never does), and when
//! nothing is installed every hook is one atomic load.
//!
//! Each record is `(stage, key, CLOCK_MONOTONIC ns, CPU)` in a slot of a log
//! allocated once by [`install`]: recording takes a slot with one `fetch_add`
//! and four relaxed stores, so the real-time reader thread neither allocates,
//! locks nor logs. A full log drops records (counted in [`StageLog::overflow`]).
//! The key of a container is the first 16 hex digits of its id ([`key_of`]);
//! one record per stage and container is not enforced (a worker syncing a pod
//! twice records twice): readers take the first record after the kernel's.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use evpleg_core::ids::ContainerId;

/// A point on a death's way through the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Stage {
    /// The kernel's exit timestamp (`bpf_ktime_get_ns` in the exit record).
    Kernel = 1,
    /// The ring-buffer reader thread took the record from the ring.
    Read = 2,
    /// Decoded and attributed by the tracker: a lifecycle event exists.
    Attributed = 3,
    /// The merge laid the death on the pod's snapshot in the cache.
    Cached = 4,
    /// The event was taken by the pod workers' (sync loop's) channel.
    Delivered = 5,
    /// The sync loop took the event from that channel (its task's wake-up
    /// included).
    Taken = 9,
    /// A pod worker started a sync with a cache entry holding the death.
    WorkerSync = 6,
    /// The status manager holds a status with the container terminated.
    StatusHeld = 7,
    /// The status manager holds a status with the container running (start
    /// latency).
    StatusRunning = 8,
}

impl Stage {
    pub const ALL: [Stage; 9] = [
        Stage::Kernel,
        Stage::Read,
        Stage::Attributed,
        Stage::Cached,
        Stage::Delivered,
        Stage::Taken,
        Stage::WorkerSync,
        Stage::StatusHeld,
        Stage::StatusRunning,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Stage::Kernel => "kernel",
            Stage::Read => "read",
            Stage::Attributed => "attributed",
            Stage::Cached => "cached",
            Stage::Delivered => "delivered",
            Stage::Taken => "taken",
            Stage::WorkerSync => "worker-sync",
            Stage::StatusHeld => "status-held",
            Stage::StatusRunning => "status-running",
        }
    }

    fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|s| *s as u8 == v)
    }
}

/// One recorded stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageRecord {
    pub stage: Stage,
    pub key: u64,
    pub at_ns: u64,
    /// The CPU it happened on, where known ([`NO_CPU`] otherwise): the
    /// program's for [`Stage::Kernel`], the reader thread's for
    /// [`Stage::Read`]. Each CPU stamps with its own clock: a read far later
    /// than its exit on one pair of CPUs alone would be their clocks'
    /// disagreement, not a wait.
    pub cpu: u32,
}

/// A stage recorded without its CPU.
pub const NO_CPU: u32 = u32::MAX;

struct Slot {
    /// `stage as u64`, 0 while the slot is being written.
    stage: AtomicU64,
    key: AtomicU64,
    at_ns: AtomicU64,
    cpu: AtomicU32,
}

/// The log of stage records (see the module's doc).
pub struct StageLog {
    slots: Box<[Slot]>,
    next: AtomicUsize,
    overflow: AtomicU64,
}

impl std::fmt::Debug for StageLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageLog")
            .field("capacity", &self.slots.len())
            .field("used", &self.next.load(Ordering::Relaxed))
            .finish()
    }
}

impl StageLog {
    fn new(capacity: usize) -> Self {
        Self {
            slots: (0..capacity)
                .map(|_| Slot {
                    stage: AtomicU64::new(0),
                    key: AtomicU64::new(0),
                    at_ns: AtomicU64::new(0),
                    cpu: AtomicU32::new(NO_CPU),
                })
                .collect(),
            next: AtomicUsize::new(0),
            overflow: AtomicU64::new(0),
        }
    }

    fn record(&self, stage: Stage, key: u64, at_ns: u64) {
        self.record_on(stage, key, at_ns, NO_CPU);
    }

    fn record_on(&self, stage: Stage, key: u64, at_ns: u64, cpu: u32) {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        let Some(slot) = self.slots.get(i) else {
            self.overflow.fetch_add(1, Ordering::Relaxed);
            return;
        };
        slot.key.store(key, Ordering::Relaxed);
        slot.at_ns.store(at_ns, Ordering::Relaxed);
        slot.cpu.store(cpu, Ordering::Relaxed);
        slot.stage.store(stage as u64, Ordering::Release);
    }

    /// The records written so far, in the order their slots were taken.
    pub fn snapshot(&self) -> Vec<StageRecord> {
        let used = self.next.load(Ordering::Acquire).min(self.slots.len());
        self.slots[..used]
            .iter()
            .filter_map(|s| {
                let stage = Stage::from_u8(s.stage.load(Ordering::Acquire) as u8)?;
                Some(StageRecord {
                    stage,
                    key: s.key.load(Ordering::Relaxed),
                    at_ns: s.at_ns.load(Ordering::Relaxed),
                    cpu: s.cpu.load(Ordering::Relaxed),
                })
            })
            .collect()
    }

    /// Forgets every record (call when nothing records: between runs).
    pub fn clear(&self) {
        let used = self.next.load(Ordering::Acquire).min(self.slots.len());
        for s in &self.slots[..used] {
            s.stage.store(0, Ordering::Relaxed);
        }
        self.next.store(0, Ordering::Release);
        self.overflow.store(0, Ordering::Relaxed);
    }

    /// Records dropped because the log was full.
    pub fn overflow(&self) -> u64 {
        self.overflow.load(Ordering::Relaxed)
    }
}

static LOG: OnceLock<StageLog> = OnceLock::new();

/// Turns recording on for this process, with room for `capacity` records
/// (allocated now). Later calls return the log installed first.
pub fn install(capacity: usize) -> &'static StageLog {
    LOG.get_or_init(|| StageLog::new(capacity))
}

/// The installed log, if any.
#[inline]
pub fn log() -> Option<&'static StageLog> {
    LOG.get()
}

/// The key of a container id: its first 16 hex digits (no allocation). Also
/// accepts a CRI `runtime://id` form.
pub fn key_of(id: &str) -> Option<u64> {
    let hex = id.rsplit("://").next().unwrap_or(id);
    u64::from_str_radix(hex.get(..16)?, 16).ok()
}

fn key(id: &ContainerId) -> u64 {
    key_of(id.as_str()).unwrap_or(0)
}

/// Records `stage` of container `id` at `at_ns` (a no-op unless installed).
#[inline]
pub fn record(stage: Stage, id: &ContainerId, at_ns: u64) {
    if let Some(log) = log() {
        log.record(stage, key(id), at_ns);
    }
}

/// Records `stage` of container `id` at `at_ns` on CPU `cpu` (a no-op
/// unless installed).
#[inline]
pub fn record_on(stage: Stage, id: &ContainerId, at_ns: u64, cpu: u32) {
    if let Some(log) = log() {
        log.record_on(stage, key(id), at_ns, cpu);
    }
}

/// The CPU the calling thread runs on ([`NO_CPU`] if unknown).
pub fn current_cpu() -> u32 {
    // SAFETY: sched_getcpu has no preconditions.
    u32::try_from(unsafe { libc::sched_getcpu() }).unwrap_or(NO_CPU)
}

/// Records `stage` of container `id` now (a no-op unless installed).
#[inline]
pub fn record_now(stage: Stage, id: &ContainerId) {
    if let Some(log) = log() {
        log.record(stage, key(id), evpleg_core::clock::monotonic_ns());
    }
}

/// A pod worker starts a sync with `entry`: [`Stage::WorkerSync`] for every
/// exited container in it (a no-op unless installed).
pub fn worker_sync(entry: &evpleg_core::cache::CacheEntry) {
    let Some(log) = log() else { return };
    let now = evpleg_core::clock::monotonic_ns();
    for c in &entry.status.containers {
        if c.state == evpleg_core::container::ContainerState::Exited {
            log.record(Stage::WorkerSync, key(&c.id), now);
        }
    }
}

/// The status manager holds `status`: [`Stage::StatusHeld`] for every
/// container terminated in it, [`Stage::StatusRunning`] for every one running
/// (a no-op unless installed).
pub fn status_held(status: &k8s_openapi::api::core::v1::PodStatus) {
    let Some(log) = log() else { return };
    let now = evpleg_core::clock::monotonic_ns();
    let all = [
        &status.container_statuses,
        &status.init_container_statuses,
        &status.ephemeral_container_statuses,
    ];
    for c in all.into_iter().flatten().flatten() {
        let Some(k) = c.container_id.as_deref().and_then(key_of) else {
            continue;
        };
        match &c.state {
            Some(s) if s.terminated.is_some() => log.record(Stage::StatusHeld, k, now),
            Some(s) if s.running.is_some() => log.record(Stage::StatusRunning, k, now),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_of_bare_and_runtime_ids() {
        let id = format!("0123456789abcdef{}", "0".repeat(48));
        assert_eq!(key_of(&id), Some(0x0123_4567_89ab_cdef));
        assert_eq!(key_of(&format!("containerd://{id}")), key_of(&id));
        assert_eq!(key_of("short"), None);
    }

    #[test]
    fn a_log_records_in_order_counts_overflow_and_clears() {
        let log = StageLog::new(2);
        log.record_on(Stage::Kernel, 7, 10, 1);
        log.record(Stage::Read, 7, 20);
        log.record(Stage::Cached, 7, 30);
        assert_eq!(
            log.snapshot(),
            vec![
                StageRecord {
                    stage: Stage::Kernel,
                    key: 7,
                    at_ns: 10,
                    cpu: 1
                },
                StageRecord {
                    stage: Stage::Read,
                    key: 7,
                    at_ns: 20,
                    cpu: NO_CPU
                },
            ]
        );
        assert_eq!(log.overflow(), 1);
        log.clear();
        assert!(log.snapshot().is_empty());
        log.record(Stage::Delivered, 1, 5);
        assert_eq!(log.snapshot().len(), 1);
    }
}
