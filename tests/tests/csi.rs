//! CSI volumes end to end (issue #14): the whole agent against the real
//! containerd and the test CSI node driver (`evpleg-csi-driver`, a process of
//! its own, tests/src/csi_driver/), which registers through the agent's
//! `<root-dir>/plugins_registry/` and bind-mounts a directory per volume.
//! An inline ephemeral volume and a PVC-backed volume (PV `spec.csi`) are
//! staged (the PV only), published, visible in the container, and
//! unpublished and unstaged when the pod is deleted, their directories gone;
//! a driver error is FailedMount with the pod ContainerCreating, retried
//! until the driver recovers. Against the real kube-apiserver (issue #30):
//! the claims and PVs created as the admin, bound as the PV controller
//! would bind them, read by the agent through the Node authorizer.
//! Privileged: skipped with a reason without root/BTF/the eBPF object, a
//! failure under `CI=true`.

use evpleg_tests::csi_driver::fixtures::*;
use evpleg_tests::csi_driver::{Call, CsiDriverProcess, DRIVER_NAME, mounts};
use evpleg_tests::e2e::*;
use serde_json::{Value, json};

const DRIVER_BIN: &str = env!("CARGO_BIN_EXE_evpleg-csi-driver");

/// The harness with the real API server, the agent as `system:node:`: it
/// reads the claims and PVs of its pods through the Node authorizer.
/// Callers check [`evpleg_tests::control_plane::available`] first.
async fn start(name: &str) -> E2e {
    E2e::start_with_control_plane(name, &[]).await
}

fn start_driver(e: &E2e, extra: &[&str]) -> CsiDriverProcess {
    start_named(e, DRIVER_NAME, extra)
}

fn start_named(e: &E2e, name: &str, extra: &[&str]) -> CsiDriverProcess {
    let base = e.args.root_dir.parent().expect("the harness's base dir");
    CsiDriverProcess::start(
        DRIVER_BIN,
        name,
        base,
        &e.args.root_dir.join("plugins_registry"),
        extra,
    )
    .unwrap_or_else(|err| panic!("CSI driver: {err}"))
}

// The driver registers through the plugin socket directory: GetInfo, then
// NodeGetInfo, then NotifyRegistrationStatus(registered); a restarted agent
// registers it again from its start scan; a stopped driver is deregistered;
// a driver whose only version is 2.x is told why it was refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_registers_through_the_plugin_socket_directory() {
    let name = "a_driver_registers_through_the_plugin_socket_directory";
    if !evpleg_tests::privileged(name) || !evpleg_tests::control_plane::available(name) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let mut e = start(name).await;
    let mut d = start_driver(&e, &[]);
    let calls = wait_calls(&d, "registered", registered).await;
    let order: Vec<&str> = calls.iter().map(|c| c.method.as_str()).collect();
    assert_eq!(
        order[..3],
        ["GetInfo", "NodeGetInfo", "NotifyRegistrationStatus"],
        "{calls:#?}"
    );
    e.wait_until("the driver in the agent's registry", || {
        e.agent().csi_drivers.names() == [DRIVER_NAME]
    })
    .await;
    let driver = e.agent().csi_drivers.get(DRIVER_NAME).expect("registered");
    assert_eq!(driver.endpoint, d.csi_socket);
    assert_eq!(driver.node_id, "e2e");
    let gauge = |state: &str| {
        format!(
            "evpleg_plugin_manager_total_plugins{{socket_path=\"{}\",state=\"{state}\"}} 1\n",
            d.registration_socket.display()
        )
    };
    wait_metrics(&e, "the plugin in both states of the world", |m| {
        ["desired_state_of_world", "actual_state_of_world"]
            .iter()
            .all(|state| m.contains(&gauge(state)))
    })
    .await;
    // A restarted agent finds the socket already there (its start scan) and
    // registers the driver again.
    e.restart_agent().await;
    let calls = wait_calls(&d, "registered again after the restart", |c| {
        c.iter()
            .filter(|c| c.method == "NotifyRegistrationStatus" && c.registered == Some(true))
            .count()
            == 2
    })
    .await;
    assert_eq!(
        calls.iter().filter(|c| c.method == "GetInfo").count(),
        2,
        "{calls:#?}"
    );
    assert_eq!(e.agent().csi_drivers.names(), [DRIVER_NAME]);
    d.stop();
    e.wait_until("the stopped driver deregistered", || {
        e.agent().csi_drivers.names().is_empty()
    })
    .await;
    wait_metrics(&e, "no plugin left", |m| {
        !m.contains("evpleg_plugin_manager_total_plugins{")
    })
    .await;

    let refused = start_named(&e, "csi.evpleg.v2", &["--versions", "2.0.0"]);
    let calls = wait_calls(&refused, "told it was refused", |c| {
        c.iter()
            .any(|c| c.method == "NotifyRegistrationStatus" && c.registered == Some(false))
    })
    .await;
    let told: Vec<&Call> = calls
        .iter()
        .filter(|c| c.method == "NotifyRegistrationStatus")
        .collect();
    assert!(
        told.iter().all(|c| c.registered == Some(false)),
        "{calls:#?}"
    );
    let told = told[0];
    let error = told.error.as_deref().unwrap_or_default();
    assert!(
        error.contains("none of the versions specified [\"2.0.0\"] are supported"),
        "{error}"
    );
    assert!(
        !calls.iter().any(|c| c.method == "NodeGetInfo"),
        "{calls:#?}"
    );
    assert!(e.agent().csi_drivers.names().is_empty());
    e.finish().await;
}

// An inline ephemeral volume, a read-only one and a PVC-backed one: the PV
// is staged at the kubelet's staging path before it is published with that
// path; the inline ones are published unstaged with the ephemeral and pod
// info keys; the container sees them (the read-only one refuses writes);
// deleting the pod unpublishes everything, then unstages the PV, and the
// mounts and directories go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_and_pvc_volumes_are_staged_published_visible_and_undone() {
    let name = "inline_and_pvc_volumes_are_staged_published_visible_and_undone";
    if !evpleg_tests::privileged(name) || !evpleg_tests::control_plane::available(name) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = start(name).await;
    let d = start_driver(&e, &[]);
    wait_calls(&d, "registered", registered).await;
    create_claim(&e, "vols").await;
    let pod = e.create_pod(&csi_pod("vols")).await;
    let pod_uid = uid(&pod);
    e.wait_api("vols", "Running", running).await;
    let p = paths(&e.args.root_dir, &pod_uid);

    let calls = d.calls();
    let stage = position(&calls, |c| ok(c, "NodeStageVolume", PV_HANDLE)).expect("staged");
    assert_eq!(
        calls[stage].staging_target_path,
        p.staging.display().to_string()
    );
    assert_eq!(
        calls[stage].volume_context.get("kind").map(String::as_str),
        Some("persistent")
    );
    let publish = position(&calls, |c| ok(c, "NodePublishVolume", PV_HANDLE)).expect("published");
    assert!(stage < publish, "staged before published: {calls:#?}");
    let c = &calls[publish];
    assert_eq!(c.staging_target_path, p.staging.display().to_string());
    assert_eq!(c.target_path, p.pv_target.display().to_string());
    assert!(!c.readonly);
    assert_eq!(
        c.volume_context
            .get("csi.storage.k8s.io/ephemeral")
            .map(String::as_str),
        Some("false")
    );
    let inline = position(&calls, |c| ok(c, "NodePublishVolume", &p.inline_handle))
        .unwrap_or_else(|| panic!("inline published: {calls:#?}"));
    let c = &calls[inline];
    assert_eq!(
        c.staging_target_path, "",
        "ephemeral volumes are not staged"
    );
    assert_eq!(c.target_path, p.inline_target.display().to_string());
    for (k, v) in [
        ("csi.storage.k8s.io/ephemeral", "true"),
        ("csi.storage.k8s.io/pod.name", "vols"),
        ("csi.storage.k8s.io/pod.namespace", "default"),
        ("csi.storage.k8s.io/pod.uid", pod_uid.as_str()),
        ("size", "1Mi"),
    ] {
        assert_eq!(
            c.volume_context.get(k).map(String::as_str),
            Some(v),
            "{k}: {c:#?}"
        );
    }
    assert!(
        !calls
            .iter()
            .any(|c| c.method == "NodeStageVolume" && c.volume_id == p.inline_handle)
    );
    let ro = position(&calls, |c| ok(c, "NodePublishVolume", &p.ro_handle)).expect("ro published");
    assert!(calls[ro].readonly);
    for t in [&p.staging, &p.pv_target, &p.inline_target, &p.ro_target] {
        assert!(mounts::is_mount_point(t), "{} mounted", t.display());
    }
    assert!(mounts::is_read_only(&p.ro_target));

    // The kubelet's metric of CSI calls, in /metrics.
    let metrics = http_get(e.agent().addr, "/metrics").await;
    assert!(
        metrics.contains(&format!(
            "evpleg_csi_operations_seconds_count{{driver_name=\"{DRIVER_NAME}\",method_name=\"/csi.v1.Node/NodeStageVolume\",grpc_status_code=\"OK\",migrated=\"false\"}} 1\n"
        )),
        "{metrics}"
    );

    // What the container wrote is in the driver's backing directories.
    let pv_backing = d.backing_dir(PV_HANDLE);
    let inline_backing = d.backing_dir(&p.inline_handle);
    e.wait_until("the container's files", || {
        std::fs::read_to_string(pv_backing.join("ro-result")).is_ok_and(|s| s.ends_with('\n'))
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(pv_backing.join("from-pod")).unwrap(),
        "from-pod\n"
    );
    assert_eq!(
        std::fs::read_to_string(inline_backing.join("from-pod")).unwrap(),
        "from-pod\n"
    );
    assert_eq!(
        std::fs::read_to_string(pv_backing.join("seen-inline")).unwrap(),
        p.inline_handle,
        "the container read the inline volume's own file"
    );
    assert_eq!(
        std::fs::read_to_string(pv_backing.join("ro-result")).unwrap(),
        "ro\n"
    );

    // Deleted: unpublished, then unstaged; mounts and dirs gone.
    let before = d.calls().len();
    delete(&e, "vols").await;
    let calls = wait_calls(&d, "unstaged", |c| {
        c.iter().any(|c| ok(c, "NodeUnstageVolume", PV_HANDLE))
    })
    .await;
    let after = &calls[before..];
    let unpublish_pv =
        position(after, |c| ok(c, "NodeUnpublishVolume", PV_HANDLE)).expect("pv unpublished");
    let unstage = position(after, |c| ok(c, "NodeUnstageVolume", PV_HANDLE)).unwrap();
    assert!(
        unpublish_pv < unstage,
        "unpublished before unstaged: {after:#?}"
    );
    assert_eq!(
        after[unstage].staging_target_path,
        p.staging.display().to_string()
    );
    for (h, t) in [
        (&p.inline_handle, &p.inline_target),
        (&p.ro_handle, &p.ro_target),
    ] {
        let i = position(after, |c| ok(c, "NodeUnpublishVolume", h))
            .unwrap_or_else(|| panic!("{h} unpublished: {after:#?}"));
        assert_eq!(after[i].target_path, t.display().to_string());
    }
    e.wait_until("the mounts and directories gone", || {
        [&p.staging, &p.pv_target, &p.inline_target, &p.ro_target]
            .iter()
            .all(|t| !mounts::is_mount_point(t) && !t.exists())
            && !p.staging.parent().unwrap().exists()
            && !p.pod_dir.exists()
    })
    .await;
    assert!(
        !inline_backing.exists(),
        "the ephemeral volume's data went with it"
    );
    assert!(
        pv_backing.join("from-pod").exists(),
        "the persistent volume's data stays"
    );
    e.finish().await;
}

/// A NodePublishVolume of the PV that failed.
fn failed_publish(c: &Call) -> bool {
    c.method == "NodePublishVolume" && c.volume_id == PV_HANDLE && c.error.is_some()
}

/// The harness with the test driver registered, its NodePublishVolume of the
/// PV failing with `message`, and API pod `pod` using the claim, once two
/// publishes failed (a retry): the harness, the driver and the pod's UID.
async fn failing_publish(name: &str, message: &str, pod: &str) -> (E2e, CsiDriverProcess, String) {
    let e = start(name).await;
    let d = start_driver(&e, &[]);
    wait_calls(&d, "registered", registered).await;
    d.inject_error(PV_HANDLE, "NodePublishVolume", message);
    create_claim(&e, pod).await;
    let pod_uid = uid(&e.create_pod(&csi_pod(pod)).await);
    wait_calls(&d, "two failed publishes (a retry)", |c| {
        c.iter().filter(|c| failed_publish(c)).count() >= 2
    })
    .await;
    (e, d, pod_uid)
}

// NodePublishVolume of the PV fails: FailedMount with the driver's error, the
// pod waits in ContainerCreating, the agent retries; once the driver
// recovers the pod runs; deleted, it is cleaned up as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_error_is_failed_mount_and_retried() {
    let name = "a_driver_error_is_failed_mount_and_retried";
    if !evpleg_tests::privileged(name) || !evpleg_tests::control_plane::available(name) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let (e, d, pod_uid) = failing_publish(name, "injected failure for the test", "failing").await;
    let event = wait_event(
        &e,
        "failing",
        "FailedMount",
        "injected failure for the test",
    )
    .await;
    assert_eq!(event["type"], "Warning");
    let waiting = |p: &k8s_openapi::api::core::v1::Pod| {
        p.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|s| s.first())
            .and_then(|c| c.state.as_ref())
            .and_then(|s| s.waiting.as_ref())
            .and_then(|w| w.reason.clone())
    };
    let api_pod = e
        .wait_api("failing", "ContainerCreating in the API", |p| {
            waiting(p).as_deref() == Some("ContainerCreating")
        })
        .await;
    let status = api_pod.status.clone().unwrap_or_default();
    assert_eq!(status.phase.as_deref(), Some("Pending"), "{status:?}");
    // Still failing and retried: the status is ContainerCreating, not Running.
    wait_calls(&d, "a third failed publish", |c| {
        c.iter().filter(|c| failed_publish(c)).count() >= 3
    })
    .await;
    let api_pod = e
        .wait_real("default", "failing", "the pod", |p| p.is_some())
        .await
        .expect("the pod");
    assert_eq!(waiting(&api_pod).as_deref(), Some("ContainerCreating"));
    assert!(
        e.sandboxes(&pod_uid).await.is_empty(),
        "no sandbox before the volumes are mounted"
    );
    let metrics = http_get(e.agent().addr, "/metrics").await;
    assert!(
        metrics.contains(&format!(
            "evpleg_csi_operations_seconds_count{{driver_name=\"{DRIVER_NAME}\",method_name=\"/csi.v1.Node/NodePublishVolume\",grpc_status_code=\"Internal\",migrated=\"false\"}}"
        )),
        "the failed calls in /metrics: {metrics}"
    );

    d.clear_error(PV_HANDLE, "NodePublishVolume");
    e.wait_api("failing", "Running after the driver recovered", running)
        .await;
    let p = paths(&e.args.root_dir, &pod_uid);
    assert!(mounts::is_mount_point(&p.pv_target));
    delete(&e, "failing").await;
    e.wait_until("cleaned up", || {
        !p.pod_dir.exists() && !p.staging.parent().unwrap().exists()
    })
    .await;
    let calls = d.calls();
    assert!(
        calls.iter().any(|c| ok(c, "NodeUnstageVolume", PV_HANDLE)),
        "{calls:#?}"
    );
    e.finish().await;
}

// A driver without STAGE_UNSTAGE_VOLUME: the PV is never staged, only the
// kubelet's staging directory (with its vol_data.json) is made; it is
// published without a staging path, and at deletion unpublished, never
// unstaged, and the staging directory goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_without_stage_unstage_is_published_unstaged() {
    let name = "a_driver_without_stage_unstage_is_published_unstaged";
    if !evpleg_tests::privileged(name) || !evpleg_tests::control_plane::available(name) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = start(name).await;
    let d = start_driver(&e, &["--no-stage"]);
    wait_calls(&d, "registered", registered).await;
    create_claim(&e, "nostage").await;
    let pod = e.create_pod(&csi_pod("nostage")).await;
    let pod_uid = uid(&pod);
    e.wait_api("nostage", "Running", running).await;
    let p = paths(&e.args.root_dir, &pod_uid);
    let calls = d.calls();
    assert!(
        calls.iter().any(|c| c.method == "NodeGetCapabilities"),
        "{calls:#?}"
    );
    assert!(
        !calls.iter().any(|c| c.method == "NodeStageVolume"),
        "{calls:#?}"
    );
    let publish = position(&calls, |c| ok(c, "NodePublishVolume", PV_HANDLE)).expect("published");
    assert_eq!(calls[publish].staging_target_path, "");
    assert_eq!(
        calls[publish].target_path,
        p.pv_target.display().to_string()
    );
    assert!(p.staging.is_dir(), "the kubelet's staging dir is made");
    assert!(!mounts::is_mount_point(&p.staging));
    let data = std::fs::read_to_string(p.staging.parent().unwrap().join("vol_data.json")).unwrap();
    let data: Value = serde_json::from_str(&data).unwrap();
    assert_eq!(
        data,
        json!({"driverName": DRIVER_NAME, "volumeHandle": PV_HANDLE})
    );
    assert!(mounts::is_mount_point(&p.pv_target));
    delete(&e, "nostage").await;
    e.wait_until("the mounts and directories gone", || {
        !p.staging.parent().unwrap().exists() && !p.pod_dir.exists()
    })
    .await;
    let calls = d.calls();
    assert!(
        calls
            .iter()
            .any(|c| ok(c, "NodeUnpublishVolume", PV_HANDLE)),
        "{calls:#?}"
    );
    assert!(
        !calls.iter().any(|c| c.method == "NodeUnstageVolume"),
        "{calls:#?}"
    );
    e.finish().await;
}

// NodePublishVolume answers Unavailable (a non-final error: the driver may
// have published): the pod never starts, and when it is deleted the volume
// is unpublished anyway, then unstaged, as the kubelet does with an
// uncertain mount; nothing is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncertain_publish_is_undone_when_the_pod_goes() {
    let name = "an_uncertain_publish_is_undone_when_the_pod_goes";
    if !evpleg_tests::privileged(name) || !evpleg_tests::control_plane::available(name) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let (e, d, pod_uid) =
        failing_publish(name, "UNAVAILABLE: the driver restarts", "uncertain").await;
    let before = d.calls().len();
    assert!(
        !d.calls()
            .iter()
            .any(|c| c.method == "NodeUnpublishVolume" && c.volume_id == PV_HANDLE),
        "not unpublished while the pod wants it"
    );
    delete(&e, "uncertain").await;
    let p = paths(&e.args.root_dir, &pod_uid);
    let calls = wait_calls(&d, "unpublished and unstaged", |c| {
        c.iter().any(|c| ok(c, "NodeUnstageVolume", PV_HANDLE))
    })
    .await;
    let after = &calls[before..];
    let unpublish = position(after, |c| ok(c, "NodeUnpublishVolume", PV_HANDLE))
        .unwrap_or_else(|| panic!("the uncertain publication undone: {after:#?}"));
    assert_eq!(
        after[unpublish].target_path,
        p.pv_target.display().to_string()
    );
    let unstage = position(after, |c| ok(c, "NodeUnstageVolume", PV_HANDLE)).unwrap();
    assert!(unpublish < unstage, "{after:#?}");
    e.wait_until("the mounts and directories gone", || {
        !p.staging.parent().unwrap().exists()
            && !p.pod_dir.exists()
            && !mounts::is_mount_point(&p.staging)
    })
    .await;
    e.finish().await;
}

// A pod created before its driver registers: FailedMount naming the missing
// driver (the kubelet's "not found in the list of registered CSI drivers"),
// then, once the driver registers, the volumes are mounted and the pod runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_waits_for_its_driver_to_register() {
    let name = "a_pod_waits_for_its_driver_to_register";
    if !evpleg_tests::privileged(name) || !evpleg_tests::control_plane::available(name) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = start(name).await;
    create_claim(&e, "early").await;
    e.create_pod(&csi_pod("early")).await;
    let needle =
        format!("driver name {DRIVER_NAME} not found in the list of registered CSI drivers");
    wait_event(&e, "early", "FailedMount", &needle).await;
    let d = start_driver(&e, &[]);
    e.wait_api("early", "Running once the driver registered", running)
        .await;
    let calls = d.calls();
    assert!(registered(&calls), "{calls:#?}");
    assert!(
        calls.iter().any(|c| ok(c, "NodeStageVolume", PV_HANDLE)),
        "{calls:#?}"
    );
    delete(&e, "early").await;
    wait_calls(&d, "unstaged", |c| {
        c.iter().any(|c| ok(c, "NodeUnstageVolume", PV_HANDLE))
    })
    .await;
    e.finish().await;
}
