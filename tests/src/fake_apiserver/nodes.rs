//! Nodes and `coordination.k8s.io/v1` Leases in the fake API server: what the
//! agent's node status does (register, renew its lease, patch its status) and
//! what tests read back.
//!
//! - `POST /api/v1/nodes`: 409 `AlreadyExists` for a name taken; 201 with uid,
//!   resourceVersion and creationTimestamp set. (`GET /api/v1/nodes/{name}`
//!   is in the parent module.)
//! - `PATCH /api/v1/nodes/{name}` (a merge patch of its metadata) and
//!   `PATCH /api/v1/nodes/{name}/status` (`application/merge-patch+json` or
//!   `application/strategic-merge-patch+json`, applied as a merge patch: a
//!   status's conditions are replaced whole, which is what the agent sends).
//! - `GET`, `PUT` and `POST` of Leases in a namespace; a `PUT` with a stale
//!   `resourceVersion` is a 409 `Conflict`, as the API server's optimistic
//!   concurrency.

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use axum::routing::{get, patch, post};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use serde_json::{Value, json};

use super::{ApiError, AppState, FakeApiServer, json_response};

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/api/v1/nodes", post(create_node))
        .route("/api/v1/nodes/{name}/status", patch(patch_status))
        .route(
            "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases",
            post(create_lease),
        )
        .route(
            "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{name}",
            get(get_lease).put(replace_lease),
        )
}

impl FakeApiServer {
    /// The stored Node `name`.
    pub fn node(&self, name: &str) -> Option<Node> {
        self.lock().nodes.get(name).cloned()
    }

    /// The stored Lease `ns/name`.
    pub fn lease(&self, ns: &str, name: &str) -> Option<Lease> {
        self.lock()
            .leases
            .get(&(ns.to_owned(), name.to_owned()))
            .cloned()
    }

    /// Waits until `done` holds for the Node `name` (None: not there),
    /// re-checking on every change.
    pub async fn wait_for_node(
        &self,
        name: &str,
        what: &str,
        timeout: std::time::Duration,
        done: impl Fn(Option<&Node>) -> bool,
    ) {
        self.wait_until(what, timeout, |i| done(i.nodes.get(name)))
            .await;
    }

    /// Waits until `done` holds for the Lease `ns/name`.
    pub async fn wait_for_lease(
        &self,
        ns: &str,
        name: &str,
        what: &str,
        timeout: std::time::Duration,
        done: impl Fn(Option<&Lease>) -> bool,
    ) {
        let key = (ns.to_owned(), name.to_owned());
        self.wait_until(what, timeout, |i| done(i.leases.get(&key)))
            .await;
    }
}

async fn create_node(State(shared): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let mut node: Node = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("error decoding the request body: {e}")))?;
    let name = node.metadata.name.clone().unwrap_or_default();
    if name.is_empty() {
        return Err(ApiError::bad_request("metadata.name: Required value"));
    }
    let mut inner = shared.lock();
    if inner.nodes.contains_key(&name) {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "AlreadyExists",
            format!("nodes \"{name}\" already exists"),
        )
        .details(&name, "nodes"));
    }
    inner.revision += 1;
    node.metadata.uid = Some(inner.next_uid());
    node.metadata.resource_version = Some(inner.revision.to_string());
    node.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::now(),
    ));
    inner.nodes.insert(name, node.clone());
    drop(inner);
    shared.notify();
    Ok(json_response(StatusCode::CREATED, &node))
}

pub(super) async fn patch_node(
    state: State<AppState>,
    name: Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    merge_part(state, name, headers, body, "metadata").await
}

async fn patch_status(
    state: State<AppState>,
    name: Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    merge_part(state, name, headers, body, "status").await
}

/// A merge patch of the node's `part` (`metadata` or `status`).
async fn merge_part(
    State(shared): State<AppState>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
    part: &str,
) -> Result<Response, ApiError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if !content_type.starts_with("application/merge-patch+json")
        && !content_type.starts_with("application/strategic-merge-patch+json")
    {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            format!(
                "the fake API server patches node status with merge patches, not {content_type}"
            ),
        ));
    }
    let patch: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("error decoding the patch: {e}")))?;
    let mut inner = shared.lock();
    let node = inner
        .nodes
        .get(&name)
        .cloned()
        .ok_or_else(|| ApiError::not_found("nodes", &name))?;
    let mut doc = serde_json::to_value(&node).expect("a node serializes");
    json_patch::merge(&mut doc[part], &patch[part]);
    let mut node: Node = serde_json::from_value(doc)
        .map_err(|e| ApiError::bad_request(format!("the patched node is not a Node: {e}")))?;
    inner.revision += 1;
    node.metadata.resource_version = Some(inner.revision.to_string());
    inner.nodes.insert(name, node.clone());
    drop(inner);
    shared.notify();
    Ok(json_response(StatusCode::OK, &node))
}

async fn get_lease(
    State(shared): State<AppState>,
    Path((ns, name)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let inner = shared.lock();
    let lease = inner
        .leases
        .get(&(ns, name.clone()))
        .ok_or_else(|| ApiError::not_found("leases.coordination.k8s.io", &name))?;
    Ok(json_response(StatusCode::OK, lease))
}

fn decode_lease(body: &Bytes, ns: &str) -> Result<Lease, ApiError> {
    let lease: Lease = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("error decoding the lease: {e}")))?;
    if lease.metadata.namespace.as_deref().is_some_and(|n| n != ns) {
        return Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    Ok(lease)
}

async fn create_lease(
    State(shared): State<AppState>,
    Path(ns): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let mut lease = decode_lease(&body, &ns)?;
    let name = lease.metadata.name.clone().unwrap_or_default();
    let mut inner = shared.lock();
    let key = (ns.clone(), name.clone());
    if inner.leases.contains_key(&key) {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "AlreadyExists",
            format!("leases.coordination.k8s.io \"{name}\" already exists"),
        )
        .details(&name, "leases"));
    }
    inner.revision += 1;
    lease.metadata.namespace = Some(ns);
    lease.metadata.uid = Some(inner.next_uid());
    lease.metadata.resource_version = Some(inner.revision.to_string());
    inner.leases.insert(key, lease.clone());
    drop(inner);
    shared.notify();
    Ok(json_response(StatusCode::CREATED, &lease))
}

async fn replace_lease(
    State(shared): State<AppState>,
    Path((ns, name)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let mut lease = decode_lease(&body, &ns)?;
    let mut inner = shared.lock();
    let key = (ns.clone(), name.clone());
    let stored = inner
        .leases
        .get(&key)
        .cloned()
        .ok_or_else(|| ApiError::not_found("leases.coordination.k8s.io", &name))?;
    if lease.metadata.resource_version.is_some()
        && lease.metadata.resource_version != stored.metadata.resource_version
    {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on leases.coordination.k8s.io \"{name}\": the object has been modified; please apply your changes to the latest version and try again"
            ),
        )
        .details(&name, "leases"));
    }
    inner.revision += 1;
    lease.metadata.namespace = Some(ns);
    lease.metadata.uid = stored.metadata.uid;
    lease.metadata.resource_version = Some(inner.revision.to_string());
    inner.leases.insert(key, lease.clone());
    drop(inner);
    shared.notify();
    Ok(json_response(StatusCode::OK, &json!(lease)))
}
