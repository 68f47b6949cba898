//! The per-container state machine of the kernel PLEG: how certain the tracker is
//! of a container's main process, and what each kernel observation means for it.
//!
//! The kubelet has no counterpart (its PLEG diffs relists); this is the part of
//! the contract (`docs/pleg.md`, clauses 2, 4 and 6) that decides whether a
//! kernel exit is a *fact* (a Died event with its exit status) or a *hint* (a
//! `PodSync` that relists the pod and writes nothing).
//!
//! | state | input | next state | effect | transition |
//! |---|---|---|---|---|
//! | `Fresh` | exec by the runtime's init (parent outside the container, made before the first exit in it) | `Certain` | Started | [`MainState::exec`]: `main_exec` |
//! | `Fresh` | exec, runtime re-exec | `Fresh` | none | `runtime_reexec` |
//! | `Fresh` | exec with its parent inside the container (a hook) | `Fresh` | none | `inner_exec` |
//! | `Fresh` | exec by a process from outside made after the init (an exec session racing the start) | `Uncertain(None)` | hint | `joined_exec` |
//! | `Fresh` | exec whose record has a read error | `Uncertain(None)` | hint | `unread_exec` |
//! | `Certain(m)` | exec by `m` | `Certain` (new key) | none | `main_reexec` |
//! | `Certain`, `Uncertain`, `Exited` | exec by another process | same | none | `other_exec` |
//! | `Certain(m)` | exit of `m` | `Exited` | Died (status) | [`MainState::exit`]: `main_exit` |
//! | `Certain(m)`, `Uncertain(Some(m))` | exit of `m`'s pid, read error | `Uncertain(None)` | hint | `unread_exit` |
//! | `Uncertain(Some(c))` | exit of `c` | `Uncertain(None)` | hint | `candidate_exit` |
//! | `Uncertain(None)` | any exit | same | hint | `unknown_main_exit` |
//! | other | another exit | same | none | `other_exit` |
//! | `Fresh`, `Uncertain` | runtime's pid confirmed | `Certain(pid)` | none | [`MainState::confirm`]: `confirmed` |
//! | `Certain(m)` | runtime's pid, not `m` | `Certain(pid)` | none | `corrected` |
//! | `Certain(m)` | runtime's pid is `m` | same | none | `agreed` |
//! | `Exited` | runtime's pid | same | none | `stale_confirmation` |
//! | `Exited` | the runtime contradicted the death | `Uncertain(None)` | none | [`MainState::contradicted`]: `contradicted` |
//! | `Fresh` | records lost | `Uncertain(None)` | none | [`MainState::records_lost`]: `demoted` |
//! | `Certain(m)` | records lost | `Uncertain(Some(m))` | none | `demoted` |
//! | `Uncertain` | its mkdir read from the ring | `Fresh` | none | [`MainState::history_in_ring`] |
//! | `Exited` | cgroup removed | forgotten | none | [`MainState::removed`]: `removed_after_death` |
//! | `Fresh` | cgroup removed | forgotten | none | `removed_unstarted` |
//! | `Uncertain(None)` | cgroup removed | forgotten | hint | `removed_after_hints` |
//! | `Certain`, `Uncertain(Some)` | cgroup removed | forgotten | hint + relist | `removed_before_death` |
//!
//! The main process is the one the runtime's init becomes: runc's and crun's
//! init waits in the container's cgroup, its parent the shim (outside the
//! container), and execs the entrypoint. OCI `createContainer` and
//! `startContainer` hooks run inside the container's cgroup before that, as
//! children of the init: an exec whose parent is inside the container is never
//! the main process, however early it comes.
//!
//! An exec session (`ExecSync`, an exec probe, `kubectl exec`, any `runc
//! exec`) has its parent outside the container too, and may exec between the
//! cgroup's creation and the init's exec (containerd takes an `ExecSync` once
//! `runc start` returned, before the init's `execve`; `runc exec` takes one
//! while the container is only created). It is told from the init by when it
//! was made: the init is made while the runtime sets the container up, before
//! anything exits in the cgroup (runc's and youki's intermediate stages exit
//! there right after making it, hooks after it), an exec session only once
//! the container exists, after those exits. The tracker keeps, per fresh
//! container, a bound on the init's start time (the first exit read in the
//! cgroup, or the newest runtime init a scan found there,
//! [`super::tracker`]); an exec from outside by a process started at or after
//! it is [`ExecOrigin::Joined`]: never the main process, and a hint, since the
//! container's records no longer tell its main process alone (issue #25: it
//! was "the first exec from outside", and the session's exit a certain death
//! with the session's code). Where nothing exits in the cgroup before the
//! start (crun without hooks) there is no bound, and the first exec from
//! outside is the main process, as before.
//!
//! A removal misses nothing when no main process ever ran (`Fresh`: a container
//! created and never started), or when every exit since the candidate's was
//! already a hint (`Uncertain(None)`); otherwise the main process's exit was
//! missed, and the pod is relisted.
//!
//! Certainty rests on having seen every record of the container: when records
//! are lost (a full ring buffer), a `Fresh` container may have missed its
//! entrypoint's exec and a `Certain` one its main's exit or a runtime re-exec,
//! so both are demoted until the runtime's pid confirms the main process again.
//!
//! A container leaves `Exited` only by being forgotten (Kubernetes restarts a
//! container under a new id, in a new cgroup), or when the runtime contradicts
//! the death: the exit was not the main process's, and the real one is to come.

use super::event::ProcessKey;

/// How a main process is identified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MainId {
    /// Seen exec'ing: pid and exact start time (ns since boot).
    Exact(ProcessKey),
    /// From `/proc` (scan or the runtime's pid): start time in clock ticks.
    Ticks { pid: u32, start_ticks: u64 },
}

impl MainId {
    pub fn pid(&self) -> u32 {
        match self {
            Self::Exact(k) => k.pid,
            Self::Ticks { pid, .. } => *pid,
        }
    }

    /// Whether `process` (from a kernel record) is this process; `tick_ns` is the
    /// length of a clock tick.
    pub fn matches(&self, process: ProcessKey, tick_ns: u64) -> bool {
        match *self {
            Self::Exact(key) => key == process,
            Self::Ticks { pid, start_ticks } => {
                pid == process.pid && process.start_boottime_ns / tick_ns.max(1) == start_ticks
            }
        }
    }

    /// Whether two identities name the same process.
    pub fn same(&self, other: &MainId, tick_ns: u64) -> bool {
        match (*self, *other) {
            (Self::Exact(a), Self::Exact(b)) => a == b,
            (Self::Exact(k), t @ Self::Ticks { .. }) | (t @ Self::Ticks { .. }, Self::Exact(k)) => {
                t.matches(k, tick_ns)
            }
            (a, b) => a == b,
        }
    }
}

/// What the tracker knows of a container's main process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MainState {
    /// The cgroup was seen created (or found holding nothing but the runtime's
    /// init): the runtime's init exec'ing (parent outside, made before the
    /// first exit in the cgroup) is the main process.
    Fresh,
    /// The main process is known with certainty and runs.
    Certain(MainId),
    /// Processes were already running when the container was learned: a
    /// candidate (the scan's choice), or none. Execs never become the main
    /// process; exits are hints.
    Uncertain(Option<MainId>),
    /// The certain main process was seen to exit.
    Exited(MainId),
}

/// Who exec'd, as far as the kernel record tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExecOrigin {
    /// The task's parent is outside the container: the runtime's init (whose
    /// parent is the shim) exec'ing the entrypoint.
    Outside,
    /// The task's parent is outside the container, but the process was made
    /// after the runtime's init: an exec session joining the container (its
    /// runtime's `exec`), never the init.
    Joined,
    /// The task's parent is inside the container: a hook run by the init, or
    /// a child of a process in the container.
    Inside,
    /// A container runtime re-executing itself ([`super::tracker::is_runtime_reexec`]).
    RuntimeReexec,
    /// A kernel read for the record failed: the start time, the parent or the
    /// file name may be zeros.
    Unread,
}

/// What a transition asks the tracker to report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    None,
    /// Started (Container or Sandbox) with this pid.
    Started(u32),
    /// Died with the exit's status.
    Died(u32),
    /// A `PodSync` hint: something happened the kernel cannot vouch for.
    Hint,
    /// A hint, and a relist: an exit was missed.
    HintAndRelist,
}

/// The name of the transition taken (for counting and tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transition {
    MainExec,
    RuntimeReexec,
    InnerExec,
    JoinedExec,
    UnreadExec,
    UnreadExit,
    Contradicted,
    Demoted,
    MainReexec,
    OtherExec,
    MainExit,
    CandidateExit,
    UnknownMainExit,
    OtherExit,
    Confirmed,
    Corrected,
    Agreed,
    StaleConfirmation,
    HistoryInRing,
    Unchanged,
    RemovedAfterDeath,
    RemovedUnstarted,
    RemovedAfterHints,
    RemovedBeforeDeath,
}

/// A transition's outcome: the next state (`None`: forget the container), its
/// name and its effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub next: Option<MainState>,
    pub transition: Transition,
    pub effect: Effect,
}

fn step(next: MainState, transition: Transition, effect: Effect) -> Step {
    Step {
        next: Some(next),
        transition,
        effect,
    }
}

impl MainState {
    /// A process exec'd in the container's cgroup (or one nested in it).
    pub fn exec(self, process: ProcessKey, origin: ExecOrigin, tick_ns: u64) -> Step {
        use Transition::*;
        match self {
            Self::Fresh => match origin {
                ExecOrigin::Outside => step(
                    Self::Certain(MainId::Exact(process)),
                    MainExec,
                    Effect::Started(process.pid),
                ),
                ExecOrigin::RuntimeReexec => step(self, RuntimeReexec, Effect::None),
                ExecOrigin::Inside => step(self, InnerExec, Effect::None),
                // The session's exit must not be a death, and the init's exec
                // may come before or after it: the runtime's pid decides.
                ExecOrigin::Joined => step(Self::Uncertain(None), JoinedExec, Effect::Hint),
                ExecOrigin::Unread => step(Self::Uncertain(None), UnreadExec, Effect::Hint),
            },
            // A shell's `exec`: the same process, a new image.
            Self::Certain(m) if m.matches(process, tick_ns) => step(
                Self::Certain(MainId::Exact(process)),
                MainReexec,
                Effect::None,
            ),
            Self::Certain(_) | Self::Uncertain(_) | Self::Exited(_) => {
                step(self, OtherExec, Effect::None)
            }
        }
    }

    /// A process in the container exited; `read_error`: a kernel read for the
    /// record failed (its status and start time may be zeros), so an exit that
    /// may be the main process's is only a hint.
    pub fn exit(self, process: ProcessKey, read_error: bool, tick_ns: u64) -> Step {
        use Transition::*;
        match self {
            Self::Certain(m) | Self::Uncertain(Some(m)) if read_error && m.pid() == process.pid => {
                step(Self::Uncertain(None), UnreadExit, Effect::Hint)
            }
            Self::Certain(m) if m.matches(process, tick_ns) => step(
                Self::Exited(MainId::Exact(process)),
                MainExit,
                Effect::Died(process.pid),
            ),
            Self::Uncertain(Some(c)) if c.matches(process, tick_ns) => {
                step(Self::Uncertain(None), CandidateExit, Effect::Hint)
            }
            Self::Uncertain(None) => step(self, UnknownMainExit, Effect::Hint),
            _ => step(self, OtherExit, Effect::None),
        }
    }

    /// The runtime's record of the main process, confirmed against `/proc` to be
    /// a live process in this container's cgroup.
    pub fn confirm(self, pid: MainId, tick_ns: u64) -> Step {
        use Transition::*;
        match self {
            Self::Fresh | Self::Uncertain(_) => step(Self::Certain(pid), Confirmed, Effect::None),
            Self::Certain(m) if m.same(&pid, tick_ns) => step(self, Agreed, Effect::None),
            Self::Certain(_) => step(Self::Certain(pid), Corrected, Effect::None),
            Self::Exited(_) => step(self, StaleConfirmation, Effect::None),
        }
    }

    /// The runtime still reports running a container whose death the kernel
    /// reported, past the confirmation bound: that exit was not the main
    /// process's. The main process is unknown again (the runtime's pid, handed
    /// with the same view, makes it certain), so that the real death is seen.
    pub fn contradicted(self) -> Step {
        match self {
            Self::Exited(_) => step(
                Self::Uncertain(None),
                Transition::Contradicted,
                Effect::None,
            ),
            _ => step(self, Transition::Unchanged, Effect::None),
        }
    }

    /// Records were lost (the ring buffer was full): certainty that rests on
    /// having seen every record of the container ends. A `Fresh` container may
    /// have missed its entrypoint's exec (the next exec would be taken for it);
    /// a `Certain` one its main process's exit or re-exec.
    pub fn records_lost(self) -> Step {
        match self {
            Self::Fresh => step(Self::Uncertain(None), Transition::Demoted, Effect::None),
            Self::Certain(m) => step(Self::Uncertain(Some(m)), Transition::Demoted, Effect::None),
            _ => step(self, Transition::Unchanged, Effect::None),
        }
    }

    /// The cgroup's mkdir record was read after the container had been learned
    /// by a scan: every record of this cgroup follows in the ring buffer, so the
    /// container is as good as seen created.
    pub fn history_in_ring(self) -> Step {
        match self {
            Self::Uncertain(_) => step(Self::Fresh, Transition::HistoryInRing, Effect::None),
            _ => step(self, Transition::Unchanged, Effect::None),
        }
    }

    /// The container's cgroup was removed.
    pub fn removed(self) -> Step {
        let (transition, effect) = match self {
            Self::Exited(_) => (Transition::RemovedAfterDeath, Effect::None),
            Self::Fresh => (Transition::RemovedUnstarted, Effect::None),
            Self::Uncertain(None) => (Transition::RemovedAfterHints, Effect::Hint),
            Self::Certain(_) | Self::Uncertain(Some(_)) => {
                (Transition::RemovedBeforeDeath, Effect::HintAndRelist)
            }
        };
        Step {
            next: None,
            transition,
            effect,
        }
    }

    /// Whether the main process is known with certainty (running or exited).
    pub fn is_certain(&self) -> bool {
        matches!(self, Self::Certain(_) | Self::Exited(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Effect as E;
    use MainState as S;
    use Transition as T;

    /// USER_HZ 100: a tick is 10 ms.
    const TICK: u64 = 10_000_000;

    fn key(pid: u32, start: u64) -> ProcessKey {
        ProcessKey {
            pid,
            start_boottime_ns: start,
        }
    }

    fn exact(pid: u32, start: u64) -> MainId {
        MainId::Exact(key(pid, start))
    }

    fn ticks(pid: u32, start_ticks: u64) -> MainId {
        MainId::Ticks { pid, start_ticks }
    }

    #[test]
    fn exec_table() {
        use ExecOrigin::{Inside, Joined, Outside, RuntimeReexec, Unread};
        let main = key(10, 1_000);
        let other = key(11, 2_000);
        let reused = key(10, 9_000);
        // (state, process, origin, next, transition, effect)
        let rows = [
            // The runtime's init (its parent the shim, outside) execs the entrypoint.
            (
                S::Fresh,
                main,
                Outside,
                S::Certain(MainId::Exact(main)),
                T::MainExec,
                E::Started(10),
            ),
            (
                S::Fresh,
                main,
                RuntimeReexec,
                S::Fresh,
                T::RuntimeReexec,
                E::None,
            ),
            // An OCI createContainer/startContainer hook: the init's child, in
            // the container's cgroup before the entrypoint. Never the main
            // process, however early (issue #25: it was, being first).
            (S::Fresh, other, Inside, S::Fresh, T::InnerExec, E::None),
            // An exec session from outside made after the init (an
            // `ExecSync` racing the start): neither the main process nor
            // silent (issue #25: it was the main process, its exit a death).
            (
                S::Fresh,
                other,
                Joined,
                S::Uncertain(None),
                T::JoinedExec,
                E::Hint,
            ),
            // Who exec'd is unknown (a kernel read failed): a hint, and the
            // runtime's pid decides.
            (
                S::Fresh,
                main,
                Unread,
                S::Uncertain(None),
                T::UnreadExec,
                E::Hint,
            ),
            (
                S::Certain(exact(10, 1_000)),
                main,
                Outside,
                S::Certain(MainId::Exact(main)),
                T::MainReexec,
                E::None,
            ),
            // A shell's `exec`: its parent is the shim still.
            (
                S::Certain(exact(10, 1_000)),
                main,
                Inside,
                S::Certain(MainId::Exact(main)),
                T::MainReexec,
                E::None,
            ),
            (
                S::Certain(exact(10, 1_000)),
                other,
                Outside,
                S::Certain(exact(10, 1_000)),
                T::OtherExec,
                E::None,
            ),
            (
                S::Certain(exact(10, 1_000)),
                other,
                Joined,
                S::Certain(exact(10, 1_000)),
                T::OtherExec,
                E::None,
            ),
            // A reused pid is another process.
            (
                S::Certain(exact(10, 1_000)),
                reused,
                Outside,
                S::Certain(exact(10, 1_000)),
                T::OtherExec,
                E::None,
            ),
            // Scanned main re-exec'ing: 1_000 ns is tick 0.
            (
                S::Certain(ticks(10, 0)),
                main,
                Outside,
                S::Certain(MainId::Exact(main)),
                T::MainReexec,
                E::None,
            ),
            // An exec into a container whose main is uncertain or unknown (an exec
            // probe, `kubectl exec`) never becomes the main process.
            (
                S::Uncertain(None),
                other,
                Outside,
                S::Uncertain(None),
                T::OtherExec,
                E::None,
            ),
            (
                S::Uncertain(Some(ticks(10, 0))),
                other,
                Outside,
                S::Uncertain(Some(ticks(10, 0))),
                T::OtherExec,
                E::None,
            ),
            (
                S::Exited(exact(10, 1_000)),
                other,
                Outside,
                S::Exited(exact(10, 1_000)),
                T::OtherExec,
                E::None,
            ),
        ];
        for (i, (state, process, origin, next, transition, effect)) in rows.into_iter().enumerate()
        {
            let got = state.exec(process, origin, TICK);
            assert_eq!(
                got,
                Step {
                    next: Some(next),
                    transition,
                    effect
                },
                "row {i}: {state:?} exec {process:?} {origin:?}"
            );
        }
    }

    /// A hook exec'd and exited before the entrypoint (its parent, the init,
    /// inside the container): no start, no death; the entrypoint's exec is the
    /// start and its exit the death.
    #[test]
    fn a_hook_before_the_entrypoint_is_neither_its_start_nor_its_death() {
        let hook = key(20, 5_000);
        let init = key(19, 4_000);
        let mut state = S::Fresh;
        let mut effects = Vec::new();
        for step in [
            |s: S, h: ProcessKey, _: ProcessKey| s.exec(h, ExecOrigin::Inside, TICK),
            |s: S, h: ProcessKey, _: ProcessKey| s.exit(h, false, TICK),
            |s: S, _: ProcessKey, i: ProcessKey| s.exec(i, ExecOrigin::Outside, TICK),
            |s: S, _: ProcessKey, i: ProcessKey| s.exit(i, false, TICK),
        ] {
            let got = step(state, hook, init);
            effects.push(got.effect);
            state = got.next.expect("kept");
        }
        assert_eq!(effects, [E::None, E::None, E::Started(19), E::Died(19)]);
        assert_eq!(state, S::Exited(MainId::Exact(init)));
    }

    /// An exec session races the start (issue #25): its exec (from outside,
    /// made after the init) and exit are a hint each, never a start and a
    /// death; the init's exec after it is not taken either, and the
    /// runtime's pid makes the init the main process, whose exit is the death.
    #[test]
    fn an_exec_session_racing_the_start_is_neither_its_start_nor_its_death() {
        let session = key(30, 9_000_000_000);
        let init = key(19, 4_000);
        let mut state = S::Fresh;
        let mut effects = Vec::new();
        type Input = fn(S, ProcessKey, ProcessKey) -> Step;
        let inputs: [Input; 4] = [
            |s, x, _| s.exec(x, ExecOrigin::Joined, TICK),
            |s, x, _| s.exit(x, false, TICK),
            |s, _, i| s.exec(i, ExecOrigin::Outside, TICK),
            |s, _, _| s.confirm(ticks(19, 0), TICK),
        ];
        for input in inputs {
            let got = input(state, session, init);
            effects.push(got.effect);
            state = got.next.expect("kept");
        }
        assert_eq!(effects, [E::Hint, E::Hint, E::None, E::None]);
        assert_eq!(state.exit(init, false, TICK).effect, E::Died(19));
    }

    #[test]
    fn exit_table() {
        let main = key(10, 25_000_000); // tick 2
        let other = key(11, 2_000);
        let rows = [
            (
                S::Certain(MainId::Exact(main)),
                main,
                S::Exited(MainId::Exact(main)),
                T::MainExit,
                E::Died(10),
            ),
            (
                S::Certain(ticks(10, 2)),
                main,
                S::Exited(MainId::Exact(main)),
                T::MainExit,
                E::Died(10),
            ),
            (
                S::Certain(ticks(10, 3)),
                main,
                S::Certain(ticks(10, 3)),
                T::OtherExit,
                E::None,
            ),
            (
                S::Certain(MainId::Exact(main)),
                other,
                S::Certain(MainId::Exact(main)),
                T::OtherExit,
                E::None,
            ),
            (
                S::Uncertain(Some(ticks(10, 2))),
                main,
                S::Uncertain(None),
                T::CandidateExit,
                E::Hint,
            ),
            (
                S::Uncertain(Some(ticks(10, 2))),
                other,
                S::Uncertain(Some(ticks(10, 2))),
                T::OtherExit,
                E::None,
            ),
            (
                S::Uncertain(None),
                other,
                S::Uncertain(None),
                T::UnknownMainExit,
                E::Hint,
            ),
            (S::Fresh, other, S::Fresh, T::OtherExit, E::None),
            // A duplicated exit record is not a second death.
            (
                S::Exited(MainId::Exact(main)),
                main,
                S::Exited(MainId::Exact(main)),
                T::OtherExit,
                E::None,
            ),
        ];
        for (i, (state, process, next, transition, effect)) in rows.into_iter().enumerate() {
            assert_eq!(
                state.exit(process, false, TICK),
                Step {
                    next: Some(next),
                    transition,
                    effect
                },
                "row {i}: {state:?} exit {process:?}"
            );
        }
    }

    /// A flagged exit record (a kernel read failed: status and start time may
    /// be zeros) is never a certain death: the main's pid gives a hint.
    #[test]
    fn an_exit_with_a_read_error_is_a_hint() {
        let main = key(10, 25_000_000);
        let zeroed = key(10, 0);
        let rows = [
            (
                S::Certain(MainId::Exact(main)),
                main,
                S::Uncertain(None),
                T::UnreadExit,
                E::Hint,
            ),
            // The start time read as zero: the main's pid still gives the hint
            // (unflagged, it would not match and the death would be lost).
            (
                S::Certain(MainId::Exact(main)),
                zeroed,
                S::Uncertain(None),
                T::UnreadExit,
                E::Hint,
            ),
            (
                S::Uncertain(Some(ticks(10, 2))),
                zeroed,
                S::Uncertain(None),
                T::UnreadExit,
                E::Hint,
            ),
            (
                S::Certain(MainId::Exact(main)),
                key(11, 0),
                S::Certain(MainId::Exact(main)),
                T::OtherExit,
                E::None,
            ),
            (
                S::Uncertain(None),
                zeroed,
                S::Uncertain(None),
                T::UnknownMainExit,
                E::Hint,
            ),
        ];
        for (i, (state, process, next, transition, effect)) in rows.into_iter().enumerate() {
            assert_eq!(
                state.exit(process, true, TICK),
                Step {
                    next: Some(next),
                    transition,
                    effect
                },
                "row {i}: {state:?} flagged exit {process:?}"
            );
        }
    }

    #[test]
    fn contradiction_and_lost_records_table() {
        let m = exact(10, 1_000);
        type Input = fn(MainState) -> Step;
        let (contradicted, lost): (Input, Input) = (S::contradicted, S::records_lost);
        let rows = [
            (
                S::Exited(m),
                contradicted,
                S::Uncertain(None),
                T::Contradicted,
            ),
            (S::Certain(m), contradicted, S::Certain(m), T::Unchanged),
            (S::Fresh, lost, S::Uncertain(None), T::Demoted),
            (S::Certain(m), lost, S::Uncertain(Some(m)), T::Demoted),
            (S::Exited(m), lost, S::Exited(m), T::Unchanged),
            (S::Uncertain(None), lost, S::Uncertain(None), T::Unchanged),
        ];
        for (i, (state, input, next, transition)) in rows.into_iter().enumerate() {
            assert_eq!(
                input(state),
                Step {
                    next: Some(next),
                    transition,
                    effect: E::None
                },
                "row {i}: {state:?}"
            );
        }
        // After a contradiction the runtime's pid makes the main certain again,
        // and its exit is the death.
        let runtime = ticks(30, 2);
        let step = S::Exited(m).contradicted().next.expect("kept");
        let step = step.confirm(runtime, TICK).next.expect("kept");
        assert_eq!(step, S::Certain(runtime));
        assert_eq!(
            step.exit(key(30, 25_000_000), false, TICK).effect,
            E::Died(30)
        );
    }

    #[test]
    fn confirm_table() {
        let runtime = ticks(20, 5);
        let rows = [
            (S::Fresh, S::Certain(runtime), T::Confirmed),
            (S::Uncertain(None), S::Certain(runtime), T::Confirmed),
            // The runtime's pid replaces a different candidate.
            (
                S::Uncertain(Some(ticks(21, 5))),
                S::Certain(runtime),
                T::Confirmed,
            ),
            (
                S::Certain(exact(20, 55_000_000)),
                S::Certain(exact(20, 55_000_000)),
                T::Agreed,
            ),
            (
                S::Certain(exact(21, 55_000_000)),
                S::Certain(runtime),
                T::Corrected,
            ),
            (
                S::Certain(exact(20, 95_000_000)),
                S::Certain(runtime),
                T::Corrected,
            ),
            (
                S::Exited(exact(20, 55_000_000)),
                S::Exited(exact(20, 55_000_000)),
                T::StaleConfirmation,
            ),
        ];
        for (i, (state, next, transition)) in rows.into_iter().enumerate() {
            assert_eq!(
                state.confirm(runtime, TICK),
                Step {
                    next: Some(next),
                    transition,
                    effect: E::None
                },
                "row {i}: {state:?}"
            );
        }
    }

    #[test]
    fn removal_and_history_table() {
        let rows = [
            (S::Exited(exact(1, 1)), T::RemovedAfterDeath, E::None),
            (
                S::Certain(exact(1, 1)),
                T::RemovedBeforeDeath,
                E::HintAndRelist,
            ),
            (
                S::Uncertain(Some(exact(1, 1))),
                T::RemovedBeforeDeath,
                E::HintAndRelist,
            ),
            (S::Uncertain(None), T::RemovedAfterHints, E::Hint),
            (S::Fresh, T::RemovedUnstarted, E::None),
        ];
        for (state, transition, effect) in rows {
            assert_eq!(
                state.removed(),
                Step {
                    next: None,
                    transition,
                    effect
                },
                "{state:?}"
            );
        }
        assert_eq!(
            S::Uncertain(Some(exact(1, 1))).history_in_ring().next,
            Some(S::Fresh)
        );
        assert_eq!(S::Uncertain(None).history_in_ring().next, Some(S::Fresh));
        for s in [S::Fresh, S::Certain(exact(1, 1)), S::Exited(exact(1, 1))] {
            assert_eq!(
                s.history_in_ring(),
                Step {
                    next: Some(s),
                    transition: T::Unchanged,
                    effect: E::None
                }
            );
        }
    }
}
