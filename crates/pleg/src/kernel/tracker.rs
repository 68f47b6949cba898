//! The user-space side of the kernel PLEG: kernel records in, the kubelet's
//! lifecycle events out, following the contract of `docs/pleg.md` (clauses 2, 4
//! and 6).
//!
//! # The main-process rule
//! A container starts when its *main process* execs and dies when that process
//! exits; other processes in the container (children, `kubectl exec` sessions,
//! probes) start and die without container events. Each container's knowledge of
//! its main process is a [`MainState`] (see [`super::main_state`] for the table of
//! transitions):
//!
//! - **certain** in a container cgroup whose creation the tracker saw (or found
//!   holding only the runtime's init): the runtime's init exec'ing the
//!   entrypoint is the main process: an exec that is not a runtime re-exec
//!   ([`is_runtime_reexec`]), whose parent is outside the container (not a
//!   hook), by a process made before the first exit in the cgroup (not an exec
//!   session racing the start; see [`super::main_state`]); or when the
//!   runtime's own pid for the container is confirmed against `/proc`
//!   ([`Tracker::reconcile`]);
//! - **uncertain** in a container learned with processes already running (the
//!   start-up scan, a rescan): [`choose_main`] names only a candidate. Its exit is
//!   a hint (`PodSync` from the kernel), and no exec ever becomes the main process.
//!
//! Started and Died kinds are sent for a certain main process only, Died with its
//! exit status. Processes are identified by host pid *and* start time, so a reused
//! pid is not mistaken for the main process; pids are host pids, so the rule holds
//! with a private PID namespace, a pod-shared one and host PID alike.
//!
//! # Differences from the kubelet
//! The kubelet's generic PLEG derives events by diffing relists; this one derives
//! them from the kernel as they happen. ContainerChanged is never produced, as in
//! the kubelet. The Removed kinds are never produced either: a cgroup's removal is
//! not the runtime forgetting the container. A container cgroup removed before its
//! certain main process was seen to exit gives a hint and a relist request (an
//! exit was missed).

mod reconcile;

use std::collections::VecDeque;

use super::{FastMap as HashMap, FastSet as HashSet};

pub use reconcile::{ReconcileOutcome, Reconciling};

use super::RuntimeView;
use super::event::{CgroupChange, Exec, Exit, KernelEvent, ProcessKey};
use super::index::{CGROUP2_HIERARCHY, ContainerIndex};
use super::main_state::{Effect, ExecOrigin, MainId, MainState, Step, Transition};
use evpleg_core::cgroup_path::{CgroupClass, CgroupPathError};
use evpleg_core::ids::{ContainerId, PodUid};
use evpleg_core::lifecycle::{EventKind, EventSource, ExitStatus, PodLifecycleEvent};

/// How long an OOM victim report is kept waiting for its process's exit (ns).
const OOM_VICTIM_MEMORY_NS: u64 = 10_000_000_000;
/// At most this many OOM victim reports are kept (the oldest go first).
const OOM_VICTIMS_MAX: usize = 256;
/// A container the runtime does not list is forgotten only if it was learned at
/// least this long before the listing started: containerd adds a sandbox to the
/// list it serves only at the end of RunPodSandbox, after its cgroup exists and
/// its pause process runs.
pub const PRUNE_GRACE_NS: u64 = 10_000_000_000;

/// Whether cgroup `path` lies strictly below `root`.
fn is_below(path: &str, root: &str) -> bool {
    path.strip_prefix(root)
        .is_some_and(|rest| rest.starts_with('/'))
}

/// A process as a scan sees it in `/proc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcInfo {
    pub pid: u32,
    pub ppid: u32,
    /// Start time in clock ticks since boot (`/proc/<pid>/stat` field 22).
    pub start_ticks: u64,
    /// The runtime's init, waiting to exec the entrypoint ([`is_runtime_init`]).
    pub runtime_init: bool,
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

/// The state of a container learned by a scan with processes `procs`. `pending`
/// is the process of the exec record that made the tracker rescan: that exec is
/// handled next, so the process and its descendants count as not yet running.
/// A container holding nothing else than the runtime's init is fresh; one with
/// processes running is uncertain.
pub fn scanned_state(procs: &[ProcInfo], pending: Option<ProcessKey>, tick_ns: u64) -> MainState {
    let mut excluded: HashSet<u32> = procs
        .iter()
        .filter(|p| {
            pending.is_some_and(|k| {
                MainId::Ticks {
                    pid: p.pid,
                    start_ticks: p.start_ticks,
                }
                .matches(k, tick_ns)
            })
        })
        .map(|p| p.pid)
        .collect();
    loop {
        let before = excluded.len();
        let children: Vec<u32> = procs
            .iter()
            .filter(|p| excluded.contains(&p.ppid))
            .map(|p| p.pid)
            .collect();
        excluded.extend(children);
        if excluded.len() == before {
            break;
        }
    }
    let running: Vec<ProcInfo> = procs
        .iter()
        .filter(|p| !p.runtime_init && !excluded.contains(&p.pid))
        .copied()
        .collect();
    if running.is_empty() {
        MainState::Fresh
    } else {
        MainState::Uncertain(choose_main(&running).map(|p| MainId::Ticks {
            pid: p.pid,
            start_ticks: p.start_ticks,
        }))
    }
}

/// Whether a process name (`comm`) is an OCI runtime's init waiting in the
/// container's cgroup for the start: the runtime's own name, or one of the
/// stage names runc and youki give their init (`runc:[2:INIT]`). Exact: a
/// main process merely named `runc...` (`runc-exporter`) is not the runtime
/// (a prefix test took it for one after an agent restart, issue #25).
pub fn is_runtime_init(comm: &str) -> bool {
    matches!(comm, "runc" | "crun" | "youki")
        || comm.starts_with("runc:[")
        || comm.starts_with("youki:[")
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

#[derive(Clone, Debug)]
struct Container {
    cgroup_id: u64,
    pod_uid: Option<PodUid>,
    state: MainState,
    /// CLOCK_MONOTONIC ns when the tracker learned it.
    learned_at_ns: u64,
    /// While `Fresh`: the runtime's init was made before this time (boot
    /// time, ns), so an exec from outside by a process made at or after it is
    /// an exec session, not the init ([`ExecOrigin::Joined`]). The first exit
    /// read in the cgroup sets it (runc's and youki's intermediate stages exit
    /// there once they have made the init; hooks, the init's children, exit
    /// after it), or a scan that found the runtime's init waiting there (the
    /// end of the newest one's start tick). `None`: nothing bounds it yet.
    init_born_by: Option<u64>,
}

/// What handling a record produced besides its lifecycle events.
#[derive(Debug, Default)]
pub struct Output {
    pub events: Vec<PodLifecycleEvent>,
    /// State was lost (an exit never seen): the runtime must be relisted.
    pub relists: Vec<String>,
    /// Cgroups (by id) under a root whose paths are malformed.
    pub malformed: Vec<(u64, CgroupPathError)>,
}

/// Whether a record could be attributed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handled {
    Done,
    /// A task ran in a cgroup the index does not know: the caller may rescan the
    /// tree and hand the record in again.
    UnknownCgroup {
        cgroup_id: u64,
    },
}

/// Counters of the tracker, for metrics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrackerStats {
    pub execs_other: u64,
    pub exits_other: u64,
    /// PodSync hints sent for exits of uncertain main processes and removals.
    pub hints: u64,
    /// Container cgroups removed before their certain main death was seen.
    pub removed_before_death: u64,
    /// Main processes made certain by the runtime's pid.
    pub confirmed: u64,
    /// Certain main processes replaced by the runtime's different pid.
    pub corrected: u64,
    /// Runtime pids not found alive in the container's cgroup.
    pub unconfirmed: u64,
    /// Containers forgotten because the runtime no longer lists them.
    pub pruned: u64,
    /// Containers whose certainty ended because records were lost.
    pub demoted: u64,
    /// Kernel deaths the runtime contradicted: the main process is unknown again.
    pub contradicted: u64,
}

/// Records in `by_pod` that `id` is held for `pod` (a free function, so that
/// it can be called while another field of the tracker is borrowed).
fn link(by_pod: &mut HashMap<PodUid, HashSet<ContainerId>>, pod: &PodUid, id: &ContainerId) {
    by_pod.entry(pod.clone()).or_default().insert(id.clone());
}

/// Containers forgotten with their cgroup, with when, expired in the order they
/// were removed: expiring costs what expires, not what is kept (at 1 000
/// deaths a second, ten seconds' worth are kept and a pod's view comes after
/// each death).
#[derive(Debug, Default)]
struct Removed {
    at: HashMap<ContainerId, u64>,
    order: VecDeque<(u64, ContainerId)>,
}

impl Removed {
    fn insert(&mut self, id: ContainerId, at_ns: u64) {
        self.order.push_back((at_ns, id.clone()));
        self.at.insert(id, at_ns);
    }

    fn contains(&self, id: &ContainerId) -> bool {
        self.at.contains_key(id)
    }

    fn len(&self) -> usize {
        self.at.len()
    }

    /// Forgets what was removed before `ns`. One removed out of order (two
    /// CPUs' records) waits for those removed before it in the queue.
    fn expire_before(&mut self, ns: u64) {
        while let Some((at, _)) = self.order.front()
            && *at < ns
        {
            let (at, id) = self.order.pop_front().expect("just seen");
            // Removed again since: the later removal's entry expires it.
            if self.at.get(&id) == Some(&at) {
                self.at.remove(&id);
            }
        }
    }
}

/// OOM victims reported by the kernel, waiting for their process's exit; bounded
/// in time and number.
#[derive(Debug, Default)]
struct OomVictims(VecDeque<(u32, u64)>);

impl OomVictims {
    fn expire(&mut self, now_ns: u64) {
        while self
            .0
            .front()
            .is_some_and(|(_, t)| now_ns.saturating_sub(*t) > OOM_VICTIM_MEMORY_NS)
        {
            self.0.pop_front();
        }
    }

    fn record(&mut self, tgid: u32, at_ns: u64) {
        self.expire(at_ns);
        if self.0.len() >= OOM_VICTIMS_MAX {
            self.0.pop_front();
        }
        self.0.push_back((tgid, at_ns));
    }

    /// Whether the process `tgid` that started at `start_boottime_ns` was
    /// reported as a victim (the report is consumed). A report made before the
    /// process started is another process's, whose pid was reused (its exit
    /// record lost): `boot_offset_ns` is CLOCK_BOOTTIME minus CLOCK_MONOTONIC
    /// when the tracker started (it only grows, so a true victim started after
    /// a suspend may be missed, never a reused pid matched; the exit record's
    /// own OOM flag still tells).
    fn take(&mut self, tgid: u32, start_boottime_ns: u64, at_ns: u64, boot_offset_ns: u64) -> bool {
        self.expire(at_ns);
        let matching = |(t, reported): &(u32, u64)| {
            *t == tgid && start_boottime_ns <= reported.saturating_add(boot_offset_ns)
        };
        match self.0.iter().position(matching) {
            Some(i) => {
                self.0.remove(i);
                true
            }
            None => false,
        }
    }
}

/// The kernel PLEG's per-container state. Single-threaded: the reader thread owns
/// it.
#[derive(Debug)]
pub struct Tracker {
    index: ContainerIndex,
    containers: HashMap<ContainerId, Container>,
    /// Ids the runtime reports as sandboxes, with their pod when known.
    sandboxes: HashMap<ContainerId, Option<PodUid>>,
    /// Running containers the runtime lists whose cgroup a rescan did not find.
    unfound: HashMap<ContainerId, PodUid>,
    /// Containers the tracker forgot (their cgroup removed), with when: a view
    /// listed about then may still show one running (the runtime learns of
    /// its death after the kernel), which is neither unfound nor a reason to
    /// rescan. Kept for the prune grace after the removal.
    removed: Removed,
    /// The ids `containers`, `sandboxes` and `unfound` hold for each pod (a
    /// superset: removals leave them until that pod's next reconcile or the
    /// next full one), so that a pod's reconcile costs that pod's containers.
    by_pod: HashMap<PodUid, HashSet<ContainerId>>,
    oom_victims: OomVictims,
    tick_ns: u64,
    /// [`PRUNE_GRACE_NS`], changed by tests.
    prune_grace_ns: u64,
    /// CLOCK_BOOTTIME minus CLOCK_MONOTONIC at the start (OOM victims).
    boot_offset_ns: u64,
    /// When records were last found lost (CLOCK_MONOTONIC ns): a cgroup made
    /// before then may have lost a record, it is not `Fresh`.
    lost_before_ns: u64,
    /// Roots the kernel filter took after the programs were loaded, with when
    /// (CLOCK_MONOTONIC ns): tasks below one were not reported before then,
    /// so a cgroup made below it before then is not `Fresh` either. One entry
    /// per configured root at most.
    roots_opened: Vec<(String, u64)>,
    pub stats: TrackerStats,
}

impl Tracker {
    /// `ticks_per_second` is the kernel's USER_HZ (for `/proc` start times).
    pub fn new(ticks_per_second: u64) -> Self {
        Self {
            index: ContainerIndex::new(),
            containers: HashMap::default(),
            sandboxes: HashMap::default(),
            unfound: HashMap::default(),
            removed: Removed::default(),
            by_pod: HashMap::default(),
            // Room for every victim kept: recording one allocates nothing.
            oom_victims: OomVictims(VecDeque::with_capacity(OOM_VICTIMS_MAX)),
            tick_ns: 1_000_000_000 / ticks_per_second.max(1),
            prune_grace_ns: PRUNE_GRACE_NS,
            boot_offset_ns: evpleg_core::clock::boottime_offset_ns(),
            lost_before_ns: 0,
            roots_opened: Vec::new(),
            stats: TrackerStats::default(),
        }
    }

    /// Sets CLOCK_BOOTTIME minus CLOCK_MONOTONIC (models without suspend: 0).
    #[cfg(test)]
    pub(crate) fn set_boot_offset(&mut self, ns: u64) {
        self.boot_offset_ns = ns;
    }

    pub fn index(&self) -> &ContainerIndex {
        &self.index
    }

    /// The main-process state of a container, if the tracker knows it.
    pub fn main_state(&self, id: &ContainerId) -> Option<MainState> {
        self.containers.get(id).map(|c| c.state)
    }

    /// How many containers, sandbox marks, unfound ids and removed ids (kept
    /// for the prune grace) are kept (memory).
    pub fn sizes(&self) -> (usize, usize, usize, usize) {
        (
            self.containers.len(),
            self.sandboxes.len(),
            self.unfound.len(),
            self.removed.len(),
        )
    }

    /// How many OOM victim reports are kept.
    pub fn oom_victims_len(&self) -> usize {
        self.oom_victims.0.len()
    }

    fn insert_container(&mut self, id: ContainerId, c: Container) {
        if let Some(pod) = &c.pod_uid {
            link(&mut self.by_pod, pod, &id);
        }
        self.containers.insert(id, c);
    }

    /// Marks an id as a pod sandbox (the runtime knows; the cgroup path does not).
    /// [`Tracker::reconcile`] does this for every sandbox a view lists.
    pub fn add_sandbox(&mut self, id: ContainerId) {
        self.sandboxes.entry(id).or_insert(None);
    }

    /// Records a cgroup found by a scan at `now_ns`, with the processes in it (for
    /// a container cgroup; see [`scanned_state`] for `pending`). Returns whether
    /// the cgroup was new to the index.
    pub fn learn_existing(
        &mut self,
        cgroup_id: u64,
        path: &str,
        procs: &[ProcInfo],
        pending: Option<ProcessKey>,
        now_ns: u64,
    ) -> Result<bool, CgroupPathError> {
        if self.index.get(cgroup_id).is_some() || self.index.is_ignored(cgroup_id) {
            return Ok(false);
        }
        let Some(entry) = self.index.insert(cgroup_id, path, now_ns)? else {
            return Ok(true);
        };
        let Some((id, pod, false)) = entry.container() else {
            return Ok(true);
        };
        let (id, pod) = (id.clone(), pod.cloned());
        self.unfound.remove(&id);
        let state = scanned_state(procs, pending, self.tick_ns);
        let init_born_by = procs
            .iter()
            .filter(|p| p.runtime_init)
            .map(|p| (p.start_ticks + 1) * self.tick_ns)
            .max()
            .filter(|_| state == MainState::Fresh);
        let known = self
            .containers
            .get(&id)
            .is_some_and(|c| c.cgroup_id == cgroup_id);
        if !known {
            self.insert_container(
                id,
                Container {
                    cgroup_id,
                    pod_uid: pod,
                    state,
                    learned_at_ns: now_ns,
                    init_born_by,
                },
            );
        }
        Ok(true)
    }

    /// Handles one kernel record.
    pub fn handle(&mut self, event: &KernelEvent, out: &mut Output) -> Handled {
        match event {
            KernelEvent::Exec(exec) => self.on_exec(exec, out),
            KernelEvent::Exit(exit) => self.on_exit(exit, out),
            KernelEvent::CgroupMkdir(change) => {
                self.on_mkdir(change, out);
                Handled::Done
            }
            KernelEvent::CgroupRmdir(change) => {
                self.on_rmdir(change, out);
                Handled::Done
            }
            KernelEvent::OomVictim { at_ns, tgid } => {
                self.oom_victims.record(*tgid, *at_ns);
                Handled::Done
            }
        }
    }

    /// The container a task's cgroup belongs to (`Ok(None)`: a known cgroup that
    /// holds no container, or a container the tracker does not follow).
    /// Borrowed: the records of a container's other processes, most of them,
    /// are handled without an allocation.
    fn container_of(&self, cgroup_id: u64) -> Result<Option<&ContainerId>, Handled> {
        if let Some(entry) = self.index.get(cgroup_id) {
            // Node- and pod-level cgroups hold no container.
            return Ok(entry
                .container()
                .map(|(id, _, _)| id)
                .filter(|id| self.containers.contains_key(*id)));
        }
        if self.index.is_ignored(cgroup_id) {
            return Ok(None);
        }
        Err(Handled::UnknownCgroup { cgroup_id })
    }

    /// Whether applying `view` after `event` rather than before changes
    /// nothing for either: `view` is one pod's, and the record belongs to a
    /// container the tracker follows, of another pod, that the view does not
    /// list (a pod's reconcile reads and changes that pod's containers, marks
    /// and cgroups only). A record of an unknown cgroup, of no container or
    /// of a container whose pod is not known yet waits for the view, as does
    /// an OOM victim's.
    pub fn view_may_follow(&self, event: &KernelEvent, view: &RuntimeView) -> bool {
        let Some(scope) = &view.scope else {
            return false;
        };
        let cgroup_id = match event {
            KernelEvent::Exec(e) => e.cgroup_id,
            KernelEvent::Exit(e) => e.cgroup_id,
            KernelEvent::CgroupMkdir(c) | KernelEvent::CgroupRmdir(c) => c.cgroup_id,
            KernelEvent::OomVictim { .. } => return false,
        };
        let Some((id, _, _)) = self.index.get(cgroup_id).and_then(|e| e.container()) else {
            return false;
        };
        (self.containers.get(id)).is_some_and(|c| {
            c.pod_uid.as_ref().is_some_and(|pod| pod != scope)
                && !view.containers.iter().any(|listed| listed.id == *id)
        })
    }

    /// A step that changes nothing and reports nothing (another process's exec
    /// or exit): counted only, nothing cloned.
    fn count_unchanged(&mut self, transition: Transition) {
        match transition {
            Transition::OtherExec => self.stats.execs_other += 1,
            Transition::OtherExit => self.stats.exits_other += 1,
            _ => {}
        }
    }

    fn kinds(&self, id: &ContainerId) -> (EventKind, EventKind) {
        if self.sandboxes.contains_key(id) {
            (EventKind::SandboxStarted, EventKind::SandboxDied)
        } else {
            (EventKind::ContainerStarted, EventKind::ContainerDied)
        }
    }

    /// Applies a transition's step to container `id` and reports its effect.
    fn apply(
        &mut self,
        id: &ContainerId,
        step: Step,
        at_ns: u64,
        exit: Option<ExitStatus>,
        out: &mut Output,
    ) {
        let (started, died) = self.kinds(id);
        // The pod is cloned only for an event to report.
        let pod_uid = match step.next {
            Some(next) => {
                let Some(c) = self.containers.get_mut(id) else {
                    return;
                };
                c.state = next;
                match step.effect {
                    Effect::None => None,
                    _ => c.pod_uid.clone(),
                }
            }
            None => {
                let Some((key, c)) = self.containers.remove_entry(id) else {
                    return;
                };
                self.sandboxes.remove(id);
                self.removed.insert(key, at_ns);
                c.pod_uid
            }
        };
        match step.transition {
            Transition::OtherExec => self.stats.execs_other += 1,
            Transition::OtherExit => self.stats.exits_other += 1,
            Transition::RemovedBeforeDeath => self.stats.removed_before_death += 1,
            _ => {}
        }
        let event = |kind, exit, pid| PodLifecycleEvent {
            pod_uid: pod_uid.clone(),
            kind,
            container_id: Some(id.clone()),
            at_ns,
            source: EventSource::Kernel,
            exit,
            pid,
        };
        match step.effect {
            Effect::None => {}
            Effect::Started(pid) => out.events.push(event(started, None, Some(pid))),
            Effect::Died(pid) => out.events.push(event(died, exit, Some(pid))),
            Effect::Hint => {
                self.stats.hints += 1;
                out.events.push(event(EventKind::PodSync, None, None));
            }
            Effect::HintAndRelist => {
                self.stats.hints += 1;
                out.events.push(event(EventKind::PodSync, None, None));
                out.relists.push(format!(
                    "cgroup of container {id} removed before its main process was seen to exit"
                ));
            }
        }
    }

    fn on_exec(&mut self, exec: &Exec, out: &mut Output) -> Handled {
        let id = match self.container_of(exec.cgroup_id) {
            Ok(Some(id)) => id,
            Ok(None) => return Handled::Done,
            Err(unknown) => return unknown,
        };
        let state = self.containers[id].state;
        let step = state.exec(exec.process, self.exec_origin(exec, id), self.tick_ns);
        if step.next == Some(state) && step.effect == Effect::None {
            self.count_unchanged(step.transition);
            return Handled::Done;
        }
        let id = id.clone();
        self.apply(&id, step, exec.at_ns, None, out);
        Handled::Done
    }

    /// Who exec'd in container `id`: the runtime's init (its parent outside the
    /// container, made before the container's bound), an exec session (its
    /// parent outside, made after the init), a process inside it (a hook, a
    /// child), the runtime re-executing itself, or unknown (a kernel read
    /// failed).
    fn exec_origin(&self, exec: &Exec, id: &ContainerId) -> ExecOrigin {
        if exec.read_error || exec.parent_cgroup_id == 0 {
            return ExecOrigin::Unread;
        }
        if is_runtime_reexec(exec.filename.as_str()) {
            return ExecOrigin::RuntimeReexec;
        }
        let parent_inside = exec.parent_cgroup_id == exec.cgroup_id
            || self
                .index
                .get(exec.parent_cgroup_id)
                .and_then(|e| e.container())
                .is_some_and(|(c, _, _)| c == id);
        let after_init = self.containers[id]
            .init_born_by
            .is_some_and(|bound| exec.process.start_boottime_ns >= bound);
        if parent_inside {
            ExecOrigin::Inside
        } else if after_init {
            ExecOrigin::Joined
        } else {
            ExecOrigin::Outside
        }
    }

    /// Whether `exec` would make its container's main process certain (a
    /// `Fresh` container's entrypoint): the reader then checks first that no
    /// record was lost before it.
    pub fn exec_would_start(&self, exec: &Exec) -> bool {
        match self.container_of(exec.cgroup_id) {
            Ok(Some(id)) => {
                self.containers[id].state == MainState::Fresh
                    && self.exec_origin(exec, id) == ExecOrigin::Outside
            }
            _ => false,
        }
    }

    /// Records were lost (a full ring buffer), as the kernel's drop counter
    /// read at `noticed_at_ns` says: every container whose certainty rested on
    /// seeing all of its records is demoted (see [`MainState::records_lost`])
    /// until the runtime's pid confirms its main process, and so is every
    /// container whose mkdir is still in the ring, written before that read (a
    /// record of it after its mkdir may be the lost one). Returns how many
    /// known containers were demoted.
    pub fn records_lost(&mut self, noticed_at_ns: u64) -> usize {
        self.lost_before_ns = self.lost_before_ns.max(noticed_at_ns);
        self.demote(|_, _| true)
    }

    /// Demotes every container `which` selects (by its entry and its path, if
    /// indexed) as after lost records ([`MainState::records_lost`]); returns
    /// how many were.
    fn demote(&mut self, which: impl Fn(&Container, Option<&str>) -> bool) -> usize {
        let mut demoted = 0;
        for c in self.containers.values_mut() {
            let path = self.index.get(c.cgroup_id).map(|e| e.path.as_str());
            if !which(c, path) {
                continue;
            }
            let step = c.state.records_lost();
            if step.transition == Transition::Demoted
                && let Some(next) = step.next
            {
                c.state = next;
                demoted += 1;
            }
        }
        self.stats.demoted += demoted as u64;
        demoted
    }

    /// The kernel filter took `root` at `at_ns`, after the programs were
    /// loaded (a root made, or found, since): tasks below it went unreported
    /// until then. Containers already known below it are demoted as after lost
    /// records, and a cgroup below it whose mkdir was written before then is
    /// not `Fresh` when that mkdir is read (a record of it may be the one the
    /// filter held back). Returns how many known containers were demoted.
    pub fn filter_opened(&mut self, root: &str, at_ns: u64) -> usize {
        let root = root.trim_end_matches('/');
        match self.roots_opened.iter_mut().find(|(r, _)| r == root) {
            Some((_, t)) => *t = (*t).max(at_ns),
            None => self.roots_opened.push((root.to_owned(), at_ns)),
        }
        self.demote(|_, path| path.is_some_and(|p| is_below(p, root)))
    }

    /// A scan found the cgroup of container `cgroup_id` empty although
    /// processes ran in it, none of which the tracker saw: a `Fresh` container
    /// is demoted (its main process's exit was not seen). Returns whether it
    /// was.
    pub fn exited_unseen(&mut self, cgroup_id: u64) -> bool {
        self.demote(|c, _| c.cgroup_id == cgroup_id) > 0
    }

    /// The latest time before which a cgroup made at `path` may have lost a
    /// record: records found lost, or its root reaching the filter late.
    fn lost_before(&self, path: &str) -> u64 {
        self.roots_opened
            .iter()
            .filter(|(root, _)| is_below(path, root))
            .map(|(_, at)| *at)
            .fold(self.lost_before_ns, u64::max)
    }

    fn on_exit(&mut self, exit: &Exit, out: &mut Output) -> Handled {
        self.bound_init(exit);
        let id = match self.container_of(exit.cgroup_id) {
            Ok(Some(id)) => id,
            Ok(None) => return Handled::Done,
            Err(unknown) => return unknown,
        };
        let state = self.containers[id].state;
        let step = state.exit(exit.process, exit.read_error, self.tick_ns);
        if step.next == Some(state) && step.effect == Effect::None {
            self.count_unchanged(step.transition);
            return Handled::Done;
        }
        let id = id.clone();
        let mut status = exit.status;
        if step.transition == Transition::MainExit {
            status.oom_killed |= self.oom_victims.take(
                exit.process.pid,
                exit.process.start_boottime_ns,
                exit.at_ns,
                self.boot_offset_ns,
            );
        }
        self.apply(&id, step, exit.at_ns, Some(status), out);
        Handled::Done
    }

    /// The first exit read in a fresh container's cgroup bounds its init's
    /// start time (see `Container::init_born_by`). Field by field, so that no
    /// id is cloned: exits of fresh containers are the runtime's stages.
    fn bound_init(&mut self, exit: &Exit) {
        let Some((id, _, _)) = self
            .index
            .get(exit.cgroup_id)
            .and_then(|entry| entry.container())
        else {
            return;
        };
        if let Some(c) = self.containers.get_mut(id)
            && c.state == MainState::Fresh
            && c.init_born_by.is_none()
            && c.cgroup_id == exit.cgroup_id
        {
            c.init_born_by = Some(exit.at_ns.saturating_add(self.boot_offset_ns));
        }
    }

    fn on_mkdir(&mut self, change: &CgroupChange, out: &mut Output) {
        if change.truncated || change.hierarchy_id != CGROUP2_HIERARCHY {
            // A cut path could be misread (a partial id); the first task in this
            // cgroup finds it unknown and the rescan reads the full path from disk.
            return;
        }
        match self
            .index
            .insert(change.cgroup_id, &change.path, change.at_ns)
        {
            Ok(Some(entry)) => {
                let Some((id, pod, false)) = entry.container() else {
                    return;
                };
                let (id, pod) = (id.clone(), pod.cloned());
                self.unfound.remove(&id);
                let lost_before = self.lost_before(&change.path);
                match self.containers.get(&id) {
                    // Learned by a scan before this record was read: every record
                    // of the cgroup follows this one in the ring buffer.
                    // (Unless records were lost after it.)
                    Some(c) if c.cgroup_id == change.cgroup_id => {
                        if change.at_ns > lost_before {
                            let step = c.state.history_in_ring();
                            self.apply(&id, step, change.at_ns, None, out);
                        }
                    }
                    // New, or a cgroup re-created under the same name; made
                    // before records were found lost, one of its own may be.
                    _ => {
                        let state = if change.at_ns > lost_before {
                            MainState::Fresh
                        } else {
                            MainState::Uncertain(None)
                        };
                        self.insert_container(
                            id,
                            Container {
                                cgroup_id: change.cgroup_id,
                                pod_uid: pod,
                                state,
                                learned_at_ns: change.at_ns,
                                init_born_by: None,
                            },
                        );
                    }
                }
            }
            Ok(None) => {}
            Err(e) => out.malformed.push((change.cgroup_id, e)),
        }
    }

    fn on_rmdir(&mut self, change: &CgroupChange, out: &mut Output) {
        if change.hierarchy_id != CGROUP2_HIERARCHY {
            return;
        }
        let Some(entry) = self.index.remove(change.cgroup_id) else {
            return;
        };
        let CgroupClass::Container {
            id, nested: false, ..
        } = entry.class
        else {
            return;
        };
        let Some(c) = self.containers.get(&id) else {
            return;
        };
        if c.cgroup_id != change.cgroup_id {
            return;
        }
        let step = c.state.removed();
        self.apply(&id, step, change.at_ns, None, out);
    }
}

#[cfg(test)]
mod tests;
