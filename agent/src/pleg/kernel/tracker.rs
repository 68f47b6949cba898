//! The user-space state machine of the kernel PLEG: kernel records in, the kubelet's
//! lifecycle events out.
//!
//! # The main-process rule
//! A container starts when its *main process* execs and dies when that process
//! exits; other processes in the container (children, `kubectl exec` sessions,
//! probes) start and die without container events. The main process is the first
//! process to exec in the container's cgroup (or a cgroup nested in it): with runc,
//! the container's init waits in the cgroup and execs the entrypoint when the
//! runtime starts the container. A runtime re-executing itself inside the cgroup
//! (`/proc/self/exe`, or runc's sealed copy run as `/dev/fd/N`; see
//! [`is_runtime_reexec`]) is not a candidate. Processes are identified by host pid *and* start time, so a reused
//! pid is not mistaken for the main process; pids are host pids, so the rule holds
//! with a private PID namespace, a pod-shared one and host PID alike.
//!
//! Containers found by the start-up scan get their main process from
//! [`choose_main`]: the process in the cgroup whose parent is outside it.
//!
//! # Differences from the kubelet
//! The kubelet's generic PLEG derives events by diffing relists; this one derives
//! them from the kernel as they happen. ContainerChanged (created, not started) is
//! never produced, as in the kubelet. A cgroup removed while its main process was
//! never seen to exit produces ContainerDied (without an exit status) then
//! ContainerRemoved, the kubelet's "gone while not exited" rule, and asks for a
//! relist, because an exit was missed.

use std::collections::{HashMap, HashSet, VecDeque};

use super::cgroup_path::{CgroupClass, CgroupPathError};
use super::event::{CgroupChange, Exec, Exit, KernelEvent, ProcessKey};
use super::index::{CGROUP2_HIERARCHY, ContainerIndex};
use crate::pleg::{ContainerId, EventKind, EventSource, PodLifecycleEvent, PodUid};

/// How long an OOM victim report is kept waiting for its process's exit (ns).
const OOM_VICTIM_MEMORY_NS: u64 = 10_000_000_000;

/// A process as the start-up scan sees it in `/proc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcInfo {
    pub pid: u32,
    pub ppid: u32,
    /// Start time in clock ticks since boot (`/proc/<pid>/stat` field 22).
    pub start_ticks: u64,
}

/// The main process of a container found already running: the process whose parent
/// is not in the container (the runtime's shim is), the oldest if several are.
pub fn choose_main(procs: &[ProcInfo]) -> Option<ProcInfo> {
    let pids: HashSet<u32> = procs.iter().map(|p| p.pid).collect();
    procs
        .iter()
        .filter(|p| !pids.contains(&p.ppid))
        .min_by_key(|p| (p.start_ticks, p.pid))
        .copied()
}

/// How the tracker knows a container's main process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MainProcess {
    /// Seen exec'ing: the exact start time.
    Exact(ProcessKey),
    /// Found by the start-up scan: the start time in clock ticks.
    Scanned { pid: u32, start_ticks: u64 },
}

#[derive(Clone, Debug)]
struct ContainerState {
    cgroup_id: u64,
    pod_uid: Option<PodUid>,
    main: Option<MainProcess>,
    died: bool,
}

/// What handling a record produced, besides lifecycle events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Notice {
    /// A task ran in a cgroup the index does not know: the caller rescans the tree
    /// and hands the record in again with [`Tracker::retry`].
    UnknownCgroup { cgroup_id: u64 },
    /// A configured root cgroup appeared: the kernel filter must learn its id.
    RootCreated {
        cgroup_id: u64,
        level: u32,
        path: String,
    },
    /// A configured root cgroup went away.
    RootRemoved { cgroup_id: u64, path: String },
    /// A cgroup path that is under a root but malformed.
    Malformed(CgroupPathError),
    /// State was lost (an exit never seen): the runtime must be relisted.
    RelistNeeded { reason: String },
}

/// Counters of the tracker, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrackerStats {
    pub execs_other: u64,
    pub exits_other: u64,
    pub unattributed: u64,
}

/// The kernel PLEG's state machine. Single-threaded: the reader thread owns it.
#[derive(Debug)]
pub struct Tracker {
    index: ContainerIndex,
    containers: HashMap<ContainerId, ContainerState>,
    sandboxes: HashSet<ContainerId>,
    roots: Vec<String>,
    oom_victims: VecDeque<(u32, u64)>,
    tick_ns: u64,
    pub stats: TrackerStats,
}

impl Tracker {
    /// `roots` are the configured root cgroup paths (`/kubepods`, ...);
    /// `ticks_per_second` is the kernel's USER_HZ (for `/proc` start times).
    pub fn new(roots: Vec<String>, ticks_per_second: u64) -> Self {
        Self {
            index: ContainerIndex::new(),
            containers: HashMap::new(),
            sandboxes: HashSet::new(),
            roots,
            oom_victims: VecDeque::new(),
            tick_ns: 1_000_000_000 / ticks_per_second.max(1),
            stats: TrackerStats::default(),
        }
    }

    pub fn index(&self) -> &ContainerIndex {
        &self.index
    }

    /// Marks an id as a pod sandbox (the runtime knows; the cgroup path does not).
    pub fn add_sandbox(&mut self, id: ContainerId) {
        self.sandboxes.insert(id);
    }

    /// Records a cgroup that existed before the agent started, with the processes
    /// in it (for a container cgroup). Returns the container's main process, if any.
    pub fn learn_existing(
        &mut self,
        hierarchy: u32,
        cgroup_id: u64,
        path: &str,
        procs: &[ProcInfo],
    ) -> Result<Option<ProcInfo>, CgroupPathError> {
        let Some(entry) = self.index.insert(hierarchy, cgroup_id, path)? else {
            return Ok(None);
        };
        if hierarchy != CGROUP2_HIERARCHY {
            return Ok(None);
        }
        let Some((id, pod, _nested)) = entry.container() else {
            return Ok(None);
        };
        let (id, pod) = (id.clone(), pod.cloned());
        let main = choose_main(procs);
        let state = self.containers.entry(id).or_insert(ContainerState {
            cgroup_id,
            pod_uid: pod,
            main: None,
            died: false,
        });
        if state.main.is_none() {
            state.main = main.map(|p| MainProcess::Scanned {
                pid: p.pid,
                start_ticks: p.start_ticks,
            });
        }
        Ok(main)
    }

    /// Handles one kernel record, appending lifecycle events to `events` and
    /// anything the caller must act on to `notices`.
    pub fn handle(
        &mut self,
        event: &KernelEvent,
        events: &mut Vec<PodLifecycleEvent>,
        notices: &mut Vec<Notice>,
    ) {
        self.handle_inner(event, events, notices, true);
    }

    /// Handles a record again after a rescan; an unknown cgroup is now counted as
    /// unattributed instead of reported.
    pub fn retry(
        &mut self,
        event: &KernelEvent,
        events: &mut Vec<PodLifecycleEvent>,
        notices: &mut Vec<Notice>,
    ) {
        self.handle_inner(event, events, notices, false);
    }

    fn handle_inner(
        &mut self,
        event: &KernelEvent,
        events: &mut Vec<PodLifecycleEvent>,
        notices: &mut Vec<Notice>,
        first_try: bool,
    ) {
        match event {
            KernelEvent::Exec(exec) => self.on_exec(exec, events, notices, first_try),
            KernelEvent::Exit(exit) => self.on_exit(exit, events, notices, first_try),
            KernelEvent::CgroupMkdir(change) => self.on_mkdir(change, notices),
            KernelEvent::CgroupRmdir(change) => self.on_rmdir(change, events, notices),
            KernelEvent::OomVictim { at_ns, tgid } => {
                while self
                    .oom_victims
                    .front()
                    .is_some_and(|(_, t)| at_ns.saturating_sub(*t) > OOM_VICTIM_MEMORY_NS)
                {
                    self.oom_victims.pop_front();
                }
                self.oom_victims.push_back((*tgid, *at_ns));
            }
        }
    }

    /// The container a task's cgroup belongs to, or a notice when unknown.
    fn container_of(
        &mut self,
        cgroup_id: u64,
        notices: &mut Vec<Notice>,
        first_try: bool,
    ) -> Option<ContainerId> {
        if let Some(entry) = self.index.get(CGROUP2_HIERARCHY, cgroup_id) {
            // Node- and pod-level cgroups hold no container.
            return entry.container().map(|(id, _, _)| id.clone());
        }
        if self.index.is_ignored(CGROUP2_HIERARCHY, cgroup_id) {
            return None;
        }
        if first_try {
            notices.push(Notice::UnknownCgroup { cgroup_id });
        } else {
            self.stats.unattributed += 1;
        }
        None
    }

    fn kinds(&self, id: &ContainerId) -> (EventKind, EventKind, EventKind) {
        if self.sandboxes.contains(id) {
            (
                EventKind::SandboxStarted,
                EventKind::SandboxDied,
                EventKind::SandboxRemoved,
            )
        } else {
            (
                EventKind::ContainerStarted,
                EventKind::ContainerDied,
                EventKind::ContainerRemoved,
            )
        }
    }

    fn on_exec(
        &mut self,
        exec: &Exec,
        events: &mut Vec<PodLifecycleEvent>,
        notices: &mut Vec<Notice>,
        first_try: bool,
    ) {
        let Some(id) = self.container_of(exec.cgroup_id, notices, first_try) else {
            return;
        };
        let (started, _, _) = self.kinds(&id);
        let tick_ns = self.tick_ns;
        let Some(state) = self.containers.get_mut(&id) else {
            return;
        };
        match state.main {
            None if !state.died && !is_runtime_reexec(&exec.filename) => {
                state.main = Some(MainProcess::Exact(exec.process));
                events.push(PodLifecycleEvent {
                    pod_uid: state.pod_uid.clone(),
                    kind: started,
                    container_id: Some(id),
                    at_ns: exec.at_ns,
                    source: EventSource::Kernel,
                    exit: None,
                    pid: Some(exec.process.pid),
                });
            }
            Some(main) if is_main(main, exec.process, tick_ns) => {
                // The main process exec'd again (`exec` in a shell): same container.
                state.main = Some(MainProcess::Exact(exec.process));
            }
            _ => self.stats.execs_other += 1,
        }
    }

    fn on_exit(
        &mut self,
        exit: &Exit,
        events: &mut Vec<PodLifecycleEvent>,
        notices: &mut Vec<Notice>,
        first_try: bool,
    ) {
        let Some(id) = self.container_of(exit.cgroup_id, notices, first_try) else {
            return;
        };
        let (_, died, _) = self.kinds(&id);
        let tick_ns = self.tick_ns;
        let oom_victim = self
            .oom_victims
            .iter()
            .any(|(tgid, _)| *tgid == exit.process.pid);
        let Some(state) = self.containers.get_mut(&id) else {
            return;
        };
        match state.main {
            Some(main) if !state.died && is_main(main, exit.process, tick_ns) => {
                state.died = true;
                let mut status = exit.status;
                status.oom_killed |= oom_victim;
                events.push(PodLifecycleEvent {
                    pod_uid: state.pod_uid.clone(),
                    kind: died,
                    container_id: Some(id),
                    at_ns: exit.at_ns,
                    source: EventSource::Kernel,
                    exit: Some(status),
                    pid: Some(exit.process.pid),
                });
            }
            _ => self.stats.exits_other += 1,
        }
    }

    fn on_mkdir(&mut self, change: &CgroupChange, notices: &mut Vec<Notice>) {
        if change.truncated {
            // A cut path could be misread (a partial id); the first task in this
            // cgroup finds it unknown and the rescan reads the full path from disk.
            return;
        }
        if change.hierarchy_id == CGROUP2_HIERARCHY && self.roots.contains(&change.path) {
            notices.push(Notice::RootCreated {
                cgroup_id: change.cgroup_id,
                level: change.level,
                path: change.path.clone(),
            });
        }
        match self
            .index
            .insert(change.hierarchy_id, change.cgroup_id, &change.path)
        {
            Ok(Some(entry)) if change.hierarchy_id == CGROUP2_HIERARCHY => {
                if let Some((id, pod, false)) = entry.container() {
                    let (id, pod) = (id.clone(), pod.cloned());
                    // The start-up scan may have learned this cgroup already (its
                    // mkdir was still in the ring buffer): keep what it found. A
                    // cgroup re-created under the same name is a new instance.
                    let known = self
                        .containers
                        .get(&id)
                        .is_some_and(|s| s.cgroup_id == change.cgroup_id);
                    if !known {
                        self.containers.insert(
                            id,
                            ContainerState {
                                cgroup_id: change.cgroup_id,
                                pod_uid: pod,
                                main: None,
                                died: false,
                            },
                        );
                    }
                }
            }
            Ok(_) => {}
            Err(e) => notices.push(Notice::Malformed(e)),
        }
    }

    fn on_rmdir(
        &mut self,
        change: &CgroupChange,
        events: &mut Vec<PodLifecycleEvent>,
        notices: &mut Vec<Notice>,
    ) {
        let removed = self.index.remove(change.hierarchy_id, change.cgroup_id);
        if change.hierarchy_id != CGROUP2_HIERARCHY {
            return;
        }
        if self.roots.contains(&change.path) {
            notices.push(Notice::RootRemoved {
                cgroup_id: change.cgroup_id,
                path: change.path.clone(),
            });
        }
        let Some(entry) = removed else { return };
        let CgroupClass::Container {
            id, nested: false, ..
        } = entry.class
        else {
            return;
        };
        let Some(state) = self.containers.remove(&id) else {
            return;
        };
        let (_, died, removed_kind) = self.kinds(&id);
        self.sandboxes.remove(&id);
        if state.main.is_some() && !state.died {
            events.push(PodLifecycleEvent {
                pod_uid: state.pod_uid.clone(),
                kind: died,
                container_id: Some(id.clone()),
                at_ns: change.at_ns,
                source: EventSource::Kernel,
                exit: None,
                pid: None,
            });
            notices.push(Notice::RelistNeeded {
                reason: format!(
                    "cgroup {} removed before its main process was seen to exit",
                    change.path
                ),
            });
        }
        events.push(PodLifecycleEvent {
            pod_uid: state.pod_uid,
            kind: removed_kind,
            container_id: Some(id),
            at_ns: change.at_ns,
            source: EventSource::Kernel,
            exit: None,
            pid: None,
        });
    }
}

/// Whether an exec is a container runtime re-executing itself rather than the
/// container's entrypoint: `/proc/self/exe`, or a sealed copy of its binary run
/// through a file descriptor (`/dev/fd/N`, `/proc/self/fd/N`, as runc 1.1 does
/// before it is moved out of the way). Such a process is never the main process.
pub fn is_runtime_reexec(filename: &str) -> bool {
    filename == "/proc/self/exe"
        || filename.starts_with("/dev/fd/")
        || filename.starts_with("/proc/self/fd/")
        || (filename.starts_with("/proc/") && filename.contains("/fd/"))
        || filename.starts_with("/memfd:")
}

fn is_main(main: MainProcess, process: ProcessKey, tick_ns: u64) -> bool {
    match main {
        MainProcess::Exact(key) => key == process,
        MainProcess::Scanned { pid, start_ticks } => {
            pid == process.pid && process.start_boottime_ns / tick_ns == start_ticks
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pleg::kernel::event::{decode, encode};
    use evpleg_events::{EVENT_CGROUP_MKDIR, EVENT_CGROUP_RMDIR, EXIT_FLAG_OOM_KILLED};

    const UID: &str = "1b4e28ba-2fa1-11d2-883f-0016d3cca427";

    fn cid(c: char) -> String {
        std::iter::repeat_n(c, 64).collect()
    }

    fn container_path(c: char) -> String {
        format!("/kubepods/besteffort/pod{UID}/{}", cid(c))
    }

    struct Harness {
        tracker: Tracker,
        events: Vec<PodLifecycleEvent>,
        notices: Vec<Notice>,
    }

    impl Harness {
        fn new() -> Self {
            Self {
                tracker: Tracker::new(vec!["/kubepods".into()], 100),
                events: Vec::new(),
                notices: Vec::new(),
            }
        }

        fn feed(&mut self, bytes: Vec<u8>) {
            let ev = decode(&bytes).unwrap();
            self.tracker
                .handle(&ev, &mut self.events, &mut self.notices);
        }

        fn take(&mut self) -> Vec<(EventKind, Option<i32>, bool)> {
            self.events
                .drain(..)
                .map(|e| {
                    (
                        e.kind,
                        e.exit.map(|x| x.code),
                        e.exit.is_some_and(|x| x.oom_killed),
                    )
                })
                .collect()
        }
    }

    #[test]
    fn start_exit_remove_of_a_container() {
        let mut h = Harness::new();
        h.feed(encode::cgroup(EVENT_CGROUP_MKDIR, 1, 0, 50, "/kubepods"));
        assert_eq!(
            h.notices,
            vec![Notice::RootCreated {
                cgroup_id: 50,
                level: 1,
                path: "/kubepods".into()
            }]
        );
        h.feed(encode::cgroup(
            EVENT_CGROUP_MKDIR,
            2,
            0,
            60,
            &format!("/kubepods/besteffort/pod{UID}"),
        ));
        h.feed(encode::cgroup(
            EVENT_CGROUP_MKDIR,
            3,
            0,
            70,
            &container_path('a'),
        ));
        h.feed(encode::exec(4, 1000, 555, 70, "/bin/sh"));
        // A child process and a second exec of another process: no container events.
        h.feed(encode::exec(5, 1001, 556, 70, "/bin/sleep"));
        h.feed(encode::exit(6, 1001, 556, 70, 0, 0));
        assert_eq!(h.take(), vec![(EventKind::ContainerStarted, None, false)]);
        h.feed(encode::exit(7, 1000, 555, 70, 0x700, 0));
        assert_eq!(h.take(), vec![(EventKind::ContainerDied, Some(7), false)]);
        h.feed(encode::cgroup(
            EVENT_CGROUP_RMDIR,
            8,
            0,
            70,
            &container_path('a'),
        ));
        assert_eq!(h.take(), vec![(EventKind::ContainerRemoved, None, false)]);
        assert_eq!(h.tracker.stats.execs_other, 1);
        assert_eq!(h.tracker.stats.exits_other, 1);
        assert!(
            !h.notices
                .iter()
                .any(|n| matches!(n, Notice::RelistNeeded { .. }))
        );
    }

    #[test]
    fn event_fields_name_the_pod_and_container() {
        let mut h = Harness::new();
        h.feed(encode::cgroup(
            EVENT_CGROUP_MKDIR,
            3,
            0,
            70,
            &container_path('a'),
        ));
        h.feed(encode::exec(4, 1000, 555, 70, "/bin/sh"));
        h.feed(encode::exit(9, 1000, 555, 70, 9, EXIT_FLAG_OOM_KILLED));
        let died = h.events.pop().unwrap();
        assert_eq!(died.pod_uid.unwrap().as_str(), UID);
        assert_eq!(died.container_id.unwrap().as_str(), cid('a'));
        assert_eq!(
            (died.at_ns, died.pid, died.source),
            (9, Some(1000), EventSource::Kernel)
        );
        let exit = died.exit.unwrap();
        assert_eq!(
            (exit.code, exit.signal, exit.oom_killed),
            (137, Some(9), true)
        );
    }

    #[test]
    fn reused_pid_is_not_the_main_process() {
        let mut h = Harness::new();
        h.feed(encode::cgroup(
            EVENT_CGROUP_MKDIR,
            1,
            0,
            70,
            &container_path('a'),
        ));
        h.feed(encode::exec(2, 1000, 555, 70, "/bin/sh"));
        // Same pid, another start time: a different process.
        h.feed(encode::exit(3, 1000, 999, 70, 0x100, 0));
        assert_eq!(h.take(), vec![(EventKind::ContainerStarted, None, false)]);
        h.feed(encode::exit(4, 1000, 555, 70, 0x100, 0));
        assert_eq!(h.take(), vec![(EventKind::ContainerDied, Some(1), false)]);
    }

    #[test]
    fn main_process_exec_again_is_not_a_new_start() {
        let mut h = Harness::new();
        h.feed(encode::cgroup(
            EVENT_CGROUP_MKDIR,
            1,
            0,
            70,
            &container_path('a'),
        ));
        h.feed(encode::exec(2, 1000, 555, 70, "/bin/sh"));
        h.feed(encode::exec(3, 1000, 555, 70, "/bin/sleep"));
        h.feed(encode::exit(4, 1000, 555, 70, 0, 0));
        assert_eq!(
            h.take(),
            vec![
                (EventKind::ContainerStarted, None, false),
                (EventKind::ContainerDied, Some(0), false)
            ]
        );
    }

    #[test]
    fn runtime_self_exec_is_not_the_main_process() {
        let mut h = Harness::new();
        h.feed(encode::cgroup(
            EVENT_CGROUP_MKDIR,
            1,
            0,
            70,
            &container_path('a'),
        ));
        h.feed(encode::exec(2, 900, 1, 70, "/proc/self/exe"));
        h.feed(encode::exit(3, 900, 1, 70, 0, 0));
        // runc 1.1 re-executes a sealed copy of itself through a descriptor.
        h.feed(encode::exec(3, 901, 1, 70, "/dev/fd/6"));
        h.feed(encode::exit(3, 901, 1, 70, 0, 0));
        h.feed(encode::exec(3, 902, 1, 70, "/proc/self/fd/7"));
        h.feed(encode::exec(4, 1000, 555, 70, "/pause"));
        assert_eq!(h.take(), vec![(EventKind::ContainerStarted, None, false)]);
    }

    #[test]
    fn nested_cgroup_processes_belong_to_the_container() {
        let mut h = Harness::new();
        h.feed(encode::cgroup(
            EVENT_CGROUP_MKDIR,
            1,
            0,
            70,
            &container_path('a'),
        ));
        h.feed(encode::cgroup(
            EVENT_CGROUP_MKDIR,
            2,
            0,
            71,
            &format!("{}/init.scope", container_path('a')),
        ));
        h.feed(encode::exec(3, 1000, 555, 71, "/sbin/init"));
        h.feed(encode::cgroup(
            EVENT_CGROUP_RMDIR,
            4,
            0,
            71,
            &format!("{}/init.scope", container_path('a')),
        ));
        assert_eq!(h.take(), vec![(EventKind::ContainerStarted, None, false)]);
    }

    #[test]
    fn removal_without_a_seen_exit_is_died_then_removed_and_a_relist() {
        let mut h = Harness::new();
        h.feed(encode::cgroup(
            EVENT_CGROUP_MKDIR,
            1,
            0,
            70,
            &container_path('a'),
        ));
        h.feed(encode::exec(2, 1000, 555, 70, "/bin/sh"));
        h.feed(encode::cgroup(
            EVENT_CGROUP_RMDIR,
            3,
            0,
            70,
            &container_path('a'),
        ));
        assert_eq!(
            h.take(),
            vec![
                (EventKind::ContainerStarted, None, false),
                (EventKind::ContainerDied, None, false),
                (EventKind::ContainerRemoved, None, false)
            ]
        );
        assert!(matches!(
            h.notices.last(),
            Some(Notice::RelistNeeded { .. })
        ));
    }

    #[test]
    fn unknown_cgroup_asks_for_a_rescan_then_counts() {
        let mut h = Harness::new();
        let exit = decode(&encode::exit(1, 5, 5, 4242, 0, 0)).unwrap();
        h.tracker.handle(&exit, &mut h.events, &mut h.notices);
        assert_eq!(h.notices, vec![Notice::UnknownCgroup { cgroup_id: 4242 }]);
        h.tracker.retry(&exit, &mut h.events, &mut h.notices);
        assert_eq!(h.tracker.stats.unattributed, 1);
        assert!(h.events.is_empty());
    }

    #[test]
    fn sandboxes_get_sandbox_events() {
        let mut h = Harness::new();
        h.tracker
            .add_sandbox(ContainerId::parse(&cid('e')).unwrap());
        h.feed(encode::cgroup(
            EVENT_CGROUP_MKDIR,
            1,
            0,
            70,
            &container_path('e'),
        ));
        h.feed(encode::exec(2, 1000, 555, 70, "/pause"));
        h.feed(encode::exit(3, 1000, 555, 70, 0, 0));
        h.feed(encode::cgroup(
            EVENT_CGROUP_RMDIR,
            4,
            0,
            70,
            &container_path('e'),
        ));
        let kinds: Vec<EventKind> = h.take().into_iter().map(|e| e.0).collect();
        assert_eq!(
            kinds,
            vec![
                EventKind::SandboxStarted,
                EventKind::SandboxDied,
                EventKind::SandboxRemoved
            ]
        );
    }

    #[test]
    fn truncated_paths_are_left_to_the_rescan() {
        let mut h = Harness::new();
        let long = format!(
            "/kubepods/besteffort/pod{UID}/{}{}",
            cid('a'),
            "/n".repeat(100)
        );
        h.feed(encode::cgroup(EVENT_CGROUP_MKDIR, 1, 0, 70, &long));
        h.feed(encode::exec(2, 1000, 555, 70, "/bin/sh"));
        assert_eq!(h.notices, vec![Notice::UnknownCgroup { cgroup_id: 70 }]);
    }

    #[test]
    fn v1_hierarchy_changes_update_the_index_only() {
        let mut h = Harness::new();
        h.feed(encode::cgroup(
            EVENT_CGROUP_MKDIR,
            1,
            7,
            70,
            &container_path('a'),
        ));
        h.feed(encode::cgroup(
            EVENT_CGROUP_RMDIR,
            2,
            7,
            70,
            &container_path('a'),
        ));
        assert!(h.take().is_empty());
        assert!(h.tracker.index().is_empty());
    }

    #[test]
    fn existing_container_gets_its_exit_code() {
        let mut h = Harness::new();
        let procs = [
            ProcInfo {
                pid: 2000,
                ppid: 1999,
                start_ticks: 300,
            },
            ProcInfo {
                pid: 2001,
                ppid: 2000,
                start_ticks: 301,
            },
        ];
        let main = h
            .tracker
            .learn_existing(0, 70, &container_path('a'), &procs)
            .unwrap();
        assert_eq!(main.unwrap().pid, 2000);
        // start_boottime 3.005 s = 300 ticks at USER_HZ 100.
        h.feed(encode::exit(5, 2001, 3_015_000_000, 70, 0, 0));
        h.feed(encode::exit(6, 2000, 3_005_000_000, 70, 0x200, 0));
        assert_eq!(h.take(), vec![(EventKind::ContainerDied, Some(2), false)]);
    }

    #[test]
    fn oom_victim_report_marks_the_exit() {
        let mut h = Harness::new();
        h.feed(encode::cgroup(
            EVENT_CGROUP_MKDIR,
            1,
            0,
            70,
            &container_path('a'),
        ));
        h.feed(encode::exec(2, 1000, 555, 70, "/bin/sh"));
        h.tracker.handle(
            &KernelEvent::OomVictim {
                at_ns: 3,
                tgid: 1000,
            },
            &mut h.events,
            &mut h.notices,
        );
        h.feed(encode::exit(4, 1000, 555, 70, 9, 0));
        assert_eq!(
            h.take().last(),
            Some(&(EventKind::ContainerDied, Some(137), true))
        );
    }

    #[test]
    fn choose_main_prefers_the_process_whose_parent_is_outside() {
        let procs = [
            ProcInfo {
                pid: 10,
                ppid: 5,
                start_ticks: 9,
            },
            ProcInfo {
                pid: 5,
                ppid: 1,
                start_ticks: 10,
            },
        ];
        assert_eq!(choose_main(&procs).unwrap().pid, 5);
        assert_eq!(choose_main(&[]), None);
    }
}
