//! Reconciling the tracker with the runtime's view after every relist
//! (`docs/pleg.md` clause 4): containers the runtime lists and the tracker does not
//! know are learned (a rescan of the cgroup tree is due), the runtime's pid makes
//! the main process certain or corrects it, sandboxes are marked, and everything
//! kept per container is forgotten once the runtime no longer lists it, so a lost
//! rmdir cannot grow memory forever.

use crate::kernel::FastSet as HashSet;

use super::{MainId, Output, Tracker, Transition, link};
use crate::kernel::proc::Reconciliation;
use evpleg_core::cgroup_path::{CgroupClass, classify};
use evpleg_core::ids::{ContainerId, PodUid};

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
    /// Running containers whose cgroup the rescan did not find, newly
    /// remembered as not found (their deaths wait for a relist: logged, and
    /// counted in `evpleg_pleg_kernel_unfound_containers`).
    pub unfound: Vec<ContainerId>,
}

/// Whether a cgroup2 path is container `id`'s cgroup or one nested in it.
fn in_container(path: &str, id: &ContainerId) -> bool {
    matches!(classify(path), Ok(CgroupClass::Container { id: ref c, .. }) if c == id)
}

/// A relist's view being applied a part at a time
/// ([`Tracker::start_reconcile`], [`Tracker::reconcile_part`]): the reader
/// applies a full relist's view, which lists every container of the node,
/// between its reads of the ring buffer, so that the records behind it wait
/// for one part, not for the whole view (a full view of 30 000 containers
/// held them 61-65 ms, issue #29). Each container is reconciled as the whole view would
/// reconcile it at that moment, and a view is always applied after it was
/// listed: a record read between two parts is handled as one read before
/// the view (its container's part to come) or after it (its part done),
/// both orders a view applied at once has with the records read while it
/// was on its way. The prune, which needs the whole view, comes last.
#[derive(Debug)]
pub struct Reconciling {
    r: Reconciliation,
    after_rescan: bool,
    /// The next of the view's containers to reconcile.
    next: usize,
    outcome: ReconcileOutcome,
}

impl Reconciling {
    /// The view, once applied.
    pub fn into_view(self) -> Reconciliation {
        self.r
    }
}

impl Tracker {
    /// Applies a relist's view. `after_rescan`: the rescan a previous call asked
    /// for ran; running containers still unknown are remembered as not found (no
    /// rescan for them again while the runtime lists them).
    pub fn reconcile(&mut self, r: &Reconciliation, after_rescan: bool) -> ReconcileOutcome {
        self.reconcile_with(r, after_rescan, Self::prune)
    }

    /// [`Tracker::reconcile`] with the prune given (tests compare two).
    pub(super) fn reconcile_with(
        &mut self,
        r: &Reconciliation,
        after_rescan: bool,
        prune: fn(&mut Self, &Reconciliation) -> usize,
    ) -> ReconcileOutcome {
        self.expire_removed(r);
        let mut outcome = ReconcileOutcome::default();
        self.reconcile_containers(r, 0..r.view.containers.len(), after_rescan, &mut outcome);
        outcome.pruned = prune(self, r);
        self.stats.pruned += outcome.pruned as u64;
        outcome
    }

    /// Starts applying a view a part at a time ([`Reconciling`]).
    pub fn start_reconcile(&mut self, r: Reconciliation, after_rescan: bool) -> Reconciling {
        self.expire_removed(&r);
        Reconciling {
            r,
            after_rescan,
            next: 0,
            outcome: ReconcileOutcome::default(),
        }
    }

    /// Reconciles up to `part` more of the view's containers; once all are,
    /// prunes and returns what was done (as [`Tracker::reconcile`] returns
    /// it), else `None`: parts are left.
    pub fn reconcile_part(
        &mut self,
        rec: &mut Reconciling,
        part: usize,
    ) -> Option<ReconcileOutcome> {
        let len = rec.r.view.containers.len();
        let end = rec.next.saturating_add(part.max(1)).min(len);
        let range = rec.next..end;
        self.reconcile_containers(&rec.r, range, rec.after_rescan, &mut rec.outcome);
        rec.next = end;
        if end < len {
            return None;
        }
        let mut outcome = std::mem::take(&mut rec.outcome);
        outcome.pruned = self.prune(&rec.r);
        self.stats.pruned += outcome.pruned as u64;
        Some(outcome)
    }

    /// What was removed before the view's grace is forgotten.
    fn expire_removed(&mut self, r: &Reconciliation) {
        let grace = r.view.listed_at_ns.saturating_sub(self.prune_grace_ns);
        self.removed.expire_before(grace);
    }

    /// Reconciles the view's containers in `range`.
    fn reconcile_containers(
        &mut self,
        r: &Reconciliation,
        range: std::ops::Range<usize>,
        after_rescan: bool,
        outcome: &mut ReconcileOutcome,
    ) {
        let view = &r.view;
        for c in &view.containers[range] {
            // Marked once: a pod's view comes after every death.
            if c.sandbox && !matches!(self.sandboxes.get(&c.id), Some(Some(p)) if *p == c.pod) {
                self.sandboxes.insert(c.id.clone(), Some(c.pod.clone()));
                link(&mut self.by_pod, &c.pod, &c.id);
            }
            let Some(container) = self.containers.get_mut(&c.id) else {
                if c.running && !self.removed.contains(&c.id) {
                    if after_rescan {
                        if self.unfound.insert(c.id.clone(), c.pod.clone()).is_none() {
                            outcome.unfound.push(c.id.clone());
                        }
                        link(&mut self.by_pod, &c.pod, &c.id);
                    } else if !self.unfound.contains_key(&c.id) {
                        outcome.rescan_due = true;
                    }
                }
                continue;
            };
            // `/k8s.io/<id>` does not name the pod; the runtime does.
            if container.pod_uid.is_none() {
                container.pod_uid = Some(c.pod.clone());
                link(&mut self.by_pod, &c.pod, &c.id);
            }
            if c.contradicted {
                // The kernel's death was not the main process's: the real one
                // is to come, and must be a death again (issue #25).
                let step = container.state.contradicted();
                if step.transition == Transition::Contradicted {
                    self.stats.contradicted += 1;
                }
                if let Some(next) = step.next {
                    container.state = next;
                }
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
    }

    /// Forgets what the view's scope no longer lists, except what was learned
    /// after the listing started, or less than the grace before it. Returns how
    /// many containers were forgotten. A pod's view visits what is held for
    /// that pod only (`by_pod`); a full view visits everything.
    pub(super) fn prune(&mut self, r: &Reconciliation) -> usize {
        match r.view.scope.clone() {
            None => self.prune_all(r),
            Some(scope) => self.prune_pod(r, &scope),
        }
    }

    fn prune_all(&mut self, r: &Reconciliation) -> usize {
        let view = &r.view;
        let at = view.listed_at_ns.saturating_sub(self.prune_grace_ns);
        let listed: HashSet<&ContainerId> = view.containers.iter().map(|c| &c.id).collect();
        let pods: HashSet<&PodUid> = view.containers.iter().map(|c| &c.pod).collect();
        let gone: Vec<ContainerId> = self
            .containers
            .iter()
            .filter(|(id, c)| !listed.contains(id) && c.learned_at_ns < at)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &gone {
            self.containers.remove(id);
        }
        let containers = &self.containers;
        self.index.retain(|e| {
            if e.learned_at_ns >= at {
                return true;
            }
            match &e.class {
                CgroupClass::Container { id, .. } | CgroupClass::RuntimeHelper { id } => {
                    listed.contains(id) || containers.contains_key(id)
                }
                CgroupClass::Pod { uid, .. } => pods.contains(uid),
                CgroupClass::NodeLevel { .. } => true,
            }
        });
        self.index.forget_ignored_before(at);
        self.sandboxes
            .retain(|id, _| listed.contains(id) || containers.contains_key(id));
        self.unfound.retain(|id, _| listed.contains(id));
        // `by_pod` is a superset of what is held: what is no longer held
        // goes (a rebuild cloned every id and uid).
        let (sandboxes, unfound) = (&self.sandboxes, &self.unfound);
        self.by_pod.retain(|pod, held| {
            held.retain(|id| {
                containers
                    .get(id)
                    .is_some_and(|c| c.pod_uid.as_ref() == Some(pod))
                    || sandboxes.get(id).is_some_and(|p| p.as_ref() == Some(pod))
                    || unfound.get(id) == Some(pod)
            });
            !held.is_empty()
        });
        gone.len()
    }

    fn prune_pod(&mut self, r: &Reconciliation, scope: &PodUid) -> usize {
        let view = &r.view;
        let at = view.listed_at_ns.saturating_sub(self.prune_grace_ns);
        // A pod's view lists a few containers: searched, not hashed; and
        // nothing is allocated unless something is forgotten.
        let listed = |id: &ContainerId| view.containers.iter().any(|c| c.id == *id);
        let pod_listed = view.containers.iter().any(|c| c.pod == *scope);
        let gone: Vec<ContainerId> = (self.by_pod.get(scope).into_iter().flatten())
            .filter(|id| {
                self.containers.get(*id).is_some_and(|c| {
                    c.pod_uid.as_ref() == Some(scope) && !listed(id) && c.learned_at_ns < at
                })
            })
            .cloned()
            .collect();
        for id in &gone {
            self.containers.remove(id);
        }
        let containers = &self.containers;
        // Entries of other pods, and those naming no pod, are kept unless
        // they serve a container forgotten here.
        self.index.retain_scoped(scope, &gone, |e| {
            if e.learned_at_ns >= at {
                return true;
            }
            match &e.class {
                CgroupClass::Container { id, .. } | CgroupClass::RuntimeHelper { id } => {
                    if gone.contains(id) {
                        return false;
                    }
                    e.pod() != Some(scope) || listed(id) || containers.contains_key(id)
                }
                CgroupClass::Pod { uid, .. } => uid != scope || pod_listed,
                CgroupClass::NodeLevel { .. } => true,
            }
        });
        let Some(held) = self.by_pod.get_mut(scope) else {
            return gone.len();
        };
        let (sandboxes, unfound) = (&mut self.sandboxes, &mut self.unfound);
        held.retain(|id| {
            let drop_sandbox = sandboxes.get(id).is_some_and(|pod| {
                gone.contains(id)
                    || (pod.as_ref() == Some(scope) && !listed(id) && !containers.contains_key(id))
            });
            if drop_sandbox {
                sandboxes.remove(id);
            }
            if unfound.get(id) == Some(scope) && !listed(id) {
                unfound.remove(id);
            }
            // Still held for this pod?
            containers
                .get(id)
                .is_some_and(|c| c.pod_uid.as_ref() == Some(scope))
                || sandboxes.get(id).is_some_and(|p| p.as_ref() == Some(scope))
                || unfound.get(id) == Some(scope)
        });
        if held.is_empty() {
            self.by_pod.remove(scope);
        }
        gone.len()
    }
}
