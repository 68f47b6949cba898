//! The tracker fed with the exact bytes the kernel writes, and the runtime's views.

use std::collections::HashMap;

use super::*;
use crate::kernel::event::{decode, encode};
use crate::kernel::proc::{ProcIdentity, Reconciliation};
use crate::kernel::{RuntimeContainer, RuntimeView};
use evpleg_events::{EVENT_CGROUP_MKDIR, EVENT_CGROUP_RMDIR, EXIT_FLAG_OOM_KILLED};

mod prune;
mod trust;

const UID: &str = "1b4e28ba-2fa1-11d2-883f-0016d3cca427";
const UID2: &str = "2b4e28ba-2fa1-11d2-883f-0016d3cca427";

fn cid(c: char) -> String {
    std::iter::repeat_n(c, 64).collect()
}

fn id(c: char) -> ContainerId {
    ContainerId::parse(&cid(c)).unwrap()
}

fn pod(uid: &str) -> PodUid {
    PodUid::parse(uid).unwrap()
}

fn container_path(c: char) -> String {
    format!("/kubepods/besteffort/pod{UID}/{}", cid(c))
}

fn pod2_path(c: char) -> String {
    format!("/kubepods/besteffort/pod{UID2}/{}", cid(c))
}

/// (kind, exit code, OOM, pid)
type Seen = (EventKind, Option<i32>, bool, Option<u32>);

struct Harness {
    tracker: Tracker,
    out: Output,
    unknown: Vec<u64>,
    relists: usize,
}

impl Harness {
    fn new() -> Self {
        let mut tracker = Tracker::new(100);
        tracker.prune_grace_ns = 0;
        // No suspend: a start time in CLOCK_BOOTTIME is a monotonic one.
        tracker.boot_offset_ns = 0;
        Self {
            tracker,
            out: Output::default(),
            unknown: Vec::new(),
            relists: 0,
        }
    }

    fn feed(&mut self, bytes: Vec<u8>) {
        let ev = decode(&bytes).unwrap();
        self.handle(&ev);
    }

    fn handle(&mut self, ev: &KernelEvent) {
        if let Handled::UnknownCgroup { cgroup_id } = self.tracker.handle(ev, &mut self.out) {
            self.unknown.push(cgroup_id);
        }
        self.relists += self.out.relists.drain(..).count();
    }

    fn mkdir(&mut self, cgroup_id: u64, path: &str) {
        self.feed(encode::cgroup(EVENT_CGROUP_MKDIR, 1, 0, cgroup_id, path));
    }

    fn rmdir(&mut self, at: u64, cgroup_id: u64, path: &str) {
        self.feed(encode::cgroup(EVENT_CGROUP_RMDIR, at, 0, cgroup_id, path));
    }

    fn take(&mut self) -> Vec<Seen> {
        self.out
            .events
            .drain(..)
            .map(|e| {
                assert_eq!(e.source, EventSource::Kernel);
                if e.kind == EventKind::PodSync {
                    assert_eq!(e.exit, None, "a hint carries no exit: {e:?}");
                }
                (
                    e.kind,
                    e.exit.map(|x| x.code),
                    e.exit.is_some_and(|x| x.oom_killed),
                    e.pid,
                )
            })
            .collect()
    }

    fn reconcile(&mut self, view: RuntimeView, mains: &[(char, ProcIdentity)]) -> ReconcileOutcome {
        let r = Reconciliation {
            view,
            mains: mains.iter().map(|(c, p)| (id(*c), p.clone())).collect(),
        };
        self.tracker.reconcile(&r, false)
    }
}

const STARTED: EventKind = EventKind::ContainerStarted;
const DIED: EventKind = EventKind::ContainerDied;
const SYNC: EventKind = EventKind::PodSync;

fn running(c: char, uid: &str, pid: Option<u32>) -> RuntimeContainer {
    RuntimeContainer {
        id: id(c),
        pod: pod(uid),
        sandbox: false,
        running: true,
        pid,
        contradicted: false,
    }
}

fn view(listed_at_ns: u64, scope: Option<&str>, containers: Vec<RuntimeContainer>) -> RuntimeView {
    RuntimeView {
        listed_at_ns,
        scope: scope.map(pod),
        containers,
    }
}

/// A live process in `path`, started at `start_ticks` (10 ms ticks).
fn alive(pid: u32, start_ticks: u64, path: &str) -> ProcIdentity {
    ProcIdentity {
        pid,
        start_ticks,
        cgroup: path.to_owned(),
    }
}

fn proc(pid: u32, ppid: u32, start_ticks: u64) -> ProcInfo {
    ProcInfo {
        pid,
        ppid,
        start_ticks,
        runtime_init: false,
    }
}

#[test]
fn start_exit_and_removal_of_a_container() {
    let mut h = Harness::new();
    h.mkdir(50, "/kubepods");
    h.mkdir(60, &format!("/kubepods/besteffort/pod{UID}"));
    h.mkdir(70, &container_path('a'));
    h.feed(encode::exec(4, 1000, 555, 70, "/bin/sh"));
    // A child process and its exec: no container events.
    h.feed(encode::exec(5, 1001, 556, 70, "/bin/sleep"));
    h.feed(encode::exit(6, 1001, 556, 70, 0, 0));
    assert_eq!(h.take(), vec![(STARTED, None, false, Some(1000))]);
    h.feed(encode::exit(7, 1000, 555, 70, 0x700, 0));
    assert_eq!(h.take(), vec![(DIED, Some(7), false, Some(1000))]);
    // The cgroup's removal is not the runtime forgetting the container: no
    // Removed from the kernel, and nothing was lost.
    h.rmdir(8, 70, &container_path('a'));
    assert_eq!(h.take(), vec![]);
    assert_eq!(h.relists, 0);
    assert_eq!(
        (h.tracker.stats.execs_other, h.tracker.stats.exits_other),
        (1, 1)
    );
    assert_eq!(h.tracker.main_state(&id('a')), None, "forgotten");
}

#[test]
fn event_fields_name_the_pod_and_container() {
    let mut h = Harness::new();
    h.mkdir(70, &container_path('a'));
    h.feed(encode::exec(4, 1000, 555, 70, "/bin/sh"));
    h.feed(encode::exit(9, 1000, 555, 70, 9, EXIT_FLAG_OOM_KILLED));
    let died = h.out.events.pop().unwrap();
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
    h.mkdir(70, &container_path('a'));
    h.feed(encode::exec(2, 1000, 555, 70, "/bin/sh"));
    // Same pid, another start time: a different process.
    h.feed(encode::exit(3, 1000, 999, 70, 0x100, 0));
    assert_eq!(h.take(), vec![(STARTED, None, false, Some(1000))]);
    h.feed(encode::exit(4, 1000, 555, 70, 0x100, 0));
    assert_eq!(h.take(), vec![(DIED, Some(1), false, Some(1000))]);
}

#[test]
fn main_process_exec_again_is_not_a_new_start() {
    let mut h = Harness::new();
    h.mkdir(70, &container_path('a'));
    h.feed(encode::exec(2, 1000, 555, 70, "/bin/sh"));
    h.feed(encode::exec(3, 1000, 555, 70, "/bin/sleep"));
    h.feed(encode::exit(4, 1000, 555, 70, 0, 0));
    // A duplicated exit record is not a second death.
    h.feed(encode::exit(4, 1000, 555, 70, 0, 0));
    assert_eq!(
        h.take(),
        vec![
            (STARTED, None, false, Some(1000)),
            (DIED, Some(0), false, Some(1000))
        ]
    );
}

#[test]
fn runtime_self_exec_is_not_the_main_process() {
    let mut h = Harness::new();
    h.mkdir(70, &container_path('a'));
    // The runtime's stages exit once they made the init (pid 1000, made at
    // 555 ns): the first exit bounds the init, made before it.
    h.feed(encode::exec(2, 900, 1, 70, "/proc/self/exe"));
    h.feed(encode::exit(600, 900, 1, 70, 0, 0));
    // runc 1.1 re-executes a sealed copy of itself through a descriptor.
    h.feed(encode::exec(3, 901, 1, 70, "/dev/fd/6"));
    h.feed(encode::exit(601, 901, 1, 70, 0, 0));
    h.feed(encode::exec(3, 902, 1, 70, "/proc/self/fd/7"));
    h.feed(encode::exec(4, 1000, 555, 70, "/pause"));
    assert_eq!(h.take(), vec![(STARTED, None, false, Some(1000))]);
}

#[test]
fn nested_cgroup_processes_belong_to_the_container() {
    let mut h = Harness::new();
    h.mkdir(70, &container_path('a'));
    h.mkdir(71, &format!("{}/init.scope", container_path('a')));
    h.feed(encode::exec(3, 1000, 555, 71, "/sbin/init"));
    h.rmdir(4, 71, &format!("{}/init.scope", container_path('a')));
    assert_eq!(h.take(), vec![(STARTED, None, false, Some(1000))]);
    assert_eq!(h.relists, 0);
}

#[test]
fn removal_before_a_certain_death_is_a_hint_and_a_relist() {
    let mut h = Harness::new();
    h.mkdir(70, &container_path('a'));
    h.feed(encode::exec(2, 1000, 555, 70, "/bin/sh"));
    h.rmdir(3, 70, &container_path('a'));
    assert_eq!(
        h.take(),
        vec![
            (STARTED, None, false, Some(1000)),
            (SYNC, None, false, None)
        ]
    );
    assert_eq!(h.relists, 1);
    assert_eq!(h.tracker.stats.removed_before_death, 1);
    assert_eq!(h.tracker.sizes(), (0, 0, 0, 1), "its id kept for the grace");
    h.reconcile(view(10, None, vec![]), &[]);
    assert_eq!(h.tracker.sizes(), (0, 0, 0, 0), "and forgotten after it");
}

#[test]
fn removal_of_a_container_that_never_started_or_was_only_hinted() {
    let mut h = Harness::new();
    h.mkdir(70, &container_path('a'));
    h.rmdir(2, 70, &container_path('a'));
    h.tracker
        .learn_existing(72, &container_path('b'), &[proc(2000, 1999, 300)], None, 1)
        .unwrap();
    h.feed(encode::exit(3, 2000, 3_005_000_000, 72, 0, 0));
    h.rmdir(4, 72, &container_path('b'));
    assert_eq!(
        h.take(),
        vec![(SYNC, None, false, None), (SYNC, None, false, None)],
        "the candidate's exit, then the removal: hints"
    );
    assert_eq!(h.relists, 0, "no exit was missed");
    assert_eq!(h.tracker.sizes(), (0, 0, 0, 2));
}

#[test]
fn unknown_cgroup_is_reported_to_the_caller() {
    let mut h = Harness::new();
    h.feed(encode::exit(1, 5, 5, 4242, 0, 0));
    h.feed(encode::exec(1, 5, 5, 4243, "/bin/true"));
    assert_eq!(h.unknown, vec![4242, 4243]);
    assert!(h.out.events.is_empty());
    // A cgroup known to be outside Kubernetes is ignored without a rescan.
    h.mkdir(80, "/kubepods/not-a-pod-or-container");
    h.feed(encode::exec(2, 6, 6, 80, "/bin/true"));
    assert_eq!(h.unknown, vec![4242, 4243]);
    assert_eq!(h.out.malformed.len(), 1, "{:?}", h.out.malformed);
}

#[test]
fn sandboxes_get_sandbox_events() {
    let mut h = Harness::new();
    h.tracker.add_sandbox(id('e'));
    h.mkdir(70, &container_path('e'));
    h.feed(encode::exec(2, 1000, 555, 70, "/pause"));
    h.feed(encode::exit(3, 1000, 555, 70, 0, 0));
    h.rmdir(4, 70, &container_path('e'));
    let kinds: Vec<EventKind> = h.take().into_iter().map(|e| e.0).collect();
    assert_eq!(
        kinds,
        vec![EventKind::SandboxStarted, EventKind::SandboxDied]
    );
}

#[test]
fn a_view_marks_sandboxes() {
    let mut h = Harness::new();
    h.mkdir(70, &container_path('e'));
    let mut pause = running('e', UID, None);
    pause.sandbox = true;
    h.reconcile(view(1, Some(UID), vec![pause]), &[]);
    h.feed(encode::exec(2, 1000, 555, 70, "/pause"));
    h.feed(encode::exit(3, 1000, 555, 70, 0x900, 0));
    let kinds: Vec<EventKind> = h.take().into_iter().map(|e| e.0).collect();
    assert_eq!(
        kinds,
        vec![EventKind::SandboxStarted, EventKind::SandboxDied]
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
    assert_eq!(h.unknown, vec![70]);
}

#[test]
fn v1_hierarchy_changes_are_ignored() {
    let mut h = Harness::new();
    h.feed(encode::cgroup(
        EVENT_CGROUP_MKDIR,
        1,
        7,
        70,
        &container_path('a'),
    ));
    assert!(h.tracker.index().is_empty());
    h.feed(encode::cgroup(
        EVENT_CGROUP_RMDIR,
        2,
        7,
        70,
        &container_path('a'),
    ));
    assert!(h.take().is_empty());
}

#[test]
fn scan_learned_running_container_exit_is_a_hint() {
    let mut h = Harness::new();
    let procs = [proc(2000, 1999, 300), proc(2001, 2000, 301)];
    assert!(
        h.tracker
            .learn_existing(70, &container_path('a'), &procs, None, 1)
            .unwrap()
    );
    assert_eq!(
        h.tracker.main_state(&id('a')),
        Some(MainState::Uncertain(Some(MainId::Ticks {
            pid: 2000,
            start_ticks: 300
        })))
    );
    // start_boottime 3.005 s = 300 ticks at USER_HZ 100. A child's exit: nothing.
    h.feed(encode::exit(5, 2001, 3_015_000_000, 70, 0, 0));
    assert_eq!(h.take(), vec![]);
    // The candidate's exit is a hint, never a death.
    h.feed(encode::exit(6, 2000, 3_005_000_000, 70, 0x200, 0));
    assert_eq!(h.take(), vec![(SYNC, None, false, None)]);
    assert_eq!(h.tracker.stats.hints, 1);
}

#[test]
fn exec_into_an_uncertain_container_is_never_the_main_process() {
    let mut h = Harness::new();
    h.tracker
        .learn_existing(70, &container_path('a'), &[proc(2000, 1999, 300)], None, 1)
        .unwrap();
    // `kubectl exec`, an exec probe: starts and ends without container events.
    h.feed(encode::exec(5, 3000, 9_000_000_000, 70, "/bin/sh"));
    h.feed(encode::exit(6, 3000, 9_000_000_000, 70, 0x100, 0));
    assert_eq!(h.take(), vec![]);
    // The candidate died: the main is unknown; every exit is now a hint, no exec
    // becomes the main process.
    h.feed(encode::exit(7, 2000, 3_005_000_000, 70, 0, 0));
    h.feed(encode::exec(8, 3001, 9_100_000_000, 70, "/bin/sh"));
    h.feed(encode::exit(9, 3001, 9_100_000_000, 70, 0, 0));
    assert_eq!(
        h.take(),
        vec![(SYNC, None, false, None), (SYNC, None, false, None)]
    );
    assert_eq!(
        h.tracker.main_state(&id('a')),
        Some(MainState::Uncertain(None))
    );
}

#[test]
fn scan_learned_container_holding_only_the_runtime_init_is_fresh() {
    let mut h = Harness::new();
    let init = ProcInfo {
        runtime_init: true,
        ..proc(2000, 1999, 300)
    };
    h.tracker
        .learn_existing(70, &container_path('a'), &[init], None, 1)
        .unwrap();
    h.tracker
        .learn_existing(71, &container_path('b'), &[], None, 1)
        .unwrap();
    for (cgroup, pid) in [(70, 2000), (71, 2100)] {
        h.feed(encode::exec(5, pid, 3_005_000_000, cgroup, "/bin/app"));
        h.feed(encode::exit(6, pid, 3_005_000_000, cgroup, 0x300, 0));
    }
    assert_eq!(
        h.take(),
        vec![
            (STARTED, None, false, Some(2000)),
            (DIED, Some(3), false, Some(2000)),
            (STARTED, None, false, Some(2100)),
            (DIED, Some(3), false, Some(2100)),
        ]
    );
}

#[test]
fn rescan_for_an_exec_treats_that_exec_as_not_yet_run() {
    // The mkdir was lost; the entrypoint's exec finds the cgroup unknown, the
    // rescan finds the entrypoint (and a child it forked) already running.
    let mut h = Harness::new();
    h.feed(encode::exec(5, 2000, 3_005_000_000, 70, "/bin/app"));
    assert_eq!(h.unknown, vec![70]);
    let pending = ProcessKey {
        pid: 2000,
        start_boottime_ns: 3_005_000_000,
    };
    let procs = [proc(2000, 1999, 300), proc(2001, 2000, 310)];
    h.tracker
        .learn_existing(70, &container_path('a'), &procs, Some(pending), 1)
        .unwrap();
    h.feed(encode::exec(5, 2000, 3_005_000_000, 70, "/bin/app"));
    h.feed(encode::exit(6, 2000, 3_005_000_000, 70, 0, 0));
    assert_eq!(
        h.take(),
        vec![
            (STARTED, None, false, Some(2000)),
            (DIED, Some(0), false, Some(2000))
        ]
    );
    // Without the pending exec, the same processes make it uncertain.
    assert!(matches!(
        scanned_state(&procs, None, 10_000_000),
        MainState::Uncertain(Some(_))
    ));
    // Another process running besides the pending one: uncertain too.
    let other = [proc(2000, 1999, 300), proc(2500, 1999, 200)];
    assert!(matches!(
        scanned_state(&other, Some(pending), 10_000_000),
        MainState::Uncertain(Some(MainId::Ticks { pid: 2500, .. }))
    ));
}

#[test]
fn mkdir_read_after_the_scan_learned_the_cgroup_makes_it_fresh() {
    // Created between attach and the start-up scan: the scan sees its process,
    // the ring buffer holds its whole history.
    let mut h = Harness::new();
    h.tracker
        .learn_existing(70, &container_path('a'), &[proc(2000, 1999, 300)], None, 1)
        .unwrap();
    h.mkdir(70, &container_path('a'));
    h.feed(encode::exec(5, 2000, 3_005_000_000, 70, "/bin/app"));
    h.feed(encode::exit(6, 2000, 3_005_000_000, 70, 0x100, 0));
    assert_eq!(
        h.take(),
        vec![
            (STARTED, None, false, Some(2000)),
            (DIED, Some(1), false, Some(2000))
        ]
    );
}

#[test]
fn oom_victim_is_matched_by_thread_group_and_consumed() {
    let mut h = Harness::new();
    h.mkdir(70, &container_path('a'));
    h.feed(encode::exec(2, 1000, 1, 70, "/bin/sh"));
    h.handle(&KernelEvent::OomVictim {
        at_ns: 3,
        tgid: 1000,
    });
    h.feed(encode::exit(4, 1000, 1, 70, 9, 0));
    assert_eq!(h.take().last(), Some(&(DIED, Some(137), true, Some(1000))));
    assert_eq!(h.tracker.oom_victims_len(), 0, "consumed by the exit");
}

/// Issue #25: a victim report whose exit record was lost is not laid on the
/// next process that reuses its pid (matched by pid and start time).
#[test]
fn an_oom_report_is_not_laid_on_a_reused_pid() {
    let mut h = Harness::new();
    h.mkdir(70, &container_path('a'));
    h.handle(&KernelEvent::OomVictim {
        at_ns: 1_000,
        tgid: 1000,
    });
    // The victim's exit is lost; pid 1000 is reused by a process started later.
    h.feed(encode::exec(2_000, 1000, 1_500, 70, "/bin/sh"));
    h.feed(encode::exit(3_000, 1000, 1_500, 70, 0x100, 0));
    assert_eq!(h.take().last(), Some(&(DIED, Some(1), false, Some(1000))));
}

#[test]
fn oom_victims_stay_bounded() {
    let mut h = Harness::new();
    for tgid in 0..(OOM_VICTIMS_MAX as u32 * 4) {
        h.handle(&KernelEvent::OomVictim { at_ns: 1, tgid });
    }
    assert_eq!(h.tracker.oom_victims_len(), OOM_VICTIMS_MAX);
    // Reports older than 10 s expire.
    h.handle(&KernelEvent::OomVictim {
        at_ns: OOM_VICTIM_MEMORY_NS + 2,
        tgid: 1,
    });
    assert_eq!(h.tracker.oom_victims_len(), 1);
}

#[test]
fn runtime_pid_makes_a_scan_learned_container_certain() {
    let mut h = Harness::new();
    h.tracker
        .learn_existing(70, &container_path('a'), &[proc(2000, 1999, 300)], None, 1)
        .unwrap();
    let o = h.reconcile(
        view(10, None, vec![running('a', UID, Some(2000))]),
        &[('a', alive(2000, 300, &container_path('a')))],
    );
    assert_eq!((o.confirmed, o.rescan_due, o.pruned), (1, false, 0));
    h.feed(encode::exit(6, 2000, 3_005_000_000, 70, 0x200, 0));
    assert_eq!(h.take(), vec![(DIED, Some(2), false, Some(2000))]);
}

/// A full view applied a part at a time: a death read between two parts is
/// certain once its container's part confirmed the main process, and a hint
/// while that part is still to come (as if read before the view).
#[test]
fn a_full_view_applied_in_parts_confirms_each_container_in_its_part() {
    let mut h = Harness::new();
    for (cgroup, c, pid) in [(70, 'a', 2000), (71, 'b', 3000), (72, 'c', 4000)] {
        let procs = [proc(pid, pid - 1, 300)];
        (h.tracker)
            .learn_existing(cgroup, &container_path(c), &procs, None, 1)
            .unwrap();
    }
    let listed = ['a', 'b', 'c'].map(|c| running(c, UID, Some(0)));
    let r = Reconciliation {
        view: view(10, None, listed.to_vec()),
        mains: [('a', 2000), ('b', 3000), ('c', 4000)]
            .iter()
            .map(|&(c, pid)| (id(c), alive(pid, 300, &container_path(c))))
            .collect(),
    };
    let mut rec = h.tracker.start_reconcile(r, false);
    assert_eq!(h.tracker.reconcile_part(&mut rec, 1), None, "one of three");
    h.feed(encode::exit(6, 2000, 3_005_000_000, 70, 0x200, 0));
    assert_eq!(
        h.take(),
        vec![(DIED, Some(2), false, Some(2000))],
        "a's part done"
    );
    h.feed(encode::exit(7, 4000, 3_006_000_000, 72, 0x100, 0));
    let seen = h.take();
    assert!(
        seen.iter().all(|(kind, ..)| *kind == SYNC) && !seen.is_empty(),
        "c's part to come: a hint, not a death: {seen:?}"
    );
    let outcome = h.tracker.reconcile_part(&mut rec, 2);
    assert_eq!(outcome.map(|o| o.confirmed), Some(3), "the last two: done");
    h.feed(encode::exit(8, 3000, 3_007_000_000, 71, 0x300, 0));
    assert_eq!(
        h.take(),
        vec![(DIED, Some(3), false, Some(3000))],
        "b's part done"
    );
}

#[test]
fn runtime_pid_replaces_a_wrong_candidate_and_corrects_a_certain_main() {
    let mut h = Harness::new();
    // The scan's candidate is 2000; the runtime says 2050.
    let procs = [proc(2000, 1999, 300), proc(2050, 1998, 305)];
    h.tracker
        .learn_existing(70, &container_path('a'), &procs, None, 1)
        .unwrap();
    h.mkdir(71, &container_path('b'));
    h.feed(encode::exec(2, 3000, 9_000_000_000, 71, "/bin/app"));
    h.take();
    let o = h.reconcile(
        view(
            10,
            None,
            vec![running('a', UID, Some(2050)), running('b', UID, Some(3100))],
        ),
        &[
            ('a', alive(2050, 305, &container_path('a'))),
            ('b', alive(3100, 950, &container_path('b'))),
        ],
    );
    assert_eq!((o.confirmed, o.corrected.clone()), (1, vec![id('b')]));
    h.feed(encode::exit(6, 2000, 3_005_000_000, 70, 0, 0));
    h.feed(encode::exit(7, 3000, 9_000_000_000, 71, 0, 0));
    assert_eq!(h.take(), vec![], "neither is the main process");
    h.feed(encode::exit(8, 2050, 3_055_000_000, 70, 0x100, 0));
    h.feed(encode::exit(9, 3100, 9_505_000_000, 71, 0x200, 0));
    assert_eq!(
        h.take(),
        vec![
            (DIED, Some(1), false, Some(2050)),
            (DIED, Some(2), false, Some(3100))
        ]
    );
}

#[test]
fn runtime_pid_outside_the_container_is_not_confirmed() {
    let mut h = Harness::new();
    h.tracker
        .learn_existing(70, &container_path('a'), &[proc(2000, 1999, 300)], None, 1)
        .unwrap();
    let o = h.reconcile(
        view(10, None, vec![running('a', UID, Some(2000))]),
        &[('a', alive(2000, 300, &container_path('b')))],
    );
    assert_eq!((o.confirmed, o.unconfirmed), (0, 1));
    h.feed(encode::exit(6, 2000, 3_005_000_000, 70, 0, 0));
    assert_eq!(h.take(), vec![(SYNC, None, false, None)]);
}

/// A view listed before a container's cgroup was removed still shows it
/// running: the fidelity run's agent warned 112 times that such containers
/// were under no kernel root (check --cgroup-root), and rescanned the cgroup
/// tree for each. One removed longer than the prune grace before the view is
/// unknown again.
#[test]
fn a_container_removed_after_the_listing_is_not_unfound() {
    let mut h = Harness::new();
    h.tracker.prune_grace_ns = 1_000;
    h.mkdir(50, "/kubepods");
    h.mkdir(60, &format!("/kubepods/besteffort/pod{UID}"));
    h.mkdir(70, &container_path('a'));
    h.feed(encode::exec(2, 1000, 3_005_000_000, 70, "/app"));
    h.feed(encode::exit(3, 1000, 3_005_000_000, 70, 0, 0));
    h.rmdir(5_000, 70, &container_path('a'));
    h.take();
    let stale = view(4_500, Some(UID), vec![running('a', UID, Some(1000))]);
    let o = h.reconcile(stale.clone(), &[]);
    assert!(!o.rescan_due, "no rescan for a container seen removed");
    let r = Reconciliation {
        view: stale,
        mains: HashMap::new(),
    };
    assert_eq!(h.tracker.reconcile(&r, true).unfound, vec![]);
    // Past the grace, a runtime still listing it running is told.
    let late = view(6_500, Some(UID), vec![running('a', UID, Some(1000))]);
    assert!(h.reconcile(late, &[]).rescan_due);
}

/// Removed containers expire in the order they were removed, and one
/// removed again is kept until its later removal expires.
#[test]
fn removed_containers_expire_in_order_and_a_second_removal_keeps_one() {
    let mut removed = Removed::default();
    removed.insert(id('a'), 10);
    removed.insert(id('b'), 20);
    removed.insert(id('a'), 30);
    let held = |r: &Removed| (r.contains(&id('a')), r.contains(&id('b')), r.len());
    let table = [
        (10, (true, true, 2)),
        (15, (true, true, 2)),
        (21, (true, false, 1)),
        (30, (true, false, 1)),
        (31, (false, false, 0)),
    ];
    for (before, expect) in table {
        removed.expire_before(before);
        assert_eq!(held(&removed), expect, "expired before {before}");
    }
    assert!(removed.order.is_empty());
}

#[test]
fn unknown_running_container_asks_for_one_rescan() {
    let mut h = Harness::new();
    let v = view(10, None, vec![running('a', UID, Some(2000))]);
    assert!(h.reconcile(v.clone(), &[]).rescan_due);
    // The rescan did not find it: remembered, no rescan again.
    let r = Reconciliation {
        view: v.clone(),
        mains: HashMap::new(),
    };
    assert!(!h.tracker.reconcile(&r, true).rescan_due);
    assert!(!h.reconcile(v, &[]).rescan_due);
    assert_eq!(h.tracker.sizes(), (0, 0, 1, 0));
    // Exited containers the tracker forgot are not a reason to rescan.
    let mut exited = running('b', UID2, None);
    exited.running = false;
    assert!(
        !h.reconcile(view(11, Some(UID2), vec![exited]), &[])
            .rescan_due
    );
    assert_eq!(
        h.tracker.sizes(),
        (0, 0, 1, 0),
        "another pod's view keeps it"
    );
    // Once the runtime stops listing it, it is forgotten.
    h.reconcile(view(12, None, vec![]), &[]);
    assert_eq!(h.tracker.sizes(), (0, 0, 0, 0));
}

#[test]
fn containerd_without_a_parent_learns_its_pod_from_the_view() {
    let mut h = Harness::new();
    h.mkdir(70, &format!("/k8s.io/{}", cid('a')));
    h.reconcile(view(1, None, vec![running('a', UID, None)]), &[]);
    h.feed(encode::exec(2, 1000, 555, 70, "/bin/sh"));
    let started = h.out.events.pop().unwrap();
    assert_eq!(started.pod_uid, Some(pod(UID)));
}

#[test]
fn a_full_view_forgets_everything_the_runtime_no_longer_lists() {
    let mut h = Harness::new();
    h.mkdir(50, "/kubepods");
    h.mkdir(60, &format!("/kubepods/besteffort/pod{UID}"));
    h.mkdir(61, &format!("/kubepods/besteffort/pod{UID2}"));
    h.mkdir(70, &container_path('a'));
    h.mkdir(71, &format!("{}/init.scope", container_path('a')));
    h.mkdir(72, &container_path('b'));
    h.mkdir(73, &pod2_path('c'));
    h.mkdir(80, "/kubepods/not-kubernetes");
    h.tracker.add_sandbox(id('b'));
    // Their rmdirs were lost. The view lists only container c (pod 2).
    let o = h.reconcile(view(10, None, vec![running('c', UID2, None)]), &[]);
    assert_eq!(o.pruned, 2);
    assert_eq!(h.tracker.sizes(), (1, 0, 0, 0));
    assert_eq!(h.tracker.main_state(&id('c')), Some(MainState::Fresh));
    // Left: /kubepods (node level), pod 2 and its container.
    let left: Vec<u64> = [50, 60, 61, 70, 71, 72, 73]
        .into_iter()
        .filter(|i| h.tracker.index().get(*i).is_some())
        .collect();
    assert_eq!(left, vec![50, 61, 73]);
    assert_eq!(h.tracker.index().ignored_len(), 0);
    assert_eq!(h.tracker.stats.pruned, 2);
}

#[test]
fn a_view_keeps_what_was_learned_after_its_listing() {
    let mut h = Harness::new();
    // Learned at 1 (the mkdir records' time) and at 50 (a scan).
    h.mkdir(70, &container_path('a'));
    h.tracker
        .learn_existing(72, &container_path('b'), &[], None, 50)
        .unwrap();
    let o = h.reconcile(view(20, None, vec![]), &[]);
    assert_eq!(o.pruned, 1);
    assert_eq!(h.tracker.main_state(&id('a')), None);
    assert_eq!(h.tracker.main_state(&id('b')), Some(MainState::Fresh));
    assert!(h.tracker.index().get(72).is_some());
}

#[test]
fn a_view_keeps_what_was_learned_within_the_grace() {
    let mut h = Harness::new();
    h.tracker.prune_grace_ns = 100;
    // Learned at 1 (mkdir records) and 50 (a scan).
    h.mkdir(70, &container_path('a'));
    h.tracker
        .learn_existing(72, &container_path('b'), &[], None, 50)
        .unwrap();
    h.reconcile(view(100, None, vec![]), &[]);
    assert_eq!(h.tracker.sizes(), (2, 0, 0, 0), "both within 100 ns of 100");
    h.reconcile(view(140, None, vec![]), &[]);
    assert_eq!(h.tracker.main_state(&id('a')), None);
    assert_eq!(h.tracker.main_state(&id('b')), Some(MainState::Fresh));
    h.reconcile(view(151, None, vec![]), &[]);
    assert_eq!(h.tracker.sizes(), (0, 0, 0, 0));
    assert!(h.tracker.index().is_empty());
}

#[test]
fn a_pod_view_prunes_only_that_pod() {
    let mut h = Harness::new();
    h.mkdir(60, &format!("/kubepods/besteffort/pod{UID}"));
    h.mkdir(70, &container_path('a'));
    h.mkdir(72, &container_path('b'));
    h.mkdir(73, &pod2_path('c'));
    let o = h.reconcile(view(10, Some(UID), vec![running('b', UID, None)]), &[]);
    assert_eq!(o.pruned, 1);
    assert_eq!(h.tracker.main_state(&id('a')), None);
    assert!(h.tracker.main_state(&id('b')).is_some());
    assert!(h.tracker.main_state(&id('c')).is_some(), "another pod's");
    assert!(h.tracker.index().get(70).is_none());
    assert!(
        h.tracker.index().get(60).is_some(),
        "the pod is still listed"
    );
    // The pod is gone: its cgroup entry goes too.
    h.reconcile(view(11, Some(UID), vec![]), &[]);
    assert!(h.tracker.index().get(60).is_none());
    assert!(h.tracker.index().get(73).is_some());
}

#[test]
fn choose_main_prefers_the_process_whose_parent_is_outside() {
    let procs = [proc(10, 5, 9), proc(5, 1, 10)];
    assert_eq!(choose_main(&procs).unwrap().pid, 5);
    assert_eq!(choose_main(&[]), None);
}

#[test]
fn runtime_init_names() {
    for comm in ["runc:[2:INIT]", "runc", "crun", "youki:[2:INIT]"] {
        assert!(is_runtime_init(comm), "{comm}");
    }
    for comm in [
        "sh",
        "pause",
        "nginx",
        "containerd-shim",
        "runc-exporter",
        "crunchy",
        "youki-app",
    ] {
        assert!(!is_runtime_init(comm), "{comm}");
    }
}

/// Which relist views the reader may apply after a record rather than before
/// it (`Tracker::view_may_follow`): only one pod's view, when the record is
/// another pod's known container's and the view does not list it.
#[test]
fn only_another_pods_view_may_follow_a_record() {
    let mut h = Harness::new();
    h.mkdir(10, &container_path('a'));
    h.mkdir(20, &pod2_path('b'));
    // A container whose path names no pod.
    h.mkdir(30, &format!("/k8s.io/{}", cid('c')));
    let exit_in = |cgroup_id| decode(&encode::exit(5, 300, 7, cgroup_id, 0, 0)).unwrap();
    let exec_in = |cgroup_id| decode(&encode::exec(5, 300, 7, cgroup_id, "/bin/true")).unwrap();
    let oom = KernelEvent::OomVictim {
        at_ns: 5,
        tgid: 300,
    };
    let rmdir_b = decode(&encode::cgroup(
        EVENT_CGROUP_RMDIR,
        5,
        0,
        20,
        &pod2_path('b'),
    ))
    .unwrap();
    let mkdir_d = decode(&encode::cgroup(
        EVENT_CGROUP_MKDIR,
        5,
        0,
        40,
        &pod2_path('d'),
    ))
    .unwrap();
    let rows: Vec<(&str, KernelEvent, RuntimeView, bool)> = vec![
        (
            "another pod's death",
            exit_in(10),
            view(1, Some(UID2), vec![running('b', UID2, None)]),
            true,
        ),
        (
            "another pod's exec",
            exec_in(20),
            view(1, Some(UID), vec![]),
            true,
        ),
        (
            "another pod's cgroup removed",
            rmdir_b,
            view(1, Some(UID), vec![]),
            true,
        ),
        (
            "the view's own pod",
            exit_in(10),
            view(1, Some(UID), vec![]),
            false,
        ),
        (
            "a full view",
            exit_in(10),
            view(1, None, vec![running('b', UID2, None)]),
            false,
        ),
        (
            "the record's container listed",
            exit_in(10),
            view(1, Some(UID2), vec![running('a', UID2, None)]),
            false,
        ),
        (
            "an unknown cgroup",
            exit_in(99),
            view(1, Some(UID2), vec![]),
            false,
        ),
        (
            "a cgroup made (not known yet)",
            mkdir_d,
            view(1, Some(UID), vec![]),
            false,
        ),
        (
            "a container of no known pod",
            exit_in(30),
            view(1, Some(UID2), vec![]),
            false,
        ),
        ("an OOM victim", oom, view(1, Some(UID2), vec![]), false),
    ];
    for (name, record, view, may_follow) in rows {
        assert_eq!(
            h.tracker.view_may_follow(&record, &view),
            may_follow,
            "{name}"
        );
    }
}
