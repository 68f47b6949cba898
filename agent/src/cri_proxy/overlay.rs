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
//! | `Pending` | the runtime says exited (answer or check) | none (caught up) |
//! | `Pending` | still running past the bound | none (contradiction, counted) |
//! | `Pending` | the container is removed | none |

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use evpleg_cri_api::v1;

use crate::pleg::{ContainerId, ExitStatus};

/// How long the runtime may keep saying "running" after a certain kernel
/// death before the runtime wins (the kernel PLEG's own bound).
pub const CONFIRM_BOUND: Duration = crate::pleg::relist::CONFIRM_BOUND;

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
    }
}

/// The deaths the runtime has not reported yet.
#[derive(Debug, Default)]
pub struct Overlay {
    pending: Mutex<HashMap<ContainerId, KernelDeath>>,
}

/// What a runtime answer said about a pending death.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// The runtime still says running: the answer was rewritten.
    Overlaid,
    /// The runtime caught up: the entry is gone.
    CaughtUp(KernelDeath),
}

fn running(state: i32) -> bool {
    state == v1::ContainerState::ContainerRunning as i32
}

impl Overlay {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ContainerId, KernelDeath>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A certain kernel death.
    pub fn died(&self, id: ContainerId, death: KernelDeath) {
        self.lock().insert(id, death);
    }

    /// The entry of `id`, if pending.
    pub fn get(&self, id: &ContainerId) -> Option<KernelDeath> {
        self.lock().get(id).copied()
    }

    /// Ends the entry of `id` (removed, caught up, contradicted).
    pub fn forget(&self, id: &ContainerId) -> Option<KernelDeath> {
        self.lock().remove(id)
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Lays a pending death on a status the runtime reports running; a status
    /// the runtime reports otherwise ends the entry.
    pub fn status(&self, status: &mut v1::ContainerStatus) -> Option<Seen> {
        let id = ContainerId::parse(&status.id)?;
        let mut pending = self.lock();
        let death = *pending.get(&id)?;
        if running(status.state) {
            death.lay_on(status);
            Some(Seen::Overlaid)
        } else {
            pending.remove(&id);
            Some(Seen::CaughtUp(death))
        }
    }

    /// The same for a ListContainers entry (which has no exit code).
    pub fn listed(&self, c: &mut v1::Container) -> Option<Seen> {
        let id = ContainerId::parse(&c.id)?;
        let mut pending = self.lock();
        let death = *pending.get(&id)?;
        if running(c.state) {
            c.state = v1::ContainerState::ContainerExited as i32;
            Some(Seen::Overlaid)
        } else {
            pending.remove(&id);
            Some(Seen::CaughtUp(death))
        }
    }

    /// ListContainers: entries overlaid; with a state filter of RUNNING, the
    /// ones shown exited are left out, as the runtime will leave them out.
    pub fn list(
        &self,
        resp: &mut v1::ListContainersResponse,
        filter_state: Option<i32>,
    ) -> Vec<Seen> {
        let mut seen = Vec::new();
        resp.containers.retain_mut(|c| {
            let s = self.listed(c);
            seen.extend(s);
            !(s == Some(Seen::Overlaid) && filter_state.is_some_and(running))
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
