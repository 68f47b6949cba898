//! Termination: the kubelet's `SyncTerminatingPod` and `SyncTerminatedPod`
//! (`kubelet.go`) with `killPodWithSyncResult` (`kuberuntime_manager.go`): stop
//! the containers with the grace period (StopContainer sends SIGTERM, then
//! SIGKILL), stop the sandbox, publish the final status; once terminated, tear
//! down the pod's volumes and remove its directory and cgroup, and the sandboxes of a pod that did not finish by its
//! restart policy (it was removed); a finished pod keeps its dead containers
//! until it is removed (then housekeeping removes them, as the kubelet's
//! garbage collection of a deleted pod's content). Every stop gives the
//! container at least the kubelet's minimum grace period of 2 s between SIGTERM
//! and SIGKILL. Sidecars are stopped after the app containers, in reverse
//! order, with what is left of the grace period (never less than the minimum).

use std::collections::HashMap;
use std::sync::Arc;

use evpleg_cri_api::v1;
use k8s_openapi::api::core::v1::Pod;
use tracing::{info, warn};

use super::actions::{PodActions, Terminal, compute_pod_actions, is_sidecar, latest};
use super::cgroups::remove_pod_cgroups;
use crate::events as kubelet_events;
use crate::kuberuntime::manager::{KubeRuntime, lock, pod_uid};
use crate::pod_workers::SyncError;
use evpleg_core::cache::CacheEntry;
use evpleg_core::container::ContainerState;
use evpleg_core::ids::PodUid;
use evpleg_core::labels;
use evpleg_core::runtime::PodRuntime;
use evpleg_cri::runtime::CriRuntime;

/// A CRI container's name (from its metadata).
fn name(c: &v1::Container) -> &str {
    c.metadata.as_ref().map(|m| m.name.as_str()).unwrap_or("")
}

/// The kubelet's `minimumGracePeriodInSeconds`.
pub const MINIMUM_GRACE_SECONDS: i64 = 2;

/// The grace period a stop gives: the pod's, but never less than the minimum
/// (the kubelet's `killContainer`; it has no override path here).
pub fn stop_grace(grace_seconds: i64) -> i64 {
    grace_seconds.max(MINIMUM_GRACE_SECONDS)
}

impl KubeRuntime {
    /// StopContainer with [`stop_grace`].
    pub(super) async fn stop_container(
        &self,
        id: &str,
        grace_seconds: i64,
    ) -> Result<(), SyncError> {
        self.cri
            .stop_container(id, stop_grace(grace_seconds))
            .await
            .map_err(|e| SyncError(e.to_string()))
    }

    /// Stops every container and sandbox of the pod, as the runtime lists them
    /// now: the app containers in parallel, then the sidecars one by one in
    /// reverse order, within what is left of the grace period (the kubelet's
    /// termination ordering of restartable init containers).
    pub(super) async fn kill_pod(
        &self,
        uid: &PodUid,
        pod: &Pod,
        grace: i64,
    ) -> Result<(), SyncError> {
        let started = tokio::time::Instant::now();
        let selector: HashMap<String, String> =
            HashMap::from([(labels::POD_UID.to_owned(), uid.to_string())]);
        let containers = self
            .cri
            .list_containers(Some(v1::ContainerFilter {
                label_selector: selector.clone(),
                ..Default::default()
            }))
            .await
            .map_err(|e| SyncError(e.to_string()))?;
        let sidecars: Vec<&str> = pod
            .spec
            .iter()
            .flat_map(|s| s.init_containers.iter().flatten())
            .filter(|c| is_sidecar(c))
            .map(|c| c.name.as_str())
            .collect();
        let running: Vec<&v1::Container> = containers
            .iter()
            .filter(|c| c.state == v1::ContainerState::ContainerRunning as i32)
            .collect();
        for c in &running {
            kubelet_events::killing(&self.events, pod, name(c), "");
        }
        let stops = running
            .iter()
            .filter(|c| !sidecars.contains(&name(c)))
            .map(|c| self.stop_with_pre_stop(pod, uid, name(c), &c.id, grace));
        // In parallel, as the kubelet stops a pod's containers.
        for r in futures::future::join_all(stops).await {
            r?;
        }
        for sidecar in sidecars.iter().rev() {
            let left = grace - started.elapsed().as_secs() as i64;
            for c in running.iter().filter(|c| name(c) == *sidecar) {
                info!(pod = %uid, container = sidecar, grace_seconds = left.max(0), "stopping sidecar after the app containers");
                self.stop_with_pre_stop(pod, uid, sidecar, &c.id, left.max(0))
                    .await?;
            }
        }
        let sandboxes = self
            .cri
            .list_pod_sandboxes(Some(v1::PodSandboxFilter {
                label_selector: selector,
                ..Default::default()
            }))
            .await
            .map_err(|e| SyncError(e.to_string()))?;
        for s in sandboxes
            .iter()
            .filter(|s| s.state == v1::PodSandboxState::SandboxReady as i32)
        {
            self.cri
                .stop_pod_sandbox(&s.id)
                .await
                .map_err(|e| SyncError(e.to_string()))?;
        }
        kubelet_events::exceeded_grace_period(&self.events, pod, started.elapsed(), grace);
        Ok(())
    }

    pub(super) async fn sync_terminating_pod(
        &self,
        pod: Arc<Pod>,
        entry: CacheEntry,
        grace_seconds: i64,
    ) -> Result<(), SyncError> {
        let uid = pod_uid(&pod)?;
        info!(pod = %uid, grace_seconds, "terminating pod");
        self.kill_pod(&uid, &pod, grace_seconds)
            .await
            .inspect_err(|e| kubelet_events::failed_kill_pod(&self.events, &pod, e))?;
        // The final status is the runtime's, read again after the kill: exit
        // codes, reasons and finish times as the runtime recorded them (a
        // container that exits 0 on SIGTERM is Completed). If the runtime cannot
        // answer, the last observation with the killed containers marked exited.
        let status = match CriRuntime::new(self.cri.clone()).pod_status(&uid).await {
            Ok(s) => s,
            Err(e) => {
                warn!(pod = %uid, error = %e, "cannot read the final status from the runtime; using the last observation");
                let mut status = (*entry.status).clone();
                for c in &mut status.containers {
                    if c.state == ContainerState::Running {
                        c.state = ContainerState::Exited;
                    }
                }
                status
            }
        };
        let apps = pod
            .spec
            .as_ref()
            .map(|s| s.containers.as_slice())
            .unwrap_or_default();
        let succeeded = !apps.is_empty()
            && apps.iter().all(|c| {
                latest(&status, &c.name)
                    .is_some_and(|s| s.state == ContainerState::Exited && s.exit_code == Some(0))
            });
        let terminal = if succeeded {
            Terminal::Succeeded
        } else {
            Terminal::Failed
        };
        let actions = PodActions::default();
        self.publish(&pod, &uid, &status, &actions, Some(terminal));
        Ok(())
    }

    pub(super) async fn sync_terminated_pod(
        &self,
        pod: Arc<Pod>,
        _entry: CacheEntry,
    ) -> Result<(), SyncError> {
        let uid = pod_uid(&pod)?;
        // A pod that finished by its restart policy keeps its dead containers
        // and sandbox until it is removed (housekeeping) or collected: they are
        // what tells a restarted agent that it finished (the kubelet removes a
        // pod's content only once the pod is deleted).
        let finished = match CriRuntime::new(self.cri.clone()).pod_status(&uid).await {
            Ok(status) => {
                let backoff = lock(&self.backoff);
                compute_pod_actions(&pod, &uid, &status, &backoff, 0)
                    .terminal
                    .is_some()
            }
            Err(e) => return Err(SyncError(e.to_string())),
        };
        // Its containers are dead: its volumes are torn down (the kubelet's
        // WaitForUnmount in SyncTerminatedPod; an error is retried), then
        // the pod's directory (volumes, the managed /etc/hosts) goes, never
        // across a mount left there. The kubelet leaves the directory to
        // housekeeping's `cleanupOrphanedPodDirs` after the pod is deleted.
        if let Some(volumes) = &self.volumes {
            volumes.remove_pod(&uid);
            volumes
                .wait_for_unmount(&uid, evpleg_volume::UNMOUNT_WAIT)
                .await
                .map_err(|e| SyncError(e.to_string()))?;
        }
        if let Err(e) = crate::network::hosts::remove_pod_dir(&self.node.root_dir, uid.as_str()) {
            warn!(pod = %uid, error = %e, "removing the pod's directory");
        }
        if finished {
            remove_pod_cgroups(
                &self.node.cgroup_mounts,
                self.node.cgroup_driver,
                &pod,
                &uid,
            );
            info!(pod = %uid, "pod finished: its dead containers stay until it is removed");
            return Ok(());
        }
        let sandboxes = self
            .cri
            .list_pod_sandboxes(Some(v1::PodSandboxFilter {
                label_selector: HashMap::from([(labels::POD_UID.to_owned(), uid.to_string())]),
                ..Default::default()
            }))
            .await
            .map_err(|e| SyncError(e.to_string()))?;
        for s in &sandboxes {
            self.cri
                .remove_pod_sandbox(&s.id)
                .await
                .map_err(|e| SyncError(e.to_string()))?;
        }
        remove_pod_cgroups(
            &self.node.cgroup_mounts,
            self.node.cgroup_driver,
            &pod,
            &uid,
        );
        lock(&self.backoff).forget(&uid);
        lock(&self.image_backoff).retain(|(p, _)| *p != uid);
        lock(&self.reasons).forget(&uid);
        lock(&self.start_times).remove(&uid);
        info!(pod = %uid, sandboxes = sandboxes.len(), "pod terminated: sandboxes and cgroup removed");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_gives_at_least_the_minimum_grace_period() {
        let cases = [(0, 2), (1, 2), (2, 2), (3, 3), (30, 30)];
        for (spec, given) in cases {
            assert_eq!(stop_grace(spec), given, "{spec}");
        }
    }
}
