//! The node's admission end to end (issue #14, the kubelet's
//! `lifecycle/predicate.go`): the whole agent against the real containerd and
//! the fake API server, the node's labels, taints and pod capacity from
//! flags; pods from the API are rejected with the kubelet's reason and
//! message (Failed, written to the API), a static pod is exempt from taints.
//! Privileged: skipped with a reason without root/BTF/the eBPF object, a
//! failure under `CI=true`.

use evpleg_tests::e2e::*;
use evpleg_tests::privileged;
use k8s_openapi::api::core::v1::Pod;

fn phase(p: &Pod) -> &str {
    p.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or_default()
}

/// An API pod tolerating the node's taint, with `selector` as nodeSelector.
fn tolerant(name: &str, selector: Option<&str>) -> Pod {
    let mut p = api_pod(name, "Always", "exec sleep 600");
    let spec = p.spec.as_mut().expect("spec");
    spec.tolerations = Some(vec![
        serde_json::from_value(
            serde_json::json!({"key": "dedicated", "operator": "Equal", "value": "db", "effect": "NoExecute"}),
        )
        .expect("toleration"),
    ]);
    spec.node_selector = selector.map(|s| [("zone".to_owned(), s.to_owned())].into());
    p
}

/// Waits for the API pod `name` to be rejected; its (reason, message).
async fn rejected(e: &E2e, name: &str) -> (String, String) {
    let p = e.wait_api(name, "rejected", |p| phase(p) == "Failed").await;
    let s = p.status.expect("status");
    (s.reason.unwrap_or_default(), s.message.unwrap_or_default())
}

// NoExecute taint not tolerated -> TaintToleration; nodeSelector not matching
// the node's labels -> NodeAffinity; one pod more than --max-pods ->
// OutOfpods; a static pod runs whatever the taints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_checks_taints_selectors_and_pod_capacity() {
    if !privileged("admission_checks_taints_selectors_and_pod_capacity") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = E2e::start_with(
        "node_admission",
        true,
        &[
            "--node-labels",
            "zone=a",
            "--register-with-taints",
            "dedicated=db:NoExecute",
            "--max-pods",
            "3",
        ],
    )
    .await;
    e.api()
        .add_pod(api_pod("intolerant", "Always", "exec sleep 600"));
    assert_eq!(
        rejected(&e, "intolerant").await,
        (
            "TaintToleration".to_owned(),
            "Pod was rejected: Predicate TaintToleration failed: node(s) had taints that the pod didn't tolerate".to_owned()
        )
    );
    e.api().add_pod(tolerant("elsewhere", Some("b")));
    assert_eq!(
        rejected(&e, "elsewhere").await,
        (
            "NodeAffinity".to_owned(),
            "Pod was rejected: Predicate NodeAffinity failed: node(s) didn't match Pod's node affinity/selector".to_owned()
        )
    );
    e.write(
        "static.yaml",
        &manifest("static", "Always", "exec sleep 600", ""),
    );
    e.wait_for("static", "running", |p| {
        container(p, "app")["state"]["running"].is_object()
    })
    .await;
    for name in ["here", "third"] {
        e.api().add_pod(tolerant(name, Some("a")));
        e.wait_api(name, "Running", |p| phase(p) == "Running").await;
    }
    e.api().add_pod(tolerant("fourth", None));
    assert_eq!(
        rejected(&e, "fourth").await,
        (
            "OutOfpods".to_owned(),
            "Pod was rejected: Node didn't have enough resource: pods, requested: 1, used: 3, capacity: 3".to_owned()
        )
    );
    e.finish().await;
}
