//! The pod configuration mux: the kubelet's `podStorage` (`pkg/kubelet/config/config.go`).
//!
//! Every source sends [`PodUpdate`]s; [`PodConfig`] keeps each source's pods by UID
//! separately and turns what arrives into the minimal changes the sync loop acts on
//! (the kubelet's `PodConfigNotificationIncremental` mode):
//!
//! | what arrived for a pod (by UID)                                | emitted      |
//! |----------------------------------------------------------------|--------------|
//! | not known to that source before                                | `Add`        |
//! | spec, labels or non-local annotations changed, not deleting    | `Update`     |
//! | any of those changed and a `deletionTimestamp` is set          | `Delete`     |
//! | only the status changed                                        | `Reconcile`  |
//! | nothing changed                                                | nothing      |
//! | `Remove` of a known pod, or missing from the source's `Set`    | `Remove`     |
//!
//! Within one merge the changes go out in the kubelet's order: `Remove`, `Add`,
//! `Update`, `Delete`, `Reconcile`. The first `Set` of a source that changes nothing
//! still emits an empty `Add`, so the sync loop hears that the source is ready.
//!
//! The kubelet's housekeeping must not remove pods of a source that has not sent its
//! first full set yet (after a restart, the running pods would otherwise be killed
//! before the source lists them): [`SeenSources::seen_all`] tells.
//!
//! Where evpleg differs from the kubelet:
//! - on `Update`/`Delete`/`Reconcile` the stored pod is the newest object from the
//!   source (its local annotations, `config.source`, `config.mirror` and `config.seen`,
//!   kept from the first time it was seen); the kubelet copies only spec, labels,
//!   deletion fields, status and annotations into its old object;
//! - a missing `labels` or `annotations` map equals an empty one (Go's
//!   `reflect.DeepEqual` tells nil from empty);
//! - validation is limited to what the mux needs: a pod without a UID or a name, or with
//!   the UID or full name of an earlier pod in the same update, is dropped with a
//!   warning (the kubelet runs the full `ValidatePod` here); the sources validate more;
//! - an incoming `Reconcile` is merged like an `Update` (the kubelet ignores it).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::{Op, PodUpdate, SourceName, annotations};

/// The annotations the kubelet itself sets: ignored when comparing pods, and kept from
/// the stored pod when a source sends a new version.
const LOCAL_ANNOTATIONS: [&str; 3] = [
    annotations::CONFIG_SOURCE,
    annotations::CONFIG_MIRROR,
    annotations::CONFIG_SEEN,
];

/// Which sources have sent at least one full set (`Op::Set`). Cheap to clone and to
/// share with the sync loop while [`PodConfig::run`] owns the mux.
#[derive(Clone, Debug, Default)]
pub struct SeenSources(Arc<AtomicU8>);

impl SeenSources {
    fn bit(source: SourceName) -> u8 {
        match source {
            SourceName::File => 1,
            SourceName::Http => 2,
            SourceName::Api => 4,
        }
    }

    fn mark(&self, source: SourceName) {
        self.0.fetch_or(Self::bit(source), Ordering::AcqRel);
    }

    /// Whether `source` has sent a full set.
    pub fn seen(&self, source: SourceName) -> bool {
        self.0.load(Ordering::Acquire) & Self::bit(source) != 0
    }

    /// Whether every one of `sources` has sent a full set (the kubelet's
    /// `SeenAllSources`): only then may housekeeping remove pods nobody lists.
    pub fn seen_all(&self, sources: &[SourceName]) -> bool {
        sources.iter().all(|&s| self.seen(s))
    }
}

/// The merged pod configuration of all sources (the kubelet's `podStorage`).
#[derive(Debug, Default)]
pub struct PodConfig {
    /// Per source, its pods by UID.
    pods: BTreeMap<SourceName, BTreeMap<String, Arc<Pod>>>,
    seen: SeenSources,
}

/// The changes one merge produces, before they are turned into updates.
#[derive(Default)]
struct Changes {
    adds: Vec<Arc<Pod>>,
    updates: Vec<Arc<Pod>>,
    deletes: Vec<Arc<Pod>>,
    removes: Vec<Arc<Pod>>,
    reconciles: Vec<Arc<Pod>>,
}

impl PodConfig {
    pub fn new() -> Self {
        Self::default()
    }

    /// A handle on which sources have sent a full set, usable after `run` took `self`.
    pub fn seen_sources(&self) -> SeenSources {
        self.seen.clone()
    }

    /// Whether every one of `sources` has sent a full set.
    pub fn seen_all(&self, sources: &[SourceName]) -> bool {
        self.seen.seen_all(sources)
    }

    /// The pods `source` currently has, by UID.
    pub fn source_pods(&self, source: SourceName) -> impl Iterator<Item = &Arc<Pod>> {
        self.pods.get(&source).into_iter().flat_map(|m| m.values())
    }

    /// All pods of all sources (the kubelet's `MergedState`).
    pub fn pods(&self) -> Vec<Arc<Pod>> {
        self.pods
            .values()
            .flat_map(|m| m.values().cloned())
            .collect()
    }

    /// Merges one update from a source and returns the changes for the sync loop, in
    /// the kubelet's order (see the module docs). Pure apart from the `config.seen`
    /// timestamp given to pods that arrive without one.
    pub fn merge(&mut self, update: PodUpdate) -> Vec<PodUpdate> {
        let PodUpdate { op, source, pods } = update;
        let seen_before = self.seen.seen(source);
        let stored = self.pods.entry(source).or_default();
        let mut changes = Changes::default();

        match op {
            Op::Add | Op::Update | Op::Delete | Op::Reconcile => {
                debug!(
                    source = source.as_str(),
                    ?op,
                    count = pods.len(),
                    "merging pods"
                );
                for pod in filter_invalid(pods, source) {
                    upsert(stored, pod, &mut changes);
                }
            }
            Op::Remove => {
                debug!(
                    source = source.as_str(),
                    count = pods.len(),
                    "removing pods"
                );
                for pod in pods {
                    if let Some(existing) =
                        pod.metadata.uid.as_ref().and_then(|uid| stored.remove(uid))
                    {
                        changes.removes.push(existing);
                    }
                }
            }
            Op::Set => {
                debug!(source = source.as_str(), count = pods.len(), "setting pods");
                self.seen.mark(source);
                let mut old = std::mem::take(stored);
                for pod in filter_invalid(pods, source) {
                    let uid = uid_of(&pod).to_owned();
                    if let Some(existing) = old.remove(&uid) {
                        stored.insert(uid, existing);
                    }
                    upsert(stored, pod, &mut changes);
                }
                changes.removes.extend(old.into_values());
            }
        }

        let first_set = !seen_before && self.seen.seen(source);
        let Changes {
            adds,
            updates,
            deletes,
            removes,
            reconciles,
        } = changes;
        let nothing_to_run = adds.is_empty() && updates.is_empty() && deletes.is_empty();
        let mut out = Vec::new();
        let mut push = |op, pods: Vec<Arc<Pod>>, always: bool| {
            if always || !pods.is_empty() {
                out.push(PodUpdate { op, source, pods });
            }
        };
        push(Op::Remove, removes, false);
        // An empty ADD after a source's first SET tells the sync loop it is ready.
        push(Op::Add, adds, first_set && nothing_to_run);
        push(Op::Update, updates, false);
        push(Op::Delete, deletes, false);
        push(Op::Reconcile, reconciles, false);
        out
    }

    /// Merges every update from `inputs` and sends the changes to `out`, in order.
    /// Returns the mux when `inputs` closes or `out`'s receiver is gone.
    pub async fn run(
        mut self,
        mut inputs: mpsc::Receiver<PodUpdate>,
        out: mpsc::Sender<PodUpdate>,
    ) -> Self {
        while let Some(update) = inputs.recv().await {
            for change in self.merge(update) {
                if out.send(change).await.is_err() {
                    return self;
                }
            }
        }
        self
    }
}

fn uid_of(pod: &Pod) -> &str {
    pod.metadata.uid.as_deref().unwrap_or_default()
}

fn full_name(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

/// Drops pods the mux cannot key or that repeat an earlier pod of the same update, and
/// stamps the others with `config.source`.
fn filter_invalid(pods: Vec<Arc<Pod>>, source: SourceName) -> Vec<Arc<Pod>> {
    let mut uids = HashSet::new();
    let mut names = HashSet::new();
    let mut kept = Vec::with_capacity(pods.len());
    for (i, mut pod) in pods.into_iter().enumerate() {
        let uid = uid_of(&pod).to_owned();
        let name = full_name(&pod);
        let problem = if uid.is_empty() {
            Some("it has no metadata.uid")
        } else if pod.metadata.name.as_deref().unwrap_or_default().is_empty() {
            Some("it has no metadata.name")
        } else if !uids.insert(uid) {
            Some("its uid is a duplicate")
        } else if !names.insert(name.clone()) {
            Some("its name is a duplicate")
        } else {
            None
        };
        if let Some(problem) = problem {
            warn!(
                source = source.as_str(),
                pod = %name,
                "pod {} from source {} ignored: {problem}",
                i + 1,
                source.as_str()
            );
            continue;
        }
        if pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(annotations::CONFIG_SOURCE))
            .map(String::as_str)
            != Some(source.as_str())
        {
            Arc::make_mut(&mut pod)
                .metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(
                    annotations::CONFIG_SOURCE.to_owned(),
                    source.as_str().to_owned(),
                );
        }
        kept.push(pod);
    }
    kept
}

/// Stores `pod` (already validated and stamped) and records what changed (the
/// kubelet's `checkAndUpdatePod`).
fn upsert(stored: &mut BTreeMap<String, Arc<Pod>>, mut pod: Arc<Pod>, changes: &mut Changes) {
    let uid = uid_of(&pod).to_owned();
    let Some(existing) = stored.get_mut(&uid) else {
        let has_seen = pod
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(annotations::CONFIG_SEEN));
        if !has_seen {
            Arc::make_mut(&mut pod)
                .metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(annotations::CONFIG_SEEN.to_owned(), now());
        }
        stored.insert(uid, pod.clone());
        changes.adds.push(pod);
        return;
    };

    if !differ_semantically(existing, &pod) {
        if existing.status != pod.status {
            Arc::make_mut(existing).status = pod.status.clone();
            changes.reconciles.push(existing.clone());
        }
        return;
    }

    // A new version: keep the local annotations of the stored pod.
    {
        let new = Arc::make_mut(&mut pod);
        let annots = new
            .metadata
            .annotations
            .get_or_insert_with(Default::default);
        for key in LOCAL_ANNOTATIONS {
            annots.remove(key);
            if let Some(v) = existing
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(key))
            {
                annots.insert(key.to_owned(), v.clone());
            }
        }
    }
    *existing = pod.clone();
    if pod.metadata.deletion_timestamp.is_some() {
        changes.deletes.push(pod);
    } else {
        changes.updates.push(pod);
    }
}

/// Whether `new` changes what the node must run (the kubelet's
/// `podsDifferSemantically`): spec, labels, deletion fields, non-local annotations.
fn differ_semantically(existing: &Pod, new: &Pod) -> bool {
    let (e, n) = (&existing.metadata, &new.metadata);
    existing.spec != new.spec
        || e.deletion_timestamp != n.deletion_timestamp
        || e.deletion_grace_period_seconds != n.deletion_grace_period_seconds
        || map_or_empty(&e.labels) != map_or_empty(&n.labels)
        || non_local(&e.annotations) != non_local(&n.annotations)
}

fn map_or_empty(map: &Option<BTreeMap<String, String>>) -> BTreeSet<(&str, &str)> {
    map.iter()
        .flatten()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

fn non_local(map: &Option<BTreeMap<String, String>>) -> BTreeSet<(&str, &str)> {
    let mut set = map_or_empty(map);
    set.retain(|(k, _)| !LOCAL_ANNOTATIONS.contains(k));
    set
}

/// The kubelet's first-seen timestamp: RFC 3339 with nanoseconds, UTC.
pub(crate) fn now() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::core::v1::{Container, PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use proptest::prelude::*;

    use super::*;

    fn pod(uid: &str, image: &str) -> Arc<Pod> {
        Arc::new(Pod {
            metadata: ObjectMeta {
                name: Some(format!("pod-{uid}")),
                namespace: Some("default".into()),
                uid: Some(uid.into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "c".into(),
                    image: Some(image.into()),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            status: None,
        })
    }

    fn with(p: &Arc<Pod>, f: impl FnOnce(&mut Pod)) -> Arc<Pod> {
        let mut p = (**p).clone();
        f(&mut p);
        Arc::new(p)
    }

    fn upd(op: Op, source: SourceName, pods: &[&Arc<Pod>]) -> PodUpdate {
        PodUpdate {
            op,
            source,
            pods: pods.iter().map(|p| Arc::clone(p)).collect(),
        }
    }

    /// `(op, uids)` of each emitted update.
    fn summary(out: &[PodUpdate]) -> Vec<(Op, Vec<String>)> {
        out.iter()
            .map(|u| (u.op, u.pods.iter().map(|p| uid_of(p).to_owned()).collect()))
            .collect()
    }

    fn ops(v: &[(Op, &[&str])]) -> Vec<(Op, Vec<String>)> {
        v.iter()
            .map(|(op, uids)| (*op, uids.iter().map(|s| s.to_string()).collect()))
            .collect()
    }

    #[test]
    fn add_emits_add_with_source_and_seen_annotations() {
        let mut mux = PodConfig::new();
        let out = mux.merge(upd(Op::Add, SourceName::Api, &[&pod("a", "i1")]));
        assert_eq!(summary(&out), ops(&[(Op::Add, &["a"])]));
        let annots = out[0].pods[0].metadata.annotations.as_ref().unwrap();
        assert_eq!(annots[annotations::CONFIG_SOURCE], "api");
        assert!(annots.contains_key(annotations::CONFIG_SEEN));
        // The same pod again changes nothing.
        assert!(
            mux.merge(upd(Op::Add, SourceName::Api, &[&pod("a", "i1")]))
                .is_empty()
        );
    }

    #[test]
    fn spec_change_emits_update_and_keeps_first_seen() {
        let mut mux = PodConfig::new();
        let first = mux.merge(upd(Op::Add, SourceName::Api, &[&pod("a", "i1")]));
        let seen = first[0].pods[0].metadata.annotations.as_ref().unwrap()
            [annotations::CONFIG_SEEN]
            .clone();
        let out = mux.merge(upd(Op::Update, SourceName::Api, &[&pod("a", "i2")]));
        assert_eq!(summary(&out), ops(&[(Op::Update, &["a"])]));
        let p = &out[0].pods[0];
        assert_eq!(
            p.spec.as_ref().unwrap().containers[0].image.as_deref(),
            Some("i2")
        );
        assert_eq!(
            p.metadata.annotations.as_ref().unwrap()[annotations::CONFIG_SEEN],
            seen
        );
    }

    #[test]
    fn label_and_annotation_changes_are_updates_local_annotations_are_not() {
        let mut mux = PodConfig::new();
        let a = pod("a", "i1");
        mux.merge(upd(Op::Add, SourceName::Api, &[&a]));
        let labelled = with(&a, |p| {
            p.metadata.labels = Some(BTreeMap::from([("k".into(), "v".into())]));
        });
        let out = mux.merge(upd(Op::Update, SourceName::Api, &[&labelled]));
        assert_eq!(summary(&out), ops(&[(Op::Update, &["a"])]));
        // A different config.seen or config.mirror is not a change.
        let local = with(&labelled, |p| {
            let a = p.metadata.annotations.get_or_insert_with(Default::default);
            a.insert(annotations::CONFIG_SEEN.into(), "yesterday".into());
            a.insert(annotations::CONFIG_MIRROR.into(), "x".into());
        });
        assert!(
            mux.merge(upd(Op::Update, SourceName::Api, &[&local]))
                .is_empty()
        );
        let annotated = with(&labelled, |p| {
            p.metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert("team".into(), "x".into());
        });
        let out = mux.merge(upd(Op::Update, SourceName::Api, &[&annotated]));
        assert_eq!(summary(&out), ops(&[(Op::Update, &["a"])]));
    }

    #[test]
    fn deletion_timestamp_emits_delete() {
        let mut mux = PodConfig::new();
        let a = pod("a", "i1");
        mux.merge(upd(Op::Add, SourceName::Api, &[&a]));
        let deleting = with(&a, |p| {
            p.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
            p.metadata.deletion_grace_period_seconds = Some(30);
        });
        let out = mux.merge(upd(Op::Update, SourceName::Api, &[&deleting]));
        assert_eq!(summary(&out), ops(&[(Op::Delete, &["a"])]));
        assert_eq!(
            out[0].pods[0].metadata.deletion_grace_period_seconds,
            Some(30)
        );
        // A shorter grace period on the next delete request is a new DELETE.
        let shorter = with(&deleting, |p| {
            p.metadata.deletion_grace_period_seconds = Some(1)
        });
        let out = mux.merge(upd(Op::Delete, SourceName::Api, &[&shorter]));
        assert_eq!(summary(&out), ops(&[(Op::Delete, &["a"])]));
    }

    #[test]
    fn status_only_change_emits_reconcile() {
        let mut mux = PodConfig::new();
        let a = pod("a", "i1");
        mux.merge(upd(Op::Add, SourceName::Api, &[&a]));
        let running = with(&a, |p| {
            p.status = Some(PodStatus {
                phase: Some("Running".into()),
                ..Default::default()
            });
        });
        let out = mux.merge(upd(Op::Update, SourceName::Api, &[&running]));
        assert_eq!(summary(&out), ops(&[(Op::Reconcile, &["a"])]));
        assert_eq!(
            out[0].pods[0].status.as_ref().unwrap().phase.as_deref(),
            Some("Running")
        );
        assert!(
            mux.merge(upd(Op::Update, SourceName::Api, &[&running]))
                .is_empty()
        );
    }

    #[test]
    fn remove_emits_remove_for_known_pods_only() {
        let mut mux = PodConfig::new();
        mux.merge(upd(
            Op::Add,
            SourceName::Api,
            &[&pod("a", "i"), &pod("b", "i")],
        ));
        let out = mux.merge(upd(
            Op::Remove,
            SourceName::Api,
            &[&pod("a", "i"), &pod("zz", "i")],
        ));
        assert_eq!(summary(&out), ops(&[(Op::Remove, &["a"])]));
        assert!(
            mux.merge(upd(Op::Remove, SourceName::Api, &[&pod("a", "i")]))
                .is_empty()
        );
        assert_eq!(mux.source_pods(SourceName::Api).count(), 1);
    }

    #[test]
    fn set_removes_what_it_no_longer_lists_in_kubelet_order() {
        let mut mux = PodConfig::new();
        let (a, b, c) = (pod("a", "i"), pod("b", "i"), pod("c", "i"));
        let out = mux.merge(upd(Op::Set, SourceName::File, &[&a, &b]));
        assert_eq!(summary(&out), ops(&[(Op::Add, &["a", "b"])]));
        let b2 = with(&b, |p| {
            p.spec.as_mut().unwrap().containers[0].image = Some("j".into())
        });
        let out = mux.merge(upd(Op::Set, SourceName::File, &[&b2, &c]));
        assert_eq!(
            summary(&out),
            ops(&[
                (Op::Remove, &["a"]),
                (Op::Add, &["c"]),
                (Op::Update, &["b"])
            ])
        );
        let out = mux.merge(upd(Op::Set, SourceName::File, &[]));
        assert_eq!(summary(&out), ops(&[(Op::Remove, &["b", "c"])]));
        assert_eq!(mux.pods().len(), 0);
    }

    #[test]
    fn sources_are_merged_separately() {
        let mut mux = PodConfig::new();
        mux.merge(upd(Op::Set, SourceName::File, &[&pod("a", "i")]));
        mux.merge(upd(Op::Set, SourceName::Http, &[&pod("h", "i")]));
        // The API source's SET does not remove the file's or the URL's pods.
        let out = mux.merge(upd(Op::Set, SourceName::Api, &[&pod("x", "i")]));
        assert_eq!(summary(&out), ops(&[(Op::Add, &["x"])]));
        assert_eq!(out[0].source, SourceName::Api);
        assert_eq!(mux.pods().len(), 3);
        let out = mux.merge(upd(Op::Set, SourceName::Http, &[]));
        assert_eq!(summary(&out), ops(&[(Op::Remove, &["h"])]));
        assert_eq!(out[0].source, SourceName::Http);
        assert_eq!(mux.source_pods(SourceName::File).count(), 1);
    }

    #[test]
    fn seen_all_needs_a_set_from_each_source() {
        let mut mux = PodConfig::new();
        let seen = mux.seen_sources();
        assert!(mux.seen_all(&[]));
        // An ADD does not make a source seen, a SET does, even an empty one.
        mux.merge(upd(Op::Add, SourceName::Api, &[&pod("a", "i")]));
        assert!(!mux.seen_all(&[SourceName::Api]));
        let out = mux.merge(upd(Op::Set, SourceName::File, &[]));
        // The first SET of a source emits an empty ADD: the source is ready.
        assert_eq!(summary(&out), ops(&[(Op::Add, &[])]));
        assert!(seen.seen_all(&[SourceName::File]));
        assert!(!seen.seen_all(&[SourceName::File, SourceName::Api]));
        mux.merge(upd(Op::Set, SourceName::Api, &[&pod("a", "i")]));
        assert!(seen.seen_all(&[SourceName::File, SourceName::Api]));
        assert!(!seen.seen_all(&[SourceName::File, SourceName::Api, SourceName::Http]));
        // Later empty SETs of an unchanged source emit nothing.
        assert!(mux.merge(upd(Op::Set, SourceName::File, &[])).is_empty());
    }

    #[test]
    fn invalid_and_duplicate_pods_are_dropped() {
        let mut mux = PodConfig::new();
        let no_uid = with(&pod("x", "i"), |p| p.metadata.uid = None);
        let no_name = with(&pod("y", "i"), |p| p.metadata.name = None);
        let same_name = with(&pod("z", "i"), |p| p.metadata.name = Some("pod-a".into()));
        let out = mux.merge(upd(
            Op::Set,
            SourceName::File,
            &[
                &pod("a", "i"),
                &no_uid,
                &no_name,
                &same_name,
                &pod("a", "j"),
            ],
        ));
        assert_eq!(summary(&out), ops(&[(Op::Add, &["a"])]));
        assert_eq!(
            out[0].pods[0].spec.as_ref().unwrap().containers[0]
                .image
                .as_deref(),
            Some("i")
        );
    }

    #[tokio::test]
    async fn run_forwards_changes_in_order() {
        let (in_tx, in_rx) = mpsc::channel(8);
        let (out_tx, mut out_rx) = mpsc::channel(8);
        let mux = PodConfig::new();
        let seen = mux.seen_sources();
        let task = tokio::spawn(mux.run(in_rx, out_tx));
        in_tx
            .send(upd(Op::Set, SourceName::File, &[&pod("a", "i")]))
            .await
            .unwrap();
        in_tx
            .send(upd(Op::Set, SourceName::File, &[&pod("b", "i")]))
            .await
            .unwrap();
        drop(in_tx);
        let mut got = Vec::new();
        while let Some(u) = tokio::time::timeout(std::time::Duration::from_secs(10), out_rx.recv())
            .await
            .expect("the mux answers")
        {
            got.push(u);
        }
        assert_eq!(
            summary(&got),
            ops(&[(Op::Add, &["a"]), (Op::Remove, &["a"]), (Op::Add, &["b"])])
        );
        assert!(seen.seen(SourceName::File));
        let mux = task.await.unwrap();
        assert_eq!(mux.pods().len(), 1);
    }

    /// A pod of the property test: its uid picks the pod, the rest its version.
    #[derive(Clone, Debug)]
    struct Gen {
        uid: u8,
        image: u8,
        label: u8,
        phase: u8,
        deleting: bool,
    }

    fn gen_pod(g: &Gen) -> Arc<Pod> {
        let mut p = (*pod(&format!("u{}", g.uid), &format!("img{}", g.image))).clone();
        p.metadata.labels =
            (g.label > 0).then(|| BTreeMap::from([("l".into(), g.label.to_string())]));
        p.status = (g.phase > 0).then(|| PodStatus {
            phase: Some(format!("phase{}", g.phase)),
            ..Default::default()
        });
        if g.deleting {
            p.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        }
        Arc::new(p)
    }

    fn gen_set() -> impl Strategy<Value = (SourceName, Vec<Gen>)> {
        let source = prop_oneof![
            Just(SourceName::File),
            Just(SourceName::Http),
            Just(SourceName::Api)
        ];
        let one = (0u8..3, 0u8..2, 0u8..3, any::<bool>())
            .prop_map(|(image, label, phase, deleting)| (image, label, phase, deleting));
        let pods = proptest::collection::btree_map(0u8..6, one, 0..6).prop_map(|m| {
            m.into_iter()
                .map(|(uid, (image, label, phase, deleting))| Gen {
                    uid,
                    image,
                    label,
                    phase,
                    deleting,
                })
                .collect()
        });
        (source, pods)
    }

    /// What the sync loop needs of a pod: everything but the local annotations.
    fn essence(p: &Pod) -> (Option<PodSpec>, Option<PodStatus>, String) {
        let m = &p.metadata;
        (
            p.spec.clone(),
            p.status.clone(),
            format!(
                "{:?} {:?} {:?}",
                m.labels,
                m.deletion_timestamp,
                non_local(&m.annotations)
            ),
        )
    }

    proptest! {
        /// Folding the mux's output over any sequence of SETs gives each source's last
        /// SET, and every change is one the fold can apply (no ADD of a known pod, no
        /// UPDATE/DELETE/RECONCILE/REMOVE of an unknown one).
        #[test]
        fn folded_changes_equal_the_last_set(sets in proptest::collection::vec(gen_set(), 1..24)) {
            let mut mux = PodConfig::new();
            let mut folded: BTreeMap<SourceName, BTreeMap<String, Arc<Pod>>> = BTreeMap::new();
            let mut last: BTreeMap<SourceName, Vec<Arc<Pod>>> = BTreeMap::new();
            for (source, gens) in sets {
                let pods: Vec<Arc<Pod>> = gens.iter().map(gen_pod).collect();
                last.insert(source, pods.clone());
                for change in mux.merge(PodUpdate { op: Op::Set, source, pods }) {
                    prop_assert_eq!(change.source, source);
                    let state = folded.entry(change.source).or_default();
                    for p in change.pods {
                        let uid = uid_of(&p).to_owned();
                        match change.op {
                            Op::Add => prop_assert!(state.insert(uid, p).is_none(), "ADD of a known pod"),
                            Op::Update | Op::Delete | Op::Reconcile => {
                                if change.op == Op::Delete {
                                    prop_assert!(p.metadata.deletion_timestamp.is_some());
                                }
                                prop_assert!(state.insert(uid, p).is_some(), "change of an unknown pod");
                            }
                            Op::Remove => prop_assert!(state.remove(&uid).is_some(), "REMOVE of an unknown pod"),
                            Op::Set => prop_assert!(false, "the mux never emits SET"),
                        }
                    }
                }
            }
            prop_assert!(mux.seen_all(&last.keys().copied().collect::<Vec<_>>()));
            for (source, pods) in &last {
                let want: BTreeMap<String, _> =
                    pods.iter().map(|p| (uid_of(p).to_owned(), essence(p))).collect();
                let got: BTreeMap<String, _> = folded
                    .get(source)
                    .into_iter()
                    .flatten()
                    .map(|(uid, p)| (uid.clone(), essence(p)))
                    .collect();
                prop_assert_eq!(&got, &want, "source {:?}", source);
                let stored: BTreeMap<String, _> = mux
                    .source_pods(*source)
                    .map(|p| (uid_of(p).to_owned(), essence(p)))
                    .collect();
                prop_assert_eq!(&stored, &want);
            }
        }
    }
}
