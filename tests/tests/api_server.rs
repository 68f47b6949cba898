//! The API server paths (the pod source and the status writer) against the
//! real kube-apiserver (`evpleg_tests::control_plane`): the agent's client is
//! the node's, `system:node:<node>` in `system:nodes`, under the Node
//! authorizer, RBAC and the NodeRestriction admission plugin, as on a
//! cluster. Each test has its own namespace and node name on the control
//! plane the tests of this binary share. What the API server received is read
//! back from its audit log. No root needed; the binaries are (skipped without
//! them, a failure under `CI=true`).
//!
//! Faults the real API server cannot give on demand (an outage, a dropped
//! watch, a compaction, a bookmark) are in `api_server_faults.rs`, against
//! the fake.
//!
//! Every wait is bounded by [`WAIT`]; nothing sleeps to synchronise.

use std::sync::Arc;

use evpleg_kubelet::source::api::ApiSource;
use evpleg_kubelet::source::{Op, PodUpdate, annotations};
use evpleg_kubelet::status::api::ApiStatusWriter;
use evpleg_kubelet::status::{StatusWriter, WriteError};
use evpleg_tests::api_fixtures::{
    WAIT, assert_update, condition, failed_status, fast_backoff, from_api, init_logging, labelled,
    next, running_status, static_pod, time,
};
use evpleg_tests::control_plane::{self, AuditRecord, ControlPlane};
use evpleg_tests::fake_apiserver::test_pod;
use k8s_openapi::api::core::v1::{Node, Pod, PodStatus};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// One test's share of the control plane: its namespace and node name, and
/// clients as the admin and as the node.
struct Fixture {
    cp: Arc<ControlPlane>,
    ns: String,
    node: String,
    admin: kube::Client,
    node_client: kube::Client,
}

impl Fixture {
    /// `None` (the test returns) when the binaries are missing.
    async fn new(test: &str) -> Option<Self> {
        init_logging();
        if !control_plane::available(test) {
            return None;
        }
        let cp = ControlPlane::shared().await;
        let ns = cp.namespace("t").await;
        let node = format!("node-{}", &ns[2..]);
        let admin = cp.admin().await;
        let node_client = cp.node_client(&node).await;
        Some(Self {
            cp,
            ns,
            node,
            admin,
            node_client,
        })
    }

    fn user(&self) -> String {
        format!("system:node:{}", self.node)
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.admin.clone(), &self.ns)
    }

    /// A pod of this test's namespace bound to `node`, created as the admin.
    async fn add_pod(&self, name: &str, node: &str) -> Pod {
        self.pods()
            .create(&PostParams::default(), &test_pod(&self.ns, name, node))
            .await
            .unwrap_or_else(|e| panic!("create pod {name}: {e}"))
    }

    async fn pod(&self, name: &str) -> Option<Pod> {
        self.pods().get_opt(name).await.expect("get a pod")
    }

    async fn status_of(&self, name: &str) -> Option<PodStatus> {
        self.pod(name).await.and_then(|p| p.status)
    }

    /// Deletes a pod at once (grace period 0), as the admin.
    async fn delete_now(&self, name: &str) {
        self.pods()
            .delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap_or_else(|e| panic!("delete pod {name}: {e}"));
    }

    /// This node's requests, as the audit log recorded them.
    fn requests(&self) -> Vec<AuditRecord> {
        let user = self.user();
        self.cp
            .audit()
            .into_iter()
            .filter(|r| r.user == user)
            .collect()
    }

    /// This node's status patches of pod `name`: their bodies.
    fn status_patches(&self, name: &str) -> Vec<Value> {
        let path = format!("/api/v1/namespaces/{}/pods/{name}/status", self.ns);
        self.requests()
            .into_iter()
            .filter(|r| r.verb == "patch" && r.path() == path)
            .filter_map(|r| r.body)
            .collect()
    }

    /// No request of this node was refused (404 and 409 aside, which the
    /// agent expects).
    fn assert_nothing_refused(&self) {
        let refused = self.cp.refused(&self.user());
        assert!(refused.is_empty(), "refused requests: {refused:#?}");
    }

    fn writer(&self) -> ApiStatusWriter {
        ApiStatusWriter::new(self.node_client.clone(), &self.node).with_request_timeout(WAIT)
    }

    /// Registers this node (its Node object, as the admin); returns its UID.
    async fn add_node(&self) -> String {
        let node: Node =
            serde_json::from_value(json!({"metadata": {"name": self.node}})).expect("a node");
        Api::<Node>::all(self.admin.clone())
            .create(&PostParams::default(), &node)
            .await
            .expect("create the node")
            .metadata
            .uid
            .expect("a uid")
    }
}

async fn write(writer: &ApiStatusWriter, pod: &Pod, status: &PodStatus) -> Result<(), WriteError> {
    tokio::time::timeout(WAIT * 2, writer.write(pod, status))
        .await
        .expect("the write returns in time")
}

// ----- the API source ------------------------------------------------------------

/// Runs the API source for the fixture's node, as the node.
fn start_source(f: &Fixture) -> mpsc::Receiver<PodUpdate> {
    let (tx, rx) = mpsc::channel(64);
    let source = ApiSource::new(f.node_client.clone(), &f.node).with_backoff(fast_backoff());
    tokio::spawn(source.run(tx));
    rx
}

/// An UPDATE of pod `name` deleted with grace period 0.
fn assert_deleted_now(update: &PodUpdate, name: &str) {
    assert_update(update, Op::Update, &[name]);
    let meta = &update.pods[0].metadata;
    assert!(meta.deletion_timestamp.is_some(), "{meta:?}");
    assert_eq!(meta.deletion_grace_period_seconds, Some(0), "{meta:?}");
}

#[tokio::test]
async fn api_source_sets_the_nodes_pods_then_follows_their_changes() {
    let Some(f) = Fixture::new("api_source_sets_the_nodes_pods_then_follows_their_changes").await
    else {
        return;
    };
    let other = format!("{}-other", f.node);
    f.add_pod("a", &f.node).await;
    f.add_pod("b", &f.node).await;
    f.add_pod("elsewhere", &other).await;
    let mut rx = start_source(&f);

    // The first list is a SET of exactly this node's pods, marked as from `api`.
    let set = next(&mut rx, "the initial SET").await;
    assert_update(&set, Op::Set, &["a", "b"]);
    for pod in &set.pods {
        let source = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(annotations::CONFIG_SOURCE));
        assert_eq!(
            source.map(String::as_str),
            Some("api"),
            "{:?}",
            pod.metadata
        );
    }

    // A pod of another node is not reported: the next update is the new pod here
    // (the watch is ordered, so a leak would come first).
    f.add_pod("elsewhere-2", &other).await;
    f.add_pod("c", &f.node).await;
    assert_update(&next(&mut rx, "c added").await, Op::Update, &["c"]);

    // A changed pod is an UPDATE carrying the new object.
    let c = f.pod("c").await.expect("c stored");
    f.pods()
        .replace("c", &PostParams::default(), &labelled(c, "tier", "web"))
        .await
        .expect("label c");
    let update = next(&mut rx, "c changed").await;
    assert_update(&update, Op::Update, &["c"]);
    let labels = update.pods[0].metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels.get("tier").map(String::as_str), Some("web"));

    // (A pod cannot move to another node in the real API server: spec.nodeName
    // is immutable once set.) A pod deleted at once: the API server first
    // stores its deletionTimestamp with grace period 0 (MODIFIED), then
    // removes it (DELETED): an UPDATE, then REMOVE.
    f.delete_now("b").await;
    assert_deleted_now(&next(&mut rx, "b's deletion").await, "b");
    assert_update(&next(&mut rx, "b deleted").await, Op::Remove, &["b"]);

    // A graceful delete: the pod stays, with a deletionTimestamp; the source
    // passes it on (the mux makes it a DELETE).
    f.pods()
        .delete("a", &DeleteParams::default())
        .await
        .expect("graceful delete of a");
    let update = next(&mut rx, "a terminating").await;
    assert_update(&update, Op::Update, &["a"]);
    let meta = &update.pods[0].metadata;
    assert!(meta.deletion_timestamp.is_some(), "{meta:?}");
    assert_eq!(meta.deletion_grace_period_seconds, Some(30));

    // The final delete removes it (after the same MODIFIED).
    f.delete_now("a").await;
    assert_deleted_now(&next(&mut rx, "a's final deletion").await, "a");
    assert_update(&next(&mut rx, "a gone").await, Op::Remove, &["a"]);

    // On the wire, as the node: one list and a watch from its resourceVersion,
    // both with the node's field selector (the Node authorizer requires it);
    // the watch asks for bookmarks. Nothing refused.
    let requests = f.requests();
    let pods: Vec<&AuditRecord> = requests
        .iter()
        .filter(|r| r.path() == "/api/v1/pods")
        .collect();
    let lists: Vec<_> = pods.iter().filter(|r| r.verb == "list").collect();
    let watch = pods
        .iter()
        .find(|r| r.verb == "watch")
        .expect("a watch request");
    assert_eq!(lists.len(), 1, "{pods:#?}");
    let selector = format!("spec.nodeName={}", f.node);
    assert_eq!(
        lists[0].query("fieldSelector").as_deref(),
        Some(selector.as_str())
    );
    assert_eq!(
        watch.query("fieldSelector").as_deref(),
        Some(selector.as_str())
    );
    assert_eq!(watch.query("allowWatchBookmarks").as_deref(), Some("true"));
    assert!(
        watch
            .query("resourceVersion")
            .is_some_and(|rv| rv.parse::<u64>().is_ok()),
        "{watch:?}"
    );
    assert!(watch.query("timeoutSeconds").is_some(), "{watch:?}");
    f.assert_nothing_refused();
}

// ----- the status writer ---------------------------------------------------------

#[tokio::test]
async fn status_writer_patches_an_api_pods_status() {
    let Some(f) = Fixture::new("status_writer_patches_an_api_pods_status").await else {
        return;
    };
    let created = f.add_pod("web", &f.node).await;
    // A condition someone else owns, already in the API.
    let gate = json!({"status": {"conditions": [condition("example.com/gate", "True")]}});
    f.pods()
        .patch_status("web", &PatchParams::default(), &Patch::Merge(&gate))
        .await
        .expect("a foreign condition");
    let pod = from_api(created);
    let uid = pod.metadata.uid.clone().expect("a uid");
    let writer = f.writer();

    write(&writer, &pod, &failed_status())
        .await
        .expect("the status is written");
    let stored = f.status_of("web").await.expect("a stored status");
    assert_eq!(stored.phase.as_deref(), Some("Failed"));
    let conditions: Vec<(String, String)> = stored
        .conditions
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|c| (c.type_, c.status))
        .collect();
    for expected in [
        ("example.com/gate", "True"),
        ("PodScheduled", "True"),
        ("Initialized", "True"),
        ("ContainersReady", "False"),
        ("Ready", "False"),
    ] {
        assert!(
            conditions.contains(&(expected.0.into(), expected.1.into())),
            "{expected:?} missing from {conditions:?}"
        );
    }
    let container = &stored
        .container_statuses
        .clone()
        .expect("container statuses")[0];
    let terminated = container
        .state
        .clone()
        .and_then(|s| s.terminated)
        .expect("terminated");
    assert_eq!(
        (terminated.exit_code, terminated.reason.as_deref()),
        (3, Some("Error"))
    );
    assert_eq!(terminated.finished_at, Some(time(1_700_000_002)));
    assert_eq!(stored.pod_ip.as_deref(), Some("10.88.0.5"));
    assert_eq!(stored.host_ip.as_deref(), Some("192.0.2.10"));

    // The patch, as the node: on the status subresource with the UID as the
    // precondition.
    let patches = f.status_patches("web");
    assert_eq!(patches.len(), 1, "{patches:#?}");
    assert_eq!(patches[0]["metadata"]["uid"], uid);
    assert_eq!(patches[0]["status"]["phase"], "Failed");

    // The same status again: nothing is sent.
    write(&writer, &pod, &failed_status())
        .await
        .expect("no-op write");
    assert_eq!(f.status_patches("web").len(), 1);

    // A condition changed: only it and what changed with it are sent.
    let mut ready = failed_status();
    ready.conditions = Some(vec![
        condition("PodScheduled", "True"),
        condition("Initialized", "True"),
        condition("ContainersReady", "True"),
        condition("Ready", "False"),
    ]);
    write(&writer, &pod, &ready)
        .await
        .expect("the status is written");
    let stored = f.status_of("web").await.expect("a stored status");
    assert!(
        stored
            .conditions
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "ContainersReady" && c.status == "True")
    );
    assert_eq!(f.status_patches("web").len(), 2);
    f.assert_nothing_refused();
}

#[tokio::test]
async fn status_writer_reports_an_unbound_or_recreated_pod() {
    let Some(f) = Fixture::new("status_writer_reports_an_unbound_or_recreated_pod").await else {
        return;
    };
    let writer = f.writer();

    let mut never = from_api(test_pod(&f.ns, "never", &f.node));
    never.metadata.uid = Some("uid-never".into());
    // The Node authorizer's 403 for a pod not bound to this node: gone, or
    // bound so lately that its graph has not seen it yet; the status
    // manager retries it while the pod is on the node.
    match write(&writer, &never, &running_status()).await {
        Err(WriteError::Unbound { pod, message }) => {
            assert_eq!(pod, format!("{}/never", f.ns));
            assert!(message.contains("gone"), "{message}");
        }
        other => panic!("expected an unbound error, got {other:?}"),
    }

    // Deleted and recreated under the same name: the old pod's status must not
    // land on the new one.
    let old = from_api(f.add_pod("again", &f.node).await);
    f.delete_now("again").await;
    f.add_pod("again", &f.node).await;
    // Until the Node authorizer's graph has the new binding, the node is
    // refused (`Unbound`), as the status manager would be: it retries.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let outcome = loop {
        match write(&writer, &old, &running_status()).await {
            Err(WriteError::Unbound { .. }) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            other => break other,
        }
    };
    match outcome {
        Err(WriteError::Permanent { message, .. }) => {
            assert!(message.contains("recreated"), "{message}")
        }
        other => panic!("expected a permanent error, got {other:?}"),
    }
    assert_eq!(
        f.status_of("again").await.and_then(|s| s.phase).as_deref(),
        Some("Pending"),
        "the API server's own status of a new pod"
    );
    assert!(f.status_patches("again").is_empty());
}

#[tokio::test]
async fn status_writer_creates_and_patches_the_mirror_pod_of_a_static_pod() {
    let Some(f) =
        Fixture::new("status_writer_creates_and_patches_the_mirror_pod_of_a_static_pod").await
    else {
        return;
    };
    let node_uid = f.add_node().await;
    let writer = f.writer();
    let name = format!("etcd-{}", f.node);
    let v1 = static_pod(&f.ns, &name, &f.node, "static-uid-1", "hash-1", "etcd:1");

    write(&writer, &v1, &running_status())
        .await
        .expect("mirror pod written");
    let mirror = f.pod(&name).await.expect("a mirror pod");
    let annotations = mirror.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        annotations
            .get(annotations::CONFIG_MIRROR)
            .map(String::as_str),
        Some("hash-1")
    );
    assert_eq!(
        annotations
            .get(annotations::CONFIG_SOURCE)
            .map(String::as_str),
        Some("file")
    );
    assert_eq!(mirror.metadata.labels, v1.metadata.labels);
    assert_ne!(
        mirror.metadata.uid.as_deref(),
        Some("static-uid-1"),
        "the API server gives its own UID"
    );
    let spec = mirror.spec.clone().expect("a spec");
    assert_eq!(spec.node_name.as_deref(), Some(f.node.as_str()));
    assert_eq!(spec.containers[0].image.as_deref(), Some("etcd:1"));
    let owners = mirror.metadata.owner_references.clone().unwrap_or_default();
    assert_eq!(owners.len(), 1, "{owners:?}");
    assert_eq!(
        (
            owners[0].kind.as_str(),
            owners[0].name.as_str(),
            owners[0].uid.as_str()
        ),
        ("Node", f.node.as_str(), node_uid.as_str())
    );
    assert_eq!(owners[0].controller, Some(true));
    assert_eq!(
        mirror.status.clone().and_then(|s| s.phase).as_deref(),
        Some("Running")
    );

    // The create, as the node, carried no status; the patch the mirror pod's UID.
    let pods_path = format!("/api/v1/namespaces/{}/pods", f.ns);
    let creates = |f: &Fixture| -> Vec<AuditRecord> {
        f.requests()
            .into_iter()
            .filter(|r| r.verb == "create" && r.path() == pods_path)
            .collect()
    };
    let create = creates(&f).first().cloned().expect("a create");
    assert_eq!(create.code, 201, "{create:?}");
    let body = create.body.clone().expect("a create body");
    // (The audit log shows the decoded object: an empty status at most.)
    assert!(body.get("status").is_none_or(|s| *s == json!({})), "{body}");
    let patches = f.status_patches(&name);
    assert_eq!(
        patches.last().expect("a patch")["metadata"]["uid"],
        mirror.metadata.uid.clone().expect("a uid")
    );

    // A later write finds the mirror pod: no second create.
    write(&writer, &v1, &failed_status())
        .await
        .expect("written");
    assert_eq!(creates(&f).len(), 1);
    assert_eq!(
        f.status_of(&name).await.and_then(|s| s.phase).as_deref(),
        Some("Failed")
    );

    // A new manifest (new hash and UID): the outdated mirror pod is deleted at
    // once, with its UID as the precondition, and recreated.
    let v2 = static_pod(&f.ns, &name, &f.node, "static-uid-2", "hash-2", "etcd:2");
    write(&writer, &v2, &running_status())
        .await
        .expect("new mirror pod written");
    let mirror2 = f.pod(&name).await.expect("a mirror pod");
    assert_ne!(mirror2.metadata.uid, mirror.metadata.uid);
    let annotations = mirror2.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        annotations
            .get(annotations::CONFIG_MIRROR)
            .map(String::as_str),
        Some("hash-2")
    );
    assert_eq!(
        mirror2.spec.expect("a spec").containers[0].image.as_deref(),
        Some("etcd:2")
    );
    let delete = f
        .requests()
        .into_iter()
        .find(|r| r.verb == "delete" && r.path() == format!("{pods_path}/{name}"))
        .expect("a delete");
    let options = delete.body.expect("delete options");
    assert_eq!(options["gracePeriodSeconds"], 0);
    assert_eq!(
        options["preconditions"]["uid"],
        mirror.metadata.uid.clone().expect("a uid")
    );

    // The old static pod is forgotten: the new mirror pod is not its, so it stays.
    writer.forget(&v1).await;
    assert!(f.pod(&name).await.is_some());
    // The new one is removed from the node: its mirror pod goes.
    writer.forget(&v2).await;
    assert!(f.pod(&name).await.is_none());
    f.assert_nothing_refused();
}

/// A pod of the static pod's name that is not a mirror pod is never touched;
/// and without this node's Node object no mirror pod is created (NodeRestriction
/// refuses one without the owner reference to the node, as the kubelet's
/// mirror client needs the node's UID first): a retryable error until the
/// node is registered, then the mirror pod with its owner.
#[tokio::test]
async fn status_writer_leaves_a_pod_that_is_not_a_mirror_pod_alone() {
    let Some(f) = Fixture::new("status_writer_leaves_a_pod_that_is_not_a_mirror_pod_alone").await
    else {
        return;
    };
    let name = format!("etcd-{}", f.node);
    let stranger = f.add_pod(&name, &f.node).await;
    let writer = f.writer();
    let static_pod_of =
        |name: &str, uid: &str, hash: &str| static_pod(&f.ns, name, &f.node, uid, hash, "etcd:1");
    match write(
        &writer,
        &static_pod_of(&name, "static-uid-1", "hash-1"),
        &running_status(),
    )
    .await
    {
        Err(WriteError::Permanent { message, .. }) => {
            assert!(message.contains("not a mirror pod"), "{message}")
        }
        other => panic!("expected a permanent error, got {other:?}"),
    }
    let still = f.pod(&name).await.expect("still there");
    assert_eq!(still.metadata.uid, stranger.metadata.uid);
    assert!(f.status_patches(&name).is_empty());

    // No Node object yet: retryable, nothing created.
    let other = static_pod_of("other", "static-uid-9", "hash-9");
    match write(&writer, &other, &running_status()).await {
        Err(WriteError::Retryable { message, .. }) => {
            assert!(message.contains(&f.node), "{message}")
        }
        other => panic!("expected a retryable error, got {other:?}"),
    }
    assert!(f.pod("other").await.is_none());
    f.assert_nothing_refused();
    // Registered: the mirror pod, owned by the node.
    let node_uid = f.add_node().await;
    write(&writer, &other, &running_status())
        .await
        .expect("written");
    let mirror = f.pod("other").await.expect("a mirror pod");
    let owners = mirror.metadata.owner_references.unwrap_or_default();
    assert_eq!(
        owners.iter().map(|o| o.uid.as_str()).collect::<Vec<_>>(),
        [node_uid.as_str()]
    );
    f.assert_nothing_refused();
}

/// Issue #27 item 4: a condition another writer (a readiness gate's
/// controller) adds between the status writer's GET and its PATCH is kept:
/// the patch is a strategic merge patch whose conditions merge by type, as
/// the kubelet's. A JSON merge patch sent the conditions read by the GET
/// whole, and the real API server then dropped the other writer's condition.
#[tokio::test]
async fn status_writer_keeps_a_condition_added_between_its_read_and_its_patch() {
    let Some(f) =
        Fixture::new("status_writer_keeps_a_condition_added_between_its_read_and_its_patch").await
    else {
        return;
    };
    let pod = from_api(f.add_pod("gated", &f.node).await);
    let writer = f.writer();
    let mut not_ready = running_status();
    not_ready.conditions = Some(vec![
        condition("PodScheduled", "True"),
        condition("Ready", "False"),
    ]);
    write(&writer, &pod, &not_ready).await.expect("written");
    // The writer's read...
    let read = f.pod("gated").await.expect("the pod");
    // ...then another writer's condition...
    let gate = json!({"status": {"conditions": [condition("example.com/lb", "True")]}});
    f.pods()
        .patch_status("gated", &PatchParams::default(), &Patch::Strategic(&gate))
        .await
        .expect("the controller's condition");
    // ...then the writer's patch, from what it read.
    tokio::time::timeout(WAIT, writer.patch_read_pod(&read, &running_status()))
        .await
        .expect("the patch returns in time")
        .expect("patched");
    let stored = f.status_of("gated").await.expect("a status");
    let conditions: Vec<(String, String)> = stored
        .conditions
        .unwrap_or_default()
        .into_iter()
        .map(|c| (c.type_, c.status))
        .collect();
    for expected in [
        ("example.com/lb", "True"),
        ("Ready", "True"),
        ("PodScheduled", "True"),
    ] {
        assert!(
            conditions.contains(&(expected.0.into(), expected.1.into())),
            "{expected:?} missing from {conditions:?}"
        );
    }
    let last = f.status_patches("gated").pop().expect("a patch");
    assert!(
        last["status"].get("$setElementOrder/conditions").is_some(),
        "{last:#}"
    );
    f.assert_nothing_refused();
}
