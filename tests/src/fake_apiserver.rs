//! An in-process fake Kubernetes API server for the API paths of the pod source
//! and the status writer.
//!
//! It serves pods (and `GET` of nodes) over plain HTTP on `127.0.0.1:0` and speaks
//! the real JSON wire format, so `kube::Client`, `Api<Pod>` and kube-runtime's
//! `watcher` talk to it exactly as they would to a kube-apiserver:
//!
//! - `GET /api/v1/pods` and `GET /api/v1/namespaces/{ns}/pods`: a `PodList` whose
//!   `metadata.resourceVersion` is the store's revision, filtered by
//!   `fieldSelector` (`spec.nodeName=...`, `metadata.name`, `status.phase`, ...)
//!   and `labelSelector` (equality and existence); with `watch=true` a stream of
//!   newline-delimited `{"type":"ADDED|MODIFIED|DELETED|BOOKMARK|ERROR","object":...}`
//!   events, `Content-Type: application/json`, honouring `resourceVersion`,
//!   `allowWatchBookmarks`, `sendInitialEvents` and `timeoutSeconds`.
//! - `GET`, `PATCH` (`application/merge-patch+json`, `application/json-patch+json`,
//!   `application/strategic-merge-patch+json` as [`strategic`] applies it)
//!   and `DELETE` on `/api/v1/namespaces/{ns}/pods/{name}`; `GET` and `PATCH` on its
//!   `/status` subresource; `POST /api/v1/namespaces/{ns}/pods`;
//!   `GET /api/v1/nodes/{name}`; `events.k8s.io/v1` Events created, patched
//!   and listed in a namespace ([`events`]); Nodes created and their status
//!   patched, `coordination.k8s.io/v1` Leases created, read and replaced
//!   ([`nodes`]); ConfigMaps and Secrets read, ServiceAccount tokens
//!   requested (TokenRequest, [`objects`]); PersistentVolumeClaims and
//!   PersistentVolumes read ([`storage`]).
//! - Every error is a `metav1.Status` object with `code`, `reason` and `details`,
//!   like the API server's.
//!
//! Watches behave like the API server's watch cache: a watch resumes from its
//! `resourceVersion` by replaying the changes after it; a field selector turns a
//! change that makes a pod stop matching into `DELETED` (the previous object with
//! the new resourceVersion) and one that makes it start matching into `ADDED`; a
//! `resourceVersion` older than the cache's window gets an `ERROR` event with a
//! 410 `Expired` status inside a 200 response (as the cacher does), which makes a
//! client relist. An outage ([`FakeApiServer::set_available`]) is a restart: every
//! request gets 503 and open watches end; on return the watch cache starts at the
//! current revision, so watchers that were cut off relist.
//!
//! No kube-apiserver can be installed where these tests run; the wire details were
//! taken from kube-client's request builders and decoders and from the API
//! server's cacher and REST handlers.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use k8s_openapi::api::core::v1::{Container, Node, Pod, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

mod events;
mod nodes;
pub mod objects;
mod storage;
mod strategic;

/// How many changes the watch cache keeps before the oldest are compacted away.
const HISTORY: usize = 10_000;
/// The revision the store starts at (any value works; not 1, so that tests do not
/// mistake an index for a resourceVersion).
const FIRST_REVISION: u64 = 1000;
/// The API server's default watch timeout when `timeoutSeconds` is absent.
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);

/// A status patch as the fake received it.
#[derive(Clone, Debug)]
pub struct RecordedPatch {
    pub namespace: String,
    pub name: String,
    /// `status` for the status subresource, empty for the object itself.
    pub subresource: String,
    /// The request's `Content-Type`.
    pub content_type: String,
    pub body: Value,
}

/// A request line as the fake received it (also the refused ones).
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    pub method: String,
    /// Path and query, e.g. `/api/v1/pods?&watch=true&...`.
    pub uri: String,
    /// The JSON body, if any (creates, patches, delete options).
    pub body: Option<Value>,
}

impl RecordedRequest {
    /// The value of a query parameter, percent-decoded.
    pub fn query(&self, key: &str) -> Option<String> {
        let (_, query) = self.uri.split_once('?')?;
        form_pairs(query)
            .into_iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
    }

    pub fn path(&self) -> &str {
        self.uri.split('?').next().unwrap_or_default()
    }
}

/// The fake API server; stops serving when dropped.
#[derive(Debug)]
pub struct FakeApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    server: tokio::task::JoinHandle<()>,
}

#[derive(Debug)]
struct Shared {
    inner: Mutex<Inner>,
    /// Bumped on every state change, for the `wait_for_*` helpers.
    changes: watch::Sender<u64>,
}

#[derive(Debug)]
struct Inner {
    available: bool,
    revision: u64,
    /// Watches from a resourceVersion below this get 410 Expired.
    compacted: u64,
    pods: BTreeMap<(String, String), Pod>,
    nodes: BTreeMap<String, Node>,
    history: VecDeque<Change>,
    watchers: Vec<Watcher>,
    patches: Vec<RecordedPatch>,
    requests: Vec<RecordedRequest>,
    /// `events.k8s.io/v1` Events by namespace and name ([`events`]).
    events: BTreeMap<(String, String), Value>,
    /// `coordination.k8s.io/v1` Leases by namespace and name ([`nodes`]).
    leases: BTreeMap<(String, String), k8s_openapi::api::coordination::v1::Lease>,
    /// PersistentVolumeClaims by namespace and name ([`storage`]).
    claims: BTreeMap<(String, String), k8s_openapi::api::core::v1::PersistentVolumeClaim>,
    /// PersistentVolumes by name ([`storage`]).
    persistent_volumes: BTreeMap<String, k8s_openapi::api::core::v1::PersistentVolume>,
    refused: u64,
    uid_counter: u64,
    /// ConfigMaps, Secrets, ServiceAccounts, TokenRequests ([`objects`]).
    objects: objects::Objects,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ChangeKind {
    Added,
    Modified,
    Deleted,
}

/// One entry of the watch cache.
#[derive(Debug)]
struct Change {
    rv: u64,
    kind: ChangeKind,
    /// The object after the change (for a deletion: its last state).
    object: Pod,
    /// The object before the change.
    prev: Option<Pod>,
}

#[derive(Debug)]
struct Watcher {
    tx: mpsc::UnboundedSender<Bytes>,
    filter: Filter,
    bookmarks: bool,
}

impl FakeApiServer {
    /// Binds `127.0.0.1:0` and serves until dropped.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0 for the fake API server");
        let addr = listener
            .local_addr()
            .expect("the fake API server's address");
        let (changes, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                available: true,
                revision: FIRST_REVISION,
                compacted: FIRST_REVISION,
                pods: BTreeMap::new(),
                nodes: BTreeMap::new(),
                history: VecDeque::new(),
                watchers: Vec::new(),
                patches: Vec::new(),
                requests: Vec::new(),
                events: BTreeMap::new(),
                leases: BTreeMap::new(),
                claims: BTreeMap::new(),
                persistent_volumes: BTreeMap::new(),
                refused: 0,
                uid_counter: 0,
                objects: Default::default(),
            }),
            changes,
        });
        let app = router(shared.clone());
        let server = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("fake API server: {e}");
            }
        });
        Self {
            addr,
            shared,
            server,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A client configuration for the fake: plain HTTP, no auth, no TLS, and no
    /// retry layer (kube 5's `default_retry` retries 429/503/504 up to 15 times
    /// inside the client, which would hide an outage from the code under test).
    pub fn kube_config(&self) -> kube::Config {
        let mut config = kube::Config::new(
            self.url()
                .parse()
                .expect("the fake API server's URL is a valid URI"),
        );
        config.default_retry = false;
        config
    }

    /// A `kube::Client` for the fake (see [`Self::kube_config`]).
    pub fn kube_client(&self) -> kube::Client {
        kube::Client::try_from(self.kube_config()).expect("a kube client for the fake API server")
    }

    // ----- test controls -------------------------------------------------------

    /// Stores a new pod as a scheduler or controller would (a UID is generated when
    /// missing) and emits `ADDED`. Returns the stored object.
    pub fn add_pod(&self, mut pod: Pod) -> Pod {
        let mut inner = self.lock();
        let key = key_of(&pod);
        assert!(
            !inner.pods.contains_key(&key),
            "add_pod: pod {}/{} already exists",
            key.0,
            key.1
        );
        if pod.metadata.namespace.is_none() {
            pod.metadata.namespace = Some(key.0.clone());
        }
        if pod.metadata.uid.as_deref().unwrap_or_default().is_empty() {
            pod.metadata.uid = Some(inner.next_uid());
        }
        if pod.metadata.creation_timestamp.is_none() {
            pod.metadata.creation_timestamp = Some(Time(Timestamp::now()));
        }
        let stored = inner.store(pod, None);
        drop(inner);
        self.notify();
        stored
    }

    /// Replaces a stored pod (its UID and creation time are kept when the given
    /// object has none) and emits `MODIFIED`, or `DELETED`/`ADDED` to watchers whose
    /// selector it leaves or enters. Panics if the pod does not exist.
    pub fn update_pod(&self, mut pod: Pod) -> Pod {
        let mut inner = self.lock();
        let key = key_of(&pod);
        let prev = inner
            .pods
            .get(&key)
            .cloned()
            .unwrap_or_else(|| panic!("update_pod: no pod {}/{}", key.0, key.1));
        pod.metadata.namespace = Some(key.0.clone());
        if pod.metadata.uid.is_none() {
            pod.metadata.uid = prev.metadata.uid.clone();
        }
        if pod.metadata.creation_timestamp.is_none() {
            pod.metadata.creation_timestamp = prev.metadata.creation_timestamp.clone();
        }
        let stored = inner.store(pod, Some(prev));
        drop(inner);
        self.notify();
        stored
    }

    /// Removes a pod at once (as the final, grace-period-0 delete does) and emits
    /// `DELETED`. Returns the removed object.
    pub fn delete_pod(&self, namespace: &str, name: &str) -> Option<Pod> {
        let mut inner = self.lock();
        let removed = inner.remove(&(namespace.to_string(), name.to_string()));
        drop(inner);
        self.notify();
        removed
    }

    /// A registered Node (for the mirror pods' owner reference). Returns its UID.
    pub fn add_node(&self, name: &str) -> String {
        let mut inner = self.lock();
        let uid = inner.next_uid();
        inner.revision += 1;
        let node = Node {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                uid: Some(uid.clone()),
                resource_version: Some(inner.revision.to_string()),
                creation_timestamp: Some(Time(Timestamp::now())),
                ..ObjectMeta::default()
            },
            ..Node::default()
        };
        inner.nodes.insert(name.to_string(), node);
        drop(inner);
        self.notify();
        uid
    }

    /// All stored pods, ordered by namespace and name.
    pub fn pods(&self) -> Vec<Pod> {
        self.lock().pods.values().cloned().collect()
    }

    pub fn pod(&self, namespace: &str, name: &str) -> Option<Pod> {
        self.lock()
            .pods
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// The stored status of a pod (`None` when the pod or its status is missing).
    pub fn status_of(&self, namespace: &str, name: &str) -> Option<PodStatus> {
        self.pod(namespace, name).and_then(|p| p.status)
    }

    /// Every PATCH received, in order (status and object patches).
    pub fn patches(&self) -> Vec<RecordedPatch> {
        self.lock().patches.clone()
    }

    /// Every request received, in order, including the refused ones.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.lock().requests.clone()
    }

    /// The store's current revision (what a list would return).
    pub fn resource_version(&self) -> u64 {
        self.lock().revision
    }

    /// Watches currently open.
    pub fn open_watches(&self) -> usize {
        let mut inner = self.lock();
        inner.watchers.retain(|w| !w.tx.is_closed());
        inner.watchers.len()
    }

    /// Requests answered 503 so far.
    pub fn refused(&self) -> u64 {
        self.lock().refused
    }

    /// `false`: every request is answered 503 `ServiceUnavailable` and open watches
    /// end. `true` after `false`: the server is back as after a restart, its watch
    /// cache starting at the current revision, so a client resuming a watch from an
    /// older resourceVersion gets 410 Expired and relists.
    pub fn set_available(&self, available: bool) {
        let mut inner = self.lock();
        if !available {
            inner.watchers.clear();
        } else if !inner.available {
            inner.compact_all();
        }
        inner.available = available;
        drop(inner);
        self.notify();
    }

    /// Ends every open watch (a dropped connection, a load balancer's idle timeout).
    /// The watch cache is kept: a client resuming from its last resourceVersion
    /// gets the changes it missed.
    pub fn close_watches(&self) {
        self.lock().watchers.clear();
        self.notify();
    }

    /// Drops the watch cache's history (etcd compaction): watches from any earlier
    /// resourceVersion get 410 Expired.
    pub fn compact(&self) {
        self.lock().compact_all();
        self.notify();
    }

    /// Sends a `BOOKMARK` at the current revision to every watch that allows them.
    pub fn bookmark(&self) {
        let inner = self.lock();
        let line = bookmark_line(inner.revision, None);
        for w in inner.watchers.iter().filter(|w| w.bookmarks) {
            let _ = w.tx.send(line.clone());
        }
    }

    /// Waits until at least `n` requests were refused.
    pub async fn wait_for_refused(&self, n: u64, timeout: Duration) {
        self.wait_until(&format!("{n} refused requests"), timeout, |i| {
            i.refused >= n
        })
        .await;
    }

    /// Waits until at least `n` watches are open.
    pub async fn wait_for_watches(&self, n: usize, timeout: Duration) {
        self.wait_until(&format!("{n} open watches"), timeout, |i| {
            i.watchers.iter().filter(|w| !w.tx.is_closed()).count() >= n
        })
        .await;
    }

    /// Waits until `done` holds for the stored pods, re-checking on every change.
    pub async fn wait_for_pods(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&[Pod]) -> bool,
    ) {
        self.wait_until(what, timeout, |i| {
            done(&i.pods.values().cloned().collect::<Vec<_>>())
        })
        .await;
    }

    async fn wait_until(&self, what: &str, timeout: Duration, done: impl Fn(&Inner) -> bool) {
        let mut rx = self.shared.changes.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            rx.borrow_and_update();
            if done(&self.lock()) {
                return;
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => panic!("fake API server gone while waiting for {what}"),
                Err(_) => panic!("timed out after {timeout:?} waiting for {what}"),
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.shared.lock()
    }

    fn notify(&self) {
        self.shared.notify();
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.lock().watchers.clear();
        self.server.abort();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn notify(&self) {
        self.changes.send_modify(|n| *n += 1);
    }
}

impl Inner {
    fn next_uid(&mut self) -> String {
        self.uid_counter += 1;
        let a = crate::unique_u64();
        format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            a >> 32,
            (a >> 16) & 0xffff,
            a & 0xfff,
            self.uid_counter & 0xfff,
            self.uid_counter
        )
    }

    /// Stores `object` at a new revision and emits the change.
    fn store(&mut self, mut object: Pod, prev: Option<Pod>) -> Pod {
        self.revision += 1;
        object.metadata.resource_version = Some(self.revision.to_string());
        let kind = if prev.is_some() {
            ChangeKind::Modified
        } else {
            ChangeKind::Added
        };
        self.pods.insert(key_of(&object), object.clone());
        self.emit(Change {
            rv: self.revision,
            kind,
            object: object.clone(),
            prev,
        });
        object
    }

    fn remove(&mut self, key: &(String, String)) -> Option<Pod> {
        let mut last = self.pods.remove(key)?;
        self.revision += 1;
        let prev = last.clone();
        last.metadata.resource_version = Some(self.revision.to_string());
        self.emit(Change {
            rv: self.revision,
            kind: ChangeKind::Deleted,
            object: last.clone(),
            prev: Some(prev),
        });
        Some(last)
    }

    fn emit(&mut self, change: Change) {
        self.watchers.retain(|w| !w.tx.is_closed());
        for w in &self.watchers {
            if let Some(line) = change.line_for(&w.filter) {
                let _ = w.tx.send(line);
            }
        }
        self.history.push_back(change);
        while self.history.len() > HISTORY {
            if let Some(old) = self.history.pop_front() {
                self.compacted = old.rv;
            }
        }
    }

    fn compact_all(&mut self) {
        self.history.clear();
        self.compacted = self.revision;
    }
}

impl Change {
    /// The event a watcher with `filter` gets for this change, as the cacher's
    /// `convertToWatchEvent` decides it.
    fn line_for(&self, filter: &Filter) -> Option<Bytes> {
        let current = self.kind != ChangeKind::Deleted && filter.matches(&self.object);
        let previous = self.prev.as_ref().is_some_and(|p| filter.matches(p));
        match (current, previous) {
            (true, false) => Some(event_line("ADDED", &self.object)),
            (true, true) => Some(event_line("MODIFIED", &self.object)),
            (false, true) => {
                // The previous object, with the change's resourceVersion.
                let mut gone = self.prev.clone().unwrap_or_default();
                gone.metadata.resource_version = Some(self.rv.to_string());
                Some(event_line("DELETED", &gone))
            }
            (false, false) => None,
        }
    }
}

fn key_of(pod: &Pod) -> (String, String) {
    (
        pod.metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".to_string()),
        pod.metadata.name.clone().expect("a pod needs a name"),
    )
}

// ----- wire format -----------------------------------------------------------

fn event_line(kind: &str, object: &impl serde::Serialize) -> Bytes {
    let mut line = serde_json::to_vec(&json!({ "type": kind, "object": object }))
        .expect("watch events serialise");
    line.push(b'\n');
    Bytes::from(line)
}

/// A `BOOKMARK` event: an object of the watched kind with only
/// `metadata.resourceVersion` (and, ending a streaming list, the
/// `k8s.io/initial-events-end` annotation).
fn bookmark_line(revision: u64, annotations: Option<Value>) -> Bytes {
    let mut metadata =
        json!({ "resourceVersion": revision.to_string(), "creationTimestamp": null });
    if let Some(a) = annotations {
        metadata["annotations"] = a;
    }
    event_line(
        "BOOKMARK",
        &json!({ "kind": "Pod", "apiVersion": "v1", "metadata": metadata }),
    )
}

/// A `metav1.Status` failure, the body of every error response.
#[derive(Debug)]
struct ApiError {
    code: StatusCode,
    reason: &'static str,
    message: String,
    details: Option<Value>,
}

impl ApiError {
    fn new(code: StatusCode, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    fn details(mut self, name: &str, kind: &str) -> Self {
        self.details = Some(json!({ "name": name, "kind": kind }));
        self
    }

    fn not_found(kind: &str, name: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("{kind} \"{name}\" not found"),
        )
        .details(name, kind)
    }

    fn already_exists(name: &str) -> Self {
        Self::new(
            StatusCode::CONFLICT,
            "AlreadyExists",
            format!("pods \"{name}\" already exists"),
        )
        .details(name, "pods")
    }

    fn conflict(name: &str, why: &str) -> Self {
        Self::new(
            StatusCode::CONFLICT,
            "Conflict",
            format!("Operation cannot be fulfilled on pods \"{name}\": {why}"),
        )
        .details(name, "pods")
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "BadRequest", message)
    }

    fn invalid(name: &str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            format!("Pod \"{name}\" is invalid: {}", message.into()),
        )
        .details(name, "Pod")
    }

    fn unavailable() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the server is currently unable to handle the request",
        )
    }

    fn body(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code.as_u16(),
        });
        if let Some(d) = &self.details {
            status["details"] = d.clone();
        }
        status
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        json_response(self.code, &self.body())
    }
}

fn json_response(code: StatusCode, body: &impl serde::Serialize) -> Response {
    let bytes = serde_json::to_vec(body).expect("responses serialise");
    (code, [(header::CONTENT_TYPE, "application/json")], bytes).into_response()
}

// ----- selectors ---------------------------------------------------------------

/// A list or watch's scope: namespace, field selector, label selector.
#[derive(Clone, Debug, Default)]
struct Filter {
    namespace: Option<String>,
    /// (field, value, equal?)
    fields: Vec<(String, String, bool)>,
    labels: Vec<LabelRequirement>,
}

#[derive(Clone, Debug)]
enum LabelRequirement {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    NotExists(String),
}

/// The pod fields the API server accepts in a field selector
/// (`pkg/registry/core/pod/strategy.go`, `ToSelectableFields`).
fn pod_field(pod: &Pod, field: &str) -> Option<String> {
    let spec = pod.spec.as_ref();
    let status = pod.status.as_ref();
    Some(match field {
        "metadata.name" => pod.metadata.name.clone().unwrap_or_default(),
        "metadata.namespace" => pod.metadata.namespace.clone().unwrap_or_default(),
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
        "spec.restartPolicy" => spec
            .and_then(|s| s.restart_policy.clone())
            .unwrap_or_default(),
        "spec.schedulerName" => spec
            .and_then(|s| s.scheduler_name.clone())
            .unwrap_or_default(),
        "spec.serviceAccountName" => spec
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_default(),
        "status.phase" => status.and_then(|s| s.phase.clone()).unwrap_or_default(),
        "status.podIP" => status.and_then(|s| s.pod_ip.clone()).unwrap_or_default(),
        "status.nominatedNodeName" => status
            .and_then(|s| s.nominated_node_name.clone())
            .unwrap_or_default(),
        _ => return None,
    })
}

impl Filter {
    fn parse(namespace: Option<String>, query: &HashMap<String, String>) -> Result<Self, ApiError> {
        let mut filter = Filter {
            namespace,
            ..Filter::default()
        };
        for term in query
            .get("fieldSelector")
            .map(String::as_str)
            .unwrap_or_default()
            .split(',')
            .filter(|t| !t.is_empty())
        {
            let (field, value, equal) = if let Some((f, v)) = term.split_once("!=") {
                (f, v, false)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, v, true)
            } else if let Some((f, v)) = term.split_once('=') {
                (f, v, true)
            } else {
                return Err(ApiError::bad_request(format!(
                    "invalid selector: '{term}'; can't understand '{term}'"
                )));
            };
            if pod_field(&Pod::default(), field).is_none() {
                return Err(ApiError::bad_request(format!(
                    "field label not supported: {field}"
                )));
            }
            filter
                .fields
                .push((field.to_string(), value.to_string(), equal));
        }
        for term in query
            .get("labelSelector")
            .map(String::as_str)
            .unwrap_or_default()
            .split(',')
            .filter(|t| !t.is_empty())
        {
            let req = if let Some((k, v)) = term.split_once("!=") {
                LabelRequirement::NotEquals(k.into(), v.into())
            } else if let Some((k, v)) = term.split_once("==") {
                LabelRequirement::Equals(k.into(), v.into())
            } else if let Some((k, v)) = term.split_once('=') {
                LabelRequirement::Equals(k.into(), v.into())
            } else if let Some(k) = term.strip_prefix('!') {
                LabelRequirement::NotExists(k.into())
            } else if term.contains(' ') || term.contains('(') {
                return Err(ApiError::bad_request(format!(
                    "unable to parse requirement: the fake API server only supports =, ==, != and existence: {term}"
                )));
            } else {
                LabelRequirement::Exists(term.into())
            };
            filter.labels.push(req);
        }
        Ok(filter)
    }

    fn matches(&self, pod: &Pod) -> bool {
        if let Some(ns) = &self.namespace
            && pod.metadata.namespace.as_deref() != Some(ns)
        {
            return false;
        }
        let fields_match = self.fields.iter().all(|(field, value, equal)| {
            (pod_field(pod, field).unwrap_or_default() == *value) == *equal
        });
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        let labels_match = self.labels.iter().all(|r| match r {
            LabelRequirement::Equals(k, v) => labels.get(k) == Some(v),
            LabelRequirement::NotEquals(k, v) => labels.get(k) != Some(v),
            LabelRequirement::Exists(k) => labels.contains_key(k),
            LabelRequirement::NotExists(k) => !labels.contains_key(k),
        });
        fields_match && labels_match
    }
}

fn form_pairs(query: &str) -> Vec<(String, String)> {
    form_urlencoded::parse(query.as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

// ----- routes ------------------------------------------------------------------

type AppState = Arc<Shared>;

fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/api/v1/pods", get(list_all))
        .route(
            "/api/v1/namespaces/{ns}/pods",
            get(list_namespaced).post(create_pod),
        )
        .route(
            "/api/v1/namespaces/{ns}/pods/{name}",
            get(get_pod).patch(patch_pod).delete(delete_pod),
        )
        .route(
            "/api/v1/namespaces/{ns}/pods/{name}/status",
            get(get_pod).patch(patch_pod_status),
        )
        .route(
            "/api/v1/nodes/{name}",
            get(get_node).patch(nodes::patch_node),
        )
        .merge(events::routes())
        .merge(nodes::routes())
        .merge(objects::routes())
        .merge(storage::routes())
        .fallback(|| async {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "NotFound",
                "the server could not find the requested resource",
            )
        })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                "the server does not allow this method on the requested resource",
            )
        })
        .layer(middleware::from_fn_with_state(shared.clone(), gate))
        .with_state(shared)
}

/// Records every request and refuses them all while the server is unavailable.
async fn gate(State(shared): State<AppState>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, 64 << 20).await {
        Ok(b) => b,
        Err(e) => {
            return ApiError::bad_request(format!("reading the request body: {e}")).into_response();
        }
    };
    let available = {
        let mut inner = shared.lock();
        inner.requests.push(RecordedRequest {
            method: parts.method.to_string(),
            uri: parts
                .uri
                .path_and_query()
                .map(|p| p.to_string())
                .unwrap_or_default(),
            body: serde_json::from_slice(&bytes).ok(),
        });
        if !inner.available {
            inner.refused += 1;
        }
        inner.available
    };
    shared.notify();
    if !available {
        return ApiError::unavailable().into_response();
    }
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

async fn list_all(
    State(shared): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    list_or_watch(shared, None, query).await
}

async fn list_namespaced(
    State(shared): State<AppState>,
    Path(ns): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    list_or_watch(shared, Some(ns), query).await
}

async fn list_or_watch(
    shared: Arc<Shared>,
    namespace: Option<String>,
    query: HashMap<String, String>,
) -> Response {
    let filter = match Filter::parse(namespace, &query) {
        Ok(f) => f,
        Err(e) => return e.into_response(),
    };
    if query.get("watch").is_some_and(|w| w == "true" || w == "1") {
        return watch_pods(&shared, filter, &query);
    }
    let inner = shared.lock();
    // Items of a list carry no kind/apiVersion on the wire; the list does.
    let items: Vec<Value> = inner
        .pods
        .values()
        .filter(|p| filter.matches(p))
        .map(|p| {
            let mut v = serde_json::to_value(p).expect("pods serialise");
            if let Some(o) = v.as_object_mut() {
                o.remove("kind");
                o.remove("apiVersion");
            }
            v
        })
        .collect();
    let list = json!({
        "kind": "PodList",
        "apiVersion": "v1",
        "metadata": { "resourceVersion": inner.revision.to_string() },
        "items": items,
    });
    json_response(StatusCode::OK, &list)
}

fn watch_pods(shared: &Arc<Shared>, filter: Filter, query: &HashMap<String, String>) -> Response {
    let bookmarks = query
        .get("allowWatchBookmarks")
        .is_some_and(|v| v == "true");
    let initial_events = query.get("sendInitialEvents").is_some_and(|v| v == "true");
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_WATCH_TIMEOUT);
    let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
    {
        let mut inner = shared.lock();
        let rv = query
            .get("resourceVersion")
            .map(String::as_str)
            .unwrap_or_default();
        let from = match rv {
            "" | "0" => None,
            rv => match rv.parse::<u64>() {
                Ok(n) => Some(n),
                Err(_) => {
                    return ApiError::bad_request(format!("invalid resource version: {rv}"))
                        .into_response();
                }
            },
        };
        match from {
            // "Start at most recent" / "any": synthetic ADDED for every matching pod.
            None => {
                for pod in inner.pods.values().filter(|p| filter.matches(p)) {
                    let _ = tx.send(event_line("ADDED", pod));
                }
                if initial_events && bookmarks {
                    let _ = tx.send(bookmark_line(
                        inner.revision,
                        Some(json!({ "k8s.io/initial-events-end": "true" })),
                    ));
                }
            }
            Some(n) if n < inner.compacted => {
                // The cacher answers a too-old resourceVersion with an ERROR event
                // in a 200 response, not with an HTTP 410.
                let status = ApiError::new(
                    StatusCode::GONE,
                    "Expired",
                    format!("too old resource version: {n} ({})", inner.compacted),
                )
                .body();
                let _ = tx.send(event_line("ERROR", &status));
                drop(tx);
                return watch_response(rx, timeout);
            }
            Some(n) => {
                for change in inner.history.iter().filter(|c| c.rv > n) {
                    if let Some(line) = change.line_for(&filter) {
                        let _ = tx.send(line);
                    }
                }
            }
        }
        inner.watchers.push(Watcher {
            tx,
            filter,
            bookmarks,
        });
    }
    shared.notify();
    watch_response(rx, timeout)
}

fn watch_response(rx: mpsc::UnboundedReceiver<Bytes>, timeout: Duration) -> Response {
    let deadline = tokio::time::Instant::now() + timeout;
    let stream = futures::stream::unfold(rx, move |mut rx| async move {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(line)) => Some((Ok::<_, Infallible>(line), rx)),
            Ok(None) | Err(_) => None,
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(stream))
        .expect("a watch response")
}

async fn get_pod(
    State(shared): State<AppState>,
    Path(path): Path<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    let (ns, name) = (&path["ns"], &path["name"]);
    let inner = shared.lock();
    let pod = inner
        .pods
        .get(&(ns.clone(), name.clone()))
        .ok_or_else(|| ApiError::not_found("pods", name))?;
    Ok(json_response(StatusCode::OK, pod))
}

async fn get_node(
    State(shared): State<AppState>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let inner = shared.lock();
    let node = inner
        .nodes
        .get(&name)
        .ok_or_else(|| ApiError::not_found("nodes", &name))?;
    Ok(json_response(StatusCode::OK, node))
}

async fn create_pod(
    State(shared): State<AppState>,
    Path(ns): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let mut pod: Pod = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("error decoding the request body: {e}")))?;
    if let Some(body_ns) = &pod.metadata.namespace
        && *body_ns != ns
    {
        return Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    let name = match (&pod.metadata.name, &pod.metadata.generate_name) {
        (Some(n), _) if !n.is_empty() => n.clone(),
        (_, Some(prefix)) if !prefix.is_empty() => {
            format!("{prefix}{:05x}", crate::unique_u64() & 0xfffff)
        }
        _ => {
            return Err(ApiError::invalid(
                "",
                "metadata.name: Required value: name or generateName is required",
            ));
        }
    };
    if pod
        .metadata
        .resource_version
        .as_deref()
        .is_some_and(|rv| !rv.is_empty())
    {
        return Err(ApiError::bad_request(
            "resourceVersion should not be set on objects to be created",
        ));
    }
    if pod.spec.as_ref().is_none_or(|s| s.containers.is_empty()) {
        return Err(ApiError::invalid(&name, "spec.containers: Required value"));
    }
    let mut inner = shared.lock();
    let key = (ns.clone(), name.clone());
    if inner.pods.contains_key(&key) {
        return Err(ApiError::already_exists(&name));
    }
    // What the API server sets on create (FillObjectMetaSystemFields and the pod
    // strategy's PrepareForCreate): a new UID, the creation time, status reset.
    pod.metadata.name = Some(name);
    pod.metadata.namespace = Some(ns);
    pod.metadata.uid = Some(inner.next_uid());
    pod.metadata.creation_timestamp = Some(Time(Timestamp::now()));
    pod.metadata.deletion_timestamp = None;
    pod.metadata.deletion_grace_period_seconds = None;
    pod.metadata.generation = Some(1);
    let qos = qos_class(pod.spec.as_ref());
    pod.status = Some(PodStatus {
        phase: Some("Pending".into()),
        qos_class: Some(qos.into()),
        ..PodStatus::default()
    });
    let stored = inner.store(pod, None);
    drop(inner);
    shared.notify();
    Ok(json_response(StatusCode::CREATED, &stored))
}

/// The pod's QoS class (`pkg/apis/core/helper/qos`), by comparing quantities as
/// strings (enough for a fake).
fn qos_class(spec: Option<&PodSpec>) -> &'static str {
    let containers: Vec<&Container> = spec
        .map(|s| {
            s.containers
                .iter()
                .chain(s.init_containers.iter().flatten())
                .collect()
        })
        .unwrap_or_default();
    let mut any = false;
    let mut guaranteed = true;
    for c in &containers {
        let res = c.resources.clone().unwrap_or_default();
        let requests = res.requests.unwrap_or_default();
        let limits = res.limits.unwrap_or_default();
        for r in ["cpu", "memory"] {
            let (req, lim) = (requests.get(r), limits.get(r));
            any |= req.is_some() || lim.is_some();
            match (req, lim) {
                (_, None) => guaranteed = false,
                (Some(q), Some(l)) if q.0 != l.0 => guaranteed = false,
                _ => {}
            }
        }
    }
    match (any, guaranteed) {
        (false, _) => "BestEffort",
        (true, true) => "Guaranteed",
        (true, false) => "Burstable",
    }
}

async fn patch_pod(
    State(shared): State<AppState>,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    patch(&shared, &ns, &name, "", &headers, &body)
}

async fn patch_pod_status(
    State(shared): State<AppState>,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    patch(&shared, &ns, &name, "status", &headers, &body)
}

fn patch(
    shared: &Arc<Shared>,
    ns: &str,
    name: &str,
    subresource: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_string();
    let patch_body: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
    let mut inner = shared.lock();
    inner.patches.push(RecordedPatch {
        namespace: ns.to_string(),
        name: name.to_string(),
        subresource: subresource.to_string(),
        content_type: content_type.clone(),
        body: patch_body.clone(),
    });
    let key = (ns.to_string(), name.to_string());
    let current = inner
        .pods
        .get(&key)
        .cloned()
        .ok_or_else(|| ApiError::not_found("pods", name))?;
    let mut doc = serde_json::to_value(&current).expect("pods serialise");
    match content_type.as_str() {
        "application/merge-patch+json" => json_patch::merge(&mut doc, &patch_body),
        "application/strategic-merge-patch+json" => strategic::apply(&mut doc, &patch_body),
        "application/json-patch+json" => {
            let ops: json_patch::Patch = serde_json::from_value(patch_body)
                .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
            json_patch::patch(&mut doc, &ops).map_err(|e| {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", e.to_string())
            })?;
        }
        other => {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "UnsupportedMediaType",
                format!(
                    "the body of the request was in an unknown format ({other}) - the fake API server accepts application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json"
                ),
            ));
        }
    }
    let patched: Pod = serde_json::from_value(doc)
        .map_err(|e| ApiError::bad_request(format!("the patched object is not a Pod: {e}")))?;
    let (cur_uid, new_uid) = (
        current.metadata.uid.clone().unwrap_or_default(),
        patched.metadata.uid.clone().unwrap_or_default(),
    );
    if new_uid != cur_uid {
        return Err(ApiError::conflict(
            name,
            &format!(
                "Precondition failed: UID in precondition: {new_uid}, UID in object meta: {cur_uid}"
            ),
        ));
    }
    if patched.metadata.resource_version != current.metadata.resource_version {
        return Err(ApiError::conflict(
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        ));
    }
    if patched.metadata.name != current.metadata.name
        || patched.metadata.namespace != current.metadata.namespace
    {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({}) does not match the name on the URL ({name})",
            patched.metadata.name.clone().unwrap_or_default()
        )));
    }
    // The status subresource changes only the status; the object itself never
    // changes the status (the pod strategies' PrepareForUpdate).
    let updated = if subresource == "status" {
        Pod {
            status: patched.status,
            ..current.clone()
        }
    } else {
        Pod {
            status: current.status.clone(),
            ..patched
        }
    };
    if serde_json::to_value(&updated).ok() == serde_json::to_value(&current).ok() {
        // A no-op update is not written: same resourceVersion, no event.
        return Ok(json_response(StatusCode::OK, &current));
    }
    let stored = inner.store(updated, Some(current));
    drop(inner);
    shared.notify();
    Ok(json_response(StatusCode::OK, &stored))
}

async fn delete_pod(
    State(shared): State<AppState>,
    Path((ns, name)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let options: Value = if body.is_empty() {
        json!({})
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad_request(format!("error decoding DeleteOptions: {e}")))?
    };
    let mut inner = shared.lock();
    let key = (ns, name.clone());
    let current = inner
        .pods
        .get(&key)
        .cloned()
        .ok_or_else(|| ApiError::not_found("pods", &name))?;
    if let Some(uid) = options["preconditions"]["uid"].as_str() {
        let actual = current.metadata.uid.clone().unwrap_or_default();
        if uid != actual {
            return Err(ApiError::conflict(
                &name,
                &format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {actual}"
                ),
            ));
        }
    }
    // The pod strategy's CheckGracefulDelete: the request's grace period, else the
    // spec's (30 s by default); unscheduled and terminated pods go at once.
    let spec = current.spec.clone().unwrap_or_default();
    let phase = current
        .status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_default();
    let mut grace = options["gracePeriodSeconds"]
        .as_i64()
        .or_else(|| query.get("gracePeriodSeconds").and_then(|g| g.parse().ok()))
        .or(spec.termination_grace_period_seconds)
        .unwrap_or(30);
    if spec.node_name.as_deref().unwrap_or_default().is_empty()
        || phase == "Succeeded"
        || phase == "Failed"
    {
        grace = 0;
    }
    if grace < 0 {
        grace = 1;
    }
    let existing_grace = current.metadata.deletion_grace_period_seconds;
    let response = if grace == 0 {
        inner.remove(&key).expect("the pod was just found")
    } else if existing_grace.is_some_and(|g| g <= grace) {
        // Already terminating with a shorter or equal grace period: no change.
        current
    } else {
        let mut terminating = current.clone();
        let deadline = Timestamp::now()
            .checked_add(SignedDuration::from_secs(grace))
            .expect("a deletion deadline");
        terminating.metadata.deletion_timestamp = Some(Time(deadline));
        terminating.metadata.deletion_grace_period_seconds = Some(grace);
        inner.store(terminating, Some(current))
    };
    drop(inner);
    shared.notify();
    Ok(json_response(StatusCode::OK, &response))
}

/// A minimal pod bound to `node`: one container, `restartPolicy: Always`.
pub fn test_pod(namespace: &str, name: &str, node: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(namespace.to_string()),
            labels: Some(BTreeMap::from([("app".to_string(), name.to_string())])),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.to_string()),
            restart_policy: Some("Always".into()),
            containers: vec![Container {
                name: "main".into(),
                image: Some("busybox:1.36".into()),
                command: Some(vec!["sleep".into(), "3600".into()]),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        status: None,
    }
}
