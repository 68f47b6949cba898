//! The overlay: a container whose death the kernel saw with certainty, while
//! the runtime still reports it running, is shown exited in the proxy's
//! answers to ListContainers, ContainerStatus and PodSandboxStatus, with the
//! kernel's exit code, reason and finish time.
//!
//! The kubelet (1.37's hint mode) relists a pod as soon as it gets an event;
//! a runtime that learns of the death 40-630 ms later (containerd 1.6 here)
//! would still say "running", and the kubelet would wait for its next relist.
//! The overlay follows the kernel PLEG's trust rules (docs/pleg.md): only a
//! certain death of a main process enters it (an `ExecSync` or probe never
//! does), and each entry lives until the runtime agrees (its own answer then
//! passes unchanged) or, as in contract clause 3, until the runtime still
//! contradicts it past [`CONFIRM_BOUND`]: then the runtime wins.
//!
//! | state | event | next |
//! |---|---|---|
//! | none | certain kernel death | `Pending` |
//! | `Pending` | the runtime says running, created or unknown (answer or check) | `Pending`, the answer shown exited |
//! | `Pending` | the runtime says exited (answer or check) | `Settled` (caught up) |
//! | `Pending` | not exited yet past the bound | none (contradiction, counted) |
//! | `Pending` | the container is removed | none |
//! | `Settled` | an answer not exited (made before the runtime caught up) | `Settled`, the answer shown exited |
//! | `Settled` | the container is removed, or [`MAX_SETTLED`] later settlements | none |
//!
//! Only EXITED is the runtime catching up. The runtime lags at a start as at
//! a death: a container whose main process exec'd and exited before
//! containerd finished StartContainer is CREATED in its answers until then
//! (then RUNNING, then EXITED). Taking CREATED for "caught up" (a first
//! version did) dropped such a death: the STOPPED's payload and the
//! kubelet's relist on it said CREATED, and no later event came (issue #15,
//! `cri_proxy::a_death_before_the_runtime_finished_the_start_is_shown_exited`).
//! An answer shown exited that had no start time (CREATED) gets the exit's
//! time as its start: the kernel saw it start, no later than that.
//!
//! A sandbox whose pause process the kernel saw exit is shown not ready the
//! same way, in PodSandboxStatus and ListPodSandbox answers (a list
//! filtered on READY leaves it out), until the runtime says NOTREADY, it is
//! removed, or the bound passes: the same table, with READY for running and
//! NOTREADY for exited.
//!
//! Once the runtime has said EXITED (NOTREADY), the entry is settled: an
//! answer it made before, still on its way, says RUNNING (READY), and is
//! stale, since a container never runs again once exited. It is shown
//! exited too, for [`MAX_SETTLED`] settlements (issue #30: a kubelet relist
//! listed the container exited, overlaid, then read its ContainerStatus
//! RUNNING as made before containerd's catch-up and answered after it; the
//! kubelet kept that RUNNING, and no later listing changed to make it look
//! again). The runtime's own EXITED answers pass unchanged; a removal ends
//! the settlement, a contradiction never makes one. [`Overlay::epoch`]
//! tells an answer made after every settlement, which needs no look.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use evpleg_cri_api::v1;

use evpleg_core::ids::ContainerId;
use evpleg_core::lifecycle::ExitStatus;

/// How long the runtime may keep saying "running" after a certain kernel
/// death before the runtime wins (the kernel PLEG's own bound).
pub const CONFIRM_BOUND: Duration = evpleg_pleg::relist::CONFIRM_BOUND;

/// A death the kernel saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelDeath {
    pub exit: ExitStatus,
    /// CLOCK_MONOTONIC ns of the exit.
    pub at_ns: u64,
    /// The same instant in Unix ns (the CRI's `finished_at`).
    pub finished_at: i64,
}

impl KernelDeath {
    /// containerd's reasons: OOMKilled, else Completed for 0, else Error.
    pub fn reason(&self) -> &'static str {
        if self.exit.oom_killed {
            "OOMKilled"
        } else if self.exit.code == 0 {
            "Completed"
        } else {
            "Error"
        }
    }

    /// `status` as it will read once the runtime catches up.
    fn lay_on(&self, status: &mut v1::ContainerStatus) {
        status.state = v1::ContainerState::ContainerExited as i32;
        status.exit_code = self.exit.code;
        status.finished_at = self.finished_at;
        status.reason = self.reason().to_owned();
        if status.started_at == 0 {
            status.started_at = self.finished_at;
        }
    }
}

/// How many settled entries are kept (the oldest go first): each is for
/// answers already on their way when the runtime caught up.
pub const MAX_SETTLED: usize = 4096;

/// The deaths the runtime has not reported yet, and those it has reported
/// lately ([`Settled`]).
#[derive(Debug, Default)]
pub struct Overlay {
    pending: Mutex<HashMap<ContainerId, KernelDeath>>,
    /// Sandboxes whose pause process died, the runtime not saying so yet.
    sandboxes: Mutex<HashSet<ContainerId>>,
    settled: Mutex<Settled>,
}

/// Deaths the runtime has reported (EXITED, a sandbox NOTREADY): a
/// non-exited answer about them is stale. Each keeps the settlement's
/// number; `epoch` is the last one's.
#[derive(Debug, Default)]
struct Settled {
    containers: HashMap<ContainerId, (KernelDeath, u64)>,
    sandboxes: HashMap<ContainerId, u64>,
    epoch: u64,
}

impl Settled {
    fn next(&mut self) -> u64 {
        self.epoch += 1;
        if self.containers.len() + self.sandboxes.len() >= MAX_SETTLED {
            // The oldest half goes.
            let keep_from = self.epoch.saturating_sub(MAX_SETTLED as u64 / 2);
            self.containers.retain(|_, (_, e)| *e >= keep_from);
            self.sandboxes.retain(|_, e| *e >= keep_from);
        }
        self.epoch
    }
}

/// What a runtime answer said about a pending death.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// The runtime still says running: the answer was rewritten.
    Overlaid,
    /// The runtime caught up: the entry is gone.
    CaughtUp(KernelDeath),
    /// The runtime says a pending sandbox not ready: the entry is gone.
    SandboxCaughtUp,
}

/// Whether a runtime's answer has caught up with a kernel death: only
/// EXITED. RUNNING, CREATED (the start not finished in the runtime yet) and
/// UNKNOWN have not.
pub fn caught_up(state: i32) -> bool {
    state == v1::ContainerState::ContainerExited as i32
}

impl Overlay {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ContainerId, KernelDeath>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A certain kernel death.
    pub fn died(&self, id: ContainerId, death: KernelDeath) {
        self.lock().insert(id, death);
    }

    fn settled_lock(&self) -> std::sync::MutexGuard<'_, Settled> {
        self.settled.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The runtime reported `id`'s death: its entry is settled (answers
    /// made before still show it exited). Whether it was pending.
    pub fn settle(&self, id: &ContainerId) -> bool {
        let Some(death) = self.lock().remove(id) else {
            return false;
        };
        let mut settled = self.settled_lock();
        let epoch = settled.next();
        settled.containers.insert(id.clone(), (death, epoch));
        true
    }

    /// The same for a sandbox the runtime reported not ready.
    pub fn settle_sandbox(&self, id: &ContainerId) -> bool {
        if !self.sandboxes_lock().remove(id) {
            return false;
        }
        let mut settled = self.settled_lock();
        let epoch = settled.next();
        settled.sandboxes.insert(id.clone(), epoch);
        true
    }

    /// The number of the last settlement: read before forwarding a call, it
    /// tells whether its answer can be stale ([`Self::quiet_since`]).
    pub fn epoch(&self) -> u64 {
        self.settled_lock().epoch
    }

    /// Nothing pending, and nothing settled since `epoch`: an answer to a
    /// call forwarded at `epoch` needs no look.
    pub fn quiet_since(&self, epoch: u64) -> bool {
        self.is_empty() && self.settled_lock().epoch == epoch
    }

    /// The entry of `id`, if pending.
    pub fn get(&self, id: &ContainerId) -> Option<KernelDeath> {
        self.lock().get(id).copied()
    }

    /// Ends the entry of `id` (removed, contradicted, gone), settled or not.
    pub fn forget(&self, id: &ContainerId) -> Option<KernelDeath> {
        self.settled_lock().containers.remove(id);
        self.lock().remove(id)
    }

    pub fn len(&self) -> usize {
        self.lock().len() + self.sandboxes_lock().len()
    }

    fn sandboxes_lock(&self) -> std::sync::MutexGuard<'_, HashSet<ContainerId>> {
        self.sandboxes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The kernel saw sandbox `id`'s pause process exit.
    pub fn sandbox_died(&self, id: ContainerId) {
        self.sandboxes_lock().insert(id);
    }

    /// Ends the entry of sandbox `id`, settled or not; whether one was
    /// pending.
    pub fn forget_sandbox(&self, id: &ContainerId) -> bool {
        self.settled_lock().sandboxes.remove(id);
        self.sandboxes_lock().remove(id)
    }

    /// A sandbox's `state` in an answer: READY shown NOTREADY while pending
    /// or settled; any other state settles a pending entry.
    fn sandbox_seen(&self, id: &str, state: &mut i32) -> Option<Seen> {
        let id = ContainerId::parse(id)?;
        let ready = *state == v1::PodSandboxState::SandboxReady as i32;
        let pending = self.sandboxes_lock().contains(&id);
        if !pending && !self.settled_lock().sandboxes.contains_key(&id) {
            return None;
        }
        if ready {
            *state = v1::PodSandboxState::SandboxNotready as i32;
            Some(Seen::Overlaid)
        } else if pending {
            self.settle_sandbox(&id);
            Some(Seen::SandboxCaughtUp)
        } else {
            None
        }
    }

    /// PodSandboxStatus's own status.
    pub fn sandbox_status(&self, status: &mut v1::PodSandboxStatus) -> Option<Seen> {
        self.sandbox_seen(&status.id, &mut status.state)
    }

    /// ListPodSandbox: entries overlaid; filtered on READY, the ones shown
    /// not ready are left out.
    pub fn list_sandboxes(
        &self,
        resp: &mut v1::ListPodSandboxResponse,
        filter_state: Option<i32>,
    ) -> Vec<Seen> {
        let ready = v1::PodSandboxState::SandboxReady as i32;
        let mut seen = Vec::new();
        resp.items.retain_mut(|s| {
            let o = self.sandbox_seen(&s.id, &mut s.state);
            seen.extend(o);
            !(o == Some(Seen::Overlaid) && filter_state == Some(ready))
        });
        seen
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The death of `id` as an answer in `state` meets it: `Some((death,
    /// true))` when the answer has not caught up ([`caught_up`]) with a
    /// pending or settled death, to be laid on it; `Some((death, false))`
    /// when it catches up with a pending one, now settled; `None` otherwise.
    fn meet(&self, id: &ContainerId, state: i32) -> Option<(KernelDeath, bool)> {
        let pending = self.lock().get(id).copied();
        match pending {
            Some(death) if caught_up(state) => {
                self.settle(id);
                Some((death, false))
            }
            Some(death) => Some((death, true)),
            None if caught_up(state) => None,
            None => {
                let settled = self.settled_lock();
                settled.containers.get(id).map(|(death, _)| (*death, true))
            }
        }
    }

    /// Lays a pending (or settled) death on a status the runtime has not
    /// caught up in ([`caught_up`]); a status that says exited settles a
    /// pending entry.
    pub fn status(&self, status: &mut v1::ContainerStatus) -> Option<Seen> {
        let id = ContainerId::parse(&status.id)?;
        match self.meet(&id, status.state)? {
            (death, true) => {
                death.lay_on(status);
                Some(Seen::Overlaid)
            }
            (death, false) => {
                // Later stale answers get the runtime's own end.
                if let Some((d, _)) = self.settled_lock().containers.get_mut(&id) {
                    d.exit.code = status.exit_code;
                    d.exit.oom_killed = status.reason == "OOMKilled";
                    d.finished_at = status.finished_at;
                }
                Some(Seen::CaughtUp(death))
            }
        }
    }

    /// The same for a ListContainers entry (which has no exit code).
    pub fn listed(&self, c: &mut v1::Container) -> Option<Seen> {
        let id = ContainerId::parse(&c.id)?;
        match self.meet(&id, c.state)? {
            (_, true) => {
                c.state = v1::ContainerState::ContainerExited as i32;
                Some(Seen::Overlaid)
            }
            (death, false) => Some(Seen::CaughtUp(death)),
        }
    }

    /// ListContainers: entries overlaid; with a state filter other than
    /// EXITED (RUNNING, CREATED), the ones shown exited are left out, as the
    /// runtime will leave them out.
    pub fn list(
        &self,
        resp: &mut v1::ListContainersResponse,
        filter_state: Option<i32>,
    ) -> Vec<Seen> {
        let mut seen = Vec::new();
        resp.containers.retain_mut(|c| {
            let s = self.listed(c);
            seen.extend(s);
            !(s == Some(Seen::Overlaid) && filter_state.is_some_and(|f| !caught_up(f)))
        });
        seen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> ContainerId {
        ContainerId::parse(&format!("{n:064x}")).unwrap()
    }

    fn death(code: i32, oom: bool) -> KernelDeath {
        KernelDeath {
            exit: ExitStatus {
                code,
                signal: (code > 128).then_some(code - 128),
                core_dumped: false,
                oom_killed: oom,
            },
            at_ns: 5,
            finished_at: 1_700_000_000_000_000_000,
        }
    }

    fn status(n: u8, state: v1::ContainerState) -> v1::ContainerStatus {
        v1::ContainerStatus {
            id: id(n).to_string(),
            state: state as i32,
            started_at: 1,
            ..Default::default()
        }
    }

    use v1::ContainerState::{ContainerExited as Exited, ContainerRunning as Running};

    /// The module's state table, row by row.
    #[test]
    fn the_state_table() {
        let o = Overlay::default();
        // No entry: the runtime's answer is untouched.
        let mut s = status(1, Running);
        assert_eq!(o.status(&mut s), None);
        assert_eq!(s, status(1, Running));
        // Pending + running: shown exited with the kernel's data.
        o.died(id(1), death(137, false));
        let mut s = status(1, Running);
        assert_eq!(o.status(&mut s), Some(Seen::Overlaid));
        assert_eq!(
            (s.state(), s.exit_code, s.reason.as_str()),
            (Exited, 137, "Error")
        );
        assert_eq!(s.finished_at, death(137, false).finished_at);
        assert_eq!(s.started_at, 1, "the rest is the runtime's");
        // Pending + the runtime says exited: its answer passes, the entry ends.
        let mut runtime = status(1, Exited);
        runtime.exit_code = 137;
        let before = runtime.clone();
        assert_eq!(
            o.status(&mut runtime),
            Some(Seen::CaughtUp(death(137, false)))
        );
        assert_eq!(runtime, before);
        assert!(o.is_empty());
        // Removed or contradicted: forgotten.
        o.died(id(2), death(0, false));
        assert!(o.forget(&id(2)).is_some());
        let mut s = status(2, Running);
        assert_eq!(o.status(&mut s), None);
    }

    /// The runtime lags at a start: CREATED (and UNKNOWN) have not caught up
    /// with a kernel death; the answer is shown exited, and the entry lives
    /// on through RUNNING until EXITED.
    #[test]
    fn created_and_unknown_are_not_caught_up() {
        use v1::ContainerState::{ContainerCreated as Created, ContainerUnknown as Unknown};
        let o = Overlay::default();
        o.died(id(1), death(3, false));
        let mut s = status(1, Created);
        s.started_at = 0;
        assert_eq!(o.status(&mut s), Some(Seen::Overlaid));
        let finished = death(3, false).finished_at;
        assert_eq!(
            (s.state(), s.exit_code, s.reason.as_str(), s.finished_at),
            (Exited, 3, "Error", finished)
        );
        assert_eq!(s.started_at, finished, "no start time: the exit's");
        for state in [Unknown, Running] {
            let mut s = status(1, state);
            assert_eq!(o.status(&mut s), Some(Seen::Overlaid), "{state:?}");
            assert_eq!((s.state(), s.started_at), (Exited, 1), "{state:?}");
        }
        let listed = |state: v1::ContainerState| v1::Container {
            id: id(1).to_string(),
            state: state as i32,
            ..Default::default()
        };
        let mut all = v1::ListContainersResponse {
            containers: vec![listed(Created)],
        };
        let mut created_only = all.clone();
        assert_eq!(o.list(&mut all, None), vec![Seen::Overlaid]);
        assert_eq!(all.containers[0].state(), Exited);
        o.list(&mut created_only, Some(Created as i32));
        assert!(created_only.containers.is_empty(), "filtered on CREATED");
        assert_eq!(o.len(), 1, "pending until the runtime says exited");
        let mut s = status(1, Exited);
        assert_eq!(o.status(&mut s), Some(Seen::CaughtUp(death(3, false))));
        assert!(o.is_empty());
    }

    /// Issue #26: the sandboxes' table: READY shown NOTREADY while
    /// pending (left out of a list filtered on READY), the runtime's
    /// NOTREADY ends the entry, another sandbox is untouched.
    #[test]
    fn a_dead_pause_process_shows_its_sandbox_not_ready() {
        use v1::PodSandboxState::{SandboxNotready as NotReady, SandboxReady as Ready};
        let o = Overlay::default();
        let status = |n: u8, state: v1::PodSandboxState| v1::PodSandboxStatus {
            id: id(n).to_string(),
            state: state as i32,
            created_at: 9,
            ..Default::default()
        };
        let mut s = status(1, Ready);
        assert_eq!(o.sandbox_status(&mut s), None);
        o.sandbox_died(id(1));
        assert!(!o.is_empty());
        assert_eq!(o.sandbox_status(&mut s), Some(Seen::Overlaid));
        assert_eq!((s.state(), s.created_at), (NotReady, 9));
        let listed = |n: u8| v1::PodSandbox {
            id: id(n).to_string(),
            state: Ready as i32,
            ..Default::default()
        };
        let mut all = v1::ListPodSandboxResponse {
            items: vec![listed(1), listed(2)],
        };
        let mut ready_only = all.clone();
        assert_eq!(o.list_sandboxes(&mut all, None), vec![Seen::Overlaid]);
        assert_eq!(
            all.items.iter().map(|s| s.state()).collect::<Vec<_>>(),
            [NotReady, Ready]
        );
        o.list_sandboxes(&mut ready_only, Some(Ready as i32));
        assert_eq!(ready_only.items, [listed(2)]);
        let mut caught_up = status(1, NotReady);
        assert_eq!(
            o.sandbox_status(&mut caught_up),
            Some(Seen::SandboxCaughtUp)
        );
        assert!(o.is_empty());
        o.sandbox_died(id(3));
        assert!(o.forget_sandbox(&id(3)));
        assert!(o.is_empty());
    }

    #[test]
    fn reasons_follow_the_runtime() {
        assert_eq!(death(0, false).reason(), "Completed");
        assert_eq!(death(3, false).reason(), "Error");
        assert_eq!(death(137, true).reason(), "OOMKilled");
    }

    #[test]
    fn a_list_filtered_on_running_leaves_out_the_dead() {
        let o = Overlay::default();
        o.died(id(1), death(1, false));
        let listed = |n| v1::Container {
            id: id(n).to_string(),
            state: Running as i32,
            ..Default::default()
        };
        let mut all = v1::ListContainersResponse {
            containers: vec![listed(1), listed(2)],
        };
        let mut running_only = all.clone();
        assert_eq!(o.list(&mut all, None), vec![Seen::Overlaid]);
        assert_eq!(all.containers[0].state(), Exited);
        assert_eq!(all.containers[1].state(), Running);
        o.list(&mut running_only, Some(Running as i32));
        assert_eq!(running_only.containers.len(), 1);
        assert_eq!(running_only.containers[0].id, id(2).to_string());
    }
}
