//! What becomes of a pod a source adds, before admission: the rules of the
//! kubelet's `HandlePodAdditions` (`kubelet.go`) and of the first update of a pod
//! worker (`pod_workers.go` `UpdatePod`).
//!
//! - A mirror pod (annotation `kubernetes.io/config.mirror`) is never run: it is
//!   the API server's read-only copy of a static pod, which runs from its own
//!   source; its status is the static pod's (`status::api`).
//! - A pod re-added with the UID of a pod whose worker has not finished
//!   terminating is restarted once it finished (the kubelet's
//!   `restartRequested`); one whose worker finished is started again at once
//!   (the kubelet purges the finished worker in housekeeping, then the pod is
//!   created again).
//! - A pod whose phase in the API server is already `Succeeded` or `Failed` is
//!   never started: it goes straight to termination (the kubelet: a pod terminal
//!   in its source and in the runtime cache starts as terminated; one whose
//!   containers still run is terminated by its first sync).
//! - Anything else goes through admission.
//!
//! Where evpleg differs: the kubelet waits for its 2 s housekeeping to purge a
//! finished worker before a restart; here the restart follows the worker's end
//! at once. A terminal pod always goes through termination here (which stops
//! whatever still runs), where the kubelet skips to terminated when the runtime
//! cache is terminal too.

use k8s_openapi::api::core::v1::Pod;

use crate::pod_workers::WorkerState;
use crate::status::finish::{is_mirror_pod, is_terminal};

/// The sync loop's course for a pod its source added.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnAdd {
    /// A mirror pod: nothing runs it.
    IgnoreMirror,
    /// The same UID is still terminating: start it again once it finished.
    RestartWhenFinished,
    /// The same UID finished terminating: forget it and start afresh.
    Restart,
    /// Terminal in the API server: terminate, never start.
    Terminate,
    /// A new pod: admission, then its worker.
    Admit,
}

/// `worker`: the state of a worker of the same UID, `live`: whether that worker
/// is still registered (its end not yet handled by the sync loop).
pub fn on_add(pod: &Pod, worker: Option<WorkerState>, live: bool) -> OnAdd {
    if is_mirror_pod(pod) {
        return OnAdd::IgnoreMirror;
    }
    match worker {
        Some(WorkerState::Done) if !live => return OnAdd::Restart,
        Some(_) => return OnAdd::RestartWhenFinished,
        None => {}
    }
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if is_terminal(phase) {
        OnAdd::Terminate
    } else {
        OnAdd::Admit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(mirror: bool, phase: Option<&str>) -> Pod {
        let mut v = serde_json::json!({"metadata": {"name": "p"}, "status": {"phase": phase}});
        if mirror {
            v["metadata"]["annotations"] = serde_json::json!({"kubernetes.io/config.mirror": "h"});
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn on_add_table() {
        use OnAdd::*;
        use WorkerState::*;
        let cases = [
            (pod(false, None), None, false, Admit),
            (pod(false, Some("Running")), None, false, Admit),
            (pod(false, Some("Pending")), None, false, Admit),
            (pod(false, Some("Succeeded")), None, false, Terminate),
            (pod(false, Some("Failed")), None, false, Terminate),
            (pod(true, None), None, false, IgnoreMirror),
            (pod(true, Some("Running")), Some(Sync), true, IgnoreMirror),
            (
                pod(false, None),
                Some(Terminating),
                true,
                RestartWhenFinished,
            ),
            (
                pod(false, None),
                Some(Terminated),
                true,
                RestartWhenFinished,
            ),
            (pod(false, None), Some(Done), true, RestartWhenFinished),
            (pod(false, None), Some(Done), false, Restart),
            (pod(false, Some("Failed")), Some(Done), false, Restart),
        ];
        for (i, (pod, worker, live, want)) in cases.into_iter().enumerate() {
            assert_eq!(on_add(&pod, worker, live), want, "case {i}");
        }
    }
}
