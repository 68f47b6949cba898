//! The end of a pod's status: terminal phases are final, and a gracefully deleted
//! API pod is removed from the API server once it finished terminating.
//!
//! Reproduces two rules of the kubelet:
//! - "pods are not allowed to transition out of terminal phases"
//!   (`generateAPIPodStatus` in `kubelet_pods.go`): once the API server shows
//!   `Succeeded` or `Failed`, or the last status handed to the status manager was
//!   one of them, a status with another phase is an illegal transition;
//! - a container that terminated for good (restart policy `Never`, or
//!   `OnFailure` after exit 0) never shows another state again: the status
//!   manager's `checkContainerStateTransition` refuses the whole status; the old
//!   status is the last one handed in, else the API server's;
//! - the status manager's `canBeDeleted` (`status_manager.go`): a pod is deleted
//!   for good (grace period 0, its UID as precondition) once it carries a
//!   `deletionTimestamp`, is not a mirror pod, its phase in the API server is
//!   terminal and its worker finished (`SyncTerminatedPod` ran: containers
//!   stopped, volumes gone).
//!
//! Where evpleg differs: the kubelet forces the phase of an illegal status back to
//! the API's and writes the rest; evpleg refuses the whole status (the status
//! manager logs and counts it). The kubelet reads the API phase from the pod it
//! just patched; evpleg uses the last status it wrote successfully (the status
//! manager asks only when everything handed in was written), or the API's status
//! for a pod it never wrote.

use k8s_openapi::api::core::v1::{ContainerStatus, Pod, PodSpec, PodStatus};

use crate::source::annotations;

/// `Succeeded` or `Failed`.
pub fn is_terminal(phase: Option<&str>) -> bool {
    matches!(phase, Some("Succeeded" | "Failed"))
}

/// The terminal phase a status with phase `new` would move the pod out of:
/// the API server's (`api`) first, then the last one handed in (`last`).
/// `None` when the move is allowed.
pub fn illegal_transition<'a>(
    api: Option<&'a str>,
    last: Option<&'a str>,
    new: Option<&str>,
) -> Option<&'a str> {
    [api, last]
        .into_iter()
        .find(|p| is_terminal(*p) && *p != new)
        .flatten()
}

/// The kubelet's `checkContainerStateTransition`: the name of a container that
/// terminated for good in `old` and is not terminated in `new`, if any. Init
/// containers with `restartPolicy: Always` (sidecars) may restart.
pub fn illegal_container_transition(
    old: &PodStatus,
    new: &PodStatus,
    spec: Option<&PodSpec>,
) -> Option<String> {
    let policy = spec
        .and_then(|s| s.restart_policy.as_deref())
        .unwrap_or("Always");
    if policy == "Always" {
        return None;
    }
    let sidecars: Vec<&str> = spec
        .and_then(|s| s.init_containers.as_ref())
        .into_iter()
        .flatten()
        .filter(|c| c.restart_policy.as_deref() == Some("Always"))
        .map(|c| c.name.as_str())
        .collect();
    let finished = |c: &ContainerStatus| {
        c.state
            .as_ref()
            .and_then(|s| s.terminated.as_ref())
            .is_some_and(|t| !(t.exit_code != 0 && policy == "OnFailure"))
    };
    let pairs = [
        (&old.container_statuses, &new.container_statuses),
        (&old.init_container_statuses, &new.init_container_statuses),
    ];
    for (olds, news) in pairs {
        for o in olds.iter().flatten().filter(|c| finished(c)) {
            if sidecars.contains(&o.name.as_str()) {
                continue;
            }
            let left = news.iter().flatten().any(|n| {
                n.name == o.name
                    && n.state
                        .as_ref()
                        .and_then(|s| s.terminated.as_ref())
                        .is_none()
            });
            if left {
                return Some(o.name.clone());
            }
        }
    }
    None
}

/// A mirror pod (annotation `kubernetes.io/config.mirror`): never run, never
/// deleted by the status manager.
pub fn is_mirror_pod(pod: &Pod) -> bool {
    pod.metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(annotations::CONFIG_MIRROR))
}

/// The kubelet's `canBeDeleted`: `written` is the pod's status as the API server
/// has it, `finished` whether its worker finished terminating.
pub fn can_be_deleted(pod: &Pod, written: &PodStatus, finished: bool) -> bool {
    pod.metadata.deletion_timestamp.is_some()
        && !is_mirror_pod(pod)
        && is_terminal(written.phase.as_deref())
        && finished
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;

    #[test]
    fn terminal_phase_table() {
        type Phase = Option<&'static str>;
        // (api, last, new, refused from)
        let cases: &[(Phase, Phase, Phase, Phase)] = &[
            (None, None, Some("Pending"), None),
            (None, Some("Running"), Some("Succeeded"), None),
            (None, Some("Succeeded"), Some("Succeeded"), None),
            (None, Some("Succeeded"), Some("Running"), Some("Succeeded")),
            (None, Some("Failed"), Some("Pending"), Some("Failed")),
            (None, Some("Failed"), Some("Succeeded"), Some("Failed")),
            (None, Some("Failed"), None, Some("Failed")),
            (Some("Failed"), None, Some("Running"), Some("Failed")),
            (
                Some("Succeeded"),
                Some("Running"),
                Some("Failed"),
                Some("Succeeded"),
            ),
            (
                Some("Running"),
                Some("Failed"),
                Some("Running"),
                Some("Failed"),
            ),
            (Some("Running"), Some("Running"), Some("Failed"), None),
            (Some("Failed"), Some("Failed"), Some("Failed"), None),
        ];
        for (api, last, new, want) in cases {
            assert_eq!(
                illegal_transition(*api, *last, *new),
                *want,
                "api {api:?}, last {last:?}, new {new:?}"
            );
        }
    }

    fn containers(states: &[(&str, Option<i32>)]) -> PodStatus {
        serde_json::from_value(serde_json::json!({
            "containerStatuses": states.iter().map(|(name, exit)| match exit {
                Some(code) => serde_json::json!({"name": name, "image": "", "imageID": "",
                    "ready": false, "restartCount": 0,
                    "state": {"terminated": {"exitCode": code}}}),
                None => serde_json::json!({"name": name, "image": "", "imageID": "",
                    "ready": false, "restartCount": 0,
                    "state": {"waiting": {"reason": "ContainerCreating"}}}),
            }).collect::<Vec<_>>()
        }))
        .unwrap()
    }

    fn spec(policy: &str) -> PodSpec {
        PodSpec {
            restart_policy: Some(policy.into()),
            ..PodSpec::default()
        }
    }

    #[test]
    fn container_transition_table() {
        // (policy, old, new, refused container)
        let cases: Vec<(&str, PodStatus, PodStatus, Option<&str>)> = vec![
            (
                "Never",
                containers(&[("a", Some(3))]),
                containers(&[("a", None)]),
                Some("a"),
            ),
            (
                "Never",
                containers(&[("a", Some(0))]),
                containers(&[("a", None)]),
                Some("a"),
            ),
            (
                "Never",
                containers(&[("a", None)]),
                containers(&[("a", Some(3))]),
                None,
            ),
            (
                "Never",
                containers(&[("a", Some(3))]),
                containers(&[("a", Some(3))]),
                None,
            ),
            (
                "Never",
                containers(&[("a", Some(3))]),
                containers(&[("b", None)]),
                None,
            ),
            (
                "OnFailure",
                containers(&[("a", Some(3))]),
                containers(&[("a", None)]),
                None,
            ),
            (
                "OnFailure",
                containers(&[("a", Some(0))]),
                containers(&[("a", None)]),
                Some("a"),
            ),
            (
                "Always",
                containers(&[("a", Some(0))]),
                containers(&[("a", None)]),
                None,
            ),
        ];
        for (i, (policy, old, new, want)) in cases.into_iter().enumerate() {
            assert_eq!(
                illegal_container_transition(&old, &new, Some(&spec(policy))).as_deref(),
                want,
                "case {i} ({policy})"
            );
        }
        // No spec: Always, as the API defaults it.
        let (old, new) = (containers(&[("a", Some(0))]), containers(&[("a", None)]));
        assert_eq!(illegal_container_transition(&old, &new, None), None);
    }

    fn pod(deleting: bool, mirror: bool) -> Pod {
        let mut pod = Pod::default();
        if deleting {
            pod.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        }
        if mirror {
            pod.metadata.annotations = Some(BTreeMap::from([(
                annotations::CONFIG_MIRROR.to_owned(),
                "h".to_owned(),
            )]));
        }
        pod
    }

    fn status(phase: &str) -> PodStatus {
        PodStatus {
            phase: Some(phase.into()),
            ..PodStatus::default()
        }
    }

    #[test]
    fn can_be_deleted_table() {
        // (deleting, mirror, phase, finished, deleted)
        let cases = [
            (true, false, "Failed", true, true),
            (true, false, "Succeeded", true, true),
            (false, false, "Failed", true, false),
            (true, true, "Failed", true, false),
            (true, false, "Running", true, false),
            (true, false, "Failed", false, false),
        ];
        for (deleting, mirror, phase, finished, want) in cases {
            assert_eq!(
                can_be_deleted(&pod(deleting, mirror), &status(phase), finished),
                want,
                "deleting {deleting}, mirror {mirror}, {phase}, finished {finished}"
            );
        }
    }
}
