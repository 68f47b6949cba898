//! The tracker under the lies of issue #25: OCI hooks before the entrypoint,
//! a death the runtime contradicts, lost records and failed kernel reads.

use super::*;
use evpleg_events::{EXEC_FLAG_READ_ERROR, EXIT_FLAG_READ_ERROR};

/// A fresh container 'a' (cgroup 70) of pod `UID`.
fn fresh() -> Harness {
    let mut h = Harness::new();
    h.mkdir(50, "/kubepods");
    h.mkdir(60, &format!("/kubepods/besteffort/pod{UID}"));
    h.mkdir(70, &container_path('a'));
    h
}

/// runc's init (pid 900) runs a `createContainer` hook (pid 901, its child, in
/// the container's cgroup) that execs a second program, then execs the
/// entrypoint itself: the hook is neither the start nor the death; the
/// entrypoint's exit is the death with its code.
#[test]
fn an_oci_hook_before_the_entrypoint_is_not_the_main_process() {
    let mut h = fresh();
    h.feed(encode::exec_by(
        2,
        901,
        9_010,
        70,
        "/usr/bin/nvidia-cdi-hook",
        (900, 70),
        0,
    ));
    h.feed(encode::exec_by(
        3,
        901,
        9_010,
        70,
        "/bin/true",
        (900, 70),
        0,
    ));
    // The hook exits after the init made it: the first exit bounds the init.
    h.feed(encode::exit(9_100, 901, 9_010, 70, 0, 0));
    assert_eq!(
        h.take(),
        vec![],
        "a hook's exec and exit are not the container's"
    );
    assert_eq!(h.tracker.main_state(&id('a')), Some(MainState::Fresh));
    // The init execs the entrypoint: its parent is the shim, outside.
    h.feed(encode::exec_by(
        5,
        900,
        9_000,
        70,
        "/app",
        (1, encode::OUTSIDE),
        0,
    ));
    assert_eq!(h.take(), vec![(STARTED, None, false, Some(900))]);
    // A hook of a nested cgroup's process, after the start: another exec.
    h.mkdir(71, &format!("{}/nested", container_path('a')));
    h.feed(encode::exec_by(6, 950, 9_500, 71, "/bin/sh", (900, 70), 0));
    h.feed(encode::exit(7, 950, 9_500, 71, 0, 0));
    assert_eq!(h.take(), vec![]);
    h.feed(encode::exit(8, 900, 9_000, 70, 0x300, 0));
    assert_eq!(h.take(), vec![(DIED, Some(3), false, Some(900))]);
}

/// The hook's parent in a cgroup nested in the container is inside too.
#[test]
fn a_hook_whose_parent_is_in_a_nested_cgroup_is_inside() {
    let mut h = fresh();
    h.mkdir(71, &format!("{}/init", container_path('a')));
    h.feed(encode::exec_by(2, 901, 9_010, 70, "/hook", (900, 71), 0));
    assert_eq!(h.take(), vec![]);
    assert_eq!(h.tracker.main_state(&id('a')), Some(MainState::Fresh));
}

/// Clause 3 after a contradiction (issue #25): the tracker is told, the
/// runtime's pid makes the main certain again, and the real main's exit is a
/// death (it was `OtherExit`, no event, before).
#[test]
fn after_a_contradiction_the_real_death_is_a_death() {
    let mut h = fresh();
    h.feed(encode::exec(2, 1000, 3_005_000_000, 70, "/wrapper"));
    h.feed(encode::exit(3, 1000, 3_005_000_000, 70, 0, 0));
    assert_eq!(
        h.take(),
        vec![
            (STARTED, None, false, Some(1000)),
            (DIED, Some(0), false, Some(1000))
        ]
    );
    // The runtime still says running with pid 1001 past the bound.
    let mut c = running('a', UID, Some(1001));
    c.contradicted = true;
    h.reconcile(
        view(10, Some(UID), vec![c]),
        &[('a', alive(1001, 301, &container_path('a')))],
    );
    assert_eq!(
        h.tracker.main_state(&id('a')),
        Some(MainState::Certain(MainId::Ticks {
            pid: 1001,
            start_ticks: 301
        }))
    );
    assert_eq!(h.tracker.stats.contradicted, 1);
    h.feed(encode::exit(11, 1001, 3_015_000_000, 70, 0x500, 0));
    assert_eq!(h.take(), vec![(DIED, Some(5), false, Some(1001))]);
}

/// Without the runtime's pid the main is unknown after a contradiction: the
/// real death is a hint (a relist), and the cgroup's removal too.
#[test]
fn after_a_contradiction_without_a_pid_the_real_death_is_a_hint() {
    let mut h = fresh();
    h.feed(encode::exec(2, 1000, 3_005_000_000, 70, "/wrapper"));
    h.feed(encode::exit(3, 1000, 3_005_000_000, 70, 0, 0));
    h.take();
    let mut c = running('a', UID, None);
    c.contradicted = true;
    h.reconcile(view(10, Some(UID), vec![c]), &[]);
    assert_eq!(
        h.tracker.main_state(&id('a')),
        Some(MainState::Uncertain(None))
    );
    h.feed(encode::exit(11, 1001, 3_015_000_000, 70, 0x500, 0));
    assert_eq!(h.take(), vec![(SYNC, None, false, None)]);
}

/// Records lost (issue #25): the entrypoint's exec is the lost one; an exec
/// probe's exec and exit afterwards are not a start and a death.
#[test]
fn after_lost_records_no_exec_becomes_the_main_process() {
    let mut h = fresh();
    h.mkdir(80, &container_path('b'));
    h.feed(encode::exec(2, 2000, 5_000, 80, "/b"));
    assert_eq!(h.take(), vec![(STARTED, None, false, Some(2000))]);
    // The entrypoint of 'a' (pid 1000) is lost with others.
    assert_eq!(h.tracker.records_lost(3), 2, "both containers demoted");
    let probe = encode::exec(5, 3000, 9_000, 70, "/bin/check");
    let KernelEvent::Exec(exec) = decode(&probe).unwrap() else {
        unreachable!()
    };
    assert!(!h.tracker.exec_would_start(&exec));
    h.feed(probe);
    h.feed(encode::exit(6, 3000, 9_000, 70, 0x100, 0));
    assert_eq!(
        h.take(),
        vec![(SYNC, None, false, None)],
        "a hint, not a death"
    );
    // 'b''s main's exit is a hint until the runtime confirms it...
    h.feed(encode::exit(7, 2000, 5_000, 80, 0x200, 0));
    assert_eq!(h.take(), vec![(SYNC, None, false, None)]);
    assert_eq!(h.tracker.stats.demoted, 2);
}

/// The drop is noticed before the mkdir of a container is read (it was
/// written before the counter was read): the lost record may be its
/// entrypoint's exec, so it is not fresh, and a probe's exec and exit that
/// follow are no start and no death (found by the lying-kernel model).
#[test]
fn a_container_made_before_a_noticed_loss_is_not_fresh() {
    let mut h = Harness::new();
    h.mkdir(50, "/kubepods");
    assert_eq!(h.tracker.records_lost(10), 0);
    h.feed(encode::cgroup(
        evpleg_events::EVENT_CGROUP_MKDIR,
        9,
        0,
        70,
        &container_path('a'),
    ));
    assert_eq!(
        h.tracker.main_state(&id('a')),
        Some(MainState::Uncertain(None))
    );
    h.feed(encode::exec(11, 3000, 9_000, 70, "/bin/probe"));
    h.feed(encode::exit(12, 3000, 9_000, 70, 0x100, 0));
    assert_eq!(h.take(), vec![(SYNC, None, false, None)]);
    // A cgroup made after the loss was noticed is fresh.
    h.feed(encode::cgroup(
        evpleg_events::EVENT_CGROUP_MKDIR,
        11,
        0,
        80,
        &container_path('b'),
    ));
    assert_eq!(h.tracker.main_state(&id('b')), Some(MainState::Fresh));
}

/// The runtime's pid after the loss makes the main certain again.
#[test]
fn after_lost_records_the_runtime_pid_restores_certainty() {
    let mut h = fresh();
    h.feed(encode::exec(2, 1000, 3_005_000_000, 70, "/app"));
    h.take();
    h.tracker.records_lost(3);
    h.reconcile(
        view(10, Some(UID), vec![running('a', UID, Some(1000))]),
        &[('a', alive(1000, 300, &container_path('a')))],
    );
    h.feed(encode::exit(11, 1000, 3_005_000_000, 70, 0x400, 0));
    assert_eq!(h.take(), vec![(DIED, Some(4), false, Some(1000))]);
}

/// Failed kernel reads (issue #25): a flagged exec never becomes the main
/// process, a flagged exit of the main is a hint (a zeroed status was a
/// death with code 0; a zeroed start time lost the death).
#[test]
fn records_with_read_errors_are_hints() {
    let mut h = fresh();
    h.feed(encode::exec_by(
        2,
        1000,
        0,
        70,
        "",
        (0, 0),
        EXEC_FLAG_READ_ERROR,
    ));
    assert_eq!(h.take(), vec![(SYNC, None, false, None)]);
    assert_eq!(
        h.tracker.main_state(&id('a')),
        Some(MainState::Uncertain(None))
    );

    let mut h = fresh();
    h.feed(encode::exec(2, 1000, 3_005_000_000, 70, "/app"));
    h.take();
    // The status and the start time read as zeros.
    h.feed(encode::exit(3, 1000, 0, 70, 0, EXIT_FLAG_READ_ERROR));
    assert_eq!(h.take(), vec![(SYNC, None, false, None)]);
    assert_eq!(
        h.tracker.main_state(&id('a')),
        Some(MainState::Uncertain(None))
    );
}

/// An exec session races the start (issue #25): runc's init (pid 900, made
/// at 9 000 ns) waits in the container's cgroup after its stages exited;
/// before its exec, a `runc exec` (an `ExecSync` fired once `runc start`
/// returned, or a `runc exec` while the container is only created) re-execs
/// runc, its stages exit, and its init (pid 952, parent `runc exec`, outside)
/// execs a command that exits 3. The session is neither the container's start
/// nor its death (it was the certain main process, its exit a death with
/// code 3): a hint each, and the runtime's pid makes the init the main
/// process, whose exit is the death with its code.
#[test]
fn an_exec_session_racing_the_start_is_not_the_main_process() {
    let mut h = fresh();
    // runc create: stage 0 re-execs runc from a sealed copy; stage 1 (made at
    // 8 500 ns) exits at 9 500 ns once it made the init, then stage 0.
    h.feed(encode::exec_by(
        2,
        898,
        8_000,
        70,
        "/dev/fd/6",
        (880, encode::OUTSIDE),
        0,
    ));
    h.feed(encode::exit(9_500, 899, 8_500, 70, 0, 0));
    h.feed(encode::exit(9_600, 898, 8_000, 70, 0, 0));
    assert_eq!(h.take(), vec![]);
    // runc exec: the same stages, later; its init execs the command.
    h.feed(encode::exec_by(
        20_000,
        950,
        19_000,
        70,
        "/dev/fd/5",
        (940, encode::OUTSIDE),
        0,
    ));
    h.feed(encode::exit(21_500, 951, 20_500, 70, 0, 0));
    h.feed(encode::exit(21_600, 950, 19_000, 70, 0, 0));
    let session = encode::exec_by(
        22_000,
        952,
        21_000,
        70,
        "/bin/sh",
        (940, encode::OUTSIDE),
        0,
    );
    let KernelEvent::Exec(exec) = decode(&session).unwrap() else {
        unreachable!()
    };
    assert!(
        !h.tracker.exec_would_start(&exec),
        "the session is not the entrypoint"
    );
    h.feed(session);
    h.feed(encode::exit(23_000, 952, 21_000, 70, 0x300, 0));
    assert_eq!(
        h.take(),
        vec![(SYNC, None, false, None), (SYNC, None, false, None)],
        "hints, not a start and a death"
    );
    assert_eq!(
        h.tracker.main_state(&id('a')),
        Some(MainState::Uncertain(None))
    );
    // The init execs the entrypoint (parent the shim): no start of its own.
    h.feed(encode::exec_by(
        30_000,
        900,
        9_000,
        70,
        "/app",
        (1, encode::OUTSIDE),
        0,
    ));
    assert_eq!(h.take(), vec![]);
    // The relist's view: the runtime's pid is the init's.
    h.reconcile(
        view(40_000, Some(UID), vec![running('a', UID, Some(900))]),
        &[('a', alive(900, 0, &container_path('a')))],
    );
    h.feed(encode::exit(50_000, 900, 9_000, 70, 0x700, 0));
    assert_eq!(h.take(), vec![(DIED, Some(7), false, Some(900))]);
}

/// Without a session the same stages leave the init's exec the start, and
/// its exit the death: the bound (the first exit in the cgroup) does not
/// hold back the init, made before it.
#[test]
fn the_init_made_before_the_first_exit_is_the_main_process() {
    let mut h = fresh();
    h.feed(encode::exit(9_500, 899, 8_500, 70, 0, 0));
    h.feed(encode::exit(9_600, 898, 8_000, 70, 0, 0));
    h.feed(encode::exec_by(
        30_000,
        900,
        9_000,
        70,
        "/app",
        (1, encode::OUTSIDE),
        0,
    ));
    h.feed(encode::exit(50_000, 900, 9_000, 70, 0x700, 0));
    assert_eq!(
        h.take(),
        vec![
            (STARTED, None, false, Some(900)),
            (DIED, Some(7), false, Some(900))
        ]
    );
}

/// Learned by a scan while the runtime's init waits (the agent restarted
/// between the container's creation and its start): the scan's init bounds
/// the start; a session's exec (made later) is a hint, the init's the start.
#[test]
fn a_scan_that_finds_the_init_waiting_bounds_the_start() {
    let mut h = Harness::new();
    let init = ProcInfo {
        runtime_init: true,
        ..proc(2000, 1999, 300)
    };
    h.tracker
        .learn_existing(70, &container_path('a'), &[init], None, 1)
        .unwrap();
    h.tracker
        .learn_existing(71, &container_path('b'), &[init], None, 1)
        .unwrap();
    // 3.02 s: tick 302, made after the init (tick 300).
    h.feed(encode::exec(5, 2050, 3_020_000_000, 70, "/bin/sh"));
    h.feed(encode::exit(6, 2050, 3_020_000_000, 70, 0x300, 0));
    assert_eq!(
        h.take(),
        vec![(SYNC, None, false, None), (SYNC, None, false, None)]
    );
    h.feed(encode::exec(7, 2000, 3_005_000_000, 71, "/bin/app"));
    h.feed(encode::exit(8, 2000, 3_005_000_000, 71, 0x300, 0));
    assert_eq!(
        h.take(),
        vec![
            (STARTED, None, false, Some(2000)),
            (DIED, Some(3), false, Some(2000))
        ]
    );
}

/// A root the kernel filter took late (CI of stop 36: `/kubepods` made again
/// while the reader lagged, a helper's exec held back by the filter, its
/// exit then read as another process's, and nothing sent): cgroups made
/// below it before the filter took it are not `Fresh`, whether learned by a
/// scan or by their mkdir, and their exits are hints; other roots, and
/// cgroups made after, keep their certainty.
#[test]
fn cgroups_made_before_their_root_reached_the_filter_are_not_fresh() {
    let mut h = Harness::new();
    let other_root = format!("/k8s.io/{}", cid('c'));
    // Known by a scan before the filter took /kubepods: demoted.
    h.tracker
        .learn_existing(70, &container_path('a'), &[], None, 1)
        .unwrap();
    h.tracker
        .learn_existing(90, &other_root, &[], None, 1)
        .unwrap();
    assert_eq!(h.tracker.filter_opened("/kubepods/", 10), 1);
    assert_eq!(h.tracker.stats.demoted, 1);
    assert_eq!(
        h.tracker.main_state(&id('a')),
        Some(MainState::Uncertain(None))
    );
    assert_eq!(h.tracker.main_state(&id('c')), Some(MainState::Fresh));
    // Its mkdir, read now, does not make it fresh again.
    h.feed(encode::cgroup(
        EVENT_CGROUP_MKDIR,
        8,
        0,
        70,
        &container_path('a'),
    ));
    assert_eq!(
        h.tracker.main_state(&id('a')),
        Some(MainState::Uncertain(None))
    );
    // Made before the filter took the root, read after: its helper's exec
    // was held back, its exit is a hint.
    h.feed(encode::cgroup(
        EVENT_CGROUP_MKDIR,
        9,
        0,
        80,
        &container_path('b'),
    ));
    assert_eq!(
        h.tracker.main_state(&id('b')),
        Some(MainState::Uncertain(None))
    );
    h.feed(encode::exit(12, 3000, 9_000, 80, 0x3100, 0));
    assert_eq!(h.take(), vec![(SYNC, None, false, None)]);
    // Made after: fresh, its exec is the start, its exit the death.
    h.feed(encode::cgroup(
        EVENT_CGROUP_MKDIR,
        11,
        0,
        81,
        &pod2_path('d'),
    ));
    assert_eq!(h.tracker.main_state(&id('d')), Some(MainState::Fresh));
    h.feed(encode::exec(13, 4000, 12_000, 81, "/app"));
    h.feed(encode::exit(14, 4000, 12_000, 81, 0x200, 0));
    assert_eq!(
        h.take(),
        vec![
            (STARTED, None, false, Some(4000)),
            (DIED, Some(2), false, Some(4000))
        ]
    );
    // Below a root the filter held all along, a mkdir written before is
    // still fresh.
    h.feed(encode::cgroup(
        EVENT_CGROUP_MKDIR,
        5,
        0,
        91,
        &format!("/k8s.io/{}", cid('e')),
    ));
    assert_eq!(h.tracker.main_state(&id('e')), Some(MainState::Fresh));
    // Taken again later (the root made anew): the later time counts.
    assert_eq!(
        h.tracker.filter_opened("/kubepods", 20),
        0,
        "no fresh container below it"
    );
    h.feed(encode::cgroup(
        EVENT_CGROUP_MKDIR,
        15,
        0,
        82,
        &pod2_path('f'),
    ));
    assert_eq!(
        h.tracker.main_state(&id('f')),
        Some(MainState::Uncertain(None))
    );
    assert_eq!(h.relists, 0, "the reader asks for the relist");
}

/// A scan finds a container's cgroup empty though processes ran in it (the
/// late root's window): its main process's exit was never read, so it is
/// not fresh, and its removal is a hint.
#[test]
fn a_container_whose_processes_exited_unseen_is_not_fresh() {
    let mut h = Harness::new();
    h.tracker
        .learn_existing(70, &container_path('a'), &[], None, 1)
        .unwrap();
    assert!(h.tracker.exited_unseen(70));
    assert_eq!(
        h.tracker.main_state(&id('a')),
        Some(MainState::Uncertain(None))
    );
    assert!(!h.tracker.exited_unseen(70), "once");
    assert!(!h.tracker.exited_unseen(71), "an unknown cgroup");
    h.rmdir(5, 70, &container_path('a'));
    assert_eq!(h.take(), vec![(SYNC, None, false, None)]);
}
