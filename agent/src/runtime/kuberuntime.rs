//! SyncPod against the CRI: the kubelet's `SyncPod`, `SyncTerminatingPod` and
//! `SyncTerminatedPod` (`kubelet.go`, `kuberuntime_manager.go`).
//!
//! Each sync generates the pod's API status and hands it to the status manager,
//! computes the actions ([`super::actions`]) and carries them out: sandbox
//! (host network, or the pod's own network namespace, which needs CNI), image
//! present or pulled, init containers one by one, app containers with command,
//! args, env, working dir and CPU/memory resources, kills of changed containers,
//! CrashLoopBackOff. Termination stops the containers with the grace period
//! (StopContainer sends SIGTERM, then SIGKILL), stops and removes the sandbox and
//! removes the pod's cgroup, as the kubelet does after RemovePodSandbox leaves it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use evpleg_cri_api::v1;
use k8s_openapi::api::core::v1::{Container, Pod};
use tracing::{info, warn};

use super::actions::{PodActions, Terminal, compute_pod_actions, container_hash, latest};
use super::backoff::CrashBackoff;
use super::labels;
use super::qos::qos_class;
use super::quantity::{parse_milli, parse_units};
use crate::container::{ContainerState, PodStatus};
use crate::cri::CriClient;
use crate::pleg::PodUid;
use crate::pleg::cache::CacheEntry;
use crate::pleg::kernel::cgroup_path::{CgroupDriver, pod_cgroup_path};
use crate::pod_workers::{PodSyncer, SyncError, SyncResult, spec_grace_seconds};
use crate::status::generate::{Context, generate};
use crate::status::manager::StatusManager;

/// CFS period used for CPU limits (µs), as the kubelet's.
const CPU_PERIOD_US: i64 = 100_000;

/// The node, as SyncPod needs it.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    pub name: String,
    pub host_ip: String,
    /// Directory for container logs (`<dir>/<ns>_<name>_<uid>/<container>/<n>.log`).
    pub log_dir: PathBuf,
    /// Cgroup mounts (cgroup2 first, then v1 hierarchies) whose pod cgroups are
    /// removed when a pod terminates.
    pub cgroup_mounts: Vec<PathBuf>,
}

/// The pod's UID, checked.
pub fn pod_uid(pod: &Pod) -> Result<PodUid, SyncError> {
    pod.metadata
        .uid
        .as_deref()
        .and_then(PodUid::parse)
        .ok_or_else(|| SyncError(format!("pod {:?} has no valid uid", pod.metadata.name)))
}

fn unix_now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

fn host_network(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.host_network)
        .unwrap_or(false)
}

fn name_ns(pod: &Pod) -> (String, String) {
    (
        pod.metadata.name.clone().unwrap_or_default(),
        pod.metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into()),
    )
}

/// The CRI sandbox config of `pod`.
pub fn sandbox_config(
    pod: &Pod,
    uid: &PodUid,
    attempt: u32,
    node: &NodeInfo,
) -> v1::PodSandboxConfig {
    let (name, namespace) = name_ns(pod);
    let spec = pod.spec.clone().unwrap_or_default();
    let mut sandbox_labels: HashMap<String, String> = pod
        .metadata
        .labels
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    sandbox_labels.insert(labels::POD_NAME.into(), name.clone());
    sandbox_labels.insert(labels::POD_NAMESPACE.into(), namespace.clone());
    sandbox_labels.insert(labels::POD_UID.into(), uid.to_string());
    let mode = |node_wide: bool, shared: bool| {
        if node_wide {
            v1::NamespaceMode::Node as i32
        } else if shared {
            v1::NamespaceMode::Pod as i32
        } else {
            v1::NamespaceMode::Container as i32
        }
    };
    let host_net = spec.host_network.unwrap_or(false);
    v1::PodSandboxConfig {
        metadata: Some(v1::PodSandboxMetadata {
            name: name.clone(),
            uid: uid.to_string(),
            namespace: namespace.clone(),
            attempt,
        }),
        // A host-network sandbox has no UTS namespace of its own to name.
        hostname: if host_net {
            String::new()
        } else {
            name.clone()
        },
        log_directory: node
            .log_dir
            .join(format!("{namespace}_{name}_{uid}"))
            .to_string_lossy()
            .into_owned(),
        labels: sandbox_labels,
        annotations: pod
            .metadata
            .annotations
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect(),
        linux: Some(v1::LinuxPodSandboxConfig {
            cgroup_parent: pod_cgroup_path(CgroupDriver::Cgroupfs, qos_class(pod), uid),
            security_context: Some(v1::LinuxSandboxSecurityContext {
                namespace_options: Some(v1::NamespaceOption {
                    network: mode(host_net, true),
                    pid: mode(
                        spec.host_pid.unwrap_or(false),
                        spec.share_process_namespace.unwrap_or(false),
                    ),
                    ipc: mode(spec.host_ipc.unwrap_or(false), true),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The CRI container config of `c` (its `attempt`-th instance).
pub fn container_config(
    pod: &Pod,
    uid: &PodUid,
    c: &Container,
    attempt: u32,
) -> Result<v1::ContainerConfig, SyncError> {
    let (name, namespace) = name_ns(pod);
    let mut envs = Vec::new();
    for e in c.env.iter().flatten() {
        if e.value_from.is_some() {
            return Err(SyncError(format!(
                "container {} of pod {namespace}/{name}: env {} uses valueFrom, which is not supported",
                c.name, e.name
            )));
        }
        envs.push(v1::KeyValue {
            key: e.name.clone(),
            value: e.value.clone().unwrap_or_default(),
        });
    }
    let mut resources = v1::LinuxContainerResources::default();
    let requests = c
        .resources
        .as_ref()
        .and_then(|r| r.requests.clone())
        .unwrap_or_default();
    let limits = c
        .resources
        .as_ref()
        .and_then(|r| r.limits.clone())
        .unwrap_or_default();
    let bad = |what: &str, e: super::quantity::QuantityError| {
        SyncError(format!(
            "container {} of pod {namespace}/{name}: {what}: {e}",
            c.name
        ))
    };
    let cpu_request = requests.get("cpu").or(limits.get("cpu"));
    if let Some(q) = cpu_request {
        let milli = parse_milli(&q.0).map_err(|e| bad("cpu request", e))?;
        resources.cpu_shares = (milli * 1024 / 1000).max(2);
    } else {
        resources.cpu_shares = 2;
    }
    if let Some(q) = limits.get("cpu") {
        let milli = parse_milli(&q.0).map_err(|e| bad("cpu limit", e))?;
        resources.cpu_period = CPU_PERIOD_US;
        resources.cpu_quota = (milli * CPU_PERIOD_US / 1000).max(1000);
    }
    if let Some(q) = limits.get("memory") {
        resources.memory_limit_in_bytes = parse_units(&q.0).map_err(|e| bad("memory limit", e))?;
    }
    let container_labels = HashMap::from([
        (labels::POD_NAME.to_owned(), name.clone()),
        (labels::POD_NAMESPACE.to_owned(), namespace.clone()),
        (labels::POD_UID.to_owned(), uid.to_string()),
        (labels::CONTAINER_NAME.to_owned(), c.name.clone()),
    ]);
    let annotations = HashMap::from([
        (
            labels::CONTAINER_HASH.to_owned(),
            format!("{:x}", container_hash(c)),
        ),
        (
            labels::CONTAINER_RESTART_COUNT.to_owned(),
            attempt.to_string(),
        ),
        (
            labels::TERMINATION_GRACE_PERIOD.to_owned(),
            spec_grace_seconds(pod).to_string(),
        ),
    ]);
    Ok(v1::ContainerConfig {
        metadata: Some(v1::ContainerMetadata {
            name: c.name.clone(),
            attempt,
        }),
        image: Some(v1::ImageSpec {
            image: c.image.clone().unwrap_or_default(),
            ..Default::default()
        }),
        command: c.command.clone().unwrap_or_default(),
        args: c.args.clone().unwrap_or_default(),
        working_dir: c.working_dir.clone().unwrap_or_default(),
        envs,
        labels: container_labels,
        annotations,
        log_path: format!("{}/{attempt}.log", c.name),
        linux: Some(v1::LinuxContainerConfig {
            resources: Some(resources),
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// Pod lifecycle against a CRI runtime.
#[derive(Debug)]
pub struct KubeRuntime {
    cri: CriClient,
    status: Arc<StatusManager>,
    node: NodeInfo,
    backoff: Mutex<CrashBackoff>,
    start_times: Mutex<HashMap<PodUid, i64>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl KubeRuntime {
    pub fn new(
        cri: CriClient,
        status: Arc<StatusManager>,
        node: NodeInfo,
        backoff: CrashBackoff,
    ) -> Self {
        Self {
            cri,
            status,
            node,
            backoff: Mutex::new(backoff),
            start_times: Mutex::new(HashMap::new()),
        }
    }

    pub fn node(&self) -> &NodeInfo {
        &self.node
    }

    fn start_time(&self, uid: &PodUid) -> i64 {
        *lock(&self.start_times)
            .entry(uid.clone())
            .or_insert_with(unix_now_ns)
    }

    fn publish(
        &self,
        pod: &Arc<Pod>,
        uid: &PodUid,
        status: &PodStatus,
        actions: &PodActions,
        terminal: Option<Terminal>,
    ) {
        let ctx = Context {
            terminal,
            backoff: &actions.backoff,
            host_ip: &self.node.host_ip,
            start_time: Some(self.start_time(uid)),
            rejected: None,
        };
        self.status
            .set_pod_status(uid, pod.clone(), generate(pod, status, &ctx));
    }

    async fn ensure_image(&self, image: &str) -> Result<(), SyncError> {
        let spec = v1::ImageSpec {
            image: image.to_owned(),
            ..Default::default()
        };
        let present = self
            .cri
            .image_status(&spec, false)
            .await
            .map_err(|e| SyncError(e.to_string()))?
            .image
            .is_some();
        if !present {
            info!(image, "pulling image");
            self.cri.pull_image(&spec, None, None).await.map_err(|e| {
                SyncError(format!(
                    "image {image} is not present and could not be pulled: {e}"
                ))
            })?;
        }
        Ok(())
    }

    async fn start_container(
        &self,
        pod: &Pod,
        uid: &PodUid,
        sandbox_id: &str,
        sandbox: &v1::PodSandboxConfig,
        c: &Container,
        status: &PodStatus,
    ) -> Result<(), SyncError> {
        let previous = latest(status, &c.name);
        let attempt = previous.map(|p| p.attempt + 1).unwrap_or(0);
        self.ensure_image(c.image.as_deref().unwrap_or_default())
            .await?;
        let config = container_config(pod, uid, c, attempt)?;
        let id = self
            .cri
            .create_container(sandbox_id, &config, sandbox)
            .await
            .map_err(|e| SyncError(e.to_string()))?;
        self.cri
            .start_container(&id)
            .await
            .map_err(|e| SyncError(e.to_string()))?;
        if previous.is_some() {
            lock(&self.backoff).restarted(uid, &c.name, unix_now_ns());
        }
        info!(pod = %uid, container = %c.name, attempt, id = %id, "container started");
        Ok(())
    }

    /// Stops every container and sandbox of the pod, as the runtime lists them now.
    async fn kill_pod(&self, uid: &PodUid, grace: i64) -> Result<(), SyncError> {
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
        let stops = containers
            .iter()
            .filter(|c| c.state == v1::ContainerState::ContainerRunning as i32)
            .map(|c| self.cri.stop_container(&c.id, grace));
        // In parallel, as the kubelet stops a pod's containers.
        for r in futures::future::join_all(stops).await {
            r.map_err(|e| SyncError(e.to_string()))?;
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
        Ok(())
    }
}

impl PodSyncer for KubeRuntime {
    async fn sync_pod(&self, pod: Arc<Pod>, entry: CacheEntry) -> Result<SyncResult, SyncError> {
        let uid = pod_uid(&pod)?;
        let now = unix_now_ns();
        let actions = {
            let backoff = lock(&self.backoff);
            compute_pod_actions(&pod, &uid, &entry.status, &backoff, now)
        };
        self.publish(&pod, &uid, &entry.status, &actions, actions.terminal);
        if actions.terminal.is_some() {
            return Ok(SyncResult {
                terminal: true,
                ..SyncResult::default()
            });
        }
        let grace = spec_grace_seconds(&pod);
        if actions.kill_pod {
            self.kill_pod(&uid, grace).await?;
        }
        for k in &actions.kill {
            info!(pod = %uid, container = %k.name, reason = k.reason, "killing container");
            self.cri
                .stop_container(k.id.as_str(), grace)
                .await
                .map_err(|e| SyncError(e.to_string()))?;
        }
        let spec = pod.spec.clone().unwrap_or_default();
        let sandbox_config = sandbox_config(&pod, &uid, actions.sandbox_attempt, &self.node);
        let sandbox_id = if actions.create_sandbox {
            if !host_network(&pod) {
                warn!(pod = %uid, "pod without hostNetwork: the runtime needs a CNI configuration for its network");
            }
            let id = self
                .cri
                .run_pod_sandbox(&sandbox_config, "")
                .await
                .map_err(|e| SyncError(e.to_string()))?;
            info!(pod = %uid, sandbox = %id, "sandbox created");
            id
        } else {
            actions
                .sandbox
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default()
        };
        // A fresh sandbox starts its containers from scratch.
        let empty = PodStatus::default();
        let status = if actions.create_sandbox {
            &empty
        } else {
            &entry.status
        };
        if let Some(i) = actions.start_init {
            let c = &spec
                .init_containers
                .as_ref()
                .map(|v| v[i].clone())
                .unwrap_or_default();
            self.start_container(&pod, &uid, &sandbox_id, &sandbox_config, c, status)
                .await?;
        }
        for j in &actions.start {
            let c = &spec.containers[*j];
            if let Err(e) = self
                .start_container(&pod, &uid, &sandbox_id, &sandbox_config, c, status)
                .await
            {
                warn!(pod = %uid, container = %c.name, error = %e, "container start failed");
                return Err(e);
            }
        }
        Ok(SyncResult {
            terminal: false,
            requeue_after: actions.backoff.iter().map(|(_, d)| *d).min(),
            did_runtime_work: actions.does_runtime_work(),
        })
    }

    async fn sync_terminating_pod(
        &self,
        pod: Arc<Pod>,
        entry: CacheEntry,
        grace_seconds: i64,
    ) -> Result<(), SyncError> {
        let uid = pod_uid(&pod)?;
        info!(pod = %uid, grace_seconds, "terminating pod");
        self.kill_pod(&uid, grace_seconds).await?;
        // The final status: what ran, terminal by the containers' exits.
        let mut status = (*entry.status).clone();
        for c in &mut status.containers {
            if c.state == ContainerState::Running {
                c.state = ContainerState::Exited;
            }
        }
        let terminal = if status
            .containers
            .iter()
            .all(|c| c.exit_code.unwrap_or(1) == 0)
            && !status.containers.is_empty()
        {
            Terminal::Succeeded
        } else {
            Terminal::Failed
        };
        let actions = PodActions::default();
        self.publish(&pod, &uid, &status, &actions, Some(terminal));
        Ok(())
    }

    async fn sync_terminated_pod(
        &self,
        pod: Arc<Pod>,
        _entry: CacheEntry,
    ) -> Result<(), SyncError> {
        let uid = pod_uid(&pod)?;
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
        remove_pod_cgroups(&self.node.cgroup_mounts, &pod, &uid);
        lock(&self.backoff).forget(&uid);
        lock(&self.start_times).remove(&uid);
        info!(pod = %uid, sandboxes = sandboxes.len(), "pod terminated: sandboxes and cgroup removed");
        Ok(())
    }
}

/// Removes the pod's (empty) cgroup in every hierarchy; RemovePodSandbox leaves it.
pub fn remove_pod_cgroups(mounts: &[PathBuf], pod: &Pod, uid: &PodUid) {
    let rel = pod_cgroup_path(CgroupDriver::Cgroupfs, qos_class(pod), uid);
    for mount in mounts {
        let dir = mount.join(rel.trim_start_matches('/'));
        match std::fs::remove_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => warn!(path = %dir.display(), error = %e, "cannot remove pod cgroup"),
        }
    }
}

/// How long to wait before a container in back-off can restart (for logs).
pub fn describe_backoff(backoff: &[(String, Duration)]) -> String {
    backoff
        .iter()
        .map(|(n, d)| format!("{n}: {}s", d.as_secs()))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "ns", "uid": "a".repeat(32), "labels": {"app": "web"}},
            "spec": {
                "hostNetwork": true,
                "terminationGracePeriodSeconds": 5,
                "containers": [{
                    "name": "app", "image": "localhost/busybox:latest",
                    "command": ["sh", "-c"], "args": ["exit 3"], "workingDir": "/tmp",
                    "env": [{"name": "A", "value": "1"}],
                    "resources": {"requests": {"cpu": "250m"}, "limits": {"cpu": "500m", "memory": "64Mi"}}
                }]
            }
        }))
        .unwrap()
    }

    fn node() -> NodeInfo {
        NodeInfo {
            name: "n".into(),
            host_ip: "10.0.0.1".into(),
            log_dir: "/var/log/pods".into(),
            cgroup_mounts: vec![],
        }
    }

    #[test]
    fn sandbox_config_for_a_host_network_pod() {
        let p = pod();
        let uid = pod_uid(&p).unwrap();
        let s = sandbox_config(&p, &uid, 1, &node());
        let m = s.metadata.as_ref().unwrap();
        assert_eq!(
            (m.name.as_str(), m.namespace.as_str(), m.attempt),
            ("web", "ns", 1)
        );
        assert_eq!(s.hostname, "");
        assert_eq!(s.labels.get(labels::POD_UID).unwrap(), &uid.to_string());
        assert_eq!(s.labels.get("app").unwrap(), "web");
        let linux = s.linux.unwrap();
        assert_eq!(linux.cgroup_parent, format!("/kubepods/burstable/pod{uid}"));
        let ns = linux.security_context.unwrap().namespace_options.unwrap();
        assert_eq!(ns.network, v1::NamespaceMode::Node as i32);
        assert_eq!(ns.pid, v1::NamespaceMode::Container as i32);
    }

    #[test]
    fn container_config_maps_the_spec() {
        let p = pod();
        let uid = pod_uid(&p).unwrap();
        let c = &p.spec.as_ref().unwrap().containers[0];
        let cfg = container_config(&p, &uid, c, 2).unwrap();
        assert_eq!(cfg.command, ["sh", "-c"]);
        assert_eq!(cfg.args, ["exit 3"]);
        assert_eq!(cfg.working_dir, "/tmp");
        assert_eq!(cfg.envs[0].key, "A");
        assert_eq!(cfg.metadata.as_ref().unwrap().attempt, 2);
        let r = cfg.linux.unwrap().resources.unwrap();
        assert_eq!(
            (
                r.cpu_shares,
                r.cpu_quota,
                r.cpu_period,
                r.memory_limit_in_bytes
            ),
            (256, 50_000, 100_000, 64 << 20)
        );
        assert_eq!(
            cfg.annotations.get(labels::CONTAINER_HASH).unwrap(),
            &format!("{:x}", container_hash(c))
        );
        let mut bad = c.clone();
        bad.env = Some(vec![serde_json::from_value(serde_json::json!({"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})).unwrap()]);
        let err = container_config(&p, &uid, &bad, 0).unwrap_err();
        assert!(err.0.contains("env X uses valueFrom"), "{err}");
    }
}
