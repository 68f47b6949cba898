//! The API server status writer: pod status as a merge patch on the `status`
//! subresource, and mirror pods for static pods (the kubelet's
//! `pkg/kubelet/status/status_manager.go` `syncPod`, `pkg/util/pod.PatchPodStatus`
//! and `pkg/kubelet/pod/mirror_client.go`).
//!
//! # One write
//!
//! As the kubelet's status manager: GET the pod; a pod whose UID differs was
//! deleted and recreated, and this status is not for it; merge the new status with
//! the stored one ([`merge_status`]: conditions the kubelet does not own, the
//! nominated node and resource claim statuses stay as the API has them); build a
//! two-way patch from the stored status to the merged one, with `metadata.uid` in
//! it as a precondition (`{"metadata":{"uid":...},"status":{...}}`, fields that
//! went away as `null`); send nothing when only the UID would be in it; else
//! PATCH `.../pods/{name}/status`. As the kubelet's (`PatchPodStatus`,
//! `CreateTwoWayMergePatch`), the patch is a strategic merge patch
//! ([`strategic_patch`]): the lists the pod status merges by a key
//! (`conditions` by `type`, `podIPs` and `hostIPs` by `ip`) carry only the
//! elements that changed (the rest of each element as a merge patch), a
//! `$patch: delete` for each one gone and the `$setElementOrder` directive;
//! other lists are replaced whole. So a condition another writer (a readiness
//! gate's controller, the disruption controller) added between the GET and
//! the PATCH stays: a JSON merge patch sent the conditions read before, whole,
//! and deleted it.
//!
//! # Static pods
//!
//! A pod whose `kubernetes.io/config.source` is not `api` is a static pod: the API
//! server does not know it, so its status goes to its **mirror pod**, a read-only
//! copy with the same namespace and name, the static pod's labels, annotations and
//! spec (bound to this node), the annotation `kubernetes.io/config.mirror` = the
//! static pod's `kubernetes.io/config.hash`, an owner reference to this Node,
//! and no status. Until this node's Node object exists no mirror pod is made
//! (a retryable error, as the kubelet's mirror client fails without the node's
//! UID): the NodeRestriction admission plugin refuses a node's mirror pod
//! without that owner reference. A missing mirror pod is created (409
//! AlreadyExists is fine when the existing one is ours); a mirror pod of another
//! hash (an older manifest) or one being deleted is deleted with grace period 0
//! and the old UID as precondition, then recreated. A pod of that name that is not
//! a mirror pod is never touched. The mirror pod's status is then patched as
//! above, with the mirror pod's UID as the precondition. [`StatusWriter::forget`]
//! deletes the static pod's mirror pod (the kubelet's orphaned mirror pod cleanup).
//! [`StatusWriter::delete`] is the status manager's final delete of a gracefully
//! deleted API pod (see [`super::finish`]).
//!
//! # Errors
//!
//! Connection errors, timeouts, 5xx, 408 and 429 are [`WriteError::Retryable`]: the
//! status manager keeps the newest status and writes it when the API is back. A
//! 404 for an API pod (it is gone), a changed UID (409 from the precondition), and
//! other 4xx are [`WriteError::Permanent`].
//!
//! The client should be built with `kube::Config::default_retry = false`: kube 5
//! otherwise retries 429/503/504 up to 15 times inside the client (minutes), and
//! the status manager's own backoff never sees the outage.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod, PodCondition, PodSpec, PodStatus as ApiPodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use serde_json::{Map, Value, json};
use tracing::{debug, info, warn};

use super::{StatusWriter, WriteError};
use crate::source::{SourceName, annotations};

/// The field manager named in patches and creates.
pub const FIELD_MANAGER: &str = "evpleg";
/// Bound of one write (all its requests), after which it is retryable.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Pod conditions the kubelet owns (`kubetypes.PodConditionsByKubelet`): the new
/// status's replace the API's.
const KUBELET_CONDITIONS: &[&str] = &[
    "PodScheduled",
    "Ready",
    "Initialized",
    "ContainersReady",
    "PodReadyToStartContainers",
    "PodResizePending",
    "PodResizeInProgress",
];
/// Conditions the kubelet shares with others (`PodConditionSharedByKubelet`): the
/// new status's replace one of the same type, others stay.
const SHARED_CONDITIONS: &[&str] = &["DisruptionTarget"];

/// Writes pod statuses to the API server.
pub struct ApiStatusWriter {
    client: kube::Client,
    node_name: String,
    timeout: Duration,
    /// This node's UID once known (for the mirror pods' owner reference).
    node_uid: Mutex<Option<String>>,
}

impl std::fmt::Debug for ApiStatusWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiStatusWriter")
            .field("node_name", &self.node_name)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl ApiStatusWriter {
    pub fn new(client: kube::Client, node_name: impl Into<String>) -> Self {
        Self {
            client,
            node_name: node_name.into(),
            timeout: DEFAULT_REQUEST_TIMEOUT,
            node_uid: Mutex::new(None),
        }
    }

    /// Bounds each write; past it the write is retryable.
    #[must_use]
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn pods(&self, namespace: &str) -> Api<Pod> {
        Api::namespaced(self.client.clone(), namespace)
    }

    /// GET, merge, PATCH for a pod that exists in the API server.
    async fn write_api_pod(&self, pod: &Pod, status: &ApiPodStatus) -> Result<(), WriteError> {
        let who = full_name(pod);
        let (namespace, name) = names(pod);
        let api = self.pods(namespace);
        let current = api.get(name).await.map_err(|e| match classify(&e) {
            ErrorClass::NotFound => permanent(&who, "the pod is gone from the API server"),
            // The Node authorizer's answer for a pod not bound to this node:
            // one that no longer exists, or one bound so lately that its
            // graph has not seen it yet (a pod rejected at admission is
            // written at once: the fidelity run lost such a status).
            ErrorClass::Forbidden => WriteError::Unbound {
                pod: who.clone(),
                message: format!(
                    "the pod is gone from the API server, or not bound to this node (yet): {}",
                    describe(&e)
                ),
            },
            _ => api_error(&who, "reading the pod", &e),
        })?;
        let uid = pod.metadata.uid.as_deref().unwrap_or_default();
        let current_uid = current.metadata.uid.as_deref().unwrap_or_default();
        if !uid.is_empty() && uid != current_uid {
            return Err(permanent(
                &who,
                &format!(
                    "the pod was deleted and recreated (uid {uid}, now {current_uid} in the API server)"
                ),
            ));
        }
        self.patch_status(&api, &current, status)
            .await
            .map_err(|e| match classify(&e) {
                ErrorClass::NotFound => permanent(&who, "the pod is gone from the API server"),
                ErrorClass::Conflict => permanent(
                    &who,
                    &format!("the pod was replaced in the API server: {}", describe(&e)),
                ),
                _ => api_error(&who, "patching the pod status", &e),
            })
    }

    /// Patches `current`'s status to `status` (merged), with its UID as the
    /// precondition. Nothing is sent when nothing changed.
    async fn patch_status(
        &self,
        api: &Api<Pod>,
        current: &Pod,
        status: &ApiPodStatus,
    ) -> Result<(), kube::Error> {
        let merged = merge_status(current.status.as_ref(), status);
        let uid = current.metadata.uid.as_deref().unwrap_or_default();
        let Some(patch) = status_patch(uid, current.status.as_ref(), &merged) else {
            debug!(pod = %full_name(current), "status unchanged in the API server; not patched");
            return Ok(());
        };
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        let (_, name) = names(current);
        api.patch_status(name, &params, &Patch::Strategic(&patch))
            .await
            .map(drop)
    }

    /// The PATCH half of a write to API pod `current`, as read by the GET
    /// before it: `status` merged with `current`'s and sent as a strategic
    /// merge patch with `current`'s UID as the precondition. Errors as
    /// [`StatusWriter::write`]'s.
    pub async fn patch_read_pod(
        &self,
        current: &Pod,
        status: &ApiPodStatus,
    ) -> Result<(), WriteError> {
        let (namespace, _) = names(current);
        self.patch_status(&self.pods(namespace), current, status)
            .await
            .map_err(|e| api_error(&full_name(current), "patching the pod status", &e))
    }

    /// Ensures the mirror pod, then patches its status; once more if the mirror pod
    /// was replaced in between.
    async fn write_static_pod(&self, pod: &Pod, status: &ApiPodStatus) -> Result<(), WriteError> {
        let who = full_name(pod);
        let hash = config_hash(pod).ok_or_else(|| {
            permanent(
                &who,
                "the static pod has no kubernetes.io/config.hash annotation, so no mirror pod",
            )
        })?;
        let (namespace, _) = names(pod);
        let api = self.pods(namespace);
        let mut again = true;
        loop {
            let mirror = self.ensure_mirror(&api, pod, hash).await?;
            match self.patch_status(&api, &mirror, status).await {
                Ok(()) => return Ok(()),
                Err(e)
                    if again
                        && matches!(classify(&e), ErrorClass::NotFound | ErrorClass::Conflict) =>
                {
                    debug!(pod = %who, error = %describe(&e), "mirror pod replaced while patching its status; again");
                    again = false;
                }
                Err(e) => return Err(api_error(&who, "patching the mirror pod status", &e)),
            }
        }
    }

    /// The mirror pod of `pod`, created or replaced as needed.
    async fn ensure_mirror(
        &self,
        api: &Api<Pod>,
        pod: &Pod,
        hash: &str,
    ) -> Result<Pod, WriteError> {
        let who = full_name(pod);
        let (_, name) = names(pod);
        let existing = get_bound(api, name)
            .await
            .map_err(|e| api_error(&who, "reading the mirror pod", &e))?;
        match existing {
            Some(mirror)
                if is_mirror_of(&mirror, hash) && mirror.metadata.deletion_timestamp.is_none() =>
            {
                return Ok(mirror);
            }
            Some(mirror) if is_mirror(&mirror) => {
                info!(pod = %who, old_hash = mirror_hash(&mirror).unwrap_or_default(), hash, "replacing an outdated mirror pod");
                self.delete_mirror(api, &mirror)
                    .await
                    .map_err(|e| api_error(&who, "deleting the outdated mirror pod", &e))?;
            }
            Some(_) => {
                return Err(permanent(
                    &who,
                    "a pod of this name that is not a mirror pod exists in the API server",
                ));
            }
            None => {}
        }
        let mirror = self.mirror_of(pod, hash).await?;
        let params = PostParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PostParams::default()
        };
        match api.create(&params, &mirror).await {
            Ok(created) => {
                info!(pod = %who, uid = created.metadata.uid.as_deref().unwrap_or_default(), "created the mirror pod");
                Ok(created)
            }
            Err(e) if classify(&e) == ErrorClass::AlreadyExists => {
                // Created in between (by an earlier write): fine if it is this
                // one's. One this node may not read is bound to another node.
                match get_bound(api, name)
                    .await
                    .map_err(|e| api_error(&who, "reading the mirror pod", &e))?
                {
                    Some(m) if is_mirror_of(&m, hash) => Ok(m),
                    Some(_) => Err(retryable(
                        &who,
                        "another pod took the mirror pod's name while it was being created",
                    )),
                    None => Err(permanent(
                        &who,
                        "a pod of this name that is not this node's mirror pod exists in the API server (bound to another node)",
                    )),
                }
            }
            Err(e) => Err(api_error(&who, "creating the mirror pod", &e)),
        }
    }

    /// Deletes a mirror pod at once, only if it still has the same UID; a mirror
    /// pod already gone or replaced is fine.
    async fn delete_mirror(&self, api: &Api<Pod>, mirror: &Pod) -> Result<(), kube::Error> {
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: mirror.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        let (_, name) = names(mirror);
        match api.delete(name, &params).await {
            Ok(_) => Ok(()),
            Err(e) if matches!(classify(&e), ErrorClass::NotFound | ErrorClass::Conflict) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The mirror pod to create for a static pod: no status, bound to this node.
    async fn mirror_of(&self, pod: &Pod, hash: &str) -> Result<Pod, WriteError> {
        let mut annotations = pod.metadata.annotations.clone().unwrap_or_default();
        annotations.insert(annotations::CONFIG_MIRROR.to_string(), hash.to_string());
        let owner = self.node_owner(&full_name(pod)).await?;
        let spec = PodSpec {
            node_name: Some(self.node_name.clone()),
            ..pod.spec.clone().unwrap_or_default()
        };
        Ok(Pod {
            metadata: ObjectMeta {
                name: pod.metadata.name.clone(),
                namespace: pod.metadata.namespace.clone(),
                labels: pod.metadata.labels.clone(),
                annotations: Some(annotations),
                owner_references: Some(vec![owner]),
                ..ObjectMeta::default()
            },
            spec: Some(spec),
            status: None,
        })
    }

    /// The owner reference to this Node (the kubelet's mirror client sets one; the
    /// NodeRestriction admission plugin requires it). Without a Node object
    /// there is none yet: retryable, as the kubelet's `getNodeUID` failing.
    async fn node_owner(&self, who: &str) -> Result<OwnerReference, WriteError> {
        let known = self
            .node_uid
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let uid = match known {
            Some(uid) => uid,
            None => {
                let nodes: Api<Node> = Api::all(self.client.clone());
                match nodes.get_opt(&self.node_name).await {
                    Ok(Some(node)) => {
                        let uid = node.metadata.uid.unwrap_or_default();
                        *self.node_uid.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some(uid.clone());
                        uid
                    }
                    Ok(None) => {
                        return Err(retryable(
                            who,
                            &format!(
                                "no Node object {} yet: a mirror pod needs its owner reference to it",
                                self.node_name
                            ),
                        ));
                    }
                    Err(e) => {
                        return Err(api_error(
                            who,
                            "reading this node for the mirror pod's owner",
                            &e,
                        ));
                    }
                }
            }
        };
        Ok(OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: self.node_name.clone(),
            uid,
            controller: Some(true),
            block_owner_deletion: None,
        })
    }

    /// Deletes the mirror pod of a static pod that left the node, if it is still
    /// that pod's (same hash).
    async fn delete_orphaned_mirror(&self, pod: &Pod) {
        let Some(hash) = config_hash(pod) else { return };
        let who = full_name(pod);
        let (namespace, name) = names(pod);
        let api = self.pods(namespace);
        let result = async {
            match get_bound(&api, name).await? {
                Some(mirror) if is_mirror_of(&mirror, hash) => {
                    self.delete_mirror(&api, &mirror).await?;
                    info!(pod = %who, "deleted the mirror pod of a removed static pod");
                    Ok(())
                }
                _ => Ok(()),
            }
        };
        match tokio::time::timeout(self.timeout, result).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                warn!(pod = %who, error = %describe(&e), "deleting the mirror pod of a removed static pod failed")
            }
            Err(_) => {
                warn!(pod = %who, timeout = ?self.timeout, "deleting the mirror pod of a removed static pod timed out")
            }
        }
    }
}

impl StatusWriter for ApiStatusWriter {
    async fn write(&self, pod: &Pod, status: &ApiPodStatus) -> Result<(), WriteError> {
        let write = async {
            if is_static(pod) {
                self.write_static_pod(pod, status).await
            } else {
                self.write_api_pod(pod, status).await
            }
        };
        match tokio::time::timeout(self.timeout, write).await {
            Ok(result) => result,
            Err(_) => Err(retryable(
                &full_name(pod),
                &format!("the API server did not answer within {:?}", self.timeout),
            )),
        }
    }

    async fn forget(&self, pod: &Pod) {
        if is_static(pod) {
            self.delete_orphaned_mirror(pod).await;
        }
    }

    /// The status manager's final delete of a pod that finished terminating:
    /// grace period 0 and the pod's UID as precondition, so that a new pod of the
    /// same name is never deleted. Gone already: done; another UID (409): a
    /// permanent error, the pod is not ours any more.
    async fn delete(&self, pod: &Pod) -> Result<(), WriteError> {
        let who = full_name(pod);
        let (namespace, name) = names(pod);
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: pod.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        let api = self.pods(namespace);
        match tokio::time::timeout(self.timeout, api.delete(name, &params)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) if classify(&e) == ErrorClass::NotFound => Ok(()),
            Ok(Err(e)) => Err(api_error(&who, "deleting the terminated pod", &e)),
            Err(_) => Err(retryable(
                &who,
                &format!("the API server did not answer within {:?}", self.timeout),
            )),
        }
    }
}

/// The pod `name` if it exists and this node may read it: under the Node
/// authorizer a node reads only pods bound to it, and a pod that does not
/// exist is not bound to it either (403 "no relationship found"), so for the
/// node's own client a 403 is no pod of its own, as a 404. (The kubelet never
/// asks: its mirror pods come from its watch of the node's pods.)
async fn get_bound(api: &Api<Pod>, name: &str) -> Result<Option<Pod>, kube::Error> {
    match api.get_opt(name).await {
        Err(e) if classify(&e) == ErrorClass::Forbidden => {
            debug!(pod = name, error = %describe(&e), "pod not readable by this node: none of its own");
            Ok(None)
        }
        other => other,
    }
}

// ----- status merge and patch --------------------------------------------------

/// The status to store: `new`, with what the kubelet does not own kept from `old`
/// (the kubelet's `mergePodStatus`): conditions of other owners, the nominated
/// node, resource claim statuses. A terminal phase waits while a container
/// could still run (`couldHaveRunningContainers`; here, a container `new`
/// shows running, as an evicted pod's during its grace period): `old`'s
/// phase, reason and message stay until then.
pub fn merge_status(old: Option<&ApiPodStatus>, new: &ApiPodStatus) -> ApiPodStatus {
    let old = old.cloned().unwrap_or_default();
    let runs = [
        &new.init_container_statuses,
        &new.container_statuses,
        &new.ephemeral_container_statuses,
    ]
    .into_iter()
    .flatten()
    .flatten()
    .any(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()));
    let held = runs
        && !super::finish::is_terminal(old.phase.as_deref())
        && super::finish::is_terminal(new.phase.as_deref());
    let mut conditions: Vec<PodCondition> = old
        .conditions
        .iter()
        .flatten()
        .filter(|c| !KUBELET_CONDITIONS.contains(&c.type_.as_str()))
        .cloned()
        .collect();
    for c in new.conditions.iter().flatten() {
        if KUBELET_CONDITIONS.contains(&c.type_.as_str()) {
            conditions.push(c.clone());
        } else if SHARED_CONDITIONS.contains(&c.type_.as_str()) {
            match conditions.iter_mut().find(|o| o.type_ == c.type_) {
                Some(o) => *o = c.clone(),
                None => conditions.push(c.clone()),
            }
        }
    }
    let (phase, reason, message) = if held {
        (old.phase, old.reason, old.message)
    } else {
        (new.phase.clone(), new.reason.clone(), new.message.clone())
    };
    ApiPodStatus {
        phase,
        reason,
        message,
        conditions: (!conditions.is_empty()).then_some(conditions),
        nominated_node_name: old.nominated_node_name,
        resource_claim_statuses: old.resource_claim_statuses,
        extended_resource_claim_status: old.extended_resource_claim_status,
        ..new.clone()
    }
}

/// The patch from `old` to `new` with `uid` as precondition:
/// `{"metadata":{"uid":...},"status":<strategic merge patch>}`, or `None` when
/// the statuses are the same. Compared as the kubelet compares Go structs,
/// where an absent field is its zero value: the API server stores a
/// container's `lastState` as `{}` when it has none, and that is no change
/// ([`prune_empty`]).
pub fn status_patch(uid: &str, old: Option<&ApiPodStatus>, new: &ApiPodStatus) -> Option<Value> {
    let old =
        prune_empty(serde_json::to_value(old.cloned().unwrap_or_default()).unwrap_or(Value::Null));
    let new = prune_empty(serde_json::to_value(new).unwrap_or(Value::Null));
    let diff = strategic_patch(&old, &new)?;
    Some(json!({ "metadata": { "uid": uid }, "status": diff }))
}

/// The lists of the pod status merged by a key in a strategic merge patch
/// (`patchStrategy:"merge"` and its `patchMergeKey` in the Go types); every
/// other list is replaced whole.
pub const MERGE_KEYS: [(&str, &str); 3] =
    [("conditions", "type"), ("podIPs", "ip"), ("hostIPs", "ip")];

/// The two-way strategic merge patch from pod status `old` to `new` (the
/// apimachinery's `CreateTwoWayMergePatch` for a pod status): a merge patch
/// ([`merge_patch`]), except that the lists of [`MERGE_KEYS`] carry the
/// changed or new elements only (each as its merge patch with its key), a
/// `{"<key>": ..., "$patch": "delete"}` per element gone, and
/// `$setElementOrder/<list>` with the new order. `None`: nothing to do.
pub fn strategic_patch(old: &Value, new: &Value) -> Option<Value> {
    let (Value::Object(o), Value::Object(n)) = (old, new) else {
        return merge_patch(old, new);
    };
    let mut rest_old = o.clone();
    let mut rest_new = n.clone();
    let mut patch = Map::new();
    for (list, key) in MERGE_KEYS {
        let (Some(ol), Some(nl)) = (
            list_of(rest_old.remove(list)),
            list_of(rest_new.remove(list)),
        ) else {
            // Not lists: left to the plain merge patch.
            if let Some(v) = o.get(list) {
                rest_old.insert(list.into(), v.clone());
            }
            if let Some(v) = n.get(list) {
                rest_new.insert(list.into(), v.clone());
            }
            continue;
        };
        let key_of = |v: &Value| v.get(key).cloned().unwrap_or(Value::Null);
        let mut items = Vec::new();
        for item in &nl {
            match ol.iter().find(|e| key_of(e) == key_of(item)) {
                Some(before) => {
                    if let Some(Value::Object(mut d)) = merge_patch(before, item) {
                        d.insert(key.into(), key_of(item));
                        items.push(Value::Object(d));
                    }
                }
                None => items.push(item.clone()),
            }
        }
        for gone in ol
            .iter()
            .filter(|e| !nl.iter().any(|i| key_of(i) == key_of(e)))
        {
            items.push(json!({ key: key_of(gone), "$patch": "delete" }));
        }
        if !items.is_empty() {
            let order: Vec<Value> = nl.iter().map(|i| json!({ key: key_of(i) })).collect();
            patch.insert(format!("$setElementOrder/{list}"), Value::Array(order));
            patch.insert(list.into(), Value::Array(items));
        }
    }
    if let Some(Value::Object(rest)) =
        merge_patch(&Value::Object(rest_old), &Value::Object(rest_new))
    {
        patch.extend(rest);
    }
    (!patch.is_empty()).then_some(Value::Object(patch))
}

/// A list of a strategic merge: absent is empty; `None` when not a list.
fn list_of(v: Option<Value>) -> Option<Vec<Value>> {
    match v {
        None | Some(Value::Null) => Some(Vec::new()),
        Some(Value::Array(a)) => Some(a),
        Some(_) => None,
    }
}

/// `value` without the object fields that are `null`, `{}` or `[]` once
/// pruned themselves (inside arrays too): what Go's `omitempty` leaves out
/// and a struct field serialises as `{}`.
pub fn prune_empty(value: Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (k, prune_empty(v)))
                .filter(|(_, v)| !is_empty(v))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(prune_empty).collect()),
        other => other,
    }
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

/// The RFC 7386 merge patch that turns `old` into `new` (`None`: nothing to do).
/// Objects are diffed key by key, removed keys become `null`, anything else that
/// differs (arrays included) is replaced whole.
pub fn merge_patch(old: &Value, new: &Value) -> Option<Value> {
    match (old, new) {
        (Value::Object(o), Value::Object(n)) => {
            let mut patch = Map::new();
            for (k, nv) in n {
                match o.get(k) {
                    Some(ov) => {
                        if let Some(p) = merge_patch(ov, nv) {
                            patch.insert(k.clone(), p);
                        }
                    }
                    None => {
                        patch.insert(k.clone(), nv.clone());
                    }
                }
            }
            for k in o.keys().filter(|k| !n.contains_key(*k)) {
                patch.insert(k.clone(), Value::Null);
            }
            (!patch.is_empty()).then_some(Value::Object(patch))
        }
        _ => (old != new).then(|| new.clone()),
    }
}

// ----- pods ----------------------------------------------------------------------

/// A static pod: its source annotation is present and not `api` (the kubelet's
/// `IsStaticPod`; a pod without the annotation is an API pod).
pub(crate) fn is_static(pod: &Pod) -> bool {
    annotation(pod, annotations::CONFIG_SOURCE).is_some_and(|s| s != SourceName::Api.as_str())
}

fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a: &BTreeMap<String, String>| a.get(key))
        .map(String::as_str)
}

fn config_hash(pod: &Pod) -> Option<&str> {
    annotation(pod, annotations::CONFIG_HASH).filter(|h| !h.is_empty())
}

fn mirror_hash(pod: &Pod) -> Option<&str> {
    annotation(pod, annotations::CONFIG_MIRROR)
}

fn is_mirror(pod: &Pod) -> bool {
    mirror_hash(pod).is_some()
}

/// The kubelet's `IsMirrorPodOf`: a mirror pod carrying the static pod's hash.
fn is_mirror_of(mirror: &Pod, hash: &str) -> bool {
    mirror_hash(mirror) == Some(hash)
}

fn names(pod: &Pod) -> (&str, &str) {
    (
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or_default(),
    )
}

pub(crate) fn full_name(pod: &Pod) -> String {
    let (namespace, name) = names(pod);
    format!("{namespace}/{name}")
}

// ----- errors --------------------------------------------------------------------

/// What an API error means for a status write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ErrorClass {
    /// Unreachable, timed out, 5xx, 408, 429.
    Retryable,
    /// 404.
    NotFound,
    /// 403: for a node's client, under the Node authorizer, also a pod that
    /// does not exist or is not bound to this node ("no relationship found
    /// between node ... and this object").
    Forbidden,
    /// 409 AlreadyExists.
    AlreadyExists,
    /// 409 otherwise (a failed UID or resourceVersion precondition).
    Conflict,
    /// Any other failure.
    Permanent,
}

pub(crate) fn classify(e: &kube::Error) -> ErrorClass {
    match e {
        kube::Error::Api(status) => match (status.code, status.reason.as_str()) {
            (404, _) | (0, "NotFound") => ErrorClass::NotFound,
            (403, _) | (0, "Forbidden") => ErrorClass::Forbidden,
            (409, "AlreadyExists") | (0, "AlreadyExists") => ErrorClass::AlreadyExists,
            (409, _) | (0, "Conflict") => ErrorClass::Conflict,
            (408 | 429, _) => ErrorClass::Retryable,
            (500..=599, _) => ErrorClass::Retryable,
            (
                0,
                "ServiceUnavailable" | "InternalError" | "Timeout" | "ServerTimeout"
                | "TooManyRequests",
            ) => ErrorClass::Retryable,
            _ => ErrorClass::Permanent,
        },
        // Connecting, sending, reading: the API server or the network is away.
        kube::Error::HyperError(_) | kube::Error::Service(_) | kube::Error::ReadEvents(_) => {
            ErrorClass::Retryable
        }
        _ => ErrorClass::Permanent,
    }
}

/// A short description: the API's own message and code, else the client error.
fn describe(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} ({} {})", s.message, s.code, s.reason),
        other => other.to_string(),
    }
}

fn api_error(pod: &str, what: &str, e: &kube::Error) -> WriteError {
    let message = format!("{what}: {}", describe(e));
    match classify(e) {
        ErrorClass::Retryable => retryable(pod, &message),
        _ => permanent(pod, &message),
    }
}

fn retryable(pod: &str, message: &str) -> WriteError {
    WriteError::Retryable {
        pod: pod.to_string(),
        message: message.to_string(),
    }
}

fn permanent(pod: &str, message: &str) -> WriteError {
    WriteError::Permanent {
        pod: pod.to_string(),
        message: message.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{ContainerState, ContainerStateTerminated, ContainerStatus};
    use kube::core::Status;

    use super::*;

    fn api(code: u16, reason: &str) -> kube::Error {
        kube::Error::Api(Status::failure("something", reason).with_code(code).boxed())
    }

    fn is_retryable(e: &WriteError) -> bool {
        matches!(e, WriteError::Retryable { .. })
    }

    #[test]
    fn api_error_mapping_5xx_408_429_are_retryable() {
        for (code, reason) in [
            (500, "InternalError"),
            (502, ""),
            (503, "ServiceUnavailable"),
            (504, "Timeout"),
            (408, "Timeout"),
            (429, "TooManyRequests"),
        ] {
            assert_eq!(
                classify(&api(code, reason)),
                ErrorClass::Retryable,
                "{code}"
            );
            assert!(
                is_retryable(&api_error("ns/p", "patching", &api(code, reason))),
                "{code}"
            );
        }
    }

    #[test]
    fn api_error_mapping_connection_errors_are_retryable() {
        let refused =
            std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
        let e = kube::Error::Service(Box::new(refused));
        assert_eq!(classify(&e), ErrorClass::Retryable);
        let e = kube::Error::ReadEvents(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset",
        ));
        assert_eq!(classify(&e), ErrorClass::Retryable);
    }

    #[test]
    fn api_error_mapping_4xx_are_permanent() {
        assert_eq!(classify(&api(404, "NotFound")), ErrorClass::NotFound);
        assert_eq!(
            classify(&api(409, "AlreadyExists")),
            ErrorClass::AlreadyExists
        );
        assert_eq!(classify(&api(409, "Conflict")), ErrorClass::Conflict);
        assert_eq!(classify(&api(403, "Forbidden")), ErrorClass::Forbidden);
        for (code, reason) in [(400, "BadRequest"), (422, "Invalid"), (410, "Expired")] {
            assert_eq!(
                classify(&api(code, reason)),
                ErrorClass::Permanent,
                "{code}"
            );
        }
        for code in [404, 409, 403, 422] {
            assert!(
                !is_retryable(&api_error("ns/p", "patching", &api(code, ""))),
                "{code}"
            );
        }
        let e = kube::Error::SerdeError(serde_json::from_str::<Value>("{").unwrap_err());
        assert_eq!(classify(&e), ErrorClass::Permanent);
    }

    #[test]
    fn api_error_mapping_uses_the_reason_without_a_code() {
        assert_eq!(
            classify(&api(0, "ServiceUnavailable")),
            ErrorClass::Retryable
        );
        assert_eq!(classify(&api(0, "NotFound")), ErrorClass::NotFound);
        assert_eq!(classify(&api(0, "Forbidden")), ErrorClass::Forbidden);
        assert_eq!(classify(&api(0, "Invalid")), ErrorClass::Permanent);
    }

    #[test]
    fn api_error_message_names_the_pod_and_the_api_message() {
        let e = api_error(
            "ns/p",
            "patching the pod status",
            &api(503, "ServiceUnavailable"),
        );
        let text = e.to_string();
        assert!(
            text.contains("ns/p")
                && text.contains("patching the pod status")
                && text.contains("503"),
            "{text}"
        );
    }

    fn condition(type_: &str, status: &str) -> PodCondition {
        PodCondition {
            type_: type_.into(),
            status: status.into(),
            ..PodCondition::default()
        }
    }

    #[test]
    fn api_merge_keeps_conditions_the_kubelet_does_not_own() {
        let old = ApiPodStatus {
            conditions: Some(vec![
                condition("Ready", "False"),
                condition("example.com/gate", "True"),
                condition("DisruptionTarget", "False"),
            ]),
            nominated_node_name: Some("other".into()),
            ..ApiPodStatus::default()
        };
        let new = ApiPodStatus {
            phase: Some("Running".into()),
            conditions: Some(vec![
                condition("Ready", "True"),
                condition("DisruptionTarget", "True"),
                condition("not-ours", "True"),
            ]),
            ..ApiPodStatus::default()
        };
        let merged = merge_status(Some(&old), &new);
        let got: Vec<(String, String)> = merged
            .conditions
            .unwrap_or_default()
            .into_iter()
            .map(|c| (c.type_, c.status))
            .collect();
        assert_eq!(
            got,
            [
                ("example.com/gate".to_string(), "True".to_string()),
                ("DisruptionTarget".into(), "True".into()),
                ("Ready".into(), "True".into()),
            ]
        );
        assert_eq!(merged.nominated_node_name.as_deref(), Some("other"));
        assert_eq!(merged.phase.as_deref(), Some("Running"));
    }

    /// The kubelet's `mergePodStatus`: a terminal phase (here an evicted
    /// pod's Failed, DeadlineExceeded) is not written while a container
    /// runs; the old phase, reason and message stay, the new conditions go.
    /// Once nothing runs, or when the API's phase is terminal already, the
    /// new phase is written.
    #[test]
    fn a_terminal_phase_waits_for_the_containers_in_the_api() {
        let state = |running: bool| ContainerState {
            running: running.then(Default::default),
            terminated: (!running).then(|| ContainerStateTerminated {
                exit_code: 137,
                ..ContainerStateTerminated::default()
            }),
            ..ContainerState::default()
        };
        let evicted = |running: bool| ApiPodStatus {
            phase: Some("Failed".into()),
            reason: Some("DeadlineExceeded".into()),
            message: Some("past".into()),
            conditions: Some(vec![condition("Ready", "False")]),
            container_statuses: Some(vec![ContainerStatus {
                name: "app".into(),
                state: Some(state(running)),
                ..ContainerStatus::default()
            }]),
            ..ApiPodStatus::default()
        };
        let old = ApiPodStatus {
            phase: Some("Running".into()),
            conditions: Some(vec![condition("Ready", "True")]),
            ..ApiPodStatus::default()
        };
        let held = merge_status(Some(&old), &evicted(true));
        assert_eq!(
            (
                held.phase.as_deref(),
                held.reason.as_deref(),
                held.message.as_deref()
            ),
            (Some("Running"), None, None)
        );
        assert_eq!(held.conditions.unwrap()[0].status, "False");
        let done = merge_status(Some(&old), &evicted(false));
        assert_eq!(
            (done.phase.as_deref(), done.reason.as_deref()),
            (Some("Failed"), Some("DeadlineExceeded"))
        );
        let already = merge_status(Some(&evicted(false)), &evicted(true));
        assert_eq!(already.phase.as_deref(), Some("Failed"));
    }

    #[test]
    fn api_patch_carries_the_uid_and_nulls_for_removed_fields() {
        let old = ApiPodStatus {
            phase: Some("Running".into()),
            pod_ip: Some("10.0.0.1".into()),
            ..ApiPodStatus::default()
        };
        let new = ApiPodStatus {
            phase: Some("Failed".into()),
            container_statuses: Some(vec![ContainerStatus {
                name: "main".into(),
                state: Some(ContainerState {
                    terminated: Some(ContainerStateTerminated {
                        exit_code: 3,
                        reason: Some("Error".into()),
                        ..ContainerStateTerminated::default()
                    }),
                    ..ContainerState::default()
                }),
                ..ContainerStatus::default()
            }]),
            ..ApiPodStatus::default()
        };
        let patch = status_patch("u-1", Some(&old), &new).expect("a patch");
        assert_eq!(patch["metadata"], json!({ "uid": "u-1" }));
        assert_eq!(patch["status"]["phase"], "Failed");
        assert_eq!(patch["status"]["podIP"], Value::Null);
        assert!(patch["status"].as_object().unwrap().contains_key("podIP"));
        assert_eq!(
            patch["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"],
            3
        );

        // Applying it (RFC 7386) to the old status gives the new one.
        let mut doc = serde_json::to_value(&old).unwrap();
        merge_into(&mut doc, &patch["status"]);
        assert_eq!(doc, serde_json::to_value(&new).unwrap());
    }

    /// The API server stores a container without a last state as
    /// `"lastState": {}`: the same status again is no patch (every write sent
    /// the container statuses again before).
    #[test]
    fn api_patch_takes_what_the_api_server_stores_as_empty_for_absent() {
        let new = ApiPodStatus {
            phase: Some("Running".into()),
            container_statuses: Some(vec![ContainerStatus {
                name: "main".into(),
                ..ContainerStatus::default()
            }]),
            ..ApiPodStatus::default()
        };
        let mut stored = serde_json::to_value(&new).unwrap();
        stored["containerStatuses"][0]["lastState"] = json!({});
        stored["conditions"] = json!([]);
        let stored: ApiPodStatus = serde_json::from_value(stored).unwrap();
        assert_ne!(stored, new, "the stored form differs");
        assert!(status_patch("u", Some(&stored), &new).is_none());
        // A last state that went away is still removed.
        let mut with_last = stored.clone();
        with_last.container_statuses.as_mut().unwrap()[0].last_state = Some(ContainerState {
            terminated: Some(ContainerStateTerminated::default()),
            ..ContainerState::default()
        });
        let patch = status_patch("u", Some(&with_last), &new).expect("a patch");
        assert!(
            patch["status"]["containerStatuses"][0]
                .get("lastState")
                .is_none(),
            "{patch}"
        );
    }

    /// Conditions merge by type: only what changed is sent, an unchanged
    /// condition not at all (so the server keeps any another writer added),
    /// one gone as `$patch: delete`, the order as `$setElementOrder`; pod IPs
    /// by ip; container statuses whole.
    #[test]
    fn the_strategic_patch_merges_conditions_by_type() {
        let old = json!({
            "conditions": [
                {"type": "Ready", "status": "False", "reason": "ContainersNotReady"},
                {"type": "PodScheduled", "status": "True"},
                {"type": "PodResizePending", "status": "True"},
            ],
            "podIPs": [{"ip": "10.0.0.1"}],
            "containerStatuses": [{"name": "a", "ready": false}, {"name": "b", "ready": false}],
        });
        let new = json!({
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True"},
                {"type": "Initialized", "status": "True"},
            ],
            "podIPs": [{"ip": "10.0.0.1"}],
            "containerStatuses": [{"name": "a", "ready": true}, {"name": "b", "ready": false}],
        });
        assert_eq!(
            strategic_patch(&old, &new),
            Some(json!({
                "$setElementOrder/conditions": [
                    {"type": "PodScheduled"}, {"type": "Ready"}, {"type": "Initialized"}
                ],
                "conditions": [
                    {"type": "Ready", "status": "True", "reason": null},
                    {"type": "Initialized", "status": "True"},
                    {"type": "PodResizePending", "$patch": "delete"},
                ],
                "containerStatuses": [{"name": "a", "ready": true}, {"name": "b", "ready": false}],
            }))
        );
        assert_eq!(strategic_patch(&new, &new), None);
    }

    #[test]
    fn api_patch_of_an_unchanged_status_is_none() {
        let s = ApiPodStatus {
            phase: Some("Running".into()),
            ..ApiPodStatus::default()
        };
        assert!(status_patch("u", Some(&s), &s).is_none());
        assert!(status_patch("u", None, &ApiPodStatus::default()).is_none());
    }

    #[test]
    fn api_static_pods_are_told_by_their_source_annotation() {
        let mut pod = Pod::default();
        assert!(!is_static(&pod));
        for (source, expected) in [("api", false), ("file", true), ("http", true)] {
            pod.metadata.annotations = Some(BTreeMap::from([(
                annotations::CONFIG_SOURCE.to_string(),
                source.to_string(),
            )]));
            assert_eq!(is_static(&pod), expected, "{source}");
        }
    }

    /// RFC 7386 application, to check [`merge_patch`] against.
    fn merge_into(doc: &mut Value, patch: &Value) {
        match patch {
            Value::Object(p) => {
                if !doc.is_object() {
                    *doc = Value::Object(Map::new());
                }
                let d = doc.as_object_mut().unwrap();
                for (k, v) in p {
                    if v.is_null() {
                        d.remove(k);
                    } else {
                        merge_into(d.entry(k.clone()).or_insert(Value::Null), v);
                    }
                }
            }
            other => *doc = other.clone(),
        }
    }
}
