//! Reconciling the tracker with the runtime's view after every relist
//! (`docs/pleg.md` clause 4): containers the runtime lists and the tracker does not
//! know are learned (a rescan of the cgroup tree is due), the runtime's pid makes
//! the main process certain or corrects it, sandboxes are marked, and everything
//! kept per container is forgotten once the runtime no longer lists it, so a lost
//! rmdir cannot grow memory forever.

use std::collections::HashSet;

use super::{MainId, Output, Tracker, Transition};
use crate::pleg::kernel::cgroup_path::{CgroupClass, classify};
use crate::pleg::kernel::proc::Reconciliation;
use crate::pleg::{ContainerId, PodUid};

/// What a reconcile did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReconcileOutcome {
    /// A running container the runtime lists has no known cgroup: rescan, then
    /// reconcile again with `after_rescan`.
    pub rescan_due: bool,
    pub confirmed: usize,
    /// Containers whose certain main process the runtime's pid replaced.
    pub corrected: Vec<ContainerId>,
    /// Runtime pids not alive in the container's cgroup.
    pub unconfirmed: usize,
    /// Containers forgotten.
    pub pruned: usize,
}

/// Whether a cgroup2 path is container `id`'s cgroup or one nested in it.
fn in_container(path: &str, id: &ContainerId) -> bool {
    matches!(classify(path), Ok(CgroupClass::Container { id: ref c, .. }) if c == id)
}

impl Tracker {
    /// Applies a relist's view. `after_rescan`: the rescan a previous call asked
    /// for ran; running containers still unknown are remembered as not found (no
    /// rescan for them again while the runtime lists them).
    pub fn reconcile(&mut self, r: &Reconciliation, after_rescan: bool) -> ReconcileOutcome {
        let view = &r.view;
        let mut outcome = ReconcileOutcome::default();
        for c in &view.containers {
            if c.sandbox {
                self.sandboxes.insert(c.id.clone(), Some(c.pod.clone()));
            }
            let Some(container) = self.containers.get_mut(&c.id) else {
                if c.running {
                    if after_rescan {
                        self.unfound.insert(c.id.clone(), c.pod.clone());
                    } else if !self.unfound.contains_key(&c.id) {
                        outcome.rescan_due = true;
                    }
                }
                continue;
            };
            // `/k8s.io/<id>` does not name the pod; the runtime does.
            if container.pod_uid.is_none() {
                container.pod_uid = Some(c.pod.clone());
            }
            let Some(proc) = r.mains.get(&c.id) else {
                continue;
            };
            if !in_container(&proc.cgroup, &c.id) {
                self.stats.unconfirmed += 1;
                outcome.unconfirmed += 1;
                continue;
            }
            let runtime_main = MainId::Ticks {
                pid: proc.pid,
                start_ticks: proc.start_ticks,
            };
            let step = container.state.confirm(runtime_main, self.tick_ns);
            match step.transition {
                Transition::Confirmed => {
                    self.stats.confirmed += 1;
                    outcome.confirmed += 1;
                }
                Transition::Corrected => {
                    self.stats.corrected += 1;
                    outcome.corrected.push(c.id.clone());
                }
                _ => {}
            }
            // Confirmation has no effect to report.
            self.apply(&c.id, step, view.listed_at_ns, None, &mut Output::default());
        }
        outcome.pruned = self.prune(r);
        self.stats.pruned += outcome.pruned as u64;
        outcome
    }

    /// Forgets what the view's scope no longer lists, except what was learned
    /// after the listing started, or less than the grace before it. Returns how
    /// many containers were forgotten.
    fn prune(&mut self, r: &Reconciliation) -> usize {
        let view = &r.view;
        let at = view.listed_at_ns.saturating_sub(self.prune_grace_ns);
        let listed: HashSet<&ContainerId> = view.containers.iter().map(|c| &c.id).collect();
        let pods: HashSet<&PodUid> = view.containers.iter().map(|c| &c.pod).collect();
        let in_scope = |pod: Option<&PodUid>| match &view.scope {
            None => true,
            Some(scope) => pod == Some(scope),
        };
        let gone: Vec<ContainerId> = self
            .containers
            .iter()
            .filter(|(id, c)| {
                in_scope(c.pod_uid.as_ref()) && !listed.contains(id) && c.learned_at_ns < at
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in &gone {
            self.containers.remove(id);
        }
        let gone_set: HashSet<&ContainerId> = gone.iter().collect();
        let containers = &self.containers;
        let full = view.scope.is_none();
        self.index.retain(|e| {
            if e.learned_at_ns >= at {
                return true;
            }
            match &e.class {
                CgroupClass::Container { id, .. } | CgroupClass::RuntimeHelper { id } => {
                    if gone_set.contains(id) {
                        return false;
                    }
                    let scoped = full || in_scope(e.pod());
                    !scoped || listed.contains(id) || containers.contains_key(id)
                }
                CgroupClass::Pod { uid, .. } => !in_scope(Some(uid)) || pods.contains(uid),
                CgroupClass::NodeLevel { .. } => true,
            }
        });
        if full {
            self.index.forget_ignored_before(at);
        }
        self.sandboxes.retain(|id, pod| {
            let scoped = full || in_scope(pod.as_ref());
            !gone_set.contains(id)
                && (!scoped || listed.contains(id) || containers.contains_key(id))
        });
        self.unfound
            .retain(|id, pod| !in_scope(Some(&*pod)) || listed.contains(id));
        gone.len()
    }
}
