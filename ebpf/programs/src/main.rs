//! evpleg's kernel programs: thin by design. Each one filters, fills a record in a
//! ring-buffer slot and submits it; every decision about containers and pods is made
//! in user space (`crates/pleg/src/kernel`).
//!
//! * `sched_process_exec` (tp_btf): an exec in a task under a configured root cgroup.
//! * `sched_process_exit` (tp_btf): one record per process exit, with the process's
//!   wait status (what `waitpid` gives) and whether the OOM killer chose it. Two
//!   programs, of which the loader attaches one: `sched_process_exit_group_dead`
//!   uses the kernel's own last-thread decision (`group_dead`, from 6.16);
//!   `sched_process_exit` (older kernels) takes `signal->live == 0` and dedupes by
//!   (tgid, start time), see its comment.
//! * `cgroup_mkdir` / `cgroup_rmdir` (tp_btf): cgroups whose path starts with a
//!   configured prefix, in a configured hierarchy; filtered before ring-buffer
//!   space is reserved.
//! * `mark_victim` (tp_btf): the OOM killer's victim, by thread-group id.
//!
//! Struct field offsets are not compiled in: user space reads them from the running
//! kernel's BTF and writes them into `OFFSETS` before loading.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{
        bpf_get_current_ancestor_cgroup_id, bpf_get_current_cgroup_id, bpf_get_current_comm,
        bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns,
        bpf_probe_read_kernel, bpf_probe_read_kernel_str_bytes,
    },
    macros::{btf_tracepoint, map},
    maps::{Array, LruHashMap, PerCpuArray, RingBuf},
    programs::BtfTracePointContext,
};
use evpleg_events::{
    CGROUP_PATH_LEN, CgroupEvent, EVENT_CGROUP_MKDIR, EVENT_CGROUP_RMDIR, EVENT_EXEC, EVENT_EXIT,
    EVENT_OOM_VICTIM, EXIT_DEDUPE_ENTRIES, EXIT_FLAG_GROUP_DEAD_ARG, EXIT_FLAG_GROUP_EXIT,
    EXIT_FLAG_OOM_KILLED, EXIT_FLAG_READ_ERROR, EXEC_FLAG_READ_ERROR, EventHeader, ExecEvent, ExitEvent, KernelOffsets, MAX_PREFIXES,
    MAX_ROOTS, OOM_VICTIM_TID_ONLY, OomVictimEvent, PREFIX_LEN, PathPrefix, RootFilter,
    SIGNAL_GROUP_EXIT, counter,
};

/// Field offsets from the running kernel's BTF (set by the loader).
#[unsafe(no_mangle)]
static OFFSETS: KernelOffsets = KernelOffsets {
    task_tgid: 0,
    task_real_parent: 0,
    task_group_leader: 0,
    task_exit_code: 0,
    task_signal: 0,
    task_start_boottime: 0,
    signal_live: 0,
    signal_oom_mm: 0,
    binprm_filename: 0,
    cgroup_kn: 0,
    cgroup_level: 0,
    cgroup_root: 0,
    kernfs_node_id: 0,
    cgroup_root_hierarchy_id: 0,
    oom_victim_arg_is_task: 0,
    task_pid: 0,
    signal_flags: 0,
    signal_group_exit_code: 0,
    task_mm: 0,
    exit_group_dead_arg: 0,
    task_cgroups: 0,
    css_set_dfl_cgrp: 0,
};

/// Bit `n` set: report mkdir/rmdir in the hierarchy with id `n` (0 is cgroup2).
#[unsafe(no_mangle)]
static HIERARCHY_MASK: u64 = 1;

/// Size set by the loader (`EbpfLoader::set_max_entries`).
#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(1 << 20, 0);

#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);

#[map]
static ROOTS: Array<RootFilter> = Array::with_max_entries(MAX_ROOTS, 0);

#[map]
static PREFIXES: Array<PathPrefix> = Array::with_max_entries(MAX_PREFIXES, 0);

#[inline(always)]
fn offsets() -> KernelOffsets {
    // SAFETY: a plain read of a global the loader initialised; volatile so the
    // compiler does not fold the zero initialiser.
    unsafe { core::ptr::read_volatile(&OFFSETS) }
}

#[inline(always)]
fn count(index: u32) {
    if let Some(slot) = COUNTERS.get_ptr_mut(index) {
        // SAFETY: a per-CPU slot: no other writer while this program runs here.
        unsafe { *slot += 1 }
    }
}

#[inline(always)]
fn header(kind: u32) -> EventHeader {
    EventHeader {
        kind,
        // SAFETY: helper without arguments.
        cpu: unsafe { bpf_get_smp_processor_id() },
        // SAFETY: helper without arguments.
        ktime_ns: unsafe { bpf_ktime_get_ns() },
    }
}

/// Reads a `T` at `base + offset`; a failed read is counted, gives zero and sets
/// `failed` (the record is then flagged, and user space takes it as a hint).
#[inline(always)]
fn read<T: Copy + Default>(base: *const u8, offset: u32, failed: &mut bool) -> T {
    if base.is_null() {
        count(counter::READ_ERRORS);
        *failed = true;
        return T::default();
    }
    // SAFETY: bpf_probe_read_kernel checks the address; a bad one is an error.
    match unsafe { bpf_probe_read_kernel(base.wrapping_add(offset as usize) as *const T) } {
        Ok(v) => v,
        Err(_) => {
            count(counter::READ_ERRORS);
            *failed = true;
            T::default()
        }
    }
}

#[inline(always)]
fn read_ptr(base: *const u8, offset: u32, failed: &mut bool) -> *const u8 {
    read::<usize>(base, offset, failed) as *const u8
}

/// Whether the current task is in, or below, one of the configured root cgroups.
#[inline(always)]
fn current_task_selected() -> bool {
    for i in 0..MAX_ROOTS {
        let Some(root) = ROOTS.get(i) else { break };
        if root.cgroup_id == 0 {
            break;
        }
        // SAFETY: helper with a plain integer argument.
        let ancestor = unsafe { bpf_get_current_ancestor_cgroup_id(root.level as i32) };
        if ancestor == root.cgroup_id {
            return true;
        }
    }
    false
}

#[inline(always)]
fn comm() -> [u8; 16] {
    bpf_get_current_comm().unwrap_or([0; 16])
}

#[btf_tracepoint(function = "sched_process_exec")]
pub fn sched_process_exec(ctx: BtfTracePointContext) -> i32 {
    if !current_task_selected() {
        count(counter::FILTERED);
        return 0;
    }
    let off = offsets();
    let task: *const u8 = ctx.arg(0);
    let old_pid: u32 = ctx.arg(1);
    let bprm: *const u8 = ctx.arg(2);
    let Some(mut entry) = EVENTS.reserve::<ExecEvent>(0) else {
        count(counter::DROPPED);
        return 0;
    };
    let ev = entry.as_mut_ptr();
    let pid_tgid = bpf_get_current_pid_tgid();
    let mut failed = false;
    let parent = read_ptr(task, off.task_real_parent, &mut failed);
    let leader = read_ptr(task, off.task_group_leader, &mut failed);
    // The parent's cgroup2 cgroup: whether the runtime's init (parent outside the
    // container) or a process inside it (a hook) exec'd is user space's to decide.
    let css_set = read_ptr(parent, off.task_cgroups, &mut failed);
    let parent_cgroup = read_ptr(css_set, off.css_set_dfl_cgrp, &mut failed);
    let parent_kn = read_ptr(parent_cgroup, off.cgroup_kn, &mut failed);
    // SAFETY: `ev` points to a reserved slot of the right size; fields are written in
    // place so the record never sits on the 512-byte stack.
    unsafe {
        (*ev).header = header(EVENT_EXEC);
        (*ev).pid = (pid_tgid >> 32) as u32;
        (*ev).tid = pid_tgid as u32;
        (*ev).ppid = read::<u32>(parent, off.task_tgid, &mut failed);
        (*ev).old_pid = old_pid;
        (*ev).cgroup_id = bpf_get_current_cgroup_id();
        (*ev).start_boottime_ns = read::<u64>(leader, off.task_start_boottime, &mut failed);
        (*ev).parent_cgroup_id = read::<u64>(parent_kn, off.kernfs_node_id, &mut failed);
        (*ev).comm = comm();
        let filename = read_ptr(bprm, off.binprm_filename, &mut failed);
        let dst = &mut (*ev).filename;
        if filename.is_null() || bpf_probe_read_kernel_str_bytes(filename, dst).is_err() {
            dst[0] = 0;
            failed = true;
        }
        (*ev).flags = if failed { EXEC_FLAG_READ_ERROR } else { 0 };
        (*ev)._pad = 0;
    }
    entry.submit(0);
    count(counter::REPORTED);
    0
}

/// The dedupe key of a process exit: its tgid and its leader's start time (a pid
/// is reused, the pair is not).
#[repr(C)]
#[derive(Clone, Copy)]
struct ExitKey {
    tgid: u32,
    _pad: u32,
    start_boottime_ns: u64,
}

/// Processes whose exit was reported, on kernels without `group_dead` (before
/// 6.16). LRU: an entry matters only while the threads of its group are in
/// `do_exit` together; PID reuse gives a new key (another start time).
#[map]
static REPORTED_EXITS: LruHashMap<ExitKey, u8> =
    LruHashMap::with_max_entries(EXIT_DEDUPE_ENTRIES, 0);

/// `-EEXIST` from a `BPF_NOEXIST` insert of a key already there.
const EEXIST: i32 = -17;

/// The process's wait status as `wait_task_zombie` computes it for the parent:
/// `signal->group_exit_code` when the group exited as a whole, else the leader's
/// `exit_code`; and the record's flag for the first case.
#[inline(always)]
fn wait_status(
    off: &KernelOffsets,
    signal: *const u8,
    signal_flags: u32,
    leader: *const u8,
    failed: &mut bool,
) -> (u32, u32) {
    if signal_flags & SIGNAL_GROUP_EXIT != 0 {
        (
            read::<u32>(signal, off.signal_group_exit_code, failed),
            EXIT_FLAG_GROUP_EXIT,
        )
    } else {
        (read::<u32>(leader, off.task_exit_code, failed), 0)
    }
}

/// Fills and submits the exit record of the current thread's process; `failed`:
/// a read for it failed, the record is flagged `EXIT_FLAG_READ_ERROR`.
#[inline(always)]
fn report_exit(
    off: &KernelOffsets,
    signal: *const u8,
    status: u32,
    flags: u32,
    start: u64,
    mut failed: bool,
) -> i32 {
    let Some(mut entry) = EVENTS.reserve::<ExitEvent>(0) else {
        count(counter::DROPPED);
        return 0;
    };
    let ev = entry.as_mut_ptr();
    let pid_tgid = bpf_get_current_pid_tgid();
    let oom_mm: usize = read(signal, off.signal_oom_mm, &mut failed);
    let oom = if oom_mm != 0 { EXIT_FLAG_OOM_KILLED } else { 0 };
    let read_error = if failed { EXIT_FLAG_READ_ERROR } else { 0 };
    // SAFETY: as in sched_process_exec.
    unsafe {
        (*ev).header = header(EVENT_EXIT);
        (*ev).pid = (pid_tgid >> 32) as u32;
        (*ev).tid = pid_tgid as u32;
        (*ev).exit_code = status;
        (*ev).flags = flags | oom | read_error;
        (*ev).cgroup_id = bpf_get_current_cgroup_id();
        (*ev).start_boottime_ns = start;
        (*ev).comm = comm();
    }
    entry.submit(0);
    count(counter::REPORTED);
    0
}

/// Kernels before 6.16: the tracepoint has no `group_dead` and fires after
/// `exit_mm`. `do_exit` decrements `signal->live` before it, so `live == 0` here
/// means the group is dead, but every thread that reaches the tracepoint after the
/// last decrement sees it: several threads exiting together all see zero. The
/// first of them to insert (tgid, start time) into `REPORTED_EXITS` reports;
/// the others count as thread exits.
///
/// The status must be final when read. With `SIGNAL_GROUP_EXIT` it is
/// (`group_exit_code` is set before any thread is told to die; from 6.0 every
/// thread's `do_exit` sets the flag before it decrements `live`, so at `live == 0`
/// it is always set). Without it (kernels before 6.0, every thread calling
/// `exit`), the status is the leader's `exit_code`, which the leader writes just
/// after its own decrement: a thread other than the leader reports only once the
/// leader has passed `exit_mm` (its `mm` is NULL, and `exit_code` was written
/// before the full barrier in `exit_mm`). While the leader's `mm` is set, the
/// leader has not reached this tracepoint yet and will see `live == 0` itself.
#[btf_tracepoint(function = "sched_process_exit")]
pub fn sched_process_exit(ctx: BtfTracePointContext) -> i32 {
    if !current_task_selected() {
        count(counter::FILTERED);
        return 0;
    }
    let off = offsets();
    let task: *const u8 = ctx.arg(0);
    let mut failed = false;
    let signal = read_ptr(task, off.task_signal, &mut failed);
    let live: i32 = read(signal, off.signal_live, &mut failed);
    if live != 0 {
        count(counter::THREAD_EXITS);
        return 0;
    }
    let leader = read_ptr(task, off.task_group_leader, &mut failed);
    let signal_flags: u32 = read(signal, off.signal_flags, &mut failed);
    if signal_flags & SIGNAL_GROUP_EXIT == 0 && leader != task {
        let leader_mm: usize = read(leader, off.task_mm, &mut failed);
        if leader_mm != 0 {
            // The leader reports, with its exit code final.
            count(counter::THREAD_EXITS);
            return 0;
        }
    }
    let key = ExitKey {
        tgid: (bpf_get_current_pid_tgid() >> 32) as u32,
        _pad: 0,
        start_boottime_ns: read::<u64>(leader, off.task_start_boottime, &mut failed),
    };
    if let Err(EEXIST) = REPORTED_EXITS.insert(key, 0u8, BPF_NOEXIST as u64) {
        count(counter::THREAD_EXITS);
        return 0;
    }
    let (status, flags) = wait_status(&off, signal, signal_flags, leader, &mut failed);
    report_exit(&off, signal, status, flags, key.start_boottime_ns, failed)
}

/// Kernels from 6.16: the tracepoint's second argument is `do_exit`'s own
/// `group_dead` (the thread whose decrement took `signal->live` to zero), true
/// for exactly one thread of the group; no dedupe is needed. The loader attaches
/// this program or [`sched_process_exit`], from the tracepoint's prototype in BTF.
#[btf_tracepoint(function = "sched_process_exit")]
pub fn sched_process_exit_group_dead(ctx: BtfTracePointContext) -> i32 {
    // A thread's exit first, and nothing else before it: where the kernel runs
    // this program preemptible (7.x), a task preempted inside it makes the
    // next one on that CPU skip it (counted in `recursion_misses`, a relist in
    // user space). The shorter every thread's run, the rarer that is.
    let group_dead: u64 = ctx.arg(1);
    if group_dead & 0xff == 0 {
        count(counter::THREAD_EXITS);
        return 0;
    }
    if !current_task_selected() {
        count(counter::FILTERED);
        return 0;
    }
    let off = offsets();
    let task: *const u8 = ctx.arg(0);
    let mut failed = false;
    let signal = read_ptr(task, off.task_signal, &mut failed);
    let leader = read_ptr(task, off.task_group_leader, &mut failed);
    let signal_flags: u32 = read(signal, off.signal_flags, &mut failed);
    let (status, flags) = wait_status(&off, signal, signal_flags, leader, &mut failed);
    let start = read::<u64>(leader, off.task_start_boottime, &mut failed);
    report_exit(
        &off,
        signal,
        status,
        flags | EXIT_FLAG_GROUP_DEAD_ARG,
        start,
        failed,
    )
}

/// Whether `path` (NUL-terminated) is a configured prefix or lies below one.
#[inline(always)]
fn path_selected(path: &[u8; CGROUP_PATH_LEN]) -> bool {
    for i in 0..MAX_PREFIXES {
        let Some(prefix) = PREFIXES.get(i) else { break };
        let len = prefix.len as usize;
        if len == 0 || len >= PREFIX_LEN {
            break;
        }
        // A fixed trip count: every index is a constant the verifier can check.
        // (`zip(..).take(len)` lets LLVM drop the array bound, since len < 64 is
        // known, and the 6.1 verifier then loses the bound of the count-down.)
        let mut differ = 0u8;
        for (j, (a, b)) in path.iter().zip(prefix.bytes.iter()).enumerate() {
            if j < len {
                differ |= a ^ b;
            }
        }
        let next = path[len & (PREFIX_LEN - 1)];
        if differ == 0 && (next == 0 || next == b'/') {
            return true;
        }
    }
    false
}

/// One `CgroupEvent` per CPU: the record is built here and filtered before any
/// ring-buffer space is reserved, so cgroup churn elsewhere on the host neither
/// takes ring space nor wakes the reader (and the 296-byte record never sits on
/// the 512-byte stack).
#[map]
static CGROUP_SCRATCH: PerCpuArray<CgroupEvent> = PerCpuArray::with_max_entries(1, 0);

#[inline(always)]
fn cgroup_event(ctx: &BtfTracePointContext, kind: u32) -> i32 {
    let off = offsets();
    let cgrp: *const u8 = ctx.arg(0);
    let path: *const u8 = ctx.arg(1);
    // A failed read is counted; a cgroup record has no flag for it: a zero id is
    // unknown to user space, whose task records then ask for a rescan.
    let mut failed = false;
    let root = read_ptr(cgrp, off.cgroup_root, &mut failed);
    let hierarchy_id: i32 = read(root, off.cgroup_root_hierarchy_id, &mut failed);
    // SAFETY: a plain read of a global the loader initialised.
    let mask = unsafe { core::ptr::read_volatile(&HIERARCHY_MASK) };
    if !(0..64).contains(&hierarchy_id) || mask & (1u64 << hierarchy_id) == 0 {
        count(counter::FILTERED);
        return 0;
    }
    let Some(ev) = CGROUP_SCRATCH.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: `ev` is this CPU's slot of a per-CPU map: no other writer while this
    // program runs here (tracepoint programs do not nest on one CPU).
    let selected = unsafe {
        let dst = &mut (*ev).path;
        match bpf_probe_read_kernel_str_bytes(path, dst) {
            Ok(s) => (*ev).path_len = s.len() as u32 + 1,
            Err(_) => {
                dst[0] = 0;
                (*ev).path_len = 0;
            }
        }
        path_selected(dst)
    };
    if !selected {
        count(counter::FILTERED);
        return 0;
    }
    let kn = read_ptr(cgrp, off.cgroup_kn, &mut failed);
    // SAFETY: as above; the record is then copied into the ring buffer.
    let sent = unsafe {
        (*ev).header = header(kind);
        (*ev).hierarchy_id = hierarchy_id as u32;
        (*ev).level = read::<i32>(cgrp, off.cgroup_level, &mut failed) as u32;
        (*ev).cgroup_id = read::<u64>(kn, off.kernfs_node_id, &mut failed);
        (*ev)._pad = 0;
        EVENTS.output::<CgroupEvent>(&*ev, 0)
    };
    match sent {
        Ok(()) => count(counter::REPORTED),
        Err(_) => count(counter::DROPPED),
    }
    0
}

#[btf_tracepoint(function = "cgroup_mkdir")]
pub fn cgroup_mkdir(ctx: BtfTracePointContext) -> i32 {
    cgroup_event(&ctx, EVENT_CGROUP_MKDIR)
}

#[btf_tracepoint(function = "cgroup_rmdir")]
pub fn cgroup_rmdir(ctx: BtfTracePointContext) -> i32 {
    cgroup_event(&ctx, EVENT_CGROUP_RMDIR)
}

/// The OOM killer's victim, by thread-group id. The newer tracepoint passes the
/// victim's `task_struct`, whose `tgid` is read; the older one only the victim
/// thread's pid, which is sent flagged `OOM_VICTIM_TID_ONLY` for user space to
/// resolve (the victim is alive until it handles its SIGKILL).
#[btf_tracepoint(function = "mark_victim")]
pub fn mark_victim(ctx: BtfTracePointContext) -> i32 {
    let off = offsets();
    let (tgid, flags) = if off.oom_victim_arg_is_task != 0 {
        let task: *const u8 = ctx.arg(0);
        // A failed read gives tgid 0, which matches no exit.
        (read::<u32>(task, off.task_tgid, &mut false), 0)
    } else {
        (ctx.arg::<u64>(0) as u32, OOM_VICTIM_TID_ONLY)
    };
    let Some(mut entry) = EVENTS.reserve::<OomVictimEvent>(0) else {
        count(counter::DROPPED);
        return 0;
    };
    let ev = entry.as_mut_ptr();
    // SAFETY: `ev` points to a reserved slot of the right size.
    unsafe {
        (*ev).header = header(EVENT_OOM_VICTIM);
        (*ev).tgid = tgid;
        (*ev).flags = flags;
    }
    entry.submit(0);
    count(counter::REPORTED);
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
