//! The API server paths (the pod source and the status writer) against the
//! in-process fake API server (`evpleg_tests::fake_apiserver`), which speaks the
//! Kubernetes JSON wire format over HTTP. No root and no cluster needed.
//!
//! Every wait is bounded by [`WAIT`]; nothing sleeps to synchronise: the tests wait
//! for the next update from the source, or for the fake to have seen a request.

use std::collections::BTreeMap;
use std::time::Duration;

use evpleg_kubelet::source::api::{ApiSource, SourceBackoff};
use evpleg_kubelet::source::{Op, PodUpdate, SourceName, annotations};
use evpleg_kubelet::status::api::ApiStatusWriter;
use evpleg_kubelet::status::{StatusWriter, WriteError};
use evpleg_tests::fake_apiserver::{FakeApiServer, test_pod};
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStatus, Pod,
    PodCondition, PodIP, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Api;
use kube::api::DeleteParams;
use serde_json::Value;
use tokio::sync::mpsc;

const NODE: &str = "node-a";
const OTHER_NODE: &str = "node-b";
/// Bound of every wait.
const WAIT: Duration = Duration::from_secs(20);

fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "evpleg=debug,kube_runtime=debug".into()),
        )
        .with_test_writer()
        .try_init();
}

/// A short reconnect backoff, so that recovery takes milliseconds.
fn fast_backoff() -> SourceBackoff {
    SourceBackoff {
        min: Duration::from_millis(10),
        max: Duration::from_millis(200),
        reset_after: Duration::from_secs(120),
    }
}

/// Runs the API source for `NODE` against the fake; it stops when the receiver
/// is dropped.
fn start_source(fake: &FakeApiServer) -> mpsc::Receiver<PodUpdate> {
    let (tx, rx) = mpsc::channel(64);
    let source = ApiSource::new(fake.kube_client(), NODE).with_backoff(fast_backoff());
    tokio::spawn(source.run(tx));
    rx
}

async fn next(rx: &mut mpsc::Receiver<PodUpdate>, what: &str) -> PodUpdate {
    tokio::time::timeout(WAIT, rx.recv())
        .await
        .unwrap_or_else(|_| {
            panic!("no update from the API source within {WAIT:?}: expected {what}")
        })
        .expect("the API source stopped")
}

fn names(update: &PodUpdate) -> Vec<String> {
    let mut names: Vec<String> = update
        .pods
        .iter()
        .map(|p| p.metadata.name.clone().unwrap_or_default())
        .collect();
    names.sort();
    names
}

fn assert_update(update: &PodUpdate, op: Op, expected: &[&str]) {
    assert_eq!(
        (update.op, names(update)),
        (
            op,
            expected.iter().map(|s| s.to_string()).collect::<Vec<_>>()
        ),
        "unexpected update {update:?}"
    );
    assert_eq!(update.source, SourceName::Api);
}

fn list_requests(fake: &FakeApiServer) -> usize {
    fake.requests()
        .iter()
        .filter(|r| r.method == "GET" && r.path() == "/api/v1/pods" && r.query("watch").is_none())
        .count()
}

fn labelled(pod: Pod, key: &str, value: &str) -> Pod {
    let mut pod = pod;
    pod.metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert(key.into(), value.into());
    pod
}

// ----- the API source ------------------------------------------------------------

#[tokio::test]
async fn api_source_sets_the_nodes_pods_then_follows_their_changes() {
    init_logging();
    let fake = FakeApiServer::start().await;
    fake.add_pod(test_pod("default", "a", NODE));
    fake.add_pod(test_pod("default", "b", NODE));
    fake.add_pod(test_pod("default", "elsewhere", OTHER_NODE));
    let mut rx = start_source(&fake);

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
    fake.add_pod(test_pod("default", "elsewhere-2", OTHER_NODE));
    fake.add_pod(test_pod("default", "c", NODE));
    assert_update(&next(&mut rx, "c added").await, Op::Update, &["c"]);

    // A changed pod is an UPDATE carrying the new object.
    let c = fake.pod("default", "c").expect("c stored");
    fake.update_pod(labelled(c, "tier", "web"));
    let update = next(&mut rx, "c changed").await;
    assert_update(&update, Op::Update, &["c"]);
    let labels = update.pods[0].metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels.get("tier").map(String::as_str), Some("web"));

    // A pod moved to another node leaves the field selector: the watch says
    // DELETED, the source REMOVE.
    let mut b = fake.pod("default", "b").expect("b stored");
    b.spec.as_mut().expect("a spec").node_name = Some(OTHER_NODE.into());
    fake.update_pod(b);
    assert_update(&next(&mut rx, "b moved away").await, Op::Remove, &["b"]);

    // A graceful delete through the API: the pod stays, with a deletionTimestamp;
    // the source passes it on (the mux makes it a DELETE).
    let pods: Api<Pod> = Api::namespaced(fake.kube_client(), "default");
    pods.delete("a", &DeleteParams::default())
        .await
        .expect("graceful delete of a");
    let update = next(&mut rx, "a terminating").await;
    assert_update(&update, Op::Update, &["a"]);
    let meta = &update.pods[0].metadata;
    assert!(meta.deletion_timestamp.is_some(), "{meta:?}");
    assert_eq!(meta.deletion_grace_period_seconds, Some(30));

    // The final delete removes it.
    fake.delete_pod("default", "a").expect("a stored");
    assert_update(&next(&mut rx, "a gone").await, Op::Remove, &["a"]);

    // On the wire: one list and a watch from its resourceVersion, both with the
    // node's field selector; the watch asks for bookmarks.
    let requests = fake.requests();
    let list = requests
        .iter()
        .find(|r| r.path() == "/api/v1/pods" && r.query("watch").is_none())
        .expect("a list request");
    let watch = requests
        .iter()
        .find(|r| r.path() == "/api/v1/pods" && r.query("watch").as_deref() == Some("true"))
        .expect("a watch request");
    let selector = format!("spec.nodeName={NODE}");
    assert_eq!(
        list.query("fieldSelector").as_deref(),
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
    assert_eq!(list_requests(&fake), 1);
    // No discovery: `Api<Pod>` knows its path.
    let others: Vec<_> = requests
        .iter()
        .filter(|r| !r.path().starts_with("/api/v1/"))
        .collect();
    assert!(others.is_empty(), "unexpected requests: {others:?}");
}

#[tokio::test]
async fn api_source_relists_after_the_api_server_comes_back() {
    init_logging();
    let fake = FakeApiServer::start().await;
    fake.add_pod(test_pod("default", "a", NODE));
    fake.add_pod(test_pod("default", "b", NODE));
    let mut rx = start_source(&fake);
    assert_update(
        &next(&mut rx, "the initial SET").await,
        Op::Set,
        &["a", "b"],
    );
    fake.wait_for_watches(1, WAIT).await;

    // The API server goes away: the watch ends and the source's retries are refused.
    fake.set_available(false);
    fake.wait_for_refused(2, WAIT).await;
    // Meanwhile `a` is deleted and `c` scheduled here; nobody can tell the source.
    fake.delete_pod("default", "a").expect("a stored");
    fake.add_pod(test_pod("default", "c", NODE));
    assert!(
        rx.try_recv().is_err(),
        "the source reported something during the outage"
    );

    // Back (as after a restart, the watch cache starts anew): the watch from the old
    // resourceVersion is answered 410 Expired, the source relists, and the SET
    // leaves out the pod deleted meanwhile, so the mux removes it.
    fake.set_available(true);
    let set = next(&mut rx, "the SET of the relist").await;
    assert_update(&set, Op::Set, &["b", "c"]);
    assert_eq!(list_requests(&fake), 2);

    // And it watches again.
    fake.add_pod(test_pod("default", "d", NODE));
    assert_update(&next(&mut rx, "d added").await, Op::Update, &["d"]);
}

#[tokio::test]
async fn api_source_resumes_a_dropped_watch_without_losing_events() {
    init_logging();
    let fake = FakeApiServer::start().await;
    fake.add_pod(test_pod("default", "a", NODE));
    let mut rx = start_source(&fake);
    assert_update(&next(&mut rx, "the initial SET").await, Op::Set, &["a"]);
    fake.wait_for_watches(1, WAIT).await;

    // The connection drops (the API server stays up and keeps its watch cache);
    // changes happen before or after the source watches again: either way they
    // arrive, in order, with no relist.
    fake.close_watches();
    let a = fake.pod("default", "a").expect("a stored");
    fake.update_pod(labelled(a, "v", "2"));
    fake.add_pod(test_pod("default", "b", NODE));
    fake.delete_pod("default", "a");
    assert_update(&next(&mut rx, "a changed").await, Op::Update, &["a"]);
    assert_update(&next(&mut rx, "b added").await, Op::Update, &["b"]);
    assert_update(&next(&mut rx, "a deleted").await, Op::Remove, &["a"]);
    assert_eq!(list_requests(&fake), 1, "a resumed watch must not relist");
}

#[tokio::test]
async fn api_source_relists_when_its_resource_version_was_compacted() {
    init_logging();
    let fake = FakeApiServer::start().await;
    fake.add_pod(test_pod("default", "a", NODE));
    fake.add_pod(test_pod("default", "b", NODE));
    let mut rx = start_source(&fake);
    assert_update(
        &next(&mut rx, "the initial SET").await,
        Op::Set,
        &["a", "b"],
    );
    fake.wait_for_watches(1, WAIT).await;

    // (No await in between: on this current-thread runtime the source cannot
    // watch again before the history is compacted.)
    fake.close_watches();
    fake.delete_pod("default", "a");
    fake.compact();
    // The DELETED event is out of the source's reach (410 Expired): only the relist
    // can tell it, by leaving `a` out.
    assert_update(
        &next(&mut rx, "the SET of the relist").await,
        Op::Set,
        &["b"],
    );
}

#[tokio::test]
async fn api_source_ignores_bookmarks_and_keeps_watching() {
    init_logging();
    let fake = FakeApiServer::start().await;
    let mut rx = start_source(&fake);
    assert_update(
        &next(&mut rx, "the initial (empty) SET").await,
        Op::Set,
        &[],
    );
    fake.wait_for_watches(1, WAIT).await;
    fake.bookmark();
    fake.add_pod(test_pod("default", "a", NODE));
    assert_update(&next(&mut rx, "a added").await, Op::Update, &["a"]);
}

// ----- the fake's wire format ----------------------------------------------------

async fn raw(fake: &FakeApiServer, method: &str, uri: &str) -> (u16, bytes_or_json::Body) {
    let request = axum::http::Request::builder()
        .method(method)
        .uri(uri)
        .header("accept", "application/json")
        .body(kube::client::Body::empty())
        .expect("a request");
    let response = tokio::time::timeout(WAIT, fake.kube_client().send(request))
        .await
        .expect("the fake answers in time")
        .expect("the fake answers");
    let code = response.status().as_u16();
    let bytes = tokio::time::timeout(WAIT, response.into_body().collect_bytes())
        .await
        .expect("the body ends in time")
        .expect("a body");
    (code, bytes_or_json::Body(bytes.to_vec()))
}

mod bytes_or_json {
    use serde_json::Value;

    pub struct Body(pub Vec<u8>);

    impl Body {
        pub fn json(&self) -> Value {
            serde_json::from_slice(&self.0)
                .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.0)))
        }

        /// Newline-delimited JSON (a watch).
        pub fn lines(&self) -> Vec<Value> {
            String::from_utf8_lossy(&self.0)
                .lines()
                .map(|l| {
                    serde_json::from_str(l).unwrap_or_else(|e| panic!("bad watch line ({e}): {l}"))
                })
                .collect()
        }
    }
}

fn assert_status(body: &Value, code: u64, reason: &str) {
    assert_eq!(body["kind"], "Status", "{body}");
    assert_eq!(body["apiVersion"], "v1", "{body}");
    assert_eq!(body["status"], "Failure", "{body}");
    assert_eq!(body["code"], code, "{body}");
    assert_eq!(body["reason"], reason, "{body}");
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
}

#[tokio::test]
async fn fake_api_server_speaks_the_kubernetes_wire_format() {
    init_logging();
    let fake = FakeApiServer::start().await;
    let before = fake.resource_version();
    fake.add_pod(test_pod("default", "a", NODE));
    fake.add_pod(test_pod("default", "z", OTHER_NODE));

    // A list: a PodList with the revision; items without kind/apiVersion.
    let (code, body) = raw(
        &fake,
        "GET",
        "/api/v1/pods?fieldSelector=spec.nodeName%3Dnode-a&limit=500",
    )
    .await;
    let list = body.json();
    assert_eq!(code, 200);
    assert_eq!(
        (list["kind"].as_str(), list["apiVersion"].as_str()),
        (Some("PodList"), Some("v1"))
    );
    assert_eq!(
        list["metadata"]["resourceVersion"],
        fake.resource_version().to_string()
    );
    let items = list["items"].as_array().expect("items");
    assert_eq!(items.len(), 1);
    assert_eq!(items[0]["metadata"]["name"], "a");
    assert!(items[0].get("kind").is_none());

    // Errors are Status objects.
    let (code, body) = raw(&fake, "GET", "/api/v1/namespaces/default/pods/missing").await;
    assert_eq!(code, 404);
    let status = body.json();
    assert_status(&status, 404, "NotFound");
    assert_eq!(status["details"]["name"], "missing");
    assert_eq!(status["details"]["kind"], "pods");
    let (code, body) = raw(&fake, "GET", "/api/v1/pods?fieldSelector=spec.unknown%3Dx").await;
    assert_eq!(code, 400);
    assert_status(&body.json(), 400, "BadRequest");
    let (code, body) = raw(&fake, "GET", "/apis/apps/v1/deployments").await;
    assert_eq!(code, 404);
    assert_status(&body.json(), 404, "NotFound");

    // A watch from before the pods replays them, then streams changes; it ends
    // when the server closes it.
    let uri = format!(
        "/api/v1/pods?watch=true&fieldSelector=spec.nodeName%3Dnode-a&allowWatchBookmarks=true&resourceVersion={before}"
    );
    let watch = {
        let fake_client = fake.kube_client();
        tokio::spawn(async move {
            let request = axum::http::Request::get(uri)
                .body(kube::client::Body::empty())
                .expect("a request");
            let response = fake_client.send(request).await.expect("a watch response");
            assert_eq!(response.status().as_u16(), 200);
            assert_eq!(response.headers()["content-type"], "application/json");
            response
                .into_body()
                .collect_bytes()
                .await
                .expect("the watch body")
        })
    };
    fake.wait_for_watches(1, WAIT).await;
    let a = fake.pod("default", "a").expect("a stored");
    fake.update_pod(labelled(a, "v", "2"));
    fake.bookmark();
    let rv_at_bookmark = fake.resource_version();
    fake.delete_pod("default", "a");
    fake.close_watches();
    let bytes = tokio::time::timeout(WAIT, watch)
        .await
        .expect("the watch ends")
        .expect("the watch task");
    let events = bytes_or_json::Body(bytes.to_vec()).lines();
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| e["type"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        kinds,
        ["ADDED", "MODIFIED", "BOOKMARK", "DELETED"],
        "{events:?}"
    );
    assert_eq!(events[0]["object"]["kind"], "Pod");
    assert_eq!(events[0]["object"]["apiVersion"], "v1");
    assert_eq!(
        events[2]["object"]["metadata"]["resourceVersion"],
        rv_at_bookmark.to_string()
    );
    assert_eq!(
        events[3]["object"]["metadata"]["resourceVersion"],
        fake.resource_version().to_string()
    );

    // A watch from a compacted resourceVersion: 200 with one ERROR event, 410 Expired.
    fake.compact();
    let (code, body) = raw(
        &fake,
        "GET",
        &format!("/api/v1/pods?watch=true&resourceVersion={before}"),
    )
    .await;
    assert_eq!(code, 200);
    let events = body.lines();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["type"], "ERROR");
    assert_status(&events[0]["object"], 410, "Expired");

    // Unavailable: 503 ServiceUnavailable, as a Status.
    fake.set_available(false);
    let (code, body) = raw(&fake, "GET", "/api/v1/pods").await;
    assert_eq!(code, 503);
    assert_status(&body.json(), 503, "ServiceUnavailable");
    fake.set_available(true);
}

#[tokio::test]
async fn fake_api_server_creates_once_and_checks_uid_preconditions() {
    init_logging();
    let fake = FakeApiServer::start().await;
    let pods: Api<Pod> = Api::namespaced(fake.kube_client(), "default");
    let created = pods
        .create(&Default::default(), &test_pod("default", "m", NODE))
        .await
        .expect("created");
    assert!(created.metadata.uid.is_some());
    assert_eq!(
        created.status.and_then(|s| s.phase).as_deref(),
        Some("Pending")
    );
    match pods
        .create(&Default::default(), &test_pod("default", "m", NODE))
        .await
    {
        Err(kube::Error::Api(s)) => {
            assert_eq!((s.code, s.reason.as_str()), (409, "AlreadyExists"), "{s:?}");
        }
        other => panic!("expected 409 AlreadyExists, got {other:?}"),
    }
    let params = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(kube::api::Preconditions {
            uid: Some("not-the-uid".into()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match pods.delete("m", &params).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"), "{s:?}")
        }
        other => panic!("expected 409 Conflict, got {other:?}"),
    }
    assert!(fake.pod("default", "m").is_some());
}

// ----- the status writer ---------------------------------------------------------

fn time(secs: i64) -> Time {
    Time(k8s_openapi::jiff::Timestamp::from_second(secs).expect("a time"))
}

fn condition(type_: &str, status: &str) -> PodCondition {
    PodCondition {
        type_: type_.into(),
        status: status.into(),
        last_transition_time: Some(time(1_700_000_000)),
        ..PodCondition::default()
    }
}

/// The status of a pod whose one container exited 3 and will not restart.
fn failed_status() -> PodStatus {
    PodStatus {
        phase: Some("Failed".into()),
        conditions: Some(vec![
            condition("PodScheduled", "True"),
            condition("Initialized", "True"),
            condition("ContainersReady", "False"),
            condition("Ready", "False"),
        ]),
        container_statuses: Some(vec![ContainerStatus {
            name: "main".into(),
            image: "busybox:1.36".into(),
            image_id: String::new(),
            container_id: Some("containerd://0123".into()),
            ready: false,
            restart_count: 0,
            state: Some(ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: 3,
                    reason: Some("Error".into()),
                    started_at: Some(time(1_700_000_001)),
                    finished_at: Some(time(1_700_000_002)),
                    ..ContainerStateTerminated::default()
                }),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        }]),
        host_ip: Some("192.0.2.10".into()),
        pod_ip: Some("10.88.0.5".into()),
        pod_ips: Some(vec![PodIP {
            ip: "10.88.0.5".into(),
        }]),
        start_time: Some(time(1_700_000_000)),
        ..PodStatus::default()
    }
}

fn running_status() -> PodStatus {
    PodStatus {
        phase: Some("Running".into()),
        conditions: Some(vec![
            condition("PodScheduled", "True"),
            condition("Ready", "True"),
        ]),
        container_statuses: Some(vec![ContainerStatus {
            name: "main".into(),
            ready: true,
            state: Some(ContainerState {
                running: Some(ContainerStateRunning {
                    started_at: Some(time(1_700_000_001)),
                }),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        }]),
        ..PodStatus::default()
    }
}

/// As the API source hands pods on: annotated with `config.source: api`.
fn from_api(pod: Pod) -> Pod {
    let mut pod = pod;
    pod.metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(annotations::CONFIG_SOURCE.into(), "api".into());
    pod
}

fn writer(fake: &FakeApiServer) -> ApiStatusWriter {
    ApiStatusWriter::new(fake.kube_client(), NODE).with_request_timeout(WAIT)
}

async fn write(writer: &ApiStatusWriter, pod: &Pod, status: &PodStatus) -> Result<(), WriteError> {
    tokio::time::timeout(WAIT * 2, writer.write(pod, status))
        .await
        .expect("the write returns in time")
}

fn status_patches(fake: &FakeApiServer) -> Vec<Value> {
    fake.patches()
        .into_iter()
        .filter(|p| p.subresource == "status")
        .map(|p| {
            assert_eq!(p.content_type, "application/merge-patch+json");
            p.body
        })
        .collect()
}

#[tokio::test]
async fn status_writer_patches_an_api_pods_status() {
    init_logging();
    let fake = FakeApiServer::start().await;
    let mut pod = test_pod("default", "web", NODE);
    // A condition someone else owns, already in the API.
    pod.status = Some(PodStatus {
        conditions: Some(vec![condition("example.com/gate", "True")]),
        ..PodStatus::default()
    });
    let pod = from_api(fake.add_pod(pod));
    let uid = pod.metadata.uid.clone().expect("a uid");
    let writer = writer(&fake);

    write(&writer, &pod, &failed_status())
        .await
        .expect("the status is written");
    let stored = fake.status_of("default", "web").expect("a stored status");
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

    // The patch: a JSON merge patch on the status subresource with the UID as the
    // precondition.
    let patches = status_patches(&fake);
    assert_eq!(patches.len(), 1, "{patches:?}");
    assert_eq!(patches[0]["metadata"]["uid"], uid);
    assert_eq!(patches[0]["status"]["phase"], "Failed");

    // The same status again: nothing is sent.
    write(&writer, &pod, &failed_status())
        .await
        .expect("no-op write");
    assert_eq!(status_patches(&fake).len(), 1);

    // A field that went away is removed (null in the patch).
    let mut without_ip = failed_status();
    without_ip.pod_ip = None;
    without_ip.pod_ips = None;
    write(&writer, &pod, &without_ip)
        .await
        .expect("the status is written");
    let stored = fake.status_of("default", "web").expect("a stored status");
    assert_eq!(stored.pod_ip, None);
    assert_eq!(stored.phase.as_deref(), Some("Failed"));
    assert_eq!(status_patches(&fake)[1]["status"]["podIP"], Value::Null);
}

#[tokio::test]
async fn status_writer_reports_a_gone_or_recreated_pod_as_permanent() {
    init_logging();
    let fake = FakeApiServer::start().await;
    let writer = writer(&fake);

    let mut never = from_api(test_pod("default", "never", NODE));
    never.metadata.uid = Some("uid-never".into());
    match write(&writer, &never, &running_status()).await {
        Err(WriteError::Permanent { pod, message }) => {
            assert_eq!(pod, "default/never");
            assert!(message.contains("gone"), "{message}");
        }
        other => panic!("expected a permanent error, got {other:?}"),
    }

    // Deleted and recreated under the same name: the old pod's status must not
    // land on the new one.
    let old = from_api(fake.add_pod(test_pod("default", "again", NODE)));
    fake.delete_pod("default", "again");
    fake.add_pod(test_pod("default", "again", NODE));
    match write(&writer, &old, &running_status()).await {
        Err(WriteError::Permanent { message, .. }) => {
            assert!(message.contains("recreated"), "{message}")
        }
        other => panic!("expected a permanent error, got {other:?}"),
    }
    assert_eq!(fake.status_of("default", "again"), None);
    assert!(status_patches(&fake).is_empty());
}

#[tokio::test]
async fn status_writer_is_retryable_while_the_api_server_is_away() {
    init_logging();
    let fake = FakeApiServer::start().await;
    let pod = from_api(fake.add_pod(test_pod("default", "web", NODE)));
    let writer = writer(&fake);

    fake.set_available(false);
    match write(&writer, &pod, &failed_status()).await {
        Err(e @ WriteError::Retryable { .. }) => {
            assert!(e.to_string().contains("503"), "{e}");
        }
        other => panic!("expected a retryable error, got {other:?}"),
    }
    assert_eq!(fake.status_of("default", "web"), None);

    fake.set_available(true);
    write(&writer, &pod, &failed_status())
        .await
        .expect("written after recovery");
    assert_eq!(
        fake.status_of("default", "web")
            .and_then(|s| s.phase)
            .as_deref(),
        Some("Failed")
    );

    // Nobody listening at all: a connection error, retryable too.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("an address")
    };
    let mut config = kube::Config::new(format!("http://{closed}").parse().expect("a URI"));
    config.default_retry = false;
    let nowhere = ApiStatusWriter::new(kube::Client::try_from(config).expect("a client"), NODE);
    match write(&nowhere, &pod, &failed_status()).await {
        Err(WriteError::Retryable { .. }) => {}
        other => panic!("expected a retryable error, got {other:?}"),
    }
}

/// A static pod as the file source produces it.
fn static_pod(uid: &str, hash: &str, image: &str) -> Pod {
    let mut pod = test_pod("kube-system", "etcd-node-a", NODE);
    pod.metadata.uid = Some(uid.into());
    pod.metadata.annotations = Some(BTreeMap::from([
        (annotations::CONFIG_SOURCE.to_string(), "file".to_string()),
        (annotations::CONFIG_HASH.to_string(), hash.to_string()),
        (
            annotations::CONFIG_SEEN.to_string(),
            "2026-01-01T00:00:00Z".to_string(),
        ),
    ]));
    pod.spec.as_mut().expect("a spec").containers[0].image = Some(image.into());
    pod
}

#[tokio::test]
async fn status_writer_creates_and_patches_the_mirror_pod_of_a_static_pod() {
    init_logging();
    let fake = FakeApiServer::start().await;
    let node_uid = fake.add_node(NODE);
    let writer = writer(&fake);
    let v1 = static_pod("static-uid-1", "hash-1", "etcd:1");

    write(&writer, &v1, &running_status())
        .await
        .expect("mirror pod written");
    let mirror = fake
        .pod("kube-system", "etcd-node-a")
        .expect("a mirror pod");
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
    assert_eq!(spec.node_name.as_deref(), Some(NODE));
    assert_eq!(spec.containers[0].image.as_deref(), Some("etcd:1"));
    let owners = mirror.metadata.owner_references.clone().unwrap_or_default();
    assert_eq!(owners.len(), 1, "{owners:?}");
    assert_eq!(
        (
            owners[0].kind.as_str(),
            owners[0].name.as_str(),
            owners[0].uid.as_str()
        ),
        ("Node", NODE, node_uid.as_str())
    );
    assert_eq!(owners[0].controller, Some(true));
    assert_eq!(
        mirror.status.clone().and_then(|s| s.phase).as_deref(),
        Some("Running")
    );

    // The create carried no status, and the patch the mirror pod's UID.
    let requests = fake.requests();
    let create = requests
        .iter()
        .find(|r| r.method == "POST")
        .expect("a create");
    assert_eq!(create.path(), "/api/v1/namespaces/kube-system/pods");
    let body = create.body.clone().expect("a create body");
    assert!(body.get("status").is_none(), "{body}");
    let patches = status_patches(&fake);
    assert_eq!(
        patches.last().expect("a patch")["metadata"]["uid"],
        mirror.metadata.uid.clone().expect("a uid")
    );

    // A later write finds the mirror pod: no second create.
    write(&writer, &v1, &failed_status())
        .await
        .expect("written");
    assert_eq!(
        fake.requests()
            .iter()
            .filter(|r| r.method == "POST")
            .count(),
        1
    );
    assert_eq!(
        fake.status_of("kube-system", "etcd-node-a")
            .and_then(|s| s.phase)
            .as_deref(),
        Some("Failed")
    );

    // A new manifest (new hash and UID): the outdated mirror pod is deleted at once,
    // with its UID as the precondition, and recreated.
    let v2 = static_pod("static-uid-2", "hash-2", "etcd:2");
    write(&writer, &v2, &running_status())
        .await
        .expect("new mirror pod written");
    let mirror2 = fake
        .pod("kube-system", "etcd-node-a")
        .expect("a mirror pod");
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
    let delete = fake
        .requests()
        .into_iter()
        .find(|r| r.method == "DELETE")
        .expect("a delete");
    let options = delete.body.expect("delete options");
    assert_eq!(options["gracePeriodSeconds"], 0);
    assert_eq!(
        options["preconditions"]["uid"],
        mirror.metadata.uid.clone().expect("a uid")
    );

    // The old static pod is forgotten: the new mirror pod is not its, so it stays.
    writer.forget(&v1).await;
    assert!(fake.pod("kube-system", "etcd-node-a").is_some());
    // The new one is removed from the node: its mirror pod goes.
    writer.forget(&v2).await;
    assert!(fake.pod("kube-system", "etcd-node-a").is_none());
}

#[tokio::test]
async fn status_writer_leaves_a_pod_that_is_not_a_mirror_pod_alone() {
    init_logging();
    let fake = FakeApiServer::start().await;
    let stranger = fake.add_pod(test_pod("kube-system", "etcd-node-a", NODE));
    let writer = writer(&fake);
    match write(
        &writer,
        &static_pod("static-uid-1", "hash-1", "etcd:1"),
        &running_status(),
    )
    .await
    {
        Err(WriteError::Permanent { message, .. }) => {
            assert!(message.contains("not a mirror pod"), "{message}")
        }
        other => panic!("expected a permanent error, got {other:?}"),
    }
    let still = fake.pod("kube-system", "etcd-node-a").expect("still there");
    assert_eq!(still.metadata.uid, stranger.metadata.uid);
    assert!(fake.patches().is_empty());
    // Without a Node object the mirror pod of another static pod is still created,
    // without an owner reference.
    let mut other = static_pod("static-uid-9", "hash-9", "etcd:1");
    other.metadata.name = Some("other".into());
    write(&writer, &other, &running_status())
        .await
        .expect("written");
    let mirror = fake.pod("kube-system", "other").expect("a mirror pod");
    assert_eq!(mirror.metadata.owner_references, None);
}

#[tokio::test]
async fn status_writer_recovers_a_mirror_pod_write_after_an_outage() {
    init_logging();
    let fake = FakeApiServer::start().await;
    fake.add_node(NODE);
    let writer = writer(&fake);
    let pod = static_pod("static-uid-1", "hash-1", "etcd:1");
    fake.set_available(false);
    assert!(matches!(
        write(&writer, &pod, &running_status()).await,
        Err(WriteError::Retryable { .. })
    ));
    assert!(fake.pods().is_empty());
    fake.set_available(true);
    write(&writer, &pod, &running_status())
        .await
        .expect("written after recovery");
    assert_eq!(
        fake.status_of("kube-system", "etcd-node-a")
            .and_then(|s| s.phase)
            .as_deref(),
        Some("Running")
    );
}

/// The status manager over the API writer: the API server goes away while the
/// pod's status changes three times; when it returns, the newest status is written
/// and nothing is lost (the "API going away and coming back").
#[tokio::test]
async fn status_manager_writes_the_newest_status_after_an_outage() {
    use evpleg_core::ids::PodUid;
    use evpleg_kubelet::status::manager::StatusManager;
    use std::sync::Arc;

    init_logging();
    let fake = FakeApiServer::start().await;
    let pod = Arc::new(from_api(fake.add_pod(test_pod("default", "web", NODE))));
    let uid = PodUid::parse(pod.metadata.uid.as_deref().expect("a uid")).expect("a valid uid");
    let manager = Arc::new(StatusManager::new());
    let shutdown = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(manager.clone().run(writer(&fake), shutdown.clone()));

    let phase = |p: &str| PodStatus {
        phase: Some(p.into()),
        ..PodStatus::default()
    };
    manager.set_pod_status(&uid, pod.clone(), phase("Pending"));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while fake
        .status_of("default", "web")
        .and_then(|s| s.phase)
        .as_deref()
        != Some("Pending")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the first status was not written"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    fake.set_available(false);
    // Only the last is terminal: a terminal phase is final.
    manager.set_pod_status(&uid, pod.clone(), phase("Running"));
    manager.set_pod_status(
        &uid,
        pod.clone(),
        PodStatus {
            pod_ip: Some("10.0.0.7".into()),
            ..phase("Running")
        },
    );
    manager.set_pod_status(&uid, pod.clone(), failed_status());
    // Retried while away (back-off from 100 ms), nothing written.
    while manager.stats().retries < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "no retries while the API was away"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        fake.status_of("default", "web")
            .and_then(|s| s.phase)
            .as_deref(),
        Some("Pending")
    );
    assert!(!manager.all_written());

    fake.set_available(true);
    while !manager.all_written() {
        assert!(
            std::time::Instant::now() < deadline,
            "the newest status was not written after the outage"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        fake.status_of("default", "web")
            .and_then(|s| s.phase)
            .as_deref(),
        Some("Failed")
    );
    shutdown.cancel();
    task.await.expect("manager task");
}
