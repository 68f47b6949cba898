//! Termination: the kubelet's `SyncTerminatingPod` and `SyncTerminatedPod`
//! (`kubelet.go`) with `killPodWithSyncResult` (`kuberuntime_manager.go`): stop
//! the containers with the grace period (StopContainer sends SIGTERM, then
//! SIGKILL), stop the sandbox, publish the final status; once terminated, tear
//! down the pod's volumes and remove its directory and cgroup. Its dead
//! containers and stopped sandbox stay, as the kubelet's `SyncTerminatedPod`
//! leaves them "to be reclaimed in the background": the container GC removes
//! them once the pod is deleted ([`super::gc`]), and until then they tell a
//! restarted agent how the pod ended. Every stop gives the
//! container at least the kubelet's minimum grace period of 2 s between SIGTERM
//! and SIGKILL. Every container is killed at once; sidecars run their preStop
//! hooks at once too, then are stopped after the app containers, in reverse
//! order, with what is left of the grace period (never less than the
//! minimum): [`super::ordering`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use evpleg_cri_api::v1;
use k8s_openapi::api::core::v1::Pod;
use tracing::{info, warn};

use super::actions::{Terminal, compute_pod_actions, is_sidecar, latest};
use super::cgroups::remove_pod_cgroups;
use super::ordering::TerminationOrdering;
use crate::events as kubelet_events;
use crate::kuberuntime::manager::{KubeRuntime, lock, pod_uid};
use crate::pod_workers::SyncError;
use evpleg_core::cache::CacheEntry;
use evpleg_core::container::{ContainerState, PodStatus};
use evpleg_core::ids::{ContainerId, PodUid};
use evpleg_core::labels;
use evpleg_core::runtime::PodRuntime;
use evpleg_cri::runtime::CriRuntime;

/// A CRI container's name (from its metadata).
fn name(c: &v1::Container) -> &str {
    c.metadata.as_ref().map(|m| m.name.as_str()).unwrap_or("")
}

/// Whether a ContainerStatus answer says the container is not running any
/// more (exited).
fn stopped(r: &v1::ContainerStatusResponse) -> bool {
    r.status
        .as_ref()
        .is_some_and(|s| s.state == v1::ContainerState::ContainerExited as i32)
}

/// The kubelet's `minimumGracePeriodInSeconds`.
pub const MINIMUM_GRACE_SECONDS: i64 = 2;

/// The grace period a stop gives: the pod's, but never less than the minimum
/// (the kubelet's `killContainer`; it has no override path here).
pub fn stop_grace(grace_seconds: i64) -> i64 {
    grace_seconds.max(MINIMUM_GRACE_SECONDS)
}

/// The containers a pod's kill stops: those the runtime lists running
/// whose death the PLEG (the kernel, or a relist) has not already seen. The
/// kubelet stops the containers its runtime lists running
/// (`killPodWithSyncResult`), and its relist has seen an exit by the time
/// it acts on it; evpleg can act on the kernel's sighting of the death
/// before containerd has processed it, when containerd still lists the
/// container running and a StopContainer races its own teardown (`ttrpc:
/// closed`): a container whose death is certain needs no stop, and gets no
/// Killing event.
pub fn to_stop<'a>(listed: &'a [v1::Container], observed: &PodStatus) -> Vec<&'a v1::Container> {
    listed
        .iter()
        .filter(|c| c.state == v1::ContainerState::ContainerRunning as i32)
        .filter(|c| {
            let dead = ContainerId::parse(&c.id)
                .and_then(|id| observed.container(&id))
                .is_some_and(|s| s.state == ContainerState::Exited);
            !dead
        })
        .collect()
}

/// How long a failed StopContainer waits for the runtime to report the
/// container exited before the failure counts.
const STOP_RECHECK: Duration = Duration::from_secs(2);

/// Asks `done` every 100 ms until it says yes or [`STOP_RECHECK`] passes:
/// whether it did (a failed stop's wait for the runtime to catch up).
async fn within_recheck<F: std::future::Future<Output = bool>>(
    mut done: impl FnMut() -> F,
) -> bool {
    let deadline = tokio::time::Instant::now() + STOP_RECHECK;
    loop {
        if done().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

impl KubeRuntime {
    /// StopContainer with [`stop_grace`], as the kubelet's `killContainer`:
    /// a container the runtime does not know is stopped (NotFound is no
    /// failure), and so is one whose stop failed because it died meanwhile
    /// (containerd answers `ttrpc: closed` when the task's shim goes away
    /// under the call): the runtime reports it exited within
    /// [`STOP_RECHECK`].
    pub(super) async fn stop_container(
        &self,
        id: &str,
        grace_seconds: i64,
    ) -> Result<(), SyncError> {
        let Err(e) = self.cri.stop_container(id, stop_grace(grace_seconds)).await else {
            return Ok(());
        };
        let gone = within_recheck(|| async {
            match self.cri.container_status(id, false).await {
                Ok(r) => stopped(&r),
                Err(s) => s.is_not_found(),
            }
        });
        if !gone.await {
            return Err(SyncError(e.to_string()));
        }
        info!(container = id, error = %e, "StopContainer failed, but the container has exited or is gone");
        Ok(())
    }

    /// StopPodSandbox, the end of the kubelet's `killPodWithSyncResult`.
    /// containerd first stops the sandbox's containers its own store holds
    /// running: one whose death the kernel reported before containerd
    /// processed it is still running there, and its stop meets the task's
    /// teardown (`ttrpc: closed`), a race the kubelet, acting on its relist,
    /// rarely meets (issue #31: a FailedKillPod for a pod whose containers
    /// had ended by themselves). Such a failure does not count: once
    /// containerd lists none of the sandbox's containers running (within
    /// [`STOP_RECHECK`]), the stop is tried again, and that answer counts.
    async fn stop_sandbox(&self, id: &str) -> Result<(), SyncError> {
        let Err(e) = self.cri.stop_pod_sandbox(id).await else {
            return Ok(());
        };
        let filter = v1::ContainerFilter {
            pod_sandbox_id: id.to_owned(),
            ..Default::default()
        };
        let none_running = within_recheck(|| async {
            self.cri
                .list_containers(Some(filter.clone()))
                .await
                .is_ok_and(|cs| {
                    !cs.iter()
                        .any(|c| c.state == v1::ContainerState::ContainerRunning as i32)
                })
        });
        if !none_running.await {
            return Err(SyncError(e.to_string()));
        }
        info!(sandbox = id, error = %e, "StopPodSandbox met a container going away; stopping it again");
        self.cri
            .stop_pod_sandbox(id)
            .await
            .map_err(|e| SyncError(e.to_string()))
    }

    /// Stops every container and sandbox of the pod, as the runtime lists them
    /// now, but those whose death `observed` (the PLEG's cache) holds
    /// ([`to_stop`]): all at once, the sidecars waiting for their turn after
    /// their preStop hooks, within what is left of the grace period (the
    /// kubelet's termination ordering of restartable init containers).
    pub(super) async fn kill_pod(
        &self,
        uid: &PodUid,
        pod: &Pod,
        grace: i64,
        observed: &PodStatus,
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
        let running = to_stop(&containers, observed);
        for c in &running {
            kubelet_events::killing(&self.events, pod, name(c), "");
        }
        // Every container is killed at once; a sidecar runs its preStop hook
        // at once too, then waits for its turn (`killContainersWithSyncResult`
        // with its `terminationOrdering`).
        let has_sidecars = pod
            .spec
            .iter()
            .flat_map(|s| s.init_containers.iter().flatten())
            .any(is_sidecar);
        let names: Vec<&str> = running.iter().map(|c| name(c)).collect();
        let ordering = has_sidecars.then(|| TerminationOrdering::new(pod, &names));
        let kills = running
            .iter()
            .map(|c| self.stop_with_pre_stop((pod, uid), name(c), &c.id, grace, ordering.as_ref()));
        let mut failed = None;
        for r in futures::future::join_all(kills).await {
            if let Err(e) = r {
                failed.get_or_insert(e);
            }
        }
        if let Some(e) = failed {
            return Err(e);
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
            self.stop_sandbox(&s.id).await?;
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
        // `SyncTerminatingPod`: no liveness or startup probe acts on a pod
        // being stopped.
        self.probes.stop_liveness_and_startup(&uid, &pod);
        self.kill_pod(&uid, &pod, grace_seconds, &entry.status)
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
        self.publish(&pod, &uid, &status, Some(terminal));
        Ok(())
    }

    pub(super) async fn sync_terminated_pod(
        &self,
        pod: Arc<Pod>,
        _entry: CacheEntry,
    ) -> Result<(), SyncError> {
        let uid = pod_uid(&pod)?;
        // Whether it finished by its restart policy: then its per-pod memory
        // (back-offs, reasons) stays with its dead containers; a pod that was
        // removed or killed forgets it.
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
        // The kubelet's SyncTerminatedPod destroys the pod cgroup too.
        remove_pod_cgroups(
            &self.node.cgroup_mounts,
            self.node.cgroup_driver,
            &pod,
            &uid,
        );
        if finished {
            info!(pod = %uid, "pod finished: its dead containers stay until it is removed and collected");
            return Ok(());
        }
        lock(&self.backoff).forget(&uid);
        lock(&self.image_backoff).retain(|(p, _)| *p != uid);
        lock(&self.pull_errors).forget(&uid);
        lock(&self.reasons).forget(&uid);
        lock(&self.start_times).remove(&uid);
        info!(pod = %uid, "pod terminated: its cgroup removed, its dead containers left to the container gc");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The FailedKillPod race: a container containerd still lists running
    /// whose death the kernel PLEG has laid in the cache is not stopped
    /// again; one the cache holds running, or does not hold, is.
    #[test]
    fn a_kill_skips_containers_whose_death_the_pleg_saw() {
        use evpleg_core::container::ContainerStatus;
        use evpleg_core::lifecycle::EventSource;
        let id = |n: u8| format!("{n:064x}");
        let listed = |n: u8, state: v1::ContainerState| v1::Container {
            id: id(n),
            state: state as i32,
            ..Default::default()
        };
        let seen = |n: u8, state: ContainerState, source: EventSource| {
            ContainerStatus::new(ContainerId::parse(&id(n)).unwrap(), "c", state, source)
        };
        let listed = [
            listed(1, v1::ContainerState::ContainerRunning),
            listed(2, v1::ContainerState::ContainerRunning),
            listed(3, v1::ContainerState::ContainerRunning),
            listed(4, v1::ContainerState::ContainerExited),
            listed(5, v1::ContainerState::ContainerRunning),
        ];
        let observed = PodStatus {
            containers: vec![
                seen(1, ContainerState::Running, EventSource::Relist),
                seen(2, ContainerState::Exited, EventSource::Kernel),
                seen(3, ContainerState::Exited, EventSource::Relist),
                seen(4, ContainerState::Exited, EventSource::Relist),
            ],
            ..PodStatus::default()
        };
        let got: Vec<&str> = to_stop(&listed, &observed)
            .iter()
            .map(|c| c.id.as_str())
            .collect();
        assert_eq!(got, [id(1), id(5)]);
    }

    #[test]
    fn a_stop_gives_at_least_the_minimum_grace_period() {
        let cases = [(0, 2), (1, 2), (2, 2), (3, 3), (30, 30)];
        for (spec, given) in cases {
            assert_eq!(stop_grace(spec), given, "{spec}");
        }
    }
}
