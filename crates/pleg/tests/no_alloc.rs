//! The reader's hot path allocates nothing per record (issue #25, item 8): the
//! records of a container's other processes (children, exec probes: most
//! records on a busy node) are decoded and handed to the tracker without one
//! allocation, counted by a global allocator that counts this thread's only.
//! Nor do its rare log lines, nor an OOM record naming a thread.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use evpleg_events::{
    CGROUP_PATH_LEN, COMM_LEN, CgroupEvent, EVENT_CGROUP_MKDIR, EVENT_EXEC, EVENT_EXIT,
    EVENT_OOM_VICTIM, EventHeader, ExecEvent, ExitEvent, FILENAME_LEN, OOM_VICTIM_TID_ONLY,
    OomVictimEvent,
};
use evpleg_pleg::kernel::event::{KernelEvent, decode};
use evpleg_pleg::kernel::histogram::AtomicHistogram;
use evpleg_pleg::kernel::tracker::{Output, Tracker};

struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    /// This thread's allocations while counting (each test counts its own).
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

fn count_one() {
    if COUNTING.with(Cell::get) {
        ALLOCATIONS.with(|a| a.set(a.get() + 1));
    }
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count_one();
        // SAFETY: the caller's layout, forwarded.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: a pointer System gave for this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count_one();
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn bytes_of<T: Copy>(v: &T) -> Vec<u8> {
    // SAFETY: `T` is a padding-free `#[repr(C)]` record of `evpleg_events`.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }.to_vec()
}

fn fill<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [0u8; N];
    out[..s.len()].copy_from_slice(s.as_bytes());
    out
}

fn header(kind: u32, at: u64) -> EventHeader {
    EventHeader {
        kind,
        cpu: 0,
        ktime_ns: at,
    }
}

fn mkdir(cgroup_id: u64, path: &str) -> Vec<u8> {
    bytes_of(&CgroupEvent {
        header: header(EVENT_CGROUP_MKDIR, 1),
        hierarchy_id: 0,
        level: path.matches('/').count() as u32,
        cgroup_id,
        path_len: (path.len() + 1) as u32,
        _pad: 0,
        path: fill::<CGROUP_PATH_LEN>(path),
    })
}

fn exec(pid: u32, start: u64, cgroup_id: u64, parent_cgroup_id: u64) -> Vec<u8> {
    bytes_of(&ExecEvent {
        header: header(EVENT_EXEC, 2),
        pid,
        tid: pid,
        ppid: 1,
        old_pid: pid,
        cgroup_id,
        start_boottime_ns: start,
        parent_cgroup_id,
        flags: 0,
        _pad: 0,
        comm: fill::<COMM_LEN>("probe"),
        filename: fill::<FILENAME_LEN>("/bin/probe"),
    })
}

fn exit(pid: u32, start: u64, cgroup_id: u64) -> Vec<u8> {
    bytes_of(&ExitEvent {
        header: header(EVENT_EXIT, 3),
        pid,
        tid: pid,
        exit_code: 0x100,
        flags: 0,
        cgroup_id,
        start_boottime_ns: start,
        comm: fill::<COMM_LEN>("probe"),
    })
}

#[test]
fn records_of_other_processes_allocate_nothing() {
    let uid = "1b4e28ba-2fa1-11d2-883f-0016d3cca427";
    let id = "a".repeat(64);
    let mut tracker = Tracker::new(100);
    let mut out = Output::default();
    for (cgroup, path) in [
        (50, "/kubepods".to_owned()),
        (60, format!("/kubepods/besteffort/pod{uid}")),
        (70, format!("/kubepods/besteffort/pod{uid}/{id}")),
    ] {
        tracker.handle(&decode(&mkdir(cgroup, &path)).unwrap(), &mut out);
    }
    tracker.handle(&decode(&exec(1000, 500, 70, 2)).unwrap(), &mut out);
    assert_eq!(
        out.events.len(),
        1,
        "the main process started: {:?}",
        out.events
    );
    out.events.clear();
    let probe = exec(2000, 900, 70, 2);
    let child = exec(2001, 901, 70, 70);
    let done = exit(2000, 900, 70);

    // The reader's per-record latency metric (issue #25 item 8: atomic,
    // never a scrape's lock).
    let latency = AtomicHistogram::doubling(1_000, 24);
    COUNTING.with(|c| c.set(true));
    for _ in 0..1000 {
        for record in [&probe, &child, &done] {
            let ev = decode(record).expect("a record");
            latency.observe_ns(ev.at_ns());
            if let KernelEvent::Exec(e) = &ev {
                assert!(!tracker.exec_would_start(e));
            }
            tracker.handle(&ev, &mut out);
        }
    }
    COUNTING.with(|c| c.set(false));
    let allocations = ALLOCATIONS.with(Cell::get);
    assert!(out.events.is_empty(), "{:?}", out.events);
    assert_eq!(
        allocations, 0,
        "allocations for 3000 records of other processes"
    );
    assert_eq!(tracker.stats.execs_other, 2000);
    assert_eq!(latency.count(), 3000);
}

/// The reader's rare log lines (issue #25, item 8): a cgroup whose path names
/// no pod, a failed rescan, a root the kernel filter refused. Each is built
/// on the real-time thread from an error already made, and queued in a
/// bounded channel as the reader's `Offload::log` does: nothing is allocated
/// (the lines carried `String`s of the errors' messages before). Records of
/// a cgroup with a malformed path (learned once, ignored since) allocate
/// nothing either.
#[test]
fn the_readers_log_lines_allocate_nothing() {
    use evpleg_pleg::kernel::index::ScanError;
    use evpleg_pleg::kernel::loader::LoadError;
    use evpleg_pleg::kernel::offload::{FilterFailure, LogLine};

    let mut tracker = Tracker::new(100);
    let mut out = Output::default();
    for (cgroup, path) in [(50, "/kubepods"), (80, "/kubepods/not-a-pod-or-container")] {
        tracker.handle(&decode(&mkdir(cgroup, path)).unwrap(), &mut out);
    }
    assert_eq!(out.malformed.len(), 1, "{:?}", out.malformed);
    let malformed = std::mem::take(&mut out.malformed);
    let scan = ScanError::Read {
        path: "/sys/fs/cgroup/kubepods".into(),
        source: std::io::Error::from_raw_os_error(libc::EACCES),
    };
    let full = LoadError::Filter("more than 64 root cgroups".to_owned());
    let (tx, rx) = std::sync::mpsc::sync_channel::<LogLine>(8);
    let record = exec(3000, 700, 80, 2);
    // An OOM victim named by a thread (older kernels' `mark_victim`): a live
    // thread, this one, which the decoder resolved through /proc before.
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() } as u32;
    let oom = bytes_of(&OomVictimEvent {
        header: header(EVENT_OOM_VICTIM, 4),
        tgid: tid,
        flags: OOM_VICTIM_TID_ONLY,
    });

    COUNTING.with(|c| c.set(true));
    let victim = decode(&oom).expect("an oom record");
    tracker.handle(&victim, &mut out);
    for (cgroup_id, _) in &malformed {
        tx.try_send(LogLine::NotAttributed {
            cgroup_id: *cgroup_id,
        })
        .unwrap();
    }
    tx.try_send(LogLine::rescan_failed(&scan)).unwrap();
    tx.try_send(LogLine::RootAddFailed {
        cgroup_id: 50,
        failure: FilterFailure::of(&full),
    })
    .unwrap();
    tx.try_send(LogLine::RootRemoveFailed {
        cgroup_id: 50,
        failure: FilterFailure::of(&full),
    })
    .unwrap();
    for _ in 0..100 {
        let ev = decode(&record).expect("a record");
        tracker.handle(&ev, &mut out);
    }
    COUNTING.with(|c| c.set(false));
    let allocations = ALLOCATIONS.with(Cell::get);
    assert_eq!(allocations, 0, "allocations for the reader's log lines");
    let lines: Vec<String> = rx.try_iter().map(|l| format!("{l:?}")).collect();
    assert_eq!(
        lines,
        [
            "NotAttributed { cgroup_id: 80 }",
            "RescanFailed { errno: 13 }",
            "RootAddFailed { cgroup_id: 50, failure: Full }",
            "RootRemoveFailed { cgroup_id: 50, failure: Full }",
        ]
    );
    assert!(out.events.is_empty(), "{:?}", out.events);
    assert_eq!(
        victim,
        KernelEvent::OomVictim {
            at_ns: 4,
            tgid: tid
        }
    );
    assert_eq!(tracker.oom_victims_len(), 1);
}
