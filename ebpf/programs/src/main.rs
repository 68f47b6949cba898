//! evpleg's kernel programs: thin by design. Each one filters, fills a record in a
//! ring-buffer slot and submits it; every decision about containers and pods is made
//! in user space (`agent/src/pleg/kernel`).
//!
//! * `sched_process_exec` (tp_btf): an exec in a task under a configured root cgroup.
//! * `sched_process_exit` (tp_btf): the exit of the *last* thread of such a process,
//!   with its wait status and whether the OOM killer chose it. "Last thread" is
//!   `signal_struct.live == 0`, which `do_exit` decrements before the tracepoint on
//!   every kernel; the tracepoint's own `group_dead` argument only exists from 6.16.
//! * `cgroup_mkdir` / `cgroup_rmdir` (tp_btf): cgroups whose path starts with a
//!   configured prefix, in a configured hierarchy.
//! * `mark_victim` (tp_btf): the OOM killer's victim.
//!
//! Struct field offsets are not compiled in: user space reads them from the running
//! kernel's BTF and writes them into `OFFSETS` before loading.
#![no_std]
#![no_main]

use aya_ebpf::{
    helpers::{
        bpf_get_current_ancestor_cgroup_id, bpf_get_current_cgroup_id, bpf_get_current_comm,
        bpf_get_current_pid_tgid, bpf_get_smp_processor_id, bpf_ktime_get_ns,
        bpf_probe_read_kernel, bpf_probe_read_kernel_str_bytes,
    },
    macros::{btf_tracepoint, map},
    maps::{Array, PerCpuArray, RingBuf},
    programs::BtfTracePointContext,
};
use evpleg_events::{
    CGROUP_PATH_LEN, CgroupEvent, EVENT_CGROUP_MKDIR, EVENT_CGROUP_RMDIR, EVENT_EXEC, EVENT_EXIT,
    EVENT_OOM_VICTIM, EXIT_FLAG_OOM_KILLED, EventHeader, ExecEvent, ExitEvent, KernelOffsets,
    MAX_PREFIXES, MAX_ROOTS, OomVictimEvent, PREFIX_LEN, PathPrefix, RootFilter, counter,
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

/// Reads a `T` at `base + offset`, counting a failed read and giving zero.
#[inline(always)]
fn read<T: Copy + Default>(base: *const u8, offset: u32) -> T {
    if base.is_null() {
        count(counter::READ_ERRORS);
        return T::default();
    }
    // SAFETY: bpf_probe_read_kernel checks the address; a bad one is an error.
    match unsafe { bpf_probe_read_kernel(base.wrapping_add(offset as usize) as *const T) } {
        Ok(v) => v,
        Err(_) => {
            count(counter::READ_ERRORS);
            T::default()
        }
    }
}

#[inline(always)]
fn read_ptr(base: *const u8, offset: u32) -> *const u8 {
    read::<usize>(base, offset) as *const u8
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
    let parent = read_ptr(task, off.task_real_parent);
    let leader = read_ptr(task, off.task_group_leader);
    // SAFETY: `ev` points to a reserved slot of the right size; fields are written in
    // place so the record never sits on the 512-byte stack.
    unsafe {
        (*ev).header = header(EVENT_EXEC);
        (*ev).pid = (pid_tgid >> 32) as u32;
        (*ev).tid = pid_tgid as u32;
        (*ev).ppid = read::<u32>(parent, off.task_tgid);
        (*ev).old_pid = old_pid;
        (*ev).cgroup_id = bpf_get_current_cgroup_id();
        (*ev).start_boottime_ns = read::<u64>(leader, off.task_start_boottime);
        (*ev).comm = comm();
        let filename = read_ptr(bprm, off.binprm_filename);
        let dst = &mut (*ev).filename;
        if filename.is_null() || bpf_probe_read_kernel_str_bytes(filename, dst).is_err() {
            dst[0] = 0;
        }
    }
    entry.submit(0);
    count(counter::REPORTED);
    0
}

#[btf_tracepoint(function = "sched_process_exit")]
pub fn sched_process_exit(ctx: BtfTracePointContext) -> i32 {
    if !current_task_selected() {
        count(counter::FILTERED);
        return 0;
    }
    let off = offsets();
    let task: *const u8 = ctx.arg(0);
    let signal = read_ptr(task, off.task_signal);
    // `live` (an atomic_t) reached zero in do_exit before this tracepoint iff this is
    // the last thread of the process.
    let live: i32 = read(signal, off.signal_live);
    if live != 0 {
        count(counter::THREAD_EXITS);
        return 0;
    }
    let Some(mut entry) = EVENTS.reserve::<ExitEvent>(0) else {
        count(counter::DROPPED);
        return 0;
    };
    let ev = entry.as_mut_ptr();
    let pid_tgid = bpf_get_current_pid_tgid();
    let leader = read_ptr(task, off.task_group_leader);
    let oom_mm: usize = read(signal, off.signal_oom_mm);
    // SAFETY: as in sched_process_exec.
    unsafe {
        (*ev).header = header(EVENT_EXIT);
        (*ev).pid = (pid_tgid >> 32) as u32;
        (*ev).tid = pid_tgid as u32;
        (*ev).exit_code = read::<u32>(task, off.task_exit_code);
        (*ev).flags = if oom_mm != 0 { EXIT_FLAG_OOM_KILLED } else { 0 };
        (*ev).cgroup_id = bpf_get_current_cgroup_id();
        (*ev).start_boottime_ns = read::<u64>(leader, off.task_start_boottime);
        (*ev).comm = comm();
    }
    entry.submit(0);
    count(counter::REPORTED);
    0
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

#[inline(always)]
fn cgroup_event(ctx: &BtfTracePointContext, kind: u32) -> i32 {
    let off = offsets();
    let cgrp: *const u8 = ctx.arg(0);
    let path: *const u8 = ctx.arg(1);
    let root = read_ptr(cgrp, off.cgroup_root);
    let hierarchy_id: i32 = read(root, off.cgroup_root_hierarchy_id);
    // SAFETY: a plain read of a global the loader initialised.
    let mask = unsafe { core::ptr::read_volatile(&HIERARCHY_MASK) };
    if !(0..64).contains(&hierarchy_id) || mask & (1u64 << hierarchy_id) == 0 {
        count(counter::FILTERED);
        return 0;
    }
    // The path is read into the slot itself and the slot discarded when it does not
    // match: the 256-byte path never sits on the stack.
    let Some(mut entry) = EVENTS.reserve::<CgroupEvent>(0) else {
        count(counter::DROPPED);
        return 0;
    };
    let ev = entry.as_mut_ptr();
    // SAFETY: `ev` points to a reserved slot of the right size.
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
        entry.discard(0);
        count(counter::FILTERED);
        return 0;
    }
    let kn = read_ptr(cgrp, off.cgroup_kn);
    // SAFETY: as above.
    unsafe {
        (*ev).header = header(kind);
        (*ev).hierarchy_id = hierarchy_id as u32;
        (*ev).level = read::<i32>(cgrp, off.cgroup_level) as u32;
        (*ev).cgroup_id = read::<u64>(kn, off.kernfs_node_id);
        (*ev)._pad = 0;
    }
    entry.submit(0);
    count(counter::REPORTED);
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

#[btf_tracepoint(function = "mark_victim")]
pub fn mark_victim(ctx: BtfTracePointContext) -> i32 {
    let off = offsets();
    let tid: u32 = if off.oom_victim_arg_is_task != 0 {
        let task: *const u8 = ctx.arg(0);
        read::<u32>(task, off.task_pid)
    } else {
        ctx.arg::<u64>(0) as u32
    };
    let Some(mut entry) = EVENTS.reserve::<OomVictimEvent>(0) else {
        count(counter::DROPPED);
        return 0;
    };
    let ev = entry.as_mut_ptr();
    // SAFETY: `ev` points to a reserved slot of the right size.
    unsafe {
        (*ev).header = header(EVENT_OOM_VICTIM);
        (*ev).tid = tid;
        (*ev)._pad = 0;
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
