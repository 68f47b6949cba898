//! The CSI volume plugin (`kubernetes.io/csi`): the kubelet's `csiPlugin`
//! with its attacher's device mount (`csi_attacher.go` `MountDevice` /
//! `UnmountDevice`: NodeStageVolume / NodeUnstageVolume) and its mounter
//! (`csi_mounter.go` `SetUp` / `TearDown`: NodePublishVolume /
//! NodeUnpublishVolume), behind the volume manager's [`VolumePlugin`].
//!
//! As the kubelet: a PV with `spec.csi` is device-mountable, keyed
//! `kubernetes.io/csi/<driver>^<handle>` (one staging per node, whatever the
//! pods); its staging path is [`paths::staging_path`]; staging asks
//! NodeGetCapabilities and is skipped (only the directory and
//! `vol_data.json` made) without STAGE_UNSTAGE_VOLUME; an inline `csi:`
//! volume is per pod and never staged; the publish target is
//! `<pod volume dir>/mount`, whose parent gets `vol_data.json`; a final
//! failure removes the directories it made, an uncertain one keeps them
//! (and the manager's tear-down or unmount is then due); containers get the
//! volume read-only if it is. Where it differs: see [`super`] and
//! [`super::spec`].

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use async_trait::async_trait;

use super::client::CsiClient;
use super::drivers::CsiDrivers;
use super::error::CsiError;
use super::paths::{self, PLUGIN_NAME};
use super::spec::{CsiVolume, LifecycleMode};
use super::state::{PublishEvent, PublishState, StageEvent, StageState};
use crate::plugin::{
    Attributes, PluginError, SetUpArgs, Spec, TearDownArgs, UniqueVolumeName, VolumePlugin,
    VolumeSource,
};
use evpleg_core::ids::PodUid;

/// The kubelet's separator of driver and handle in a CSI volume's name.
pub const VOL_NAME_SEP: &str = "^";

/// The CSI volume plugin.
#[derive(Debug)]
pub struct CsiPlugin {
    root_dir: PathBuf,
    node_name: String,
    drivers: CsiDrivers,
    /// Staged volumes by (driver, handle).
    staged: Mutex<HashMap<(String, String), StageState>>,
    /// Publications by target path.
    published: Mutex<HashMap<PathBuf, PublishState>>,
}

fn to_plugin_error(e: CsiError) -> PluginError {
    if e.is_uncertain() {
        PluginError::Uncertain(e.to_string())
    } else {
        PluginError::Failed(e.to_string())
    }
}

impl CsiPlugin {
    pub fn new(root_dir: &Path, node_name: &str, drivers: CsiDrivers) -> Self {
        Self {
            root_dir: root_dir.to_owned(),
            node_name: node_name.to_owned(),
            drivers,
            staged: Mutex::new(HashMap::new()),
            published: Mutex::new(HashMap::new()),
        }
    }

    /// The CSI volume of `spec` for the pod `uid`.
    pub fn volume(spec: &Spec, uid: &str) -> Result<CsiVolume, CsiError> {
        match &spec.source {
            VolumeSource::Inline(v) => {
                let src = v.csi.as_ref().ok_or_else(|| CsiError::InvalidSpec {
                    volume: spec.name.clone(),
                    reason: "not a csi volume".into(),
                })?;
                CsiVolume::inline(uid, &spec.name, src)
            }
            VolumeSource::Persistent { volume, .. } => {
                CsiVolume::persistent(&spec.name, volume, spec.read_only)
            }
        }
    }

    fn client(&self, v: &CsiVolume) -> Result<CsiClient, CsiError> {
        self.drivers.client(&v.driver)
    }

    fn stage_state(&self, v: &CsiVolume) -> Option<StageState> {
        let map = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        map.get(&(v.driver.clone(), v.handle.clone())).copied()
    }

    fn stage_event(&self, v: &CsiVolume, event: &StageEvent) -> StageState {
        let mut map = self.staged.lock().unwrap_or_else(|e| e.into_inner());
        let key = (v.driver.clone(), v.handle.clone());
        let next = map
            .get(&key)
            .copied()
            .unwrap_or(StageState::Unstaged)
            .on(event);
        if next == StageState::Unstaged {
            map.remove(&key);
        } else {
            map.insert(key, next);
        }
        next
    }

    fn publish_event(&self, target: &Path, event: &PublishEvent) -> PublishState {
        let mut map = self.published.lock().unwrap_or_else(|e| e.into_inner());
        let next = map
            .get(target)
            .copied()
            .unwrap_or(PublishState::Unpublished)
            .on(event);
        if next == PublishState::Unpublished {
            map.remove(target);
        } else {
            map.insert(target.to_owned(), next);
        }
        next
    }

    /// The staging path of `v`: the kubelet's, for a persistent volume (what
    /// [`VolumePlugin::device_mount_path`] gives the manager).
    pub fn staging_path(&self, v: &CsiVolume) -> PathBuf {
        paths::staging_path(&self.root_dir, &v.driver, &v.handle)
    }

    /// A persistent volume's staging state: known from this run, else (after
    /// a restart) staged if its directory exists.
    async fn staged_for_publish(
        &self,
        v: &CsiVolume,
        client: &CsiClient,
    ) -> Result<Option<PathBuf>, CsiError> {
        if !v.stages() {
            return Ok(None);
        }
        let staging = self.staging_path(v);
        match self.stage_state(v) {
            Some(StageState::Staged) => Ok(Some(staging)),
            Some(StageState::NotNeeded) => Ok(None),
            // Unknown or uncertain: as the kubelet's SetUpAt, the driver's
            // capability decides whether a staging path is passed.
            _ => Ok(client
                .node_get_capabilities()
                .await?
                .stage_unstage
                .then_some(staging)),
        }
    }

    async fn mount_device_csi(&self, spec: &Spec, staging: &Path) -> Result<(), CsiError> {
        let v = Self::volume(spec, "")?;
        let client = self.client(&v)?;
        std::fs::create_dir_all(staging).map_err(|e| CsiError::io("staging dir", staging, e))?;
        if let Some(parent) = staging.parent() {
            let data = BTreeMap::from([
                ("driverName", v.driver.clone()),
                ("volumeHandle", v.handle.clone()),
            ]);
            paths::save_volume_data(parent, &data)?;
        }
        let caps = client.node_get_capabilities().await?;
        if !caps.stage_unstage {
            self.stage_event(&v, &StageEvent::StageSkipped);
            return Ok(());
        }
        match client.node_stage_volume(v.stage_request(staging)).await {
            Ok(()) => {
                self.stage_event(&v, &StageEvent::StageSucceeded);
                Ok(())
            }
            Err(e) => {
                let uncertain = e.is_uncertain();
                self.stage_event(&v, &StageEvent::StageFailed { uncertain });
                if !uncertain {
                    let _ = paths::remove_mount_dir(staging);
                }
                Err(e)
            }
        }
    }

    async fn unmount_device_csi(&self, spec: &Spec, staging: &Path) -> Result<(), CsiError> {
        let v = Self::volume(spec, "")?;
        let client = self.client(&v)?;
        let caps = client.node_get_capabilities().await?;
        if caps.stage_unstage
            && let Err(e) = client.node_unstage_volume(v.unstage_request(staging)).await
        {
            self.stage_event(&v, &StageEvent::UnstageFailed);
            return Err(e);
        }
        self.stage_event(&v, &StageEvent::UnstageSucceeded);
        paths::remove_mount_dir(staging)
    }

    async fn set_up_csi(&self, args: SetUpArgs<'_>) -> Result<(), CsiError> {
        let v = Self::volume(args.spec, args.pod.uid.as_str())?;
        let client = self.client(&v)?;
        let staging = self.staged_for_publish(&v, &client).await?;
        let target = paths::target_path(args.dir);
        let mode = match v.mode {
            LifecycleMode::Persistent => "Persistent",
            LifecycleMode::Ephemeral => "Ephemeral",
        };
        let data = BTreeMap::from([
            ("specVolID", v.name.clone()),
            ("volumeHandle", v.handle.clone()),
            ("driverName", v.driver.clone()),
            ("nodeName", self.node_name.clone()),
            ("volumeLifecycleMode", mode.to_owned()),
        ]);
        paths::save_volume_data(args.dir, &data)?;
        let req = v.publish_request(&args.pod.pod, &target, staging.as_deref());
        match client.node_publish_volume(req).await {
            Ok(()) => {
                self.publish_event(&target, &PublishEvent::PublishSucceeded);
                Ok(())
            }
            Err(e) => {
                let uncertain = e.is_uncertain();
                let state = self.publish_event(&target, &PublishEvent::PublishFailed { uncertain });
                if !state.needs_unpublish() {
                    let _ = paths::remove_mount_dir(&target);
                }
                Err(e)
            }
        }
    }

    async fn tear_down_csi(&self, args: TearDownArgs<'_>) -> Result<(), CsiError> {
        let v = Self::volume(args.spec, args.pod_uid.as_str())?;
        let target = paths::target_path(args.dir);
        let client = self.client(&v)?;
        if let Err(e) = client
            .node_unpublish_volume(v.unpublish_request(&target))
            .await
        {
            self.publish_event(&target, &PublishEvent::UnpublishFailed);
            return Err(e);
        }
        self.publish_event(&target, &PublishEvent::UnpublishSucceeded);
        paths::remove_mount_dir(&target)
    }
}

#[async_trait]
impl VolumePlugin for CsiPlugin {
    fn name(&self) -> &'static str {
        PLUGIN_NAME
    }

    fn can_support(&self, spec: &Spec) -> bool {
        match &spec.source {
            VolumeSource::Inline(v) => v.csi.is_some(),
            VolumeSource::Persistent { volume, .. } => {
                volume.spec.as_ref().is_some_and(|s| s.csi.is_some())
            }
        }
    }

    fn unique_name(&self, spec: &Spec, pod: &PodUid) -> Result<UniqueVolumeName, PluginError> {
        let v = Self::volume(spec, pod.as_str()).map_err(to_plugin_error)?;
        Ok(match v.mode {
            LifecycleMode::Persistent => UniqueVolumeName::global(
                PLUGIN_NAME,
                &format!("{}{VOL_NAME_SEP}{}", v.driver, v.handle),
            ),
            LifecycleMode::Ephemeral => UniqueVolumeName::per_pod(PLUGIN_NAME, pod, &spec.name),
        })
    }

    fn device_mountable(&self, spec: &Spec) -> bool {
        matches!(spec.source, VolumeSource::Persistent { .. })
    }

    fn attributes(&self, spec: &Spec) -> Attributes {
        let v = Self::volume(spec, "").ok();
        let read_only = v.as_ref().is_some_and(|v| v.read_only);
        Attributes {
            read_only,
            // The kubelet's default fsGroupPolicy (ReadWriteOnceWithFSType).
            managed: v.is_some_and(|v| {
                !v.read_only
                    && !v.fs_type.is_empty()
                    && v.access_mode
                        == evpleg_csi_api::v1::volume_capability::access_mode::Mode::SingleNodeWriter
            }),
        }
    }

    fn host_path(&self, _spec: &Spec, dir: &Path) -> PathBuf {
        paths::target_path(dir)
    }

    fn device_mount_path(
        &self,
        spec: &Spec,
        root_dir: &Path,
    ) -> Result<Option<PathBuf>, PluginError> {
        let v = Self::volume(spec, "").map_err(to_plugin_error)?;
        Ok(Some(paths::staging_path(root_dir, &v.driver, &v.handle)))
    }

    async fn mount_device(&self, spec: &Spec, device_mount_path: &Path) -> Result<(), PluginError> {
        self.mount_device_csi(spec, device_mount_path)
            .await
            .map_err(to_plugin_error)
    }

    async fn unmount_device(
        &self,
        spec: &Spec,
        device_mount_path: &Path,
    ) -> Result<(), PluginError> {
        self.unmount_device_csi(spec, device_mount_path)
            .await
            .map_err(to_plugin_error)
    }

    async fn set_up(&self, args: SetUpArgs<'_>) -> Result<(), PluginError> {
        self.set_up_csi(args).await.map_err(to_plugin_error)
    }

    async fn tear_down(&self, args: TearDownArgs<'_>) -> Result<(), PluginError> {
        self.tear_down_csi(args).await.map_err(to_plugin_error)
    }
}
