//! The kubelet's volume manager (`pkg/kubelet/volumemanager`): a desired state
//! of the world ([`desired`]: pods -> volumes to mount, filled by the
//! populator, [`populator`], from the pod spec, a claim resolved to its
//! PersistentVolume through the API server), an actual state ([`actual`]:
//! what is mounted where, per pod and node-global, as the state machines of
//! [`state`]), and a reconciler ([`reconciler`]) that sets up and tears down
//! through the volume plugins ([`plugin`]) until they agree. The pod sync
//! waits for its volumes ([`VolumeManager::wait_for_attach_and_mount`]: the
//! kubelet's `WaitForAttachAndMount`, a failure being the sync's error and a
//! FailedMount event, "Unable to attach or mount volumes: ..."); the
//! terminated pod's sync removes it from the desired state and waits for the
//! tear-downs ([`VolumeManager::wait_for_unmount`], `WaitForUnmount`) before
//! its directory goes and it is forgotten. Plugins: [`empty_dir`] (disk, and
//! `Memory` as a tmpfs sized by `sizeLimit`), [`host_path`] (with its type
//! checks), [`projection`] (configMap, secret, downwardAPI — its files from
//! [`downward_api`] — and projected with service-account tokens from the
//! TokenRequest API, [`token`]), all written with the kubelet's AtomicWriter
//! ([`atomic_writer`]), secret and projected ones on a tmpfs of their own;
//! `subPath` opened beneath its volume and bind-mounted under the pod's
//! `volume-subpaths/` in [`subpath`]; `<root-dir>/pods` (mode 0750) and its
//! orphans in [`pod_dirs`]; metrics under the kubelet's names in
//! [`metrics`].
//!
//! Differences from the kubelet: the populator is not a loop over a pod
//! manager but runs on each pod sync (the kubelet's `ReprocessPod`, which
//! its sync also does), so a pod's volumes follow its syncs; the wait is
//! bounded by [`MOUNT_WAIT`] per sync (the kubelet waits 2 min 3 s, and
//! its wait is cancelled when the pod is killed; the pod workers here have
//! no cancellation, so the sync returns and the worker retries with its
//! back-off); no reconstruction of volumes mounted by a previous agent run
//! (a tmpfs left by one is found mounted and kept; orphaned pod directories
//! are unmounted and removed by housekeeping, [`pod_dirs`]); configMaps and secrets are read from the API server at
//! each set-up (the kubelet's `Get` change detection strategy, not its
//! default watch); no attach/detach, no block volumes (`volumeDevices` is
//! refused at admission), no SELinux relabelling; emptyDir's `sizeLimit` on
//! disk is not enforced (the kubelet's eviction manager does it).
//! docs/volumes.md has the whole table.

pub mod actual;
pub mod atomic_writer;
pub mod csi;
pub mod desired;
pub mod downward_api;
pub mod empty_dir;
pub mod host_path;
pub mod metrics;
pub mod plugin;
pub mod pod_dirs;
pub mod populator;
pub mod projection;
pub mod reconciler;
pub mod state;
pub mod subpath;
pub mod token;
pub mod util;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use sha2::Digest;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use evpleg_core::ids::PodUid;
use evpleg_record::Recorder;
use plugin::{PodContext, UniqueVolumeName, VolumePluginMgr, escape_plugin_name};

/// How long a pod sync waits for its volumes before it fails (and the
/// worker retries).
pub const MOUNT_WAIT: Duration = Duration::from_secs(5);
/// How long the terminated pod's sync waits for its tear-downs.
pub const UNMOUNT_WAIT: Duration = Duration::from_secs(10);

/// What plugins may need of the node (the kubelet's `VolumeHost`).
#[derive(Clone)]
pub struct VolumeHost {
    /// `--root-dir`.
    pub root_dir: PathBuf,
    pub node_name: String,
    /// The API client, with `--kubeconfig`; configMap, secret, token and
    /// claim volumes need it.
    pub kube: Option<kube::Client>,
}

impl std::fmt::Debug for VolumeHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VolumeHost")
            .field("root_dir", &self.root_dir)
            .field("node_name", &self.node_name)
            .field("api", &self.kube.is_some())
            .finish()
    }
}

/// The built-in plugins: emptyDir, hostPath, configMap, secret, downwardAPI,
/// projected. Others (CSI) are registered on the returned manager before it
/// is handed to [`VolumeManager::new`].
pub fn builtin_plugins(host: &VolumeHost) -> VolumePluginMgr {
    let mut mgr = VolumePluginMgr::default();
    let tokens = Arc::new(token::TokenManager::new(host.kube.clone()));
    let plugins: Vec<Arc<dyn plugin::VolumePlugin>> = vec![
        Arc::new(empty_dir::EmptyDirPlugin),
        Arc::new(host_path::HostPathPlugin),
        Arc::new(projection::ProjectionPlugin::config_map(host.kube.clone())),
        Arc::new(projection::ProjectionPlugin::secret(host.kube.clone())),
        Arc::new(projection::ProjectionPlugin::downward_api()),
        Arc::new(projection::ProjectionPlugin::projected(
            host.kube.clone(),
            tokens,
        )),
    ];
    for p in plugins {
        // Distinct names: registration cannot fail.
        let _ = mgr.register(p);
    }
    mgr
}

/// Why a pod's volumes are not (un)mounted.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// The kubelet's `WaitForAttachAndMount` error (retryable).
    #[error(
        "unmounted volumes=[{}], unattached volumes=[], failed to process volumes=[{}]: {why}",
        unmounted.join(" "), failed.join(" ")
    )]
    NotMounted {
        unmounted: Vec<String>,
        failed: Vec<String>,
        why: String,
    },
    /// Tear-downs not finished (retryable).
    #[error("pod {uid}: volumes still mounted after {bound:?}: [{}] (retryable)", volumes.join(" "))]
    StillMounted {
        uid: PodUid,
        bound: Duration,
        volumes: Vec<String>,
    },
}

/// A pod's set-up volume, as container mounts need it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodVolume {
    pub host_path: PathBuf,
    /// The plugin mounts it read-only for every container.
    pub read_only: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Worlds {
    pub desired: desired::DesiredStateOfWorld,
    pub actual: actual::ActualStateOfWorld,
    pub pending: reconciler::Pending,
    /// The last set-up error of a pod's volume.
    pub last_errors: BTreeMap<(PodUid, String), String>,
}

#[derive(Debug)]
pub(crate) struct Shared {
    root_dir: PathBuf,
    events: Recorder,
    metrics: metrics::VolumeMetrics,
    worlds: Mutex<Worlds>,
    changes: watch::Sender<u64>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Worlds> {
        self.worlds.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n += 1);
    }
}

/// The volume manager: states, populator, reconciler.
#[derive(Debug)]
pub struct VolumeManager {
    shared: Arc<Shared>,
    plugins: VolumePluginMgr,
    host: VolumeHost,
}

impl VolumeManager {
    pub fn new(host: VolumeHost, plugins: VolumePluginMgr, events: Recorder) -> Self {
        let (changes, _) = watch::channel(0);
        Self {
            shared: Arc::new(Shared {
                root_dir: host.root_dir.clone(),
                events,
                metrics: metrics::VolumeMetrics::default(),
                worlds: Mutex::new(Worlds::default()),
                changes,
            }),
            plugins,
            host,
        }
    }

    /// The reconciler's loop, until `shutdown`: a pass on every change of the
    /// states, at the end of an operation's back-off, and every
    /// [`reconciler::IDLE_PERIOD`] otherwise ([`reconciler::wait_after`]).
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let mut rx = self.shared.changes.subscribe();
        loop {
            let backoff_end = reconciler::pass(&self.shared);
            let wait = reconciler::wait_after(backoff_end, tokio::time::Instant::now());
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
                _ = rx.changed() => {}
            }
        }
    }

    /// The populator for one pod (its `ReprocessPod`): the pod's volumes
    /// become desired, and those mounted whose plugin requires it are set up
    /// again.
    pub async fn add_pod(&self, pod: &Arc<Pod>, uid: &PodUid) {
        let ctx = PodContext {
            uid: uid.clone(),
            pod: pod.clone(),
        };
        let desired = populator::desired_pod(&self.plugins, self.host.kube.as_ref(), ctx).await;
        {
            let mut w = self.shared.lock();
            w.desired.set_pod(desired);
            w.actual.mark_remount_required(uid);
        }
        self.shared.changed();
    }

    /// The pod's volumes are no longer desired: the reconciler tears them down.
    pub fn remove_pod(&self, uid: &PodUid) {
        {
            let mut w = self.shared.lock();
            w.desired.remove_pod(uid);
            w.last_errors.retain(|(u, _), _| u != uid);
        }
        self.shared.changed();
    }

    /// Waits (at most `bound`) until every volume of the pod is mounted.
    pub async fn wait_for_attach_and_mount(
        &self,
        uid: &PodUid,
        bound: Duration,
    ) -> Result<(), VolumeError> {
        let check = |w: &Worlds| {
            let Some(p) = w.desired.pod(uid) else {
                return (Vec::new(), Vec::new());
            };
            let mounted = w.actual.mounted_for_pod(uid);
            // The pod's volumes not mounted, those that could not be
            // processed included (the kubelet's expected volumes).
            let names: std::collections::BTreeSet<&String> =
                p.volumes.keys().chain(p.errors.keys()).collect();
            let unmounted = (names.into_iter())
                .filter(|n| !mounted.contains_key(*n))
                .cloned()
                .collect();
            (unmounted, p.errors.keys().cloned().collect())
        };
        // Volumes that could not be processed (a claim not bound, no plugin)
        // stay so until the pod's next sync reprocesses it: no wait.
        let failed_now = self
            .shared
            .lock()
            .desired
            .pod(uid)
            .is_some_and(|p| !p.errors.is_empty());
        let waited = if failed_now {
            Err(())
        } else {
            self.wait(bound, |w| {
                let (u, f): (Vec<String>, Vec<String>) = check(w);
                u.is_empty() && f.is_empty()
            })
            .await
        };
        waited.map_err(|()| {
            let (unmounted, failed) = check(&self.shared.lock());
            let why = {
                let w = self.shared.lock();
                let errors: Vec<String> = w
                    .desired
                    .pod(uid)
                    .map(|p| p.errors.values().cloned().collect())
                    .unwrap_or_default();
                if errors.is_empty() {
                    "timed out waiting for the condition".to_owned()
                } else {
                    errors.join("; ")
                }
            };
            VolumeError::NotMounted {
                unmounted,
                failed,
                why,
            }
        })
    }

    /// Waits (at most `bound`) until nothing is mounted for the pod and no
    /// operation of the pod is running (a set-up still in flight when the
    /// pod was removed is torn down after it ends).
    pub async fn wait_for_unmount(&self, uid: &PodUid, bound: Duration) -> Result<(), VolumeError> {
        self.wait(bound, |w| {
            w.actual.pod_has_volumes(uid).is_empty() && !w.pending.pod_running(uid)
        })
        .await
        .map_err(|()| VolumeError::StillMounted {
            uid: uid.clone(),
            bound,
            volumes: self.shared.lock().actual.pod_has_volumes(uid),
        })?;
        self.shared.lock().pending.forget_pod(uid);
        Ok(())
    }

    async fn wait(&self, bound: Duration, done: impl Fn(&Worlds) -> bool) -> Result<(), ()> {
        let mut rx = self.shared.changes.subscribe();
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            rx.borrow_and_update();
            if done(&self.shared.lock()) {
                return Ok(());
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return Err(()),
            }
        }
    }

    /// The pod's mounted volumes by their name in the pod (the kubelet's
    /// `GetMountedVolumesForPod`), for its containers' mounts.
    pub fn pod_volumes(&self, uid: &PodUid) -> BTreeMap<String, PodVolume> {
        let w = self.shared.lock();
        w.actual
            .mounted_for_pod(uid)
            .into_iter()
            .map(|(n, m)| {
                let v = PodVolume {
                    host_path: m.host_path.clone(),
                    read_only: m.attributes.read_only,
                };
                (n, v)
            })
            .collect()
    }

    /// The last set-up error of each of the pod's volumes not mounted.
    pub fn errors(&self, uid: &PodUid) -> BTreeMap<String, String> {
        let w = self.shared.lock();
        w.last_errors
            .iter()
            .filter(|((u, _), _)| u == uid)
            .map(|((_, n), e)| (n.clone(), e.clone()))
            .collect()
    }

    pub fn root_dir(&self) -> &Path {
        &self.host.root_dir
    }

    /// Registers the manager's metrics ([`metrics`]).
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "storage_operation_duration_seconds",
            "Storage operation duration",
            self.shared.metrics.duration.clone(),
        );
        registry.register_collector(Box::new(metrics::TotalVolumes(self.shared.clone())));
    }
}

/// `<root-dir>/pods/<uid>/volumes/<plugin, / as ~>/<volume name>` (the
/// kubelet's `getPodVolumeDir`).
pub fn pod_volume_dir(root: &Path, uid: &PodUid, plugin: &str, volume: &str) -> PathBuf {
    root.join("pods")
        .join(uid.as_str())
        .join("volumes")
        .join(escape_plugin_name(plugin))
        .join(volume)
}

/// `<root-dir>/plugins/<plugin, / as ~>/globalmount/<sha256 of the unique
/// name>`: a device-mountable volume's node-global directory.
pub fn device_mount_path(root: &Path, plugin: &str, unique: &UniqueVolumeName) -> PathBuf {
    let hash = sha2::Sha256::digest(unique.0.as_bytes());
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    root.join("plugins")
        .join(escape_plugin_name(plugin))
        .join("globalmount")
        .join(hex)
}

#[cfg(test)]
mod tests;
