//! Records shared by evpleg's kernel programs (`ebpf/programs`) and user space
//! (`agent`, module `pleg::kernel`).
//!
//! Every record is `#[repr(C)]` with fixed-width fields only (flags are `u32`, never
//! `bool`), no implicit padding and an alignment of at most 8, so the kernel writes
//! it in place into a ring-buffer slot and user space reads the same bytes. Each
//! layout has a compile-time size assertion; user space checks a record's length
//! against these sizes before decoding it.
#![no_std]

/// A task ran `execve` (kernel: `sched_process_exec`).
pub const EVENT_EXEC: u32 = 1;
/// A process exited: one record per thread group, from the thread the kernel (or,
/// before 6.16, the exit program's dedupe) took for the last one
/// (kernel: `sched_process_exit`).
pub const EVENT_EXIT: u32 = 2;
/// A cgroup directory was created (kernel: `cgroup_mkdir`).
pub const EVENT_CGROUP_MKDIR: u32 = 3;
/// A cgroup directory was removed (kernel: `cgroup_rmdir`).
pub const EVENT_CGROUP_RMDIR: u32 = 4;
/// The OOM killer chose a victim (kernel: `mark_victim`).
pub const EVENT_OOM_VICTIM: u32 = 5;

/// Bytes of the exec'd file name kept (NUL-terminated when shorter).
pub const FILENAME_LEN: usize = 128;
/// Bytes of a cgroup path kept (NUL-terminated when shorter).
pub const CGROUP_PATH_LEN: usize = 256;
/// Bytes of a task's `comm`.
pub const COMM_LEN: usize = 16;

/// `ExitEvent::flags`: the process was chosen by the OOM killer
/// (`signal_struct.oom_mm` was set when it exited).
pub const EXIT_FLAG_OOM_KILLED: u32 = 1;
/// `ExitEvent::flags`: the thread group exited as a whole (`SIGNAL_GROUP_EXIT`:
/// exit_group, a fatal signal, or, from Linux 6.0, the last thread's exit), so the
/// wait status is `signal_struct.group_exit_code`; otherwise it is the group
/// leader's `task_struct.exit_code`.
pub const EXIT_FLAG_GROUP_EXIT: u32 = 2;
/// `ExitEvent::flags`: the kernel's own `group_dead` (the tracepoint's second
/// argument, from Linux 6.16) chose this thread as the last one; otherwise the exit
/// program's dedupe by (tgid, start time) did.
pub const EXIT_FLAG_GROUP_DEAD_ARG: u32 = 4;
/// `ExitEvent::flags`: a kernel read for this record failed (its status, start
/// time or OOM mark may be zeros): user space takes the record as a hint only.
pub const EXIT_FLAG_READ_ERROR: u32 = 8;

/// `ExecEvent::flags`: a kernel read for this record failed (the start time, the
/// parent, its cgroup or the file name may be zeros): user space never takes the
/// exec for a container's main process on its word.
pub const EXEC_FLAG_READ_ERROR: u32 = 1;

/// `OomVictimEvent::flags`: the kernel's `mark_victim` passes only the victim
/// thread's id (the older `int pid` form), so `OomVictimEvent::tgid` is a tid that
/// user space resolves to its thread group.
pub const OOM_VICTIM_TID_ONLY: u32 = 1;

/// The header every record starts with.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventHeader {
    /// One of the `EVENT_*` constants.
    pub kind: u32,
    /// The CPU the program ran on.
    pub cpu: u32,
    /// `bpf_ktime_get_ns()` at the event: CLOCK_MONOTONIC nanoseconds.
    pub ktime_ns: u64,
}

/// `EVENT_EXEC`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ExecEvent {
    pub header: EventHeader,
    /// Thread-group id (the process id in the initial PID namespace).
    pub pid: u32,
    /// Thread id of the exec'ing task (equal to `pid` after a successful exec).
    pub tid: u32,
    /// The parent's thread-group id.
    pub ppid: u32,
    /// The tid before exec (differs when a non-leader thread exec'd).
    pub old_pid: u32,
    /// The task's cgroup id in the cgroup2 (default) hierarchy.
    pub cgroup_id: u64,
    /// The process's start time, `task_struct.start_boottime` of its leader (ns since
    /// boot, counting suspend): the PID-reuse guard.
    pub start_boottime_ns: u64,
    /// The parent's cgroup id in the cgroup2 hierarchy
    /// (`real_parent->cgroups->dfl_cgrp->kn->id`): a runtime's init exec'ing the
    /// entrypoint has its parent (the shim) outside the container, a hook the
    /// runtime runs inside the container has its parent (the init) inside.
    pub parent_cgroup_id: u64,
    /// `EXEC_FLAG_*` bits.
    pub flags: u32,
    pub _pad: u32,
    pub comm: [u8; COMM_LEN],
    pub filename: [u8; FILENAME_LEN],
}

/// `EVENT_EXIT`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ExitEvent {
    pub header: EventHeader,
    /// Thread-group id of the process that died.
    pub pid: u32,
    /// The thread whose exit was taken for the process's (see `EVENT_EXIT`).
    pub tid: u32,
    /// The process's wait status, what `waitpid` gives its parent:
    /// `signal_struct.group_exit_code` with `EXIT_FLAG_GROUP_EXIT`, else the group
    /// leader's `task_struct.exit_code`. `code << 8` for an exit, the signal number
    /// (`| 0x80` with a core dump) for a death by signal.
    pub exit_code: u32,
    /// `EXIT_FLAG_*` bits.
    pub flags: u32,
    pub cgroup_id: u64,
    pub start_boottime_ns: u64,
    pub comm: [u8; COMM_LEN],
}

/// `EVENT_CGROUP_MKDIR` and `EVENT_CGROUP_RMDIR`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CgroupEvent {
    pub header: EventHeader,
    /// `cgroup_root.hierarchy_id`: 0 is the cgroup2 hierarchy, others are v1 ones.
    pub hierarchy_id: u32,
    /// Depth below the hierarchy's root (the root is 0).
    pub level: u32,
    /// The cgroup's id (`kernfs_node.id`; the directory's inode number on cgroup2).
    pub cgroup_id: u64,
    /// Bytes the kernel copied into `path`, NUL included; `CGROUP_PATH_LEN` means the
    /// path may be truncated.
    pub path_len: u32,
    pub _pad: u32,
    /// The path relative to the hierarchy's root, e.g. `/kubepods/pod<uid>/<id>`.
    pub path: [u8; CGROUP_PATH_LEN],
}

/// `EVENT_OOM_VICTIM`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct OomVictimEvent {
    pub header: EventHeader,
    /// The victim's thread-group id (its process id); a thread id when `flags` has
    /// `OOM_VICTIM_TID_ONLY`.
    pub tgid: u32,
    /// `OOM_VICTIM_*` bits.
    pub flags: u32,
}

/// Byte offsets of the kernel struct fields the programs read, taken from the
/// running kernel's BTF by user space at load time (never compiled in).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelOffsets {
    pub task_tgid: u32,
    pub task_real_parent: u32,
    pub task_group_leader: u32,
    pub task_exit_code: u32,
    pub task_signal: u32,
    pub task_start_boottime: u32,
    pub signal_live: u32,
    pub signal_oom_mm: u32,
    pub binprm_filename: u32,
    pub cgroup_kn: u32,
    pub cgroup_level: u32,
    pub cgroup_root: u32,
    pub kernfs_node_id: u32,
    pub cgroup_root_hierarchy_id: u32,
    /// 1 when `mark_victim`'s first argument is a `struct task_struct *` (kernels
    /// from 6.6), 0 when it is the victim's pid.
    pub oom_victim_arg_is_task: u32,
    pub task_pid: u32,
    /// `signal_struct.flags` (`SIGNAL_GROUP_EXIT`).
    pub signal_flags: u32,
    /// `signal_struct.group_exit_code`.
    pub signal_group_exit_code: u32,
    /// `task_struct.mm`: NULL once a task has passed `exit_mm`.
    pub task_mm: u32,
    /// 1 when `sched_process_exit` has the `group_dead` argument (Linux 6.16) and
    /// the loader attached `sched_process_exit_group_dead`; 0 when it attached
    /// `sched_process_exit` (the dedupe). Read by user space only.
    pub exit_group_dead_arg: u32,
    /// `task_struct.cgroups` (the task's `css_set`).
    pub task_cgroups: u32,
    /// `css_set.dfl_cgrp` (its cgroup in the cgroup2 hierarchy).
    pub css_set_dfl_cgrp: u32,
}

/// Maximum number of root cgroups a task may be under to be reported.
pub const MAX_ROOTS: u32 = 16;
/// Entries of the exit program's dedupe map (kernels before 6.16): an entry is
/// needed only while the threads of one group are in `do_exit` together.
pub const EXIT_DEDUPE_ENTRIES: u32 = 4096;
/// `SIGNAL_GROUP_EXIT` in `signal_struct.flags` (include/linux/sched/signal.h;
/// 0x4 on every kernel since 2.6: a flag value, not an offset).
pub const SIGNAL_GROUP_EXIT: u32 = 0x4;
/// Maximum number of cgroup path prefixes for mkdir/rmdir reports.
pub const MAX_PREFIXES: u32 = 8;
/// Longest cgroup path prefix.
pub const PREFIX_LEN: usize = 64;

/// An entry of the `ROOTS` map: a cgroup2 cgroup whose descendants are reported.
/// An entry with `cgroup_id == 0` is unused.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RootFilter {
    pub cgroup_id: u64,
    /// The root's level (its depth: `/kubepods` is 1).
    pub level: u32,
    pub _pad: u32,
}

/// An entry of the `PREFIXES` map: cgroup paths equal to `bytes[..len]` or below it
/// are reported on mkdir and rmdir. An entry with `len == 0` is unused.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PathPrefix {
    pub len: u32,
    pub _pad: u32,
    pub bytes: [u8; PREFIX_LEN],
}

/// Indices of the per-CPU `COUNTERS` array.
pub mod counter {
    /// Records submitted to the ring buffer.
    pub const REPORTED: u32 = 0;
    /// Events outside the configured roots, prefixes or hierarchies.
    pub const FILTERED: u32 = 1;
    /// Records lost because the ring buffer was full: each one calls for a relist.
    pub const DROPPED: u32 = 2;
    /// Kernel reads that failed (the record is still sent, with zeros, and
    /// flagged `EXEC_FLAG_READ_ERROR` or `EXIT_FLAG_READ_ERROR`).
    pub const READ_ERRORS: u32 = 3;
    /// Thread exits that did not end their process, and exits of a thread group
    /// already reported by another of its threads (not reported).
    pub const THREAD_EXITS: u32 = 4;
    /// Number of counters.
    pub const COUNT: u32 = 5;
}

const _: () = {
    assert!(core::mem::size_of::<EventHeader>() == 16);
    assert!(core::mem::size_of::<ExecEvent>() == 64 + COMM_LEN + FILENAME_LEN);
    assert!(core::mem::size_of::<ExitEvent>() == 48 + COMM_LEN);
    assert!(core::mem::size_of::<CgroupEvent>() == 40 + CGROUP_PATH_LEN);
    assert!(core::mem::size_of::<OomVictimEvent>() == 24);
    assert!(core::mem::size_of::<KernelOffsets>() == 88);
    assert!(core::mem::size_of::<RootFilter>() == 16);
    assert!(core::mem::size_of::<PathPrefix>() == 8 + PREFIX_LEN);
    assert!(core::mem::align_of::<CgroupEvent>() == 8);
};

#[cfg(feature = "user")]
mod pod_impls {
    use super::*;
    // SAFETY: plain `#[repr(C)]` integers and byte arrays, no padding (asserted above),
    // every bit pattern valid.
    unsafe impl aya::Pod for KernelOffsets {}
    // SAFETY: as above.
    unsafe impl aya::Pod for RootFilter {}
    // SAFETY: as above.
    unsafe impl aya::Pod for PathPrefix {}
}
