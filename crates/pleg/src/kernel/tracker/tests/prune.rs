//! The pod-scoped prune (which visits one pod's ids through `by_pod`) against
//! the prune it replaced (which visited every container, index entry, sandbox
//! mark and unfound id), kept here as the reference: random sequences of
//! scans, cgroup removals and runtime views, node-wide and per pod, applied
//! to two trackers, must leave them in the same state after every step; and
//! so must a third that applies each view a part at a time.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use proptest::prelude::*;

use crate::kernel::event::CgroupChange;
use crate::kernel::proc::Reconciliation;
use crate::kernel::tracker::*;
use crate::kernel::{RuntimeContainer, RuntimeView};

const PODS: [&str; 3] = [
    "1b4e28ba-2fa1-11d2-883f-0016d3cca427",
    "2b4e28ba-2fa1-11d2-883f-0016d3cca427",
    "3b4e28ba-2fa1-11d2-883f-0016d3cca427",
];
const CONTAINERS: usize = 6;

fn cid(n: usize) -> String {
    std::iter::repeat_n(char::from(b'a' + n as u8), 64).collect()
}

fn id(n: usize) -> ContainerId {
    ContainerId::parse(&cid(n)).unwrap()
}

/// Cgroup paths: a pod's cgroup, its containers' (and one nested below), and
/// the `/k8s.io/<id>` layout that names no pod.
fn path(kind: u8, pod: usize, container: usize) -> String {
    let uid = PODS[pod];
    match kind % 4 {
        0 => format!("/kubepods/besteffort/pod{uid}"),
        1 => format!("/kubepods/besteffort/pod{uid}/{}", cid(container)),
        2 => format!("/kubepods/besteffort/pod{uid}/{}/nested", cid(container)),
        _ => format!("/k8s.io/{}", cid(container)),
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// A scan learns cgroup `cgroup_id` at `path`.
    Learn { cgroup_id: u64, path: String },
    /// The kernel reports the cgroup removed.
    Rmdir { cgroup_id: u64 },
    /// A runtime view: `scope` a pod or the node; each listed container
    /// (id, pod, sandbox, running).
    View {
        scope: Option<usize>,
        listed: Vec<(usize, usize, bool, bool)>,
        after_rescan: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1u64..24, 0u8..4, 0usize..3, 0usize..CONTAINERS).prop_map(|(cgroup_id, k, p, c)| {
            Op::Learn {
                cgroup_id,
                path: path(k, p, c),
            }
        }),
        (1u64..24).prop_map(|cgroup_id| Op::Rmdir { cgroup_id }),
        (
            prop::option::weighted(0.8, 0usize..3),
            prop::collection::vec(
                (0usize..CONTAINERS, 0usize..3, any::<bool>(), any::<bool>()),
                0..5
            ),
            any::<bool>(),
        )
            .prop_map(|(scope, listed, after_rescan)| Op::View {
                scope,
                listed,
                after_rescan,
            }),
    ]
}

/// Everything the prune may change, comparable.
type State = (
    BTreeMap<String, (u64, Option<String>)>,
    BTreeMap<String, Option<String>>,
    BTreeMap<String, String>,
    BTreeMap<u64, String>,
);

fn state(t: &Tracker) -> State {
    (
        (t.containers.iter())
            .map(|(id, c)| {
                (
                    id.to_string(),
                    (c.cgroup_id, c.pod_uid.as_ref().map(|p| p.to_string())),
                )
            })
            .collect(),
        (t.sandboxes.iter())
            .map(|(id, p)| (id.to_string(), p.as_ref().map(|p| p.to_string())))
            .collect(),
        (t.unfound.iter())
            .map(|(id, p)| (id.to_string(), p.to_string()))
            .collect(),
        (1u64..24)
            .filter_map(|c| t.index.get(c).map(|e| (c, e.path.clone())))
            .collect(),
    )
}

/// A view's op as the reader gets it at `now`.
fn reconciliation(
    scope: Option<usize>,
    listed: &[(usize, usize, bool, bool)],
    now: u64,
) -> Reconciliation {
    let scope = scope.map(|p| PodUid::parse(PODS[p]).unwrap());
    let mut seen = HashSet::new();
    let containers = (listed.iter())
        .filter(|(c, ..)| seen.insert(*c))
        .map(|&(c, p, sandbox, running)| RuntimeContainer {
            id: id(c),
            // A pod's view lists that pod's containers.
            pod: scope
                .clone()
                .unwrap_or_else(|| PodUid::parse(PODS[p]).unwrap()),
            sandbox,
            running,
            pid: None,
            contradicted: false,
        })
        .collect();
    Reconciliation {
        view: RuntimeView {
            // Half the views started before the last step.
            listed_at_ns: now - (now % 2),
            scope,
            containers,
        },
        mains: Default::default(),
    }
}

/// Applies `op`: a view at once, with `prune`, or `in_parts` of that many
/// containers ([`Tracker::reconcile_part`]); a view's outcome is returned.
fn apply(
    t: &mut Tracker,
    op: &Op,
    now: u64,
    prune: fn(&mut Tracker, &Reconciliation) -> usize,
    in_parts: Option<usize>,
) -> Option<ReconcileOutcome> {
    match op {
        Op::Learn { cgroup_id, path } => {
            let _ = t.learn_existing(*cgroup_id, path, &[], None, now);
        }
        Op::Rmdir { cgroup_id } => {
            let path = t.index.get(*cgroup_id).map(|e| e.path.clone())?;
            let change = CgroupChange {
                at_ns: now,
                hierarchy_id: 0,
                level: 0,
                cgroup_id: *cgroup_id,
                path,
                truncated: false,
            };
            t.handle(&KernelEvent::CgroupRmdir(change), &mut Output::default());
        }
        Op::View {
            scope,
            listed,
            after_rescan,
        } => {
            let r = reconciliation(*scope, listed, now);
            let Some(part) = in_parts else {
                return Some(t.reconcile_with(&r, *after_rescan, prune));
            };
            let mut rec = t.start_reconcile(r, *after_rescan);
            loop {
                if let Some(outcome) = t.reconcile_part(&mut rec, part) {
                    return Some(outcome);
                }
            }
        }
    }
    None
}

impl Tracker {
    /// The prune before `by_pod`: every id visited for every view.
    fn prune_reference(&mut self, r: &Reconciliation) -> usize {
        let view = &r.view;
        let at = view.listed_at_ns.saturating_sub(self.prune_grace_ns);
        let listed: HashSet<&ContainerId> = view.containers.iter().map(|c| &c.id).collect();
        let pods: HashSet<&PodUid> = view.containers.iter().map(|c| &c.pod).collect();
        let in_scope = |pod: Option<&PodUid>| match &view.scope {
            None => true,
            Some(scope) => pod == Some(scope),
        };
        let gone: Vec<ContainerId> = (self.containers.iter())
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn the_pod_scoped_prune_forgets_what_the_full_scan_forgot(
        ops in prop::collection::vec(op(), 1..40),
    ) {
        let mut fast = Tracker::new(100);
        let mut reference = Tracker::new(100);
        let mut parted = Tracker::new(100);
        fast.prune_grace_ns = 0;
        reference.prune_grace_ns = 0;
        parted.prune_grace_ns = 0;
        for (step, op) in ops.iter().enumerate() {
            let now = 10 + step as u64;
            let outcome = apply(&mut fast, op, now, Tracker::prune, None);
            apply(&mut reference, op, now, Tracker::prune_reference, None);
            prop_assert_eq!(state(&fast), state(&reference), "after step {} {:?}", step, op);
            // A view applied a part at a time (1 to 3 containers) ends as
            // one applied at once, with the same outcome.
            let parted_outcome = apply(&mut parted, op, now, Tracker::prune, Some(step % 3 + 1));
            prop_assert_eq!(&parted_outcome, &outcome, "outcome of step {} in parts", step);
            prop_assert_eq!(state(&parted), state(&fast), "after step {} in parts {:?}", step, op);
            // Whatever `by_pod` misses, a pod's view would never visit; after
            // a full view it holds exactly what is held (no stale id stays
            // for a pod no view visits again).
            let mut held: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
            let pods = (fast.containers.iter()).filter_map(|(id, c)| Some((id, c.pod_uid.as_ref()?)));
            let sandboxes = fast.sandboxes.iter().filter_map(|(id, p)| Some((id, p.as_ref()?)));
            for (id, pod) in pods.chain(sandboxes).chain(fast.unfound.iter()) {
                held.entry(pod.to_string()).or_default().insert(id.to_string());
            }
            let linked: BTreeMap<String, BTreeSet<String>> = (fast.by_pod.iter())
                .map(|(pod, ids)| (pod.to_string(), ids.iter().map(|i| i.to_string()).collect()))
                .collect();
            for (pod, ids) in &held {
                prop_assert!(
                    linked.get(pod).is_some_and(|l| l.is_superset(ids)),
                    "by_pod misses ids of pod {} after step {} {:?}", pod, step, op
                );
            }
            if matches!(op, Op::View { scope: None, .. }) {
                prop_assert_eq!(&linked, &held, "by_pod after the full view of step {}", step);
            }
        }
    }
}
