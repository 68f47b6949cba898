//! What a case does to its pod mid-run (`act=<what>:<N>s` in its header, done
//! once, N seconds after its status was first seen), as a user or a
//! controller would: the pod's sandbox killed (its pause process SIGKILLed,
//! as by the OOM killer or a stray `kill`), a static pod's manifest updated
//! in place (a new pod for both: another UID), a readiness gate's condition
//! set True by a controller on the API server, or the node itself (the
//! kubelet or the agent) stopped and started again, its pods left running.

use std::time::Duration;

use evpleg_cri_api::v1;
use serde_json::{Value, json};

use super::DifferentialError;

/// What is done mid-run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// SIGKILL to the pod's sandbox's pause process.
    KillSandbox,
    /// The manifest rewritten with every `v1-of-fidelity` replaced by
    /// `v2-of-fidelity` (static pods only).
    Update,
    /// The condition `fidelity.evpleg.dev/gate` set True in the pod's status
    /// (API pods only).
    Gate,
    /// The node's process (the stock kubelet, or the agent) stopped as an
    /// operator would (SIGTERM; the agent's orderly stop) and started again
    /// with the same configuration and state. Its cases run on a node of
    /// their own, so that the restart does not reach other cases.
    RestartNode,
}

/// The readiness gate's condition type.
pub const GATE: &str = "fidelity.evpleg.dev/gate";

/// Parses `<kill-sandbox|update|gate|restart-node>:<N>s`.
pub fn parse(s: &str) -> Option<(Act, Duration)> {
    let (what, after) = s.split_once(':')?;
    let secs: u64 = after.strip_suffix('s')?.parse().ok()?;
    let act = match what {
        "kill-sandbox" => Act::KillSandbox,
        "update" => Act::Update,
        "gate" => Act::Gate,
        "restart-node" => Act::RestartNode,
        _ => return None,
    };
    Some((act, Duration::from_secs(secs)))
}

/// The manifest after [`Act::Update`].
pub fn updated(yaml: &str) -> String {
    yaml.replace("v1-of-fidelity", "v2-of-fidelity")
}

/// Kills the pause process of pod `pod`'s ready sandbox (its pid from the
/// runtime's verbose status); `false` when it has none yet (the node is
/// still starting it: the caller tries again).
pub async fn kill_sandbox(
    client: &evpleg_cri::CriClient,
    pod: &str,
) -> Result<bool, DifferentialError> {
    let failed =
        |why: String| DifferentialError::Containerd(format!("kill the sandbox of {pod}: {why}"));
    let sandboxes = client
        .list_pod_sandboxes(None)
        .await
        .map_err(|e| failed(e.to_string()))?;
    let Some(sandbox) = sandboxes.iter().find(|s| {
        s.metadata.as_ref().is_some_and(|m| m.name == pod)
            && s.state == v1::PodSandboxState::SandboxReady as i32
    }) else {
        return Ok(false);
    };
    let status = client
        .pod_sandbox_status(&sandbox.id, true)
        .await
        .map_err(|e| failed(e.to_string()))?;
    let info: Value = status
        .info
        .get("info")
        .and_then(|i| serde_json::from_str(i).ok())
        .unwrap_or(Value::Null);
    let pid = info["pid"]
        .as_i64()
        .filter(|p| *p > 1)
        .ok_or_else(|| failed(format!("no pid in the verbose status of {}", sandbox.id)))?;
    // SAFETY: kill has no memory preconditions; the pid is the sandbox's.
    if unsafe { libc::kill(pid as i32, libc::SIGKILL) } != 0 {
        return Err(failed(format!(
            "kill {pid}: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(true)
}

/// Sets the readiness gate's condition True in pod `name`'s status, as its
/// controller would.
pub async fn open_gate(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> Result<(), DifferentialError> {
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::{Patch, PatchParams};
    let api: kube::Api<Pod> = kube::Api::namespaced(client.clone(), namespace);
    let now = k8s_openapi::jiff::Timestamp::now();
    let now = k8s_openapi::jiff::Timestamp::from_second(now.as_second()).unwrap_or(now);
    let patch = json!({"status": {"conditions": [{
        "type": GATE, "status": "True", "lastTransitionTime": now.to_string(),
    }]}});
    api.patch_status(name, &PatchParams::default(), &Patch::Strategic(patch))
        .await
        .map_err(|e| DifferentialError::Api(format!("open the gate of {namespace}/{name}: {e}")))?;
    Ok(())
}
