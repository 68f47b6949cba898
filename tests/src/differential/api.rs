//! The API-server side of the differential harness: the corpus's pods created
//! as API pods (bound by `spec.nodeName` to the side's node, in a namespace of
//! the side's own, on the real control plane of [`crate::control_plane`]), their
//! statuses as written to the API server and their events (the kubelet's
//! `core/v1` Events and the agent's `events.k8s.io/v1` ones, both read as
//! `core/v1`), read back as the admin.
//!
//! Each side has its own node name ([`node_name`]), its own namespace and its
//! own containerd; the control plane is shared. An event is compared by its
//! type, reason, the part of the pod it names (`involvedObject.fieldPath`:
//! kubelet 1.37's messages no longer name the container) and message, the
//! message with what differs by construction replaced ([`normalise`]): the node's name,
//! the namespace, the pod's UID, durations (an image pull's `in 52ms`, a
//! back-off's `10s`), byte counts and hexadecimal ids.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    ConfigMap, Event, PersistentVolume, PersistentVolumeClaim, Pod, Secret,
};
use k8s_openapi::api::storage::v1::CSIDriver;
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::{DifferentialError, Side};
use crate::control_plane::ControlPlane;

/// The node name of a side in API mode (the two register distinct Nodes).
pub fn node_name(side: Side) -> &'static str {
    match side {
        Side::Kubelet => "fidelity-kubelet",
        Side::Evpleg { .. } => "fidelity-evpleg",
        Side::KubeletBehindProxy { evented: false } => "fidelity-proxy",
        Side::KubeletBehindProxy { evented: true } => "fidelity-proxy-evented",
    }
}

/// One event as compared: type, reason, the part of the pod it is about
/// (`spec.containers{app}`, or empty for the pod), normalised message.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Seen {
    pub kind: String,
    pub reason: String,
    pub field_path: String,
    pub message: String,
}

/// One side's view of the API server: the admin's client, its namespace and
/// its node.
#[allow(missing_debug_implementations)]
pub struct ApiSide {
    client: kube::Client,
    pub namespace: String,
    pub node: &'static str,
}

impl ApiSide {
    /// A new namespace (with its `default` ServiceAccount) for `side`.
    pub async fn new(cp: &ControlPlane, side: Side) -> Self {
        let node = node_name(side);
        Self {
            client: cp.admin().await,
            namespace: cp.namespace(node).await,
            node,
        }
    }

    fn pods_api(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Creates the pod of manifest `yaml` bound to this side's node.
    pub async fn create(&self, file: &str, yaml: &str) -> Result<(), DifferentialError> {
        let bad = |why: String| DifferentialError::Manifest {
            path: file.into(),
            why,
        };
        let decoded = evpleg_kubelet::source::file::decode(yaml.as_bytes())
            .map_err(|(i, e)| bad(format!("document {i}: {e}")))?;
        let Some((_, mut pod)) = decoded.into_iter().next() else {
            return Err(bad("no pod".into()));
        };
        pod.metadata.namespace = Some(self.namespace.clone());
        pod.spec.get_or_insert_with(Default::default).node_name = Some(self.node.to_owned());
        self.pods_api()
            .create(&PostParams::default(), &pod)
            .await
            .map_err(|e| DifferentialError::Api(format!("create pod {file}: {e}")))?;
        Ok(())
    }

    /// Creates the object of `yaml` (a document of manifest `file`): a
    /// ConfigMap, a Secret or a PersistentVolumeClaim in this side's
    /// namespace, or a PersistentVolume, named `<namespace>-<name>` (it is
    /// cluster-wide, the claim's `volumeName` is renamed so too). A claim and
    /// its volume are bound to each other as the PV controller binds them
    /// (none runs here): the volume's `claimRef` gets the claim's namespace
    /// and UID (the claim comes first in the manifest), and both statuses
    /// are patched `Bound` (a claim without a `volumeName` stays `Pending`).
    pub async fn create_object(&self, file: &str, yaml: &str) -> Result<(), DifferentialError> {
        let bad = |why: String| DifferentialError::Manifest {
            path: file.into(),
            why,
        };
        let options = evpleg_kubelet::source::file::yaml_options();
        let value: Value = serde_saphyr::from_str_with_options(yaml, options)
            .map_err(|e| bad(format!("an object: {e}")))?;
        let created = match value["kind"].as_str() {
            Some("ConfigMap") => self.create_in::<ConfigMap>(value).await,
            Some("Secret") => self.create_in::<Secret>(value).await,
            Some("PersistentVolumeClaim") => self.create_claim(value).await,
            Some("PersistentVolume") => self.create_volume(value).await,
            other => {
                return Err(bad(format!(
                    "an object of kind {other:?}: not ConfigMap, Secret, PersistentVolumeClaim or PersistentVolume"
                )));
            }
        };
        created.map_err(|e| DifferentialError::Api(format!("create an object of {file}: {e}")))
    }

    /// `<namespace>-<name>`: a cluster-wide object's name of this side.
    fn cluster_name(&self, name: &Value) -> String {
        format!("{}-{}", self.namespace, name.as_str().unwrap_or_default())
    }

    fn claims(&self) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Creates claim `value`; one with a `volumeName` (renamed,
    /// [`Self::cluster_name`]) is marked `Bound` with what it requests, one
    /// without stays `Pending`.
    async fn create_claim(&self, mut value: Value) -> Result<(), String> {
        if value["spec"]["volumeName"].is_null() {
            return self.create_in::<PersistentVolumeClaim>(value).await;
        }
        value["spec"]["volumeName"] = self.cluster_name(&value["spec"]["volumeName"]).into();
        let name = value["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let bound = json!({"status": {
            "phase": "Bound",
            "accessModes": value["spec"]["accessModes"],
            "capacity": value["spec"]["resources"]["requests"],
        }});
        self.create_in::<PersistentVolumeClaim>(value).await?;
        self.claims()
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(bound))
            .await
            .map(drop)
            .map_err(|e| format!("bind claim {name}: {e}"))
    }

    /// Creates volume `value`, named [`Self::cluster_name`], its `claimRef`
    /// given the namespace and UID of the claim it names (created before
    /// it), and marks it `Bound`.
    async fn create_volume(&self, mut value: Value) -> Result<(), String> {
        let claim = value["spec"]["claimRef"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let uid = self
            .claims()
            .get(&claim)
            .await
            .map_err(|e| format!("the volume's claim {claim:?} (written before it): {e}"))?
            .metadata
            .uid;
        value["metadata"]["name"] = self.cluster_name(&value["metadata"]["name"]).into();
        value["spec"]["claimRef"]["namespace"] = self.namespace.clone().into();
        value["spec"]["claimRef"]["uid"] = uid.into();
        let volume: PersistentVolume = serde_json::from_value(value).map_err(|e| e.to_string())?;
        let name = volume.metadata.name.clone().unwrap_or_default();
        let volumes = Api::<PersistentVolume>::all(self.client.clone());
        volumes
            .create(&PostParams::default(), &volume)
            .await
            .map_err(|e| e.to_string())?;
        let bound = json!({"status": {"phase": "Bound"}});
        volumes
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(bound))
            .await
            .map(drop)
            .map_err(|e| format!("bind volume {name}: {e}"))
    }

    /// The CSIDriver object of the test driver `name`, as its installation
    /// creates one: no attach, pod info on mount, both lifecycle modes (the
    /// kubelet refuses an inline volume of a driver without one).
    pub async fn ensure_csi_driver(&self, name: &str) {
        let driver: CSIDriver = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {
                "attachRequired": false,
                "podInfoOnMount": true,
                "volumeLifecycleModes": ["Persistent", "Ephemeral"],
            },
        }))
        .expect("a CSIDriver");
        let api = Api::<CSIDriver>::all(self.client.clone());
        crate::control_plane::create_or_keep(&api, &driver, &format!("CSIDriver {name}")).await;
    }

    /// Creates `value`, a `K`, in this side's namespace.
    async fn create_in<K>(&self, value: Value) -> Result<(), String>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + serde::Serialize
            + serde::de::DeserializeOwned
            + Clone
            + std::fmt::Debug,
        K::DynamicType: Default,
    {
        let mut object: K = serde_json::from_value(value).map_err(|e| e.to_string())?;
        object.meta_mut().namespace = Some(self.namespace.clone());
        Api::<K>::namespaced(self.client.clone(), &self.namespace)
            .create(&PostParams::default(), &object)
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    }

    /// Deletes pod `name` (its own grace period).
    pub async fn delete(&self, name: &str) -> Result<(), DifferentialError> {
        self.pods_api()
            .delete(name, &DeleteParams::default())
            .await
            .map_err(|e| DifferentialError::Api(format!("delete pod {name}: {e}")))?;
        Ok(())
    }

    /// Removes every pod of the namespace at once (no grace period), so that
    /// the next batch's node, of the same name, is not handed them.
    pub async fn delete_all(&self) -> Result<(), DifferentialError> {
        self.pods_api()
            .delete_collection(
                &DeleteParams::default().grace_period(0),
                &ListParams::default(),
            )
            .await
            .map_err(|e| {
                DifferentialError::Api(format!(
                    "delete the pods of namespace {}: {e}",
                    self.namespace
                ))
            })?;
        Ok(())
    }

    /// Sets pod `name`'s readiness gate True, as its controller would.
    pub async fn open_gate(&self, name: &str) -> Result<(), DifferentialError> {
        super::act::open_gate(&self.client, &self.namespace, name).await
    }

    /// The namespace's pods now, by name (none when the list fails).
    pub async fn pods(&self) -> BTreeMap<String, Value> {
        let Ok(list) = self.pods_api().list(&ListParams::default()).await else {
            return BTreeMap::new();
        };
        list.items
            .into_iter()
            .filter_map(|p| {
                let name = p.metadata.name.clone()?;
                Some((name, serde_json::to_value(&p).ok()?))
            })
            .collect()
    }

    /// The namespace's events about pods, by pod name, each normalised with
    /// the pod's `uid` (from `uids`, by name).
    pub async fn events(&self, uids: &BTreeMap<String, String>) -> BTreeMap<String, Vec<Seen>> {
        let api: Api<Event> = Api::namespaced(self.client.clone(), &self.namespace);
        let Ok(list) = api.list(&ListParams::default()).await else {
            return BTreeMap::new();
        };
        let mut out: BTreeMap<String, Vec<Seen>> = BTreeMap::new();
        for e in list.items {
            if e.involved_object.kind.as_deref() != Some("Pod") {
                continue;
            }
            let Some(pod) = e.involved_object.name.clone() else {
                continue;
            };
            let uid = uids.get(&pod).map(String::as_str).unwrap_or("");
            let seen = Seen {
                field_path: e.involved_object.field_path.clone().unwrap_or_default(),
                kind: e.type_.unwrap_or_default(),
                reason: e.reason.unwrap_or_default(),
                message: normalise(
                    e.message.as_deref().unwrap_or(""),
                    &[
                        (uid, "<uid>"),
                        (&self.namespace, "<ns>"),
                        (self.node, "<node>"),
                    ],
                ),
            };
            let list = out.entry(pod).or_default();
            if !list.contains(&seen) {
                list.push(seen);
            }
        }
        for list in out.values_mut() {
            list.sort();
        }
        out
    }
}

const UNITS: [&str; 7] = ["ns", "µs", "us", "ms", "s", "m", "h"];

/// `message` with each `(from, to)` replaced (empty `from`s skipped), then
/// every duration (`52ms`, `1m2.5s`, `1.2s`) as `<d>`, every number followed by
/// ` bytes` as `<n> bytes`, and every run of 12 or more hexadecimal digits as
/// `<id>`.
pub fn normalise(message: &str, known: &[(&str, &str)]) -> String {
    let mut s = message.to_owned();
    for (from, to) in known {
        if !from.is_empty() {
            s = s.replace(from, to);
        }
    }
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        let word_start = i == 0 || !chars[i - 1].is_alphanumeric();
        if word_start && chars[i].is_ascii_hexdigit() {
            let mut j = i;
            while j < chars.len() && chars[j].is_ascii_hexdigit() {
                j += 1;
            }
            if j - i >= 12 && (j == chars.len() || !chars[j].is_alphanumeric()) {
                out.push_str("<id>");
                i = j;
                continue;
            }
        }
        if word_start && chars[i].is_ascii_digit() {
            if let Some(end) = duration_end(&chars, i) {
                out.push_str("<d>");
                i = end;
                continue;
            }
            let mut j = i;
            while j < chars.len() && (chars[j].is_ascii_digit() || chars[j] == '.') {
                j += 1;
            }
            let rest: String = chars[j..].iter().take(6).collect();
            if rest == " bytes" {
                out.push_str("<n>");
                i = j;
                continue;
            }
        }
        out.push(chars[i]);
        i += 1;
    }
    out
}

/// Where a duration starting at `i` ends (one or more `<number><unit>`
/// parts, then no letter or digit), if one does.
fn duration_end(chars: &[char], mut i: usize) -> Option<usize> {
    let mut parts = 0;
    loop {
        let mut j = i;
        while j < chars.len() && (chars[j].is_ascii_digit() || chars[j] == '.') {
            j += 1;
        }
        if j == i {
            break;
        }
        let unit = UNITS.iter().find(|u| {
            let n = u.chars().count();
            j + n <= chars.len() && chars[j..j + n].iter().copied().eq(u.chars())
        })?;
        i = j + unit.chars().count();
        parts += 1;
        if i >= chars.len() || !chars[i].is_ascii_digit() {
            break;
        }
    }
    let ends_word = i >= chars.len() || !chars[i].is_alphanumeric();
    (parts > 0 && ends_word).then_some(i)
}
