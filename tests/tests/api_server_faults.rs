//! The API server paths (the pod source and the status writer) where a test
//! needs a fault the real API server cannot give on demand: an outage, a
//! dropped watch, a compacted resourceVersion, a bookmark now; and the fake
//! API server's own wire format. Against the in-process fake
//! (`evpleg_tests::fake_apiserver`); everything else runs against the real
//! kube-apiserver in `api_server.rs`. No root needed.
//!
//! Every wait is bounded by [`WAIT`]; nothing sleeps to synchronise: the tests wait
//! for the next update from the source, or for the fake to have seen a request.

use std::time::Duration;

use evpleg_kubelet::source::api::ApiSource;
use evpleg_kubelet::source::{Op, PodUpdate};
use evpleg_kubelet::status::api::ApiStatusWriter;
use evpleg_kubelet::status::{StatusWriter, WriteError};
use evpleg_tests::api_fixtures::{
    WAIT, assert_update, failed_status, fast_backoff, from_api, init_logging, labelled, next,
    running_status, static_pod,
};
use evpleg_tests::fake_apiserver::{FakeApiServer, test_pod};
use k8s_openapi::api::core::v1::{Pod, PodStatus};
use kube::Api;
use kube::api::DeleteParams;
use serde_json::Value;
use tokio::sync::mpsc;

const NODE: &str = "node-a";
const OTHER_NODE: &str = "node-b";

/// Runs the API source for `NODE` against the fake; it stops when the receiver
/// is dropped.
fn start_source(fake: &FakeApiServer) -> mpsc::Receiver<PodUpdate> {
    let (tx, rx) = mpsc::channel(64);
    let source = ApiSource::new(fake.kube_client(), NODE).with_backoff(fast_backoff());
    tokio::spawn(source.run(tx));
    rx
}

fn list_requests(fake: &FakeApiServer) -> usize {
    fake.requests()
        .iter()
        .filter(|r| r.method == "GET" && r.path() == "/api/v1/pods" && r.query("watch").is_none())
        .count()
}

// ----- the API source ------------------------------------------------------------

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

fn writer(fake: &FakeApiServer) -> ApiStatusWriter {
    ApiStatusWriter::new(fake.kube_client(), NODE).with_request_timeout(WAIT)
}

async fn write(writer: &ApiStatusWriter, pod: &Pod, status: &PodStatus) -> Result<(), WriteError> {
    tokio::time::timeout(WAIT * 2, writer.write(pod, status))
        .await
        .expect("the write returns in time")
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

#[tokio::test]
async fn status_writer_recovers_a_mirror_pod_write_after_an_outage() {
    init_logging();
    let fake = FakeApiServer::start().await;
    fake.add_node(NODE);
    let writer = writer(&fake);
    let pod = static_pod(
        "kube-system",
        "etcd-node-a",
        NODE,
        "static-uid-1",
        "hash-1",
        "etcd:1",
    );
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
