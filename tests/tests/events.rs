//! Pod events end to end (issue #13): the whole agent against the real
//! containerd; events read at the local endpoint
//! (`/pods/<namespace>/<name>/events`), in `evpleg describe pod`'s text, and,
//! with `--kubeconfig`, in the real kube-apiserver as `events.k8s.io/v1` Events.
//! Privileged: skipped with a reason without root/BTF/the eBPF object.

use std::time::{Duration, Instant};

use evpleg_tests::e2e::*;
use evpleg_tests::e2e_test;
use serde_json::Value;

/// The pod's events at the agent's local endpoint.
async fn local_events(e: &E2e, name: &str) -> Vec<Value> {
    let path = format!("/pods/default/{name}-{NODE}/events");
    let response = http_get(e.agent().addr, &path).await;
    assert!(response.starts_with("HTTP/1.1 200"), "{path}: {response}");
    let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
    let list: Value = serde_json::from_str(body).unwrap_or_else(|err| panic!("{body}: {err}"));
    assert_eq!(list["kind"], "EventList");
    list["items"].as_array().cloned().unwrap_or_default()
}

/// Waits (polling every 50 ms, bounded) until the pod's local events satisfy
/// `done`; returns them.
async fn wait_events(
    e: &E2e,
    name: &str,
    what: &str,
    done: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let events = local_events(e, name).await;
        if done(&events) {
            return events;
        }
        assert!(
            Instant::now() < deadline,
            "{name}: {what} not within {DEADLINE:?}: {events:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn with_reason<'a>(events: &'a [Value], reason: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["reason"] == reason).collect()
}

fn count(e: &Value) -> i64 {
    e["count"].as_i64().unwrap_or(0)
}

/// `describe pod`'s text with each line's runs of blanks made one space.
async fn described(e: &E2e, pod: &str) -> (String, Vec<String>) {
    let server = format!("http://{}", e.agent().addr);
    let text = evpleg::describe::describe_pod(&server, pod, None)
        .await
        .unwrap_or_else(|err| panic!("describe {pod}: {err}"));
    let lines = text
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    (text, lines)
}

// A crash loop: Created and Started counted, not repeated; one BackOff entry
// whose count grows; the kernel's ContainerDied with the exit code; all of it
// in describe's events table.
e2e_test!(a_crash_loop_s_events_are_aggregated_and_described, |e| {
    Box::pin(async move {
        e.write("crasher.yaml", &manifest("crasher", "Always", "exit 2", ""));
        // A kernel death's event is recorded once the runtime reports the
        // death too (or 5 s after it, without the lead): under load that can
        // come after the third BackOff (the full test command once read the
        // events before any ContainerDied).
        let events = wait_events(
            e,
            "crasher",
            "BackOff counted 3 times, a ContainerDied",
            |ev| {
                with_reason(ev, "BackOff").iter().any(|b| count(b) >= 3)
                    && !with_reason(ev, "ContainerDied").is_empty()
            },
        )
        .await;
        let pod = e.pod("crasher").expect("the pod's status");
        let uid = pod["metadata"]["uid"].as_str().expect("uid").to_owned();
        let back_off = with_reason(&events, "BackOff");
        assert_eq!(
            back_off.len(),
            1,
            "aggregated into one entry: {back_off:#?}"
        );
        let b = back_off[0];
        assert_eq!(b["type"], "Warning");
        assert_eq!(
            b["message"],
            format!(
                "Back-off restarting failed container app in pod crasher-{NODE}_default({uid})"
            )
        );
        assert_eq!(b["involvedObject"]["fieldPath"], "spec.containers{app}");
        assert_eq!(b["involvedObject"]["uid"], uid.as_str());
        assert_eq!(b["source"]["component"], "kubelet");
        // Second precision (core/v1 Time): the last is not before the first.
        assert!(
            b["lastTimestamp"].as_str() >= b["firstTimestamp"].as_str(),
            "{b:#}"
        );
        for (reason, message) in [
            ("Created", "Container created"),
            ("Started", "Container started"),
        ] {
            let found = with_reason(&events, reason);
            assert_eq!(found.len(), 1, "{reason}: {found:#?}");
            assert_eq!(found[0]["message"], message);
            assert!(count(found[0]) >= 2, "{reason} counted: {:#}", found[0]);
        }
        let pulled = with_reason(&events, "Pulled");
        assert_eq!(
            pulled[0]["message"],
            format!(
                "Container image \"{IMAGE}\" already present on machine and can be accessed by the pod"
            )
        );
        // The kernel PLEG's own: each death with its exit code and how long
        // before the runtime reported it.
        let died = with_reason(&events, "ContainerDied");
        assert!(!died.is_empty(), "{events:#?}");
        for d in &died {
            assert_eq!(d["source"]["component"], "kernel");
            assert_eq!(d["type"], "Warning");
            let message = d["message"].as_str().unwrap_or_default();
            let lead: f64 = message
                .strip_prefix("Container app died (exit code 2), seen by the kernel ")
                .and_then(|m| m.strip_suffix(" ms before the runtime reported it"))
                .and_then(|ms| ms.parse().ok())
                .unwrap_or_else(|| panic!("{message}"));
            assert!((0.0..5_000.0).contains(&lead), "{message}");
        }
        // describe: the pod and the same events, by name and by UID.
        let (text, lines) = described(e, &format!("crasher-{NODE}")).await;
        assert!(lines.contains(&format!("UID: {uid}")), "{text}");
        assert!(
            lines.iter().any(|l| l.starts_with("Restart Count: ")),
            "{text}"
        );
        let row = lines
            .iter()
            .find(|l| l.starts_with("Warning BackOff "))
            .unwrap_or_else(|| panic!("no BackOff row: {text}"));
        assert!(
            row.contains(" (x")
                && row.contains(" kubelet Back-off restarting failed container app"),
            "{row}"
        );
        assert!(
            lines.iter().any(|l| l.starts_with("Warning ContainerDied ")
                && l.contains(" kernel Container app died")),
            "{text}"
        );
        let (by_uid, lines) = described(e, &uid).await;
        assert!(lines.contains(&format!("Name: crasher-{NODE}")), "{by_uid}");
    })
});

// An image that does not exist: Pulling, Failed with the pull error, Failed
// "Error: ErrImagePull", then BackOff "Back-off pulling image" and Failed
// "Error: ImagePullBackOff"; at the endpoint and in describe.
e2e_test!(an_absent_image_is_err_image_pull_then_back_off, |e| {
    Box::pin(async move {
        let image = "localhost/evpleg-absent:1";
        e.write(
            "absent.yaml",
            &manifest("absent", "Always", "sleep 600", "").replace(IMAGE, image),
        );
        let events = wait_events(e, "absent", "ImagePullBackOff", |ev| {
            ev.iter().any(|x| x["message"] == "Error: ImagePullBackOff")
        })
        .await;
        let messages: Vec<(&str, &str, &str)> = events
            .iter()
            .map(|x| {
                (
                    x["type"].as_str().unwrap_or_default(),
                    x["reason"].as_str().unwrap_or_default(),
                    x["message"].as_str().unwrap_or_default(),
                )
            })
            .collect();
        let has = |kind: &str, reason: &str, prefix: &str| {
            messages
                .iter()
                .any(|(k, r, m)| *k == kind && *r == reason && m.starts_with(prefix))
        };
        assert!(
            has("Normal", "Pulling", &format!("Pulling image \"{image}\"")),
            "{messages:#?}"
        );
        assert!(
            has(
                "Warning",
                "Failed",
                &format!("Failed to pull image \"{image}\": ")
            ),
            "{messages:#?}"
        );
        assert!(
            has("Warning", "Failed", "Error: ErrImagePull"),
            "{messages:#?}"
        );
        assert!(
            has(
                "Normal",
                "BackOff",
                &format!("Back-off pulling image \"{image}\"")
            ),
            "{messages:#?}"
        );
        assert!(
            has("Warning", "Failed", "Error: ImagePullBackOff"),
            "{messages:#?}"
        );
        assert!(
            !messages
                .iter()
                .any(|(_, r, _)| *r == "Created" || *r == "Started"),
            "nothing created without the image: {messages:#?}"
        );
        let (text, lines) = described(e, &format!("absent-{NODE}")).await;
        for prefix in [
            "Warning Failed ".to_owned(),
            "Normal BackOff ".to_owned(),
            "Normal Pulling ".to_owned(),
        ] {
            assert!(
                lines.iter().any(|l| l.starts_with(&prefix)),
                "{prefix}: {text}"
            );
        }
        assert!(
            lines
                .iter()
                .any(|l| l.ends_with("kubelet Error: ErrImagePull")),
            "{text}"
        );
    })
});

// With --kubeconfig: the same events reach the real API server as
// events.k8s.io/v1 Events, written as `system:node:e2e`, a repetition as the
// event's series.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_written_to_the_api_server_with_kubeconfig() {
    let name = "events_are_written_to_the_api_server_with_kubeconfig";
    if !evpleg_tests::privileged(name) || !evpleg_tests::control_plane::available(name) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = E2e::start_with_control_plane("events_api", &[]).await;
    let crasher = e.create_pod(&api_pod("crasher", "Always", "exit 2")).await;
    let mut absent = api_pod("absent", "Always", "sleep 600");
    if let Some(spec) = absent.spec.as_mut() {
        spec.containers[0].image = Some("localhost/evpleg-absent:2".into());
    }
    e.create_pod(&absent).await;
    let uid = crasher.metadata.uid.clone().expect("uid");
    let about = |ev: &k8s_openapi::api::events::v1::Event, pod: &str, reason: &str| {
        ev.reason.as_deref() == Some(reason)
            && ev.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(pod)
    };
    let api: kube::Api<k8s_openapi::api::events::v1::Event> =
        kube::Api::namespaced(e.kube().await, "default");
    let events = wait_list(
        &api,
        "crasher's BackOff as a series, absent's ErrImagePull",
        |evs| {
            evs.iter().any(|ev| {
                about(ev, "crasher", "BackOff") && ev.series.as_ref().is_some_and(|s| s.count >= 2)
            }) && evs.iter().any(|ev| {
                about(ev, "absent", "Failed") && ev.note.as_deref() == Some("Error: ErrImagePull")
            })
        },
    )
    .await;
    let back_off = events
        .iter()
        .find(|ev| about(ev, "crasher", "BackOff"))
        .expect("BackOff");
    assert_eq!(back_off.type_.as_deref(), Some("Warning"));
    assert_eq!(back_off.reporting_controller.as_deref(), Some("kubelet"));
    assert_eq!(back_off.reporting_instance.as_deref(), Some(NODE));
    assert_eq!(back_off.metadata.namespace.as_deref(), Some("default"));
    let regarding = back_off.regarding.as_ref().expect("regarding");
    assert_eq!(regarding.uid.as_deref(), Some(uid.as_str()));
    assert_eq!(
        regarding.field_path.as_deref(),
        Some("spec.containers{app}")
    );
    let series = back_off.series.as_ref().expect("series");
    // No deprecated core/v1 field: the strict events.k8s.io/v1 validation
    // refuses them (the API server answers an empty deprecatedSource).
    assert_eq!(back_off.deprecated_count, None);
    assert_eq!(
        back_off.deprecated_source.clone().unwrap_or_default(),
        k8s_openapi::api::core::v1::EventSource::default()
    );
    assert!(
        series.last_observed_time.0 > back_off.event_time.as_ref().expect("eventTime").0,
        "{back_off:#?}"
    );
    // One object per event: no two BackOff events for the crasher.
    assert_eq!(
        events
            .iter()
            .filter(|ev| about(ev, "crasher", "BackOff"))
            .count(),
        1
    );
    for reason in ["Created", "Started", "Pulled"] {
        assert!(
            events.iter().any(|ev| about(ev, "crasher", reason)),
            "{reason}: {events:#?}"
        );
    }
    // The requests, as the node: created with POST, repetitions merge-patched;
    // none refused.
    let user = format!("system:node:{NODE}");
    let requests: Vec<_> = e
        .cp()
        .audit()
        .into_iter()
        .filter(|r| r.user == user)
        .collect();
    let path = "/apis/events.k8s.io/v1/namespaces/default/events";
    assert!(
        requests
            .iter()
            .any(|r| r.verb == "create" && r.path() == path && r.code == 201)
    );
    assert!(
        requests
            .iter()
            .any(|r| r.verb == "patch" && r.path().starts_with(path) && r.code == 200)
    );
    let refused = e.cp().refused(&user);
    assert!(refused.is_empty(), "refused: {refused:#?}");
    e.finish().await;
}

/// Issue #31's FailedKillPod: containerd's StopPodSandbox first stops the
/// sandbox's containers its store holds running, and fails (`ttrpc: closed`)
/// when one's task goes away under the call, which the kernel PLEG's early
/// sighting of a death makes likely. The interceptor fails the first
/// StopPodSandbox so; the agent stops the sandbox again once containerd lists
/// none of its containers running, and records no FailedKillPod, as the
/// kubelet records none for a pod whose containers ended by themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_stop_that_meets_a_container_s_teardown_is_not_a_failed_kill() {
    use evpleg_tests::cri_interceptor::CriInterceptor;
    let name = "a_sandbox_stop_that_meets_a_container_s_teardown_is_not_a_failed_kill";
    if !evpleg_tests::privileged(name) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let containerd = E2e::containerd();
    let interceptor = CriInterceptor::start(
        containerd.socket(),
        containerd.base().join("agent-cri.sock"),
    )
    .expect("interceptor");
    interceptor.fail_next("StopPodSandbox", 1);
    let e = E2e::start_via(containerd, &interceptor.endpoint(), "stop-sandbox", &[]).await;
    e.write("once.yaml", &manifest("once", "Never", "exit 0", ""));
    let pod = e
        .wait_for("once", "phase Succeeded", |p| {
            p["status"]["phase"] == "Succeeded"
        })
        .await;
    let uid = pod["metadata"]["uid"].as_str().expect("uid").to_owned();
    let deadline = Instant::now() + DEADLINE;
    loop {
        let sandboxes = e.sandboxes(&uid).await;
        let stops = interceptor.calls().get("StopPodSandbox").copied();
        if stops >= Some(2)
            && !sandboxes.is_empty()
            && sandboxes
                .iter()
                .all(|s| s.state == evpleg_cri_api::v1::PodSandboxState::SandboxNotready as i32)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the sandbox not stopped again within {DEADLINE:?}: {stops:?} StopPodSandbox, {sandboxes:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let events = local_events(&e, "once").await;
    assert!(
        with_reason(&events, "FailedKillPod").is_empty(),
        "a FailedKillPod: {events:#?}"
    );
    assert_eq!(
        interceptor.calls().get("StopPodSandbox"),
        Some(&2),
        "the failed stop, then one more"
    );
    e.finish().await;
}
