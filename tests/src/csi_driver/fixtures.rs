//! Fixtures of the CSI end-to-end tests (tests/tests/csi.rs): the PV and its
//! claim, a pod using an inline, a read-only inline and the claimed CSI
//! volume, the kubelet's paths computed here independently of the agent, and
//! waiting on the driver's call log.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::{Call, CsiDriverProcess, DRIVER_NAME};
use crate::e2e::{DEADLINE, E2e, IMAGE, NODE};

/// The PV's volume handle.
pub const PV_HANDLE: &str = "pv-handle-1";

pub fn sha256_hex(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Waits (bounded) until the driver's calls satisfy `done`; returns them.
pub async fn wait_calls(
    d: &CsiDriverProcess,
    what: &str,
    done: impl Fn(&[Call]) -> bool,
) -> Vec<Call> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let calls = d.calls();
        if done(&calls) {
            return calls;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {DEADLINE:?}; calls: {calls:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn position(calls: &[Call], f: impl Fn(&Call) -> bool) -> Option<usize> {
    calls.iter().position(f)
}

pub fn ok(c: &Call, method: &str, volume: &str) -> bool {
    c.method == method && c.volume_id == volume && c.error.is_none()
}

pub fn registered(calls: &[Call]) -> bool {
    calls
        .iter()
        .any(|c| c.method == "NotifyRegistrationStatus" && c.registered == Some(true))
}

/// Creates, in the real API server (as the admin), the claim `claim-<pod>`
/// and the PV `pv-<pod>` of the CSI volume [`PV_HANDLE`], bound to each other
/// as the PV controller would bind them (no controller manager runs here:
/// the claim's `volumeName`, the PV's `claimRef` with the claim's UID, both
/// statuses `Bound`). Names of their own per pod: a claim once used keeps the
/// API server's `kubernetes.io/pvc-protection` finalizer, which only the
/// controller manager would remove.
pub async fn create_claim(e: &E2e, pod: &str) {
    let client = e.kube().await;
    let (claim, volume) = (format!("claim-{pod}"), format!("pv-{pod}"));
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    let pvc: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": claim, "namespace": "default"},
        "spec": {"accessModes": ["ReadWriteOnce"], "volumeName": volume,
                 "resources": {"requests": {"storage": "1Gi"}}},
    }))
    .expect("a PVC");
    let made = pvcs
        .create(&PostParams::default(), &pvc)
        .await
        .unwrap_or_else(|err| panic!("create PVC {claim}: {err}"));
    let pv: PersistentVolume = serde_json::from_value(json!({
        "metadata": {"name": volume},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "claimRef": {"kind": "PersistentVolumeClaim", "namespace": "default",
                         "name": claim, "uid": made.metadata.uid},
            "csi": {"driver": DRIVER_NAME, "volumeHandle": PV_HANDLE,
                    "volumeAttributes": {"kind": "persistent"}},
        },
    }))
    .expect("a PV");
    let pvs: Api<PersistentVolume> = Api::all(client);
    pvs.create(&PostParams::default(), &pv)
        .await
        .unwrap_or_else(|err| panic!("create PV {volume}: {err}"));
    let pv_bound = json!({"status": {"phase": "Bound"}});
    pvs.patch_status(&volume, &PatchParams::default(), &Patch::Merge(pv_bound))
        .await
        .unwrap_or_else(|err| panic!("bind PV {volume}: {err}"));
    let claim_bound = json!({"status": {"phase": "Bound", "accessModes": ["ReadWriteOnce"],
                                        "capacity": {"storage": "1Gi"}}});
    pvcs.patch_status(&claim, &PatchParams::default(), &Patch::Merge(claim_bound))
        .await
        .unwrap_or_else(|err| panic!("bind PVC {claim}: {err}"));
}

/// A pod with an inline ephemeral CSI volume, a read-only one, and the
/// claim `claim-<name>` ([`create_claim`]); its container writes into the two writable ones and reports
/// whether the read-only one refused a write.
pub fn csi_pod(name: &str) -> Pod {
    let script = "cat /inline/volume-id > /data/seen-inline && echo from-pod > /inline/from-pod \
        && echo from-pod > /data/from-pod \
        && (touch /ro/x 2>/dev/null && echo rw || echo ro) > /data/ro-result; exec sleep 600";
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": NODE,
            "hostNetwork": true,
            "terminationGracePeriodSeconds": 2,
            "volumes": [
                {"name": "inline", "csi": {"driver": DRIVER_NAME, "volumeAttributes": {"size": "1Mi"}}},
                {"name": "ro", "csi": {"driver": DRIVER_NAME, "readOnly": true}},
                {"name": "data", "persistentVolumeClaim": {"claimName": format!("claim-{name}")}},
            ],
            "containers": [{
                "name": "app", "image": IMAGE, "command": ["sh", "-c", script],
                "volumeMounts": [
                    {"name": "inline", "mountPath": "/inline"},
                    {"name": "ro", "mountPath": "/ro"},
                    {"name": "data", "mountPath": "/data"},
                ],
            }],
        },
    }))
    .expect("a valid pod")
}

pub fn running(p: &Pod) -> bool {
    p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

pub fn uid(p: &Pod) -> String {
    p.metadata.uid.clone().expect("a uid")
}

pub async fn delete(e: &E2e, name: &str) {
    let pods: Api<Pod> = Api::namespaced(e.kube().await, "default");
    pods.delete(name, &DeleteParams::default())
        .await
        .expect("graceful delete");
    e.wait_real("default", name, "deleted for good", |p| p.is_none())
        .await;
}

/// The kubelet's paths of the pod's CSI volumes.
#[derive(Debug)]
pub struct Paths {
    pub staging: PathBuf,
    pub pv_target: PathBuf,
    pub inline_target: PathBuf,
    pub ro_target: PathBuf,
    pub inline_handle: String,
    pub ro_handle: String,
    pub pod_dir: PathBuf,
}

/// The kubelet's paths for the pod `uid`, computed here independently.
pub fn paths(root: &Path, uid: &str) -> Paths {
    let vols = root
        .join("pods")
        .join(uid)
        .join("volumes/kubernetes.io~csi");
    Paths {
        staging: root
            .join("plugins/kubernetes.io/csi")
            .join(DRIVER_NAME)
            .join(sha256_hex(PV_HANDLE))
            .join("globalmount"),
        pv_target: vols.join("data/mount"),
        inline_target: vols.join("inline/mount"),
        ro_target: vols.join("ro/mount"),
        inline_handle: format!("csi-{}", sha256_hex(&format!("{uid}inline"))),
        ro_handle: format!("csi-{}", sha256_hex(&format!("{uid}ro"))),
        pod_dir: root.join("pods").join(uid),
    }
}

/// Waits (bounded) for the first event of `reason` whose message holds
/// `needle`, of the pod `default/name`, in the agent's
/// `/pods/<namespace>/<name>/events`. Another event of the same reason may
/// come first: the API server's Node authorizer learns of a new pod's claim
/// from its own watch, and the agent's first read of the claim can be
/// forbidden, as a stock kubelet's is.
pub async fn wait_event(e: &E2e, name: &str, reason: &str, needle: &str) -> Value {
    let path = format!("/pods/default/{name}/events");
    let deadline = Instant::now() + DEADLINE;
    loop {
        let response = crate::e2e::http_get(e.agent().addr, &path).await;
        let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
        let list: Value = serde_json::from_str(body).unwrap_or(Value::Null);
        let found = list["items"].as_array().and_then(|a| {
            a.iter()
                .find(|ev| {
                    ev["reason"] == reason
                        && ev["message"].as_str().is_some_and(|m| m.contains(needle))
                })
                .cloned()
        });
        if let Some(ev) = found {
            return ev;
        }
        assert!(
            Instant::now() < deadline,
            "no {reason} with {needle:?} for {name}: {list:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (bounded) until the agent's `/metrics` satisfies `done`.
pub async fn wait_metrics(e: &E2e, what: &str, done: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let metrics = crate::e2e::http_get(e.agent().addr, "/metrics").await;
        if done(&metrics) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {metrics}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
