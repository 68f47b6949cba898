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
//! | `Fresh` | exec, not a runtime re-exec | `Certain` | Started | [`MainState::exec`]: `main_exec` |
//! | `Fresh` | exec, runtime re-exec | `Fresh` | none | `runtime_reexec` |
//! | `Certain(m)` | exec by `m` | `Certain` (new key) | none | `main_reexec` |
//! | `Certain`, `Uncertain`, `Exited` | exec by another process | same | none | `other_exec` |
//! | `Certain(m)` | exit of `m` | `Exited` | Died (status) | [`MainState::exit`]: `main_exit` |
//! | `Uncertain(Some(c))` | exit of `c` | `Uncertain(None)` | hint | `candidate_exit` |
//! | `Uncertain(None)` | any exit | same | hint | `unknown_main_exit` |
//! | other | another exit | same | none | `other_exit` |
//! | `Fresh`, `Uncertain` | runtime's pid confirmed | `Certain(pid)` | none | [`MainState::confirm`]: `confirmed` |
//! | `Certain(m)` | runtime's pid, not `m` | `Certain(pid)` | none | `corrected` |
//! | `Certain(m)` | runtime's pid is `m` | same | none | `agreed` |
//! | `Exited` | runtime's pid | same | none | `stale_confirmation` |
//! | `Uncertain` | its mkdir read from the ring | `Fresh` | none | [`MainState::history_in_ring`] |
//! | `Exited` | cgroup removed | forgotten | none | [`MainState::removed`]: `removed_after_death` |
//! | `Fresh` | cgroup removed | forgotten | none | `removed_unstarted` |
//! | `Uncertain(None)` | cgroup removed | forgotten | hint | `removed_after_hints` |
//! | `Certain`, `Uncertain(Some)` | cgroup removed | forgotten | hint + relist | `removed_before_death` |
//!
//! A removal misses nothing when no main process ever ran (`Fresh`: a container
//! created and never started), or when every exit since the candidate's was
//! already a hint (`Uncertain(None)`); otherwise the main process's exit was
//! missed, and the pod is relisted.
//!
//! A container leaves `Exited` only by being forgotten: Kubernetes restarts a
//! container under a new id, in a new cgroup.

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
    /// init): the first exec that is not a runtime re-exec is the main process.
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
    pub fn exec(self, process: ProcessKey, runtime_reexec: bool, tick_ns: u64) -> Step {
        use Transition::*;
        match self {
            Self::Fresh if runtime_reexec => step(self, RuntimeReexec, Effect::None),
            Self::Fresh => step(
                Self::Certain(MainId::Exact(process)),
                MainExec,
                Effect::Started(process.pid),
            ),
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

    /// A process in the container exited.
    pub fn exit(self, process: ProcessKey, tick_ns: u64) -> Step {
        use Transition::*;
        match self {
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
        let main = key(10, 1_000);
        let other = key(11, 2_000);
        let reused = key(10, 9_000);
        // (state, process, runtime re-exec, next, transition, effect)
        let rows = [
            (
                S::Fresh,
                main,
                false,
                S::Certain(MainId::Exact(main)),
                T::MainExec,
                E::Started(10),
            ),
            (S::Fresh, main, true, S::Fresh, T::RuntimeReexec, E::None),
            (
                S::Certain(exact(10, 1_000)),
                main,
                false,
                S::Certain(MainId::Exact(main)),
                T::MainReexec,
                E::None,
            ),
            (
                S::Certain(exact(10, 1_000)),
                other,
                false,
                S::Certain(exact(10, 1_000)),
                T::OtherExec,
                E::None,
            ),
            // A reused pid is another process.
            (
                S::Certain(exact(10, 1_000)),
                reused,
                false,
                S::Certain(exact(10, 1_000)),
                T::OtherExec,
                E::None,
            ),
            // Scanned main re-exec'ing: 1_000 ns is tick 0.
            (
                S::Certain(ticks(10, 0)),
                main,
                false,
                S::Certain(MainId::Exact(main)),
                T::MainReexec,
                E::None,
            ),
            // An exec into a container whose main is uncertain or unknown (an exec
            // probe, `kubectl exec`) never becomes the main process.
            (
                S::Uncertain(None),
                other,
                false,
                S::Uncertain(None),
                T::OtherExec,
                E::None,
            ),
            (
                S::Uncertain(Some(ticks(10, 0))),
                other,
                false,
                S::Uncertain(Some(ticks(10, 0))),
                T::OtherExec,
                E::None,
            ),
            (
                S::Exited(exact(10, 1_000)),
                other,
                false,
                S::Exited(exact(10, 1_000)),
                T::OtherExec,
                E::None,
            ),
        ];
        for (i, (state, process, reexec, next, transition, effect)) in rows.into_iter().enumerate()
        {
            let got = state.exec(process, reexec, TICK);
            assert_eq!(
                got,
                Step {
                    next: Some(next),
                    transition,
                    effect
                },
                "row {i}: {state:?} exec {process:?}"
            );
        }
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
                state.exit(process, TICK),
                Step {
                    next: Some(next),
                    transition,
                    effect
                },
                "row {i}: {state:?} exit {process:?}"
            );
        }
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
