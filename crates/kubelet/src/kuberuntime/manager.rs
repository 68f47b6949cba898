//! The kubelet's container runtime manager (`kuberuntime_manager.go`) as the pod
//! workers see it: [`KubeRuntime`] implements [`PodSyncer`] over a CRI client.
//! The work is split by concern: [`super::sync`] (SyncPod),
//! [`super::terminate`] (SyncTerminatingPod, SyncTerminatedPod),
//! [`super::cri_config`] (sandbox and container configs), [`super::cgroups`]
//! (the pod's cgroup files) and [`super::actions`] (computePodActions).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::Pod;

use super::actions::Terminal;
use super::backoff::{CrashBackoff, ImagePullBackoff};
use super::reasons::ReasonCache;
use crate::pod_workers::{PodSyncer, SyncError, SyncResult};
use crate::status::generate::{Context, generate};
use crate::status::manager::StatusManager;
use evpleg_core::cache::CacheEntry;
use evpleg_core::cgroup_path::CgroupDriver;
use evpleg_core::container::PodStatus;
use evpleg_core::ids::PodUid;
use evpleg_cri::CriClient;
use evpleg_record::Recorder;

/// The node, as SyncPod needs it.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    pub name: String,
    pub host_ip: String,
    /// The runtime's name from CRI `Version`: the scheme of container ids.
    pub runtime_name: String,
    /// How pod cgroups are named (`--cgroup-driver`).
    pub cgroup_driver: CgroupDriver,
    /// Directory for container logs (`<dir>/<ns>_<name>_<uid>/<container>/<n>.log`).
    pub log_dir: PathBuf,
    /// Cgroup mounts (cgroup2 first, then v1 hierarchies) whose pod cgroups are
    /// removed when a pod terminates.
    pub cgroup_mounts: Vec<PathBuf>,
    /// The pods' DNS settings (`--cluster-dns`, `--cluster-domain`,
    /// `--resolv-conf`).
    pub dns: crate::network::dns::Configurer,
    /// The agent's state directory (`--root-dir`): `pods/<uid>/etc-hosts`.
    pub root_dir: PathBuf,
}

/// The pod's UID, checked.
pub fn pod_uid(pod: &Pod) -> Result<PodUid, SyncError> {
    pod.metadata
        .uid
        .as_deref()
        .and_then(PodUid::parse)
        .ok_or_else(|| SyncError(format!("pod {:?} has no valid uid", pod.metadata.name)))
}

pub(super) fn unix_now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// Pod lifecycle against a CRI runtime.
#[derive(Debug)]
pub struct KubeRuntime {
    pub(super) cri: CriClient,
    pub(super) status: Arc<StatusManager>,
    pub(super) node: NodeInfo,
    pub(super) backoff: Mutex<CrashBackoff>,
    pub(super) image_backoff: Mutex<ImagePullBackoff>,
    /// The last failed pull of each pod and image, for the back-off's message.
    pub(super) pull_errors: Mutex<super::images::PullErrors>,
    pub(super) reasons: Mutex<ReasonCache>,
    pub(super) start_times: Mutex<HashMap<PodUid, i64>>,
    /// The probes' results ([`crate::prober`]).
    pub(super) probes: Arc<crate::prober::Results>,
    /// The pod events recorded ([`evpleg_record`]).
    pub(super) events: Recorder,
    /// The volume manager ([`evpleg_volume`]); without one a pod with
    /// volumes cannot start.
    pub(super) volumes: Option<Arc<evpleg_volume::VolumeManager>>,
    /// The API server (`--kubeconfig`): the ConfigMaps, Secrets and Services
    /// of containers' environments ([`crate::env`]).
    pub(super) kube: Option<crate::env::ApiClient>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
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
            image_backoff: Mutex::new(ImagePullBackoff::default()),
            pull_errors: Mutex::new(super::images::PullErrors::default()),
            reasons: Mutex::new(ReasonCache::default()),
            start_times: Mutex::new(HashMap::new()),
            probes: crate::prober::Results::new().0,
            events: Recorder::default(),
            volumes: None,
            kube: None,
        }
    }

    /// Mounts pods' volumes with this volume manager (its reconciler runs
    /// elsewhere: [`evpleg_volume::VolumeManager::run`]).
    pub fn with_volumes(mut self, volumes: Arc<evpleg_volume::VolumeManager>) -> Self {
        self.volumes = Some(volumes);
        self
    }

    /// Reads containers' ConfigMaps, Secrets and Services from this API
    /// server.
    pub fn with_kube(mut self, kube: Option<kube::Client>) -> Self {
        self.kube = kube.map(crate::env::ApiClient::new);
        self
    }

    /// Uses these probe results (the prober manager's).
    pub fn with_probes(mut self, probes: Arc<crate::prober::Results>) -> Self {
        self.probes = probes;
        self
    }

    /// Records events with this recorder (the agent's, served and written).
    pub fn with_events(mut self, events: Recorder) -> Self {
        self.events = events;
        self
    }

    /// The recorder events go to.
    pub fn events(&self) -> &Recorder {
        &self.events
    }

    /// Replaces the image pull back-off (the kubelet's 10 s to 5 min).
    pub fn with_image_pull_backoff(mut self, backoff: ImagePullBackoff) -> Self {
        self.image_backoff = Mutex::new(backoff);
        self
    }

    pub fn node(&self) -> &NodeInfo {
        &self.node
    }

    fn start_time(&self, uid: &PodUid) -> i64 {
        *lock(&self.start_times)
            .entry(uid.clone())
            .or_insert_with(unix_now_ns)
    }

    /// When the pod became active, for its deadline
    /// ([`crate::active_deadline::start_ns`]).
    pub(super) fn active_start(&self, pod: &Pod, uid: &PodUid) -> i64 {
        crate::active_deadline::start_ns(pod, self.start_time(uid))
    }

    pub(super) fn publish(
        &self,
        pod: &Arc<Pod>,
        uid: &PodUid,
        status: &PodStatus,
        terminal: Option<Terminal>,
    ) {
        // What the syncs before this one recorded: their start errors and
        // back-offs ([`super::reasons`]).
        let waiting = lock(&self.reasons).waiting(uid);
        let previous = self
            .status
            .get_pod_status(uid)
            .or_else(|| pod.status.clone());
        // A kill of the agent's own with its status (preemption), else the
        // kubelet's `ShouldEvict` in `generateAPIPodStatus`.
        let eviction = self.status.eviction(uid);
        let evicted = eviction.map(|e| (e.reason, e.message)).or_else(|| {
            crate::active_deadline::past(pod, self.active_start(pod, uid), unix_now_ns()).then_some(
                (
                    crate::active_deadline::REASON,
                    crate::active_deadline::MESSAGE,
                ),
            )
        });
        let ctx = Context {
            previous: previous.as_ref(),
            evicted,
            disruption: eviction.map(|e| e.disruption),
            terminal,
            waiting: &waiting,
            host_ip: &self.node.host_ip,
            runtime: &self.node.runtime_name,
            start_time: Some(self.start_time(uid)),
            rejected: None,
            probes: Some(&self.probes),
        };
        // Exited containers' termination messages (`toKubeContainerStatus`).
        let mut status = status.clone();
        super::termination_message::add_messages(
            pod,
            uid,
            &mut status,
            &self.node.root_dir,
            &self.node.log_dir,
        );
        let api_status = generate(pod, &status, &ctx);
        self.status.set_pod_status(uid, pod.clone(), api_status);
        self.probes.trigger_readiness(uid, pod, &status);
    }
}

impl PodSyncer for KubeRuntime {
    async fn sync_pod(&self, pod: Arc<Pod>, entry: CacheEntry) -> Result<SyncResult, SyncError> {
        KubeRuntime::sync_pod(self, pod, entry).await
    }

    async fn sync_terminating_pod(
        &self,
        pod: Arc<Pod>,
        entry: CacheEntry,
        grace_seconds: i64,
    ) -> Result<(), SyncError> {
        KubeRuntime::sync_terminating_pod(self, pod, entry, grace_seconds).await
    }

    async fn sync_terminated_pod(&self, pod: Arc<Pod>, entry: CacheEntry) -> Result<(), SyncError> {
        KubeRuntime::sync_terminated_pod(self, pod, entry).await
    }
}
