//! The kubelet's events at its points in the pod lifecycle, with its types,
//! reasons and messages (`kuberuntime_container.go`'s `startContainer` and
//! `killContainer`, `kuberuntime_manager.go`'s `SyncPod` and `doBackOff`,
//! `executePreStopHook`, `images/image_manager.go`'s `EnsureImageExists`, `kubelet.go`'s
//! `SyncTerminatingPod` and `killPodNow`), and the kernel PLEG's own. The
//! runtime code calls these in one line each.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;

use crate::kuberuntime::actions::{Waiting, format_pod};
use crate::kuberuntime::backoff::go_duration;
use crate::kuberuntime::reasons::{
    CRASH_LOOP_BACK_OFF, ERR_IMAGE_NEVER_PULL as WAIT_NEVER_PULL, ERR_IMAGE_PULL,
    IMAGE_INSPECT_ERROR, IMAGE_PULL_BACKOFF, INVALID_IMAGE_NAME, StartError,
};
use evpleg_core::ids::PodUid;
use evpleg_core::lifecycle::ExitStatus;
use evpleg_record::{
    BACK_OFF, CONTAINER_DIED, CREATED, ERR_IMAGE_NEVER_PULL, EXCEEDED_GRACE_PERIOD, EventType,
    FAILED, FAILED_CREATE_POD_SANDBOX, FAILED_KILL_POD, FAILED_POST_START_HOOK,
    FAILED_PRE_STOP_HOOK, INSPECT_FAILED, KILLING, PULLED, PULLING, Recorder, SANDBOX_CHANGED,
    STARTED, Source,
};

/// `SyncPod`: the pod's sandbox is gone and it gets a new one.
pub fn sandbox_changed(rec: &Recorder, pod: &Pod) {
    let message = "Pod sandbox changed, it will be killed and re-created.";
    rec.record(pod, None, EventType::Normal, SANDBOX_CHANGED, message);
}

/// `SyncPod`: RunPodSandbox failed.
pub fn failed_create_pod_sandbox(rec: &Recorder, pod: &Pod, error: &dyn std::fmt::Display) {
    let message = format!("Failed to create pod sandbox: {error}");
    rec.record(
        pod,
        None,
        EventType::Warning,
        FAILED_CREATE_POD_SANDBOX,
        message,
    );
}

/// `killContainer`: a container is stopped (`reason` is SyncPod's, empty for
/// the pod's termination: [`kill_message`]).
pub fn killing(rec: &Recorder, pod: &Pod, container: &str, reason: &str) {
    let message = kill_message(container, reason);
    rec.record(pod, Some(container), EventType::Normal, KILLING, message);
}

/// `SyncTerminatingPod`: the kill failed.
pub fn failed_kill_pod(rec: &Recorder, pod: &Pod, error: &dyn std::fmt::Display) {
    let message = format!("error killing pod: {error}");
    rec.record(pod, None, EventType::Warning, FAILED_KILL_POD, message);
}

/// `EnsureImageExists`: no pull needed. 1.37 (`KubeletEnsureSecretPulledImages`,
/// beta and on) asks its pull manager whether the pod may use the present
/// image (`MustAttemptImagePull`) and says so: "... and can be accessed by the
/// pod". evpleg keeps no record of which credentials pulled an image, so it
/// answers as the kubelet's default policy (`NeverVerifyPreloadedImages`)
/// does for an image it did not pull with credentials: no pull, this message.
pub fn already_present(rec: &Recorder, pod: &Pod, container: &str, image: &str) {
    let message = format!(
        "Container image {image:?} already present on machine and can be accessed by the pod"
    );
    rec.record(pod, Some(container), EventType::Normal, PULLED, message);
}

/// `getPullSecretsForPod`: some pull secrets could not be read (nothing
/// when all were).
pub fn failed_to_retrieve_pull_secrets(rec: &Recorder, pod: &Pod, names: &[String]) {
    if names.is_empty() {
        return;
    }
    let message = format!(
        "Unable to retrieve some image pull secrets ({}); attempting to pull the image may not succeed.",
        names.join(", ")
    );
    let reason = crate::credentials::FAILED_TO_RETRIEVE_IMAGE_PULL_SECRET;
    rec.record(pod, None, EventType::Warning, reason, message);
}

/// `EnsureImageExists`: a pull starts.
pub fn pulling(rec: &Recorder, pod: &Pod, container: &str, image: &str) {
    let message = format!("Pulling image {image:?}");
    rec.record(pod, Some(container), EventType::Normal, PULLING, message);
}

/// `startContainer`: CreateContainer succeeded. 1.37's message names no
/// container (the event's `fieldPath` does); before 1.37 it was
/// `Created container: <name>`.
pub fn created(rec: &Recorder, pod: &Pod, container: &str) {
    rec.record(
        pod,
        Some(container),
        EventType::Normal,
        CREATED,
        "Container created",
    );
}

/// `startContainer`: StartContainer succeeded (1.37: `Container started`;
/// before, `Started container <name>`).
pub fn started(rec: &Recorder, pod: &Pod, container: &str) {
    rec.record(
        pod,
        Some(container),
        EventType::Normal,
        STARTED,
        "Container started",
    );
}

/// `doBackOff`: a container waiting in CrashLoopBackOff, at each sync.
pub fn crash_loop_back_off(rec: &Recorder, pod: &Pod, uid: &PodUid, waiting: &[Waiting]) {
    for w in waiting.iter().filter(|w| w.reason == CRASH_LOOP_BACK_OFF) {
        let message = format!(
            "Back-off restarting failed container {} in pod {}",
            w.name,
            format_pod(pod, uid)
        );
        rec.record(pod, Some(&w.name), EventType::Warning, BACK_OFF, message);
    }
}

/// A failed start: the image manager's event for an image error (its own
/// reason and message), then `startContainer`'s `Failed` "Error: ..." (the
/// error's name for an image error, its message otherwise).
pub fn start_failed(rec: &Recorder, pod: &Pod, container: &str, e: &StartError) {
    // A failed postStart hook has had its own event ([`post_start_hook_failed`]);
    // the kubelet records no `Failed` for it (its message carries the hook's
    // output).
    if e.reason == crate::kuberuntime::hooks::POST_START_HOOK_ERROR {
        return;
    }
    let image = match e.reason {
        INVALID_IMAGE_NAME | IMAGE_INSPECT_ERROR => Some((EventType::Warning, INSPECT_FAILED)),
        WAIT_NEVER_PULL => Some((EventType::Warning, ERR_IMAGE_NEVER_PULL)),
        IMAGE_PULL_BACKOFF => Some((EventType::Normal, BACK_OFF)),
        ERR_IMAGE_PULL => Some((EventType::Warning, FAILED)),
        _ => None,
    };
    let error = match image {
        Some((kind, reason)) => {
            rec.record(pod, Some(container), kind, reason, e.message.clone());
            e.reason.to_owned()
        }
        None => e.message.clone(),
    };
    rec.record(
        pod,
        Some(container),
        EventType::Warning,
        FAILED,
        format!("Error: {error}"),
    );
}

/// `EnsureImageExists` after a pull: "Successfully pulled image ... in ..."
/// (durations truncated to the millisecond, as Go's; without the image size,
/// which PullImage does not return).
pub fn pulled(rec: &Recorder, pod: &Pod, container: &str, image: &str, took: Duration) {
    let took = go_duration(Duration::from_millis(took.as_millis() as u64));
    let message =
        format!("Successfully pulled image {image:?} in {took} ({took} including waiting)");
    rec.record(pod, Some(container), EventType::Normal, PULLED, message);
}

/// `startContainer`: the postStart hook failed, then the container is
/// killed (`killContainer` with the message `FailedPostStartHook`, which its
/// Killing event carries alone). The message never carries the hook's output
/// or error ("do not record the message in the event so that secrets won't
/// leak from the server"); the log has them. No `Failed` event follows
/// ([`start_failed`]).
pub fn post_start_hook_failed(rec: &Recorder, pod: &Pod, container: &str) {
    rec.record(
        pod,
        Some(container),
        EventType::Warning,
        FAILED_POST_START_HOOK,
        "PostStartHook failed",
    );
    killing(rec, pod, container, FAILED_POST_START_HOOK);
}

/// `executePreStopHook`: the preStop hook failed; as
/// [`post_start_hook_failed`], without the hook's output.
pub fn pre_stop_hook_failed(rec: &Recorder, pod: &Pod, container: &str) {
    rec.record(
        pod,
        Some(container),
        EventType::Warning,
        FAILED_PRE_STOP_HOOK,
        "PreStopHook failed",
    );
}

/// The message of a container killed by SyncPod (`computePodActions`'s).
pub fn kill_message(name: &str, reason: &str) -> String {
    match reason {
        "spec changed" => format!("Container {name} definition changed, will be restarted"),
        "" => format!("Stopping container {name}"),
        other => other.to_owned(),
    }
}

/// `killPodNow`: the pod took longer than its grace period and a half (at
/// least 10 s) to stop.
pub fn exceeded_grace_period(rec: &Recorder, pod: &Pod, took: Duration, grace_seconds: i64) {
    let grace = grace_seconds.max(0) as u64;
    let timeout = Duration::from_secs((grace + grace / 2).max(10));
    if took > timeout {
        rec.record(
            pod,
            None,
            EventType::Warning,
            EXCEEDED_GRACE_PERIOD,
            "Container runtime did not kill the pod within specified grace period.",
        );
    }
}

/// The kernel PLEG saw a container's main process exit: Normal for exit code
/// 0, Warning otherwise. `name` is the container's, when the cache knows it.
/// `lead`: how long after the kernel the runtime reported the death (`None`:
/// it had not within the wait).
pub fn kernel_death(
    rec: &Recorder,
    pod: &Pod,
    name: Option<&str>,
    id: &str,
    exit: &ExitStatus,
    lead: Option<std::time::Duration>,
) {
    let who = name.unwrap_or(id);
    let mut how = format!("exit code {}", exit.code);
    if let Some(s) = exit.signal {
        how.push_str(&format!(", signal {s}"));
    }
    if exit.core_dumped {
        how.push_str(", core dumped");
    }
    if exit.oom_killed {
        how.push_str(", OOM killed");
    }
    let kind = if exit.code == 0 && !exit.oom_killed {
        EventType::Normal
    } else {
        EventType::Warning
    };
    let message = match lead {
        Some(lead) => format!(
            "Container {who} died ({how}), seen by the kernel {:.1} ms before the runtime reported it",
            lead.as_secs_f64() * 1e3
        ),
        None => format!(
            "Container {who} died ({how}), seen by the kernel; the runtime had not reported it after 5 s"
        ),
    };
    rec.record_from(Source::Kernel, pod, name, kind, CONTAINER_DIED, message);
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use evpleg_core::clock::ManualClock;

    fn pod() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "default", "uid": "a".repeat(32)},
            "spec": {"containers": [{"name": "app"}]}
        }))
        .unwrap()
    }

    fn events(rec: &Recorder) -> Vec<(String, String, String)> {
        rec.pod_events("default", "web")
            .into_iter()
            .map(|r| (r.kind.as_str().to_owned(), r.reason, r.message))
            .collect()
    }

    fn recorder() -> Recorder {
        Recorder::new("n", Arc::new(ManualClock::new(1)), Default::default(), None)
    }

    #[test]
    fn a_failed_pull_is_failed_with_the_error_then_error_err_image_pull() {
        let rec = recorder();
        let e = StartError::new(ERR_IMAGE_PULL, "Failed to pull image \"x:1\": not found");
        start_failed(&rec, &pod(), "app", &e);
        let e = StartError::new(IMAGE_PULL_BACKOFF, "Back-off pulling image \"x:1\"");
        start_failed(&rec, &pod(), "app", &e);
        let e = StartError::new("RunContainerError", "exec: no such file");
        start_failed(&rec, &pod(), "app", &e);
        let e = StartError::new("PostStartHookError", "Exec lifecycle hook ... s3cret");
        start_failed(&rec, &pod(), "app", &e);
        let s = |a: &str, b: &str, c: &str| (a.to_owned(), b.to_owned(), c.to_owned());
        assert_eq!(
            events(&rec),
            [
                s(
                    "Warning",
                    "Failed",
                    "Failed to pull image \"x:1\": not found"
                ),
                s("Warning", "Failed", "Error: ErrImagePull"),
                s("Normal", "BackOff", "Back-off pulling image \"x:1\""),
                s("Warning", "Failed", "Error: ImagePullBackOff"),
                s("Warning", "Failed", "Error: exec: no such file"),
            ]
        );
    }

    /// 1.37's `startContainer` and `EnsureImageExists` messages (the
    /// differential oracle's kubelet): the container named by the field path
    /// only.
    #[test]
    fn start_events_carry_the_1_37_messages() {
        let rec = recorder();
        already_present(&rec, &pod(), "app", "localhost/busybox:local");
        created(&rec, &pod(), "app");
        started(&rec, &pod(), "app");
        let got: Vec<_> = rec
            .pod_events("default", "web")
            .into_iter()
            .map(|r| (r.field_path, r.reason, r.message))
            .collect();
        let path = Some("spec.containers{app}".to_owned());
        let want = [
            (
                "Pulled",
                "Container image \"localhost/busybox:local\" already present on machine and can be accessed by the pod",
            ),
            ("Created", "Container created"),
            ("Started", "Container started"),
        ]
        .map(|(r, m)| (path.clone(), r.to_owned(), m.to_owned()));
        assert_eq!(got, want);
    }

    #[test]
    fn kernel_deaths_say_how_the_process_ended() {
        let rec = recorder();
        let exit = ExitStatus {
            code: 137,
            signal: Some(9),
            core_dumped: false,
            oom_killed: true,
        };
        kernel_death(
            &rec,
            &pod(),
            Some("app"),
            "abc",
            &exit,
            Some(std::time::Duration::from_micros(12_345)),
        );
        let ok = ExitStatus {
            code: 0,
            signal: None,
            core_dumped: false,
            oom_killed: false,
        };
        kernel_death(&rec, &pod(), None, "abc", &ok, None);
        let got = rec.pod_events("default", "web");
        assert_eq!(got[0].source, Source::Kernel);
        assert_eq!(got[0].field_path.as_deref(), Some("spec.containers{app}"));
        assert_eq!(
            got[0].message,
            "Container app died (exit code 137, signal 9, OOM killed), seen by the kernel 12.3 ms before the runtime reported it"
        );
        assert_eq!(got[0].kind, EventType::Warning);
        assert_eq!(
            got[1].message,
            "Container abc died (exit code 0), seen by the kernel; the runtime had not reported it after 5 s"
        );
        assert_eq!(got[1].kind, EventType::Normal);
    }

    /// The kubelet's `startContainer` for a failed postStart hook:
    /// FailedPostStartHook, then `killContainer`'s Killing with the message
    /// `FailedPostStartHook`, and no `Failed` for the start's error.
    #[test]
    fn hook_failures_never_carry_the_hook_s_output() {
        let rec = recorder();
        post_start_hook_failed(&rec, &pod(), "app");
        let e = StartError::new(
            crate::kuberuntime::hooks::POST_START_HOOK_ERROR,
            "PostStart hook of container app: exec \"sh -c exit 1\" exited with 1: ",
        );
        start_failed(&rec, &pod(), "app", &e);
        pre_stop_hook_failed(&rec, &pod(), "app");
        let s = |a: &str, b: &str, c: &str| (a.to_owned(), b.to_owned(), c.to_owned());
        assert_eq!(
            events(&rec),
            [
                s("Warning", "FailedPostStartHook", "PostStartHook failed"),
                s("Normal", "Killing", "FailedPostStartHook"),
                s("Warning", "FailedPreStopHook", "PreStopHook failed"),
            ]
        );
    }

    #[test]
    fn exceeded_grace_period_only_after_grace_and_a_half_at_least_10_s() {
        let rec = recorder();
        exceeded_grace_period(&rec, &pod(), Duration::from_secs(9), 2);
        exceeded_grace_period(&rec, &pod(), Duration::from_secs(44), 30);
        assert!(events(&rec).is_empty());
        exceeded_grace_period(&rec, &pod(), Duration::from_secs(46), 30);
        assert_eq!(events(&rec)[0].1, "ExceededGracePeriod");
    }
}
