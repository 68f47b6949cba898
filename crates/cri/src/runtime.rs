//! The CRI runtime as the PLEG sees it: the kubelet's `kuberuntime` side of
//! `GetPods` and `GetPodStatus`.
//!
//! [`CriRuntime`] implements the relist PLEG's [`PodRuntime`] over a
//! [`CriClient`] as the kubelet's `GetPods` and `GetPodStatus` do: sandboxes and
//! containers are attributed to pods by the labels the agent puts on them
//! ([`labels`]); a pod's status is every sandbox's `PodSandboxStatus` and every
//! container's `ContainerStatus`. Objects without the pod UID label are not the
//! agent's and are ignored, unless [`CriRuntime::attributing_unlabelled`]
//! (`evpleg cri-proxy`, which serves the events of every container of its
//! runtime, crictl's included): then a sandbox without the label is a pod of
//! its own, named by the sandbox's id, and a container without it belongs to
//! its sandbox's pod, as the runtime knows every container's sandbox.
//!
//! Where it differs from `GetPodStatus`: statuses are asked `verbose` (for the
//! main process's pid) only of containers and sandboxes the listing shows
//! alive, and only until their pid is known (a container's or sandbox's pid
//! never changes; it is remembered while the container or sandbox lives);
//! the kubelet asks none verbose. A verbose status costs the runtime the
//! spec and, for a sandbox, a call to its shim (containerd's
//! `toCRISandboxInfo`: `task.Status`): asked at every inspection, it made
//! the pod relists queue for seconds while containerd started the whole
//! fidelity corpus's shims (issue #31). That call waits for any task the
//! pod's shim is creating (the runc shim holds its lock through `runc
//! create`, hooks included; containerd 1.7 runs one shim per pod): a sandbox
//! is therefore not asked verbose while a container of its pod is listed
//! Created (its StartContainer may be creating the task), nor longer than
//! [`SANDBOX_VERBOSE_WAIT`] (then it is asked again, not verbose); its pid
//! is learned at a later inspection. One such wait held a relist batch of
//! 22 pods for 1.7 s, and the workers waiting for it, in a fidelity run. And with
//! [`CriRuntime::remembering_exited`] (ebpf mode) an exited container's
//! status, which the runtime never changes again, is read once and then
//! remembered while the container is listed exited: a pod's inspection costs a
//! call per live container, not per container it ever ran (issue #29: a pod of
//! 120 dead containers made every start and death cost 121 `ContainerStatus`
//! calls). The kubelet reads them all at every inspection.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use evpleg_cri_api::v1;
use tracing::warn;

use crate::{CriClient, CriError};
use evpleg_core::container::{
    ContainerState, ContainerStatus, PodStatus, SandboxState, SandboxStatus,
};
use evpleg_core::ids::{ContainerId, PodUid};
use evpleg_core::labels;
use evpleg_core::lifecycle::EventSource;
use evpleg_core::runtime::{PlegState, PodRuntime, RuntimeEntry, RuntimeError};

/// How long a verbose `PodSandboxStatus` may take before the sandbox is
/// asked again without `verbose` (the module's doc says why): longer than
/// containerd takes to answer one under the whole fidelity corpus (tens of
/// milliseconds), far shorter than a task's creation under load (seconds).
pub const SANDBOX_VERBOSE_WAIT: std::time::Duration = std::time::Duration::from_millis(250);

impl From<CriError> for RuntimeError {
    fn from(e: CriError) -> Self {
        RuntimeError(e.to_string())
    }
}

/// The CRI runtime as the PLEG sees it.
#[derive(Clone, Debug)]
pub struct CriRuntime {
    client: CriClient,
    /// Attribute objects without the pod UID label too.
    unlabelled: bool,
    /// The statuses of exited containers, by pod and container id, when
    /// remembering them ([`Self::remembering_exited`]).
    exited: Option<Arc<Mutex<ExitedStatuses>>>,
    /// The pids of live containers and sandboxes, by id, from their first
    /// verbose status.
    pids: Arc<Mutex<HashMap<String, u32>>>,
}

/// Exited containers' statuses, by pod and container id.
type ExitedStatuses = HashMap<PodUid, HashMap<String, ContainerStatus>>;

impl CriRuntime {
    pub fn new(client: CriClient) -> Self {
        Self {
            client,
            unlabelled: false,
            exited: None,
            pids: Arc::default(),
        }
    }

    /// Remembers each exited container's status from its first read while
    /// the container is listed exited, instead of asking the runtime again
    /// at each inspection of its pod (the module's doc says why). A pod's
    /// memory is replaced at each of its inspections (containers removed or
    /// no longer listed are forgotten) and dropped by a full listing that
    /// lists nothing of the pod.
    pub fn remembering_exited(mut self) -> Self {
        self.exited = Some(Arc::default());
        self
    }

    fn pids(&self) -> std::sync::MutexGuard<'_, HashMap<String, u32>> {
        self.pids.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The remembered pid of container or sandbox `id` when its listing
    /// shows it `alive`; a dead one's is forgotten.
    fn known_pid(&self, id: &str, alive: bool) -> Option<u32> {
        let mut pids = self.pids();
        if alive {
            pids.get(id).copied()
        } else {
            pids.remove(id);
            None
        }
    }

    /// `id`'s pid from its verbose status's `info`, remembered while it lives.
    fn learn_pid(&self, id: &str, info: &HashMap<String, String>) -> Option<u32> {
        let pid = pid_from_info(info);
        if let Some(pid) = pid {
            self.pids().insert(id.to_owned(), pid);
        }
        pid
    }

    /// `PodSandboxStatus`; a `verbose` one that takes longer than
    /// [`SANDBOX_VERBOSE_WAIT`] is given up and the sandbox asked again
    /// without it.
    async fn sandbox_status(
        &self,
        id: &str,
        verbose: bool,
    ) -> Result<v1::PodSandboxStatusResponse, CriError> {
        if verbose
            && let Ok(answer) = tokio::time::timeout(
                SANDBOX_VERBOSE_WAIT,
                self.client.pod_sandbox_status(id, true),
            )
            .await
        {
            return answer;
        }
        self.client.pod_sandbox_status(id, false).await
    }

    fn remembered(&self) -> Option<std::sync::MutexGuard<'_, ExitedStatuses>> {
        self.exited
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Also attributes sandboxes and containers without the kubelet's pod UID
    /// label (made by crictl or another client): a sandbox without it is its
    /// own pod, whose UID is the sandbox's id (64 hex digits: a valid UID
    /// that no API server gives, its UIDs being 36-character UUIDs); a
    /// container without it is in its sandbox's pod. Listing one pod then
    /// lists its sandboxes' containers sandbox by sandbox (the runtime
    /// filters containers by one sandbox, not by a label's absence).
    pub fn attributing_unlabelled(mut self) -> Self {
        self.unlabelled = true;
        self
    }

    pub fn client(&self) -> &CriClient {
        &self.client
    }
}

fn pod_selector(pod: Option<&PodUid>) -> BTreeMap<String, String> {
    pod.map(|p| BTreeMap::from([(labels::POD_UID.to_owned(), p.to_string())]))
        .unwrap_or_default()
        .into_iter()
        .collect()
}

fn pod_of(labels: &std::collections::HashMap<String, String>) -> Option<PodUid> {
    labels.get(labels::POD_UID).and_then(|u| PodUid::parse(u))
}

/// The CRI's container state as the kubelet's.
pub fn container_state(state: i32) -> ContainerState {
    match v1::ContainerState::try_from(state) {
        Ok(v1::ContainerState::ContainerCreated) => ContainerState::Created,
        Ok(v1::ContainerState::ContainerRunning) => ContainerState::Running,
        Ok(v1::ContainerState::ContainerExited) => ContainerState::Exited,
        _ => ContainerState::Unknown,
    }
}

fn nonzero(ns: i64) -> Option<i64> {
    (ns != 0).then_some(ns)
}

/// Converts a CRI `ContainerStatus` to the kubelet's view.
pub fn convert_container_status(s: &v1::ContainerStatus) -> Option<ContainerStatus> {
    let id = ContainerId::parse(&s.id)?;
    let name = s
        .metadata
        .as_ref()
        .map(|m| m.name.clone())
        .unwrap_or_default();
    let mut c = ContainerStatus::new(id, &name, container_state(s.state), EventSource::Relist);
    c.attempt = s.metadata.as_ref().map(|m| m.attempt).unwrap_or(0);
    c.created_at = nonzero(s.created_at);
    c.started_at = nonzero(s.started_at);
    c.finished_at = nonzero(s.finished_at);
    c.exit_code = (c.state == ContainerState::Exited).then_some(s.exit_code);
    c.reason = s.reason.clone();
    c.message = s.message.clone();
    c.image = s
        .image
        .as_ref()
        .map(|i| i.image.clone())
        .unwrap_or_default();
    c.image_ref = s.image_ref.clone();
    c.hash = s
        .annotations
        .get(labels::CONTAINER_HASH)
        .and_then(|h| u64::from_str_radix(h, 16).ok());
    c.labels = s
        .labels
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    c.annotations = s
        .annotations
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Some(c)
}

/// The main process's host pid from a `verbose` status: containerd and CRI-O put
/// a JSON document under `info` whose `pid` is the task's init process. `None`
/// when absent, zero (not running) or unreadable.
pub fn pid_from_info(info: &std::collections::HashMap<String, String>) -> Option<u32> {
    let doc: serde_json::Value = serde_json::from_str(info.get("info")?).ok()?;
    let pid = doc.get("pid")?.as_u64()?;
    u32::try_from(pid).ok().filter(|p| *p > 0)
}

impl PodRuntime for CriRuntime {
    async fn list(&self, pod: Option<&PodUid>) -> Result<Vec<RuntimeEntry>, RuntimeError> {
        let (sandboxes, containers) = self.members(pod).await?;
        let mut out = Vec::with_capacity(sandboxes.len() + containers.len());
        let mut pod_of_sandbox = std::collections::HashMap::new();
        for s in &sandboxes {
            let (Some(uid), Some(id)) = (self.sandbox_pod(s), ContainerId::parse(&s.id)) else {
                continue;
            };
            pod_of_sandbox.insert(s.id.as_str(), uid.clone());
            let state = if s.state == v1::PodSandboxState::SandboxReady as i32 {
                PlegState::Running
            } else {
                PlegState::Exited
            };
            out.push(RuntimeEntry {
                pod: uid,
                id,
                sandbox: true,
                state,
            });
        }
        for c in &containers {
            let uid = match pod_of(&c.labels) {
                Some(uid) => uid,
                None if self.unlabelled => match pod_of_sandbox.get(c.pod_sandbox_id.as_str()) {
                    Some(uid) => uid.clone(),
                    None => continue,
                },
                None => continue,
            };
            let Some(id) = ContainerId::parse(&c.id) else {
                warn!(container = %c.id, "container id is not 64 hex digits; ignored");
                continue;
            };
            out.push(RuntimeEntry {
                pod: uid,
                id,
                sandbox: false,
                state: container_state(c.state).into(),
            });
        }
        if pod.is_none() {
            // Only what lives keeps its pid.
            let live: HashSet<&str> = out
                .iter()
                .filter(|e| e.state == PlegState::Running)
                .map(|e| e.id.as_str())
                .collect();
            self.pids().retain(|id, _| live.contains(id.as_str()));
            if let Some(mut remembered) = self.remembered() {
                remembered.retain(|uid, _| out.iter().any(|e| &e.pod == uid));
            }
        }
        Ok(out)
    }

    async fn pod_status(&self, pod: &PodUid) -> Result<PodStatus, RuntimeError> {
        let (sandboxes, containers) = self.members(Some(pod)).await?;
        let mut status = PodStatus {
            uid: Some(pod.clone()),
            ..PodStatus::default()
        };
        // Newest sandbox first, as the kubelet orders them; newest container
        // first too (its `getPodContainerStatuses`): the order is the
        // runtime's creation times, not its listing's, which varies.
        let mut sandboxes = sandboxes;
        sandboxes.sort_by_key(|s| std::cmp::Reverse(s.created_at));
        let mut containers = containers;
        containers.sort_by(|a, b| {
            b.created_at
                .cmp(&a.created_at)
                .then_with(|| a.id.cmp(&b.id))
        });
        // A task may be being created in the pod's shim.
        let creating = containers
            .iter()
            .any(|c| c.state == v1::ContainerState::ContainerCreated as i32);
        for s in &sandboxes {
            let Some(id) = ContainerId::parse(&s.id) else {
                continue;
            };
            let ready = s.state == v1::PodSandboxState::SandboxReady as i32;
            let known = self.known_pid(&s.id, ready);
            let verbose = ready && known.is_none() && !creating;
            let resp = match self.sandbox_status(&s.id, verbose).await {
                Ok(r) => r,
                Err(e) if e.is_not_found() => continue,
                Err(e) => return Err(e.into()),
            };
            let Some(st) = resp.status else { continue };
            if let Some(m) = &st.metadata
                && status.name.is_empty()
            {
                status.name = m.name.clone();
                status.namespace = m.namespace.clone();
            }
            // As the kubelet: the pod's IPs are the newest sandbox's, and
            // only while it is ready.
            if status.sandboxes.is_empty() && st.state == v1::PodSandboxState::SandboxReady as i32 {
                status.ips = sandbox_ips(Some(&st));
            }
            status.sandboxes.push(sandbox_status(
                id,
                &st,
                known.or_else(|| self.learn_pid(&s.id, &resp.info)),
            ));
        }
        // Taken out while the pod is inspected; put back with what it holds
        // now (an inspection that fails forgets it: the next one reads all).
        let mut remembered = self
            .remembered()
            .map(|mut m| m.remove(pod).unwrap_or_default());
        let mut exited = HashMap::new();
        for c in &containers {
            let listed_exited = c.state == v1::ContainerState::ContainerExited as i32;
            if listed_exited && let Some(s) = remembered.as_mut().and_then(|m| m.remove(&c.id)) {
                status.containers.push(s.clone());
                exited.insert(c.id.clone(), s);
                continue;
            }
            // Verbose (the pid) only for a container that may be alive and
            // whose pid is not known: one listed exited stays exited.
            let known = self.known_pid(&c.id, !listed_exited);
            let verbose = !listed_exited && known.is_none();
            let resp = match self.client.container_status(&c.id, verbose).await {
                Ok(r) => r,
                Err(e) if e.is_not_found() => continue,
                Err(e) => return Err(e.into()),
            };
            if let Some(mut s) = resp.status.as_ref().and_then(convert_container_status) {
                if s.state == ContainerState::Running {
                    s.pid = known.or_else(|| self.learn_pid(&c.id, &resp.info));
                } else {
                    self.pids().remove(&c.id);
                }
                if remembered.is_some() && s.state == ContainerState::Exited {
                    exited.insert(c.id.clone(), s.clone());
                }
                status.containers.push(s);
            }
        }
        if remembered.is_some()
            && !exited.is_empty()
            && let Some(mut m) = self.remembered()
        {
            m.insert(pod.clone(), exited);
        }
        Ok(status)
    }
}

impl CriRuntime {
    /// The pod of sandbox `s`: its label, else (attributing unlabelled ones)
    /// its id.
    fn sandbox_pod(&self, s: &v1::PodSandbox) -> Option<PodUid> {
        match pod_of(&s.labels) {
            Some(uid) => Some(uid),
            None if self.unlabelled => PodUid::parse(&s.id),
            None => None,
        }
    }

    /// The sandboxes and containers of `pod` (every one for `None`), each
    /// still to be attributed by [`Self::sandbox_pod`] and the labels.
    async fn members(
        &self,
        pod: Option<&PodUid>,
    ) -> Result<(Vec<v1::PodSandbox>, Vec<v1::Container>), CriError> {
        let selector = pod_selector(pod);
        let mut sandboxes = self
            .client
            .list_pod_sandboxes(Some(v1::PodSandboxFilter {
                label_selector: selector.clone().into_iter().collect(),
                ..Default::default()
            }))
            .await?;
        let (Some(pod), true) = (pod, self.unlabelled) else {
            let containers = self
                .client
                .list_containers(Some(v1::ContainerFilter {
                    label_selector: selector.into_iter().collect(),
                    ..Default::default()
                }))
                .await?;
            return Ok((sandboxes, containers));
        };
        // A pod named by its sandbox's id: that sandbox, if it has no label.
        if ContainerId::parse(pod.as_str()).is_some() {
            let by_id = self
                .client
                .list_pod_sandboxes(Some(v1::PodSandboxFilter {
                    id: pod.to_string(),
                    ..Default::default()
                }))
                .await?;
            sandboxes.extend(
                by_id
                    .into_iter()
                    .filter(|s| pod_of(&s.labels).is_none() && s.id == pod.as_str()),
            );
        }
        let mut containers = Vec::new();
        for s in &sandboxes {
            let listed = self
                .client
                .list_containers(Some(v1::ContainerFilter {
                    pod_sandbox_id: s.id.clone(),
                    ..Default::default()
                }))
                .await?;
            containers.extend(
                listed
                    .into_iter()
                    .filter(|c| pod_of(&c.labels).is_none_or(|uid| &uid == pod)),
            );
        }
        Ok((sandboxes, containers))
    }
}

/// A CRI `PodSandboxStatus` as the kubelet's view of a sandbox (`pid`: its
/// process, from a verbose status's info).
pub fn sandbox_status(
    id: ContainerId,
    st: &v1::PodSandboxStatus,
    pid: Option<u32>,
) -> SandboxStatus {
    SandboxStatus {
        id,
        state: if st.state == v1::PodSandboxState::SandboxReady as i32 {
            SandboxState::Ready
        } else {
            SandboxState::NotReady
        },
        attempt: st.metadata.as_ref().map(|m| m.attempt).unwrap_or(0),
        created_at: nonzero(st.created_at),
        ip: sandbox_ips(Some(st)).into_iter().next(),
        pid,
    }
}

/// A sandbox's IPs from its status (the kubelet's `determinePodSandboxIPs`):
/// the network's IP, then the additional ones, empties dropped.
pub fn sandbox_ips(status: Option<&v1::PodSandboxStatus>) -> Vec<String> {
    let Some(net) = status.and_then(|s| s.network.as_ref()) else {
        return Vec::new();
    };
    std::iter::once(net.ip.clone())
        .chain(net.additional_ips.iter().map(|a| a.ip.clone()))
        .filter(|ip| !ip.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_ips_in_order() {
        let st = v1::PodSandboxStatus {
            network: Some(v1::PodSandboxNetworkStatus {
                ip: "10.1.0.2".into(),
                additional_ips: vec![v1::PodIp {
                    ip: "fd00::2".into(),
                }],
            }),
            ..Default::default()
        };
        assert_eq!(sandbox_ips(Some(&st)), ["10.1.0.2", "fd00::2"]);
        assert!(sandbox_ips(Some(&v1::PodSandboxStatus::default())).is_empty());
        assert!(sandbox_ips(None).is_empty());
    }

    #[test]
    fn converts_a_cri_container_status() {
        let s = v1::ContainerStatus {
            id: "a".repeat(64),
            metadata: Some(v1::ContainerMetadata {
                name: "app".into(),
                attempt: 2,
            }),
            state: v1::ContainerState::ContainerExited as i32,
            created_at: 1,
            started_at: 2,
            finished_at: 3,
            exit_code: 7,
            reason: "Error".into(),
            annotations: [(labels::CONTAINER_HASH.to_owned(), "ff".to_owned())].into(),
            ..Default::default()
        };
        let c = convert_container_status(&s).unwrap();
        assert_eq!(
            (c.name.as_str(), c.attempt, c.state),
            ("app", 2, ContainerState::Exited)
        );
        assert_eq!(
            (c.started_at, c.finished_at, c.exit_code),
            (Some(2), Some(3), Some(7))
        );
        assert_eq!((c.reason.as_str(), c.hash), ("Error", Some(255)));
        let running = v1::ContainerStatus {
            state: v1::ContainerState::ContainerRunning as i32,
            ..s.clone()
        };
        assert_eq!(convert_container_status(&running).unwrap().exit_code, None);
        let bad = v1::ContainerStatus {
            id: "short".into(),
            ..s
        };
        assert!(convert_container_status(&bad).is_none());
        assert_eq!(container_state(99), ContainerState::Unknown);
    }

    #[test]
    fn main_pid_from_verbose_info() {
        let info = |s: &str| std::collections::HashMap::from([("info".to_owned(), s.to_owned())]);
        assert_eq!(
            pid_from_info(&info(r#"{"pid": 4242, "sandboxID": "x"}"#)),
            Some(4242)
        );
        assert_eq!(pid_from_info(&info(r#"{"pid": 0}"#)), None);
        assert_eq!(pid_from_info(&info(r#"{"pid": -1}"#)), None);
        assert_eq!(pid_from_info(&info("not json")), None);
        assert_eq!(pid_from_info(&std::collections::HashMap::new()), None);
    }
}
