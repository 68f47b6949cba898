//! Lifecycle hooks, as the kubelet's `lifecycle/handlers.go` and
//! `kuberuntime_container.go` run them:
//!
//! * postStart runs right after StartContainer; if it fails the container is
//!   killed (FailedPostStartHook) and the start fails with
//!   `PostStartHookError`, so it restarts under the pod's policy and back-off;
//! * preStop runs before StopContainer, bounded by the grace period (not at
//!   all with a grace period of 0; the pod workers give a kill at least 1 s);
//!   its time is taken from the grace period given to StopContainer (never
//!   below the kubelet's 2 s minimum); a failure is logged and recorded
//!   (FailedPreStopHook) and the stop goes on; a sidecar runs its preStop
//!   hook at once, then waits for its turn to stop
//!   ([`super::ordering`]);
//! * a failed hook's event says only `PostStartHook failed` /
//!   `PreStopHook failed`: its output may hold secrets (the log has it).
//!
//! Handlers: `exec` (CRI `ExecSync`; exit code 0 succeeds), `httpGet` (the
//! kubelet's `runHTTPHandler`, [`crate::prober::http::lifecycle`]: any
//! response succeeds, HTTPS with any certificate, an HTTPS hook answered in
//! plain http retried over http with a `LifecycleHTTPFallback` event) and
//! `sleep`. A deprecated `tcpSocket` handler does nothing,
//! as in the kubelet. Difference: a postStart hook is bounded by
//! [`POST_START_BOUND`] (the kubelet waits for it without a bound).

use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, LifecycleHandler, Pod};

use crate::kuberuntime::manager::KubeRuntime;
use crate::prober::http::Hooked;
use evpleg_core::ids::PodUid;
use evpleg_core::runtime::PodRuntime as _;

/// The longest a postStart hook may run.
pub const POST_START_BOUND: Duration = Duration::from_secs(120);

/// The kubelet's reason for a failed postStart hook (the start's error).
pub const POST_START_HOOK_ERROR: &str = "PostStartHookError";

/// Why a hook failed: the kubelet's event message.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HookError {
    #[error("{hook} hook of container {container}: exec {command:?} exited with {code}: {output}")]
    Exec {
        hook: &'static str,
        container: String,
        command: String,
        code: i32,
        output: String,
    },
    #[error("{hook} hook of container {container}: {message}")]
    Failed {
        hook: &'static str,
        container: String,
        message: String,
    },
    #[error("{hook} hook of container {container}: not done within {bound:?}")]
    TimedOut {
        hook: &'static str,
        container: String,
        bound: Duration,
    },
}

impl KubeRuntime {
    /// Runs one hook handler against container `id`, bounded by `bound`.
    pub(super) async fn run_hook(
        &self,
        hook: &'static str,
        (pod, uid): (&Pod, &PodUid),
        c: &Container,
        id: &str,
        handler: &LifecycleHandler,
        bound: Duration,
    ) -> Result<(), HookError> {
        let failed = |message: String| HookError::Failed {
            hook,
            container: c.name.clone(),
            message,
        };
        let run = async {
            if let Some(exec) = &handler.exec {
                let cmd: Vec<&str> = exec.command.iter().flatten().map(String::as_str).collect();
                let r = self
                    .cri
                    .exec_sync(id, &cmd, bound)
                    .await
                    .map_err(|e| failed(e.to_string()))?;
                if r.exit_code != 0 {
                    let output = String::from_utf8_lossy(&[r.stdout, r.stderr].concat())
                        .trim()
                        .chars()
                        .take(512)
                        .collect();
                    return Err(HookError::Exec {
                        hook,
                        container: c.name.clone(),
                        command: cmd.join(" "),
                        code: r.exit_code,
                        output,
                    });
                }
                return Ok(());
            }
            if let Some(http) = &handler.http_get {
                let handlers = crate::prober::handlers::Handlers {
                    cri: self.cri.clone(),
                    host_ip: self.node.host_ip.clone(),
                };
                // As the kubelet's handler runner: without a host, the pod's
                // IP, asked from the runtime.
                let handlers = if http.host.as_deref().unwrap_or_default().is_empty() {
                    let status = evpleg_cri::runtime::CriRuntime::new(self.cri.clone())
                        .pod_status(uid)
                        .await
                        .map_err(|e| failed(format!("pod status for the hook's address: {e}")))?;
                    handlers.at_pod(pod, &status.ips)
                } else {
                    handlers
                };
                let (target, headers) = handlers
                    .http_request(c, http)
                    .map_err(|e| failed(e.to_string()))?;
                return match crate::prober::http::lifecycle(target, &headers).await {
                    Ok(Hooked::Done) => Ok(()),
                    Ok(Hooked::FellBack { authority }) => {
                        tracing::warn!(
                            container = %c.name,
                            reason = evpleg_record::LIFECYCLE_HTTP_FALLBACK,
                            authority,
                            "https {hook} hook got an http response; the retry over http succeeded"
                        );
                        self.events.record(
                            pod,
                            None,
                            evpleg_record::EventType::Warning,
                            evpleg_record::LIFECYCLE_HTTP_FALLBACK,
                            format!(
                                "request to HTTPS lifecycle hook {authority} got HTTP response, retry with HTTP succeeded"
                            ),
                        );
                        Ok(())
                    }
                    Err(e) => Err(failed(e.to_string())),
                };
            }
            if let Some(sleep) = &handler.sleep {
                tokio::time::sleep(Duration::from_secs(sleep.seconds.max(0) as u64)).await;
            }
            Ok(())
        };
        tokio::time::timeout(bound, run)
            .await
            .unwrap_or(Err(HookError::TimedOut {
                hook,
                container: c.name.clone(),
                bound,
            }))
    }

    /// The preStop hook of the pod's container `name` (an app or init
    /// container), if it has one and `grace_seconds` is above 0, bounded by
    /// it (the kubelet's `executePreStopHook`); returns the whole seconds it
    /// took, to be taken from the grace period. A failure is logged and
    /// recorded as `PreStopHook failed`, and the stop goes on.
    pub(super) async fn pre_stop(
        &self,
        (pod, uid): (&Pod, &PodUid),
        name: &str,
        id: &str,
        grace_seconds: i64,
    ) -> i64 {
        let spec = pod
            .spec
            .iter()
            .flat_map(|s| {
                s.containers
                    .iter()
                    .chain(s.init_containers.iter().flatten())
            })
            .find(|c| c.name == name);
        let Some((c, pre_stop)) =
            spec.and_then(|c| Some((c, c.lifecycle.as_ref()?.pre_stop.as_ref()?)))
        else {
            return 0;
        };
        if grace_seconds <= 0 {
            return 0;
        }
        let pod_name = super::actions::format_pod(pod, uid);
        let pod_name = pod_name.as_str();
        let started = tokio::time::Instant::now();
        let bound = Duration::from_secs(grace_seconds as u64);
        match self
            .run_hook("PreStop", (pod, uid), c, id, pre_stop, bound)
            .await
        {
            Ok(()) => tracing::info!(pod = pod_name, container = %c.name, "preStop hook done"),
            Err(e) => {
                tracing::warn!(
                    pod = pod_name,
                    container = %c.name,
                    reason = "FailedPreStopHook",
                    error = %e,
                    "preStop hook failed; stopping the container"
                );
                crate::events::pre_stop_hook_failed(&self.events, pod, &c.name);
            }
        }
        started.elapsed().as_secs() as i64
    }

    /// The kubelet's `killContainer`: the preStop hook ([`Self::pre_stop`]),
    /// then, with `ordering`, the wait for the container's turn, each taken
    /// from `grace_seconds`; then StopContainer with what is left.
    pub(super) async fn stop_with_pre_stop(
        &self,
        (pod, uid): (&Pod, &PodUid),
        name: &str,
        id: &str,
        grace_seconds: i64,
        ordering: Option<&super::ordering::TerminationOrdering>,
    ) -> Result<(), crate::pod_workers::SyncError> {
        let mut grace = grace_seconds - self.pre_stop((pod, uid), name, id, grace_seconds).await;
        if let Some(o) = ordering
            && grace > 0
        {
            let waited = o.wait_for_turn(name, grace).await;
            tracing::debug!(pod = %uid, container = name, waited_ms = waited.as_millis() as u64, "the container's turn to stop");
            grace -= waited.as_secs() as i64;
        }
        self.stop_container(id, grace).await?;
        if let Some(o) = ordering {
            o.terminated(name);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hook_errors_name_the_container_and_what_failed() {
        let e = HookError::Exec {
            hook: "PostStart",
            container: "app".into(),
            command: "sh -c exit 3".into(),
            code: 3,
            output: "no".into(),
        };
        assert_eq!(
            e.to_string(),
            "PostStart hook of container app: exec \"sh -c exit 3\" exited with 3: no"
        );
        let t = HookError::TimedOut {
            hook: "PreStop",
            container: "app".into(),
            bound: Duration::from_secs(3),
        };
        assert_eq!(
            t.to_string(),
            "PreStop hook of container app: not done within 3s"
        );
    }
}
