//! The node's admission end to end (issue #14, the kubelet's
//! `lifecycle/predicate.go`): the whole agent against the real containerd and
//! the real kube-apiserver (the agent as `system:node:e2e`, under the Node
//! authorizer and NodeRestriction), the node's labels, taints and pod
//! capacity from flags; pods from the API are rejected with the kubelet's
//! reason and message (Failed, written to the API), a static pod is exempt
//! from taints; the Node registered, its Lease renewed, its conditions
//! following the runtime. Privileged: skipped with a reason without
//! root/BTF/the eBPF object or the control plane's binaries, a failure under
//! `CI=true`.

use evpleg_tests::e2e::*;
use evpleg_tests::privileged;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;

/// Whether an end-to-end test against the real API server can run here.
fn real(test: &str) -> bool {
    privileged(test) && evpleg_tests::control_plane::available(test)
}

/// Waits until this node's Node object satisfies `check`; returns it.
async fn wait_node(e: &E2e, what: &str, check: impl Fn(Option<&Node>) -> bool) -> Option<Node> {
    wait_object(&Api::<Node>::all(e.kube().await), NODE, what, check).await
}

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
// the node's labels -> NodeAffinity; more ephemeral storage than the node's
// -> OutOfephemeral-storage; one pod more than --max-pods -> OutOfpods; a
// static pod runs whatever the taints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_checks_taints_selectors_and_pod_capacity() {
    if !real("admission_checks_taints_selectors_and_pod_capacity") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = E2e::start_with_control_plane(
        "node_admission",
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
    e.create_pod(&api_pod("intolerant", "Always", "exec sleep 600"))
        .await;
    assert_eq!(
        rejected(&e, "intolerant").await,
        (
            "TaintToleration".to_owned(),
            "Pod was rejected: Predicate TaintToleration failed: node(s) had taints that the pod didn't tolerate".to_owned()
        )
    );
    e.create_pod(&tolerant("elsewhere", Some("b"))).await;
    assert_eq!(
        rejected(&e, "elsewhere").await,
        (
            "NodeAffinity".to_owned(),
            "Pod was rejected: Predicate NodeAffinity failed: node(s) didn't match Pod's node affinity/selector".to_owned()
        )
    );
    // More ephemeral storage than the filesystem of --root-dir holds.
    let mut hungry = tolerant("hungry", Some("a"));
    hungry.spec.as_mut().expect("spec").containers[0].resources = Some(
        serde_json::from_value(serde_json::json!({"requests": {"ephemeral-storage": "1Pi"}}))
            .expect("resources"),
    );
    e.create_pod(&hungry).await;
    let (reason, message) = rejected(&e, "hungry").await;
    assert_eq!(reason, "OutOfephemeral-storage");
    assert!(
        message.starts_with("Pod was rejected: Node didn't have enough resource: ephemeral-storage, requested: 1125899906842624, used: 0, capacity: "),
        "{message}"
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
        e.create_pod(&tolerant(name, Some("a"))).await;
        e.wait_api(name, "Running", |p| phase(p) == "Running").await;
    }
    e.create_pod(&tolerant("fourth", None)).await;
    assert_eq!(
        rejected(&e, "fourth").await,
        (
            "OutOfpods".to_owned(),
            "Pod was rejected: Node didn't have enough resource: pods, requested: 1, used: 3, capacity: 3".to_owned()
        )
    );
    // A second static pod is critical: not refused for the pod it lacks,
    // but one of the API pods (not critical, both best-effort: which one is
    // the order of the pods the kubelet holds) is preempted for it, as the
    // kubelet's `CriticalPodAdmissionHandler` does: Failed, `Preempting`, a
    // DisruptionTarget condition, a Warning event; the first static pod
    // (critical too) is not a candidate.
    e.write(
        "critical.yaml",
        &manifest("critical", "Always", "exec sleep 600", ""),
    );
    e.wait_for("critical", "running", |p| {
        container(p, "app")["state"]["running"].is_object()
    })
    .await;
    let pods: Api<Pod> = Api::namespaced(e.kube().await, "default");
    let is_preempted = |p: &Pod| {
        phase(p) == "Failed"
            && p.status.as_ref().and_then(|s| s.reason.as_deref()) == Some("Preempting")
    };
    let preempted = wait_list(&pods, "an API pod preempted", |ps| {
        ps.iter().filter(|p| is_preempted(p)).count() == 1
    })
    .await;
    let victim = preempted
        .iter()
        .find(|p| is_preempted(p))
        .expect("the preempted pod");
    let name = victim.metadata.name.clone().unwrap_or_default();
    assert!(
        ["here", "third"].contains(&name.as_str()),
        "{name} preempted"
    );
    let status = victim.status.as_ref().expect("status");
    assert_eq!(
        status.message.as_deref(),
        Some("Preempted in order to admit critical pod")
    );
    let disruption = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "DisruptionTarget")
        .unwrap_or_else(|| panic!("no DisruptionTarget: {status:?}"));
    assert_eq!(
        (
            disruption.status.as_str(),
            disruption.reason.as_deref(),
            disruption.message.as_deref()
        ),
        (
            "True",
            Some("TerminationByKubelet"),
            Some("Pod was preempted by Kubelet to accommodate a critical pod.")
        )
    );
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(e.kube().await, "default");
    wait_list(&events, "the Preempting event", |evs| {
        evs.iter().any(|ev| {
            ev.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name.as_str())
                && ev.reason.as_deref() == Some("Preempting")
                && ev.type_.as_deref() == Some("Warning")
                && ev.note.as_deref() == Some("Preempted in order to admit critical pod")
        })
    })
    .await;
    e.finish().await;
}

// With --kubeconfig the node registers itself (as `system:node:e2e`, which
// NodeRestriction lets create only its own Node): its labels (the defaults
// and --node-labels) and taints at creation, its capacity and allocatable and
// conditions written (Ready), and its Lease in kube-node-lease renewed every
// quarter of its duration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_is_registered_with_a_renewed_lease_and_ready() {
    if !real("the_node_is_registered_with_a_renewed_lease_and_ready") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = E2e::start_with_control_plane(
        "node_status",
        &[
            "--node-labels",
            "zone=a",
            "--register-with-taints",
            "dedicated=db:NoSchedule",
            "--max-pods",
            "7",
            "--node-lease-duration-seconds",
            "1",
            "--node-status-update-frequency",
            "200ms",
        ],
    )
    .await;
    let condition = |n: &Node, kind: &str| {
        n.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == kind).cloned())
    };
    let node = wait_node(&e, "registered and Ready", |n| {
        n.and_then(|n| condition(n, "Ready"))
            .is_some_and(|c| c.status == "True")
    })
    .await
    .expect("the node");
    let labels = node.metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels["kubernetes.io/hostname"], NODE);
    assert_eq!(labels["kubernetes.io/os"], "linux");
    assert!(labels.contains_key("kubernetes.io/arch"), "{labels:?}");
    assert_eq!(
        labels.get("zone").map(String::as_str),
        Some("a"),
        "{labels:?}"
    );
    let taints = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    assert!(
        taints.iter().any(|t| t.key == "dedicated"
            && t.value.as_deref() == Some("db")
            && t.effect == "NoSchedule"),
        "{taints:?}"
    );
    let status = node.status.clone().expect("status");
    assert_eq!(status.capacity.expect("capacity")["pods"].0, "7");
    assert!(
        status
            .allocatable
            .expect("allocatable")
            .contains_key("memory")
    );
    let ready = condition(&node, "Ready").expect("Ready");
    assert_eq!(ready.reason.as_deref(), Some("KubeletReady"));
    for kind in ["MemoryPressure", "DiskPressure", "PIDPressure"] {
        assert!(condition(&node, kind).is_some(), "{kind}: {node:?}");
    }
    // The lease: held by the node, renewed (its renewTime moves).
    let leases: Api<Lease> = Api::namespaced(e.kube().await, "kube-node-lease");
    let renew = |l: &Lease| l.spec.as_ref().and_then(|s| s.renew_time.clone());
    let first = wait_object(&leases, NODE, "the lease", |l| {
        l.is_some_and(|l| renew(l).is_some())
    })
    .await
    .expect("the lease");
    let spec = first.spec.clone().expect("spec");
    assert_eq!(spec.holder_identity.as_deref(), Some(NODE));
    assert_eq!(spec.lease_duration_seconds, Some(1));
    let first_renew = renew(&first);
    wait_object(&leases, NODE, "renewed", |l| {
        l.is_some_and(|l| renew(l) != first_renew)
    })
    .await;
    let refused = e.cp().refused(&format!("system:node:{NODE}"));
    assert!(refused.is_empty(), "refused: {refused:#?}");
    e.finish().await;
}

// The node's Ready condition follows the runtime and the PLEG as the
// kubelet's: with containerd stopped, the runtime's Status goes unanswered
// ("container runtime is down") and relists fail until the PLEG is unhealthy
// ("PLEG is not healthy: pleg was last seen active ..."): Ready False
// `KubeletNotReady` naming both; with containerd back, Ready True again.
// The periods are shortened by flags (the kubelet's are 5 s and 3 min).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_turns_false_while_the_runtime_is_down_and_true_again() {
    if !real("ready_turns_false_while_the_runtime_is_down_and_true_again") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let mut e = E2e::start_with_control_plane(
        "node_ready",
        &[
            "--node-status-update-frequency",
            "200ms",
            "--runtime-status-period",
            "200ms",
            "--pleg-health-threshold",
            "2s",
            "--relist-period",
            "500ms",
        ],
    )
    .await;
    let ready = |n: Option<&Node>| {
        n.and_then(|n| n.status.as_ref())
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == "Ready").cloned())
    };
    wait_node(&e, "Ready", |n| {
        ready(n).is_some_and(|c| c.status == "True")
    })
    .await;
    e.containerd.as_mut().expect("containerd").stop();
    wait_node(&e, "not Ready: runtime down and PLEG unhealthy", |n| {
        ready(n).is_some_and(|c| {
            let m = c.message.clone().unwrap_or_default();
            c.status == "False"
                && c.reason.as_deref() == Some("KubeletNotReady")
                && m.contains("container runtime is down")
                && m.contains("PLEG is not healthy: pleg was last seen active")
        })
    })
    .await;
    e.containerd
        .as_mut()
        .expect("containerd")
        .restart()
        .unwrap_or_else(|err| panic!("restart containerd: {err}"));
    wait_node(&e, "Ready again", |n| {
        ready(n).is_some_and(|c| c.status == "True" && c.reason.as_deref() == Some("KubeletReady"))
    })
    .await;
    e.finish().await;
}

// Issue #27 (the kubelet's `HandlePodAdditions` and `rejectPod`, and its
// sysctl allowlist): two API pods asking for the same host port, there
// before the agent starts, come in its first list in name order, the newer
// one first; admission takes them oldest first, so the older runs and the
// newer is rejected (NodePorts), each rejection with a Warning event of its
// reason and message. A pod setting a sysctl outside the safe set (and no
// --allowed-unsafe-sysctls) is rejected SysctlForbidden.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_takes_pods_oldest_first_warns_and_forbids_unsafe_sysctls() {
    if !real("admission_takes_pods_oldest_first_warns_and_forbids_unsafe_sysctls") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let cp = evpleg_tests::control_plane::ControlPlane::shared().await;
    cp.ensure_namespace("default").await;
    let pods: Api<Pod> = Api::namespaced(cp.admin().await, "default");
    let with_port = |name: &str| {
        let mut p = api_pod(name, "Always", "exec sleep 600");
        p.spec.as_mut().expect("spec").containers[0].ports = Some(vec![
            serde_json::from_value(serde_json::json!({"containerPort": 18127})).expect("port"),
        ]);
        p
    };
    let create = |p: Pod| {
        let pods = pods.clone();
        async move {
            pods.create(&Default::default(), &p)
                .await
                .unwrap_or_else(|e| panic!("create {:?}: {e}", p.metadata.name))
        }
    };
    let older = create(with_port("z-older")).await;
    // Creation times have a resolution of a second: the newer pod is made in
    // a later second than the older one.
    let created = older
        .metadata
        .creation_timestamp
        .clone()
        .expect("created")
        .0;
    let deadline = std::time::Instant::now() + DEADLINE;
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64)
    };
    while now() <= created.as_second() {
        assert!(
            std::time::Instant::now() < deadline,
            "the clock did not move"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    create(with_port("a-newer")).await;
    let mut sysctl = api_pod("sysctl", "Always", "exec sleep 600");
    sysctl.spec.as_mut().expect("spec").security_context = Some(
        serde_json::from_value(
            serde_json::json!({"sysctls": [{"name": "kernel.shm_rmid_forced", "value": "1"},
                                           {"name": "kernel.msgmax", "value": "65536"}]}),
        )
        .expect("security context"),
    );
    create(sysctl).await;
    let e = E2e::start_with_control_plane("admission_order", &[]).await;
    e.wait_api("z-older", "Running", |p| phase(p) == "Running")
        .await;
    let ports =
        "Predicate NodePorts failed: node(s) didn't have free ports for the requested pod ports";
    assert_eq!(
        rejected(&e, "a-newer").await,
        ("NodePorts".to_owned(), format!("Pod was rejected: {ports}"))
    );
    let sysctl_message = "forbidden sysctl: \"kernel.msgmax\" not allowlisted";
    assert_eq!(
        rejected(&e, "sysctl").await,
        (
            "SysctlForbidden".to_owned(),
            format!("Pod was rejected: {sysctl_message}")
        )
    );
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(e.kube().await, "default");
    let warning =
        |ev: &k8s_openapi::api::events::v1::Event, pod: &str, reason: &str, note: &str| {
            ev.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(pod)
                && ev.reason.as_deref() == Some(reason)
                && ev.type_.as_deref() == Some("Warning")
                && ev.note.as_deref() == Some(note)
        };
    wait_list(&events, "the rejections' Warning events", |evs| {
        evs.iter()
            .any(|ev| warning(ev, "a-newer", "NodePorts", ports))
            && evs
                .iter()
                .any(|ev| warning(ev, "sysctl", "SysctlForbidden", sysctl_message))
    })
    .await;
    // Gone for the other tests of this binary, which run on the same node.
    for name in ["z-older", "a-newer", "sysctl"] {
        pods.delete(name, &kube::api::DeleteParams::default().grace_period(0))
            .await
            .unwrap_or_else(|e| panic!("delete {name}: {e}"));
        e.wait_real("default", name, "deleted", |p| p.is_none())
            .await;
    }
    e.finish().await;
}
