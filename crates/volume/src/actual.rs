//! The actual state of the world (the kubelet's
//! `cache/actual_state_of_world.go`): what is mounted where. Per volume (by
//! unique name) its plugin, spec, node-global device state and path, and per
//! pod its mount state ([`super::state`]), directory and the host path
//! containers bind-mount. Changed only by the outcome of the reconciler's
//! operations and by remount requests; a volume with nothing mounted any
//! more is forgotten.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use super::plugin::{Attributes, PodContext, Spec, UniqueVolumeName, VolumePlugin};
use super::state::{DeviceMountState, DeviceMountTransition, PodMountState, PodMountTransition};
use evpleg_core::ids::PodUid;

/// A volume as mounted for one pod.
#[derive(Clone, Debug)]
pub struct MountedPod {
    pub ctx: PodContext,
    /// The pod's name for the volume.
    pub outer: String,
    pub state: PodMountState,
    /// The directory set-up was given.
    pub dir: PathBuf,
    /// What containers bind-mount (`Mounter.GetPath`).
    pub host_path: PathBuf,
    pub attributes: Attributes,
}

#[derive(Clone, Debug)]
pub struct ActualVolume {
    pub plugin: Arc<dyn VolumePlugin>,
    pub spec: Spec,
    pub device: DeviceMountState,
    /// The node-global directory of a device-mountable volume.
    pub device_path: Option<PathBuf>,
    pub pods: BTreeMap<PodUid, MountedPod>,
}

#[derive(Debug, Default)]
pub struct ActualStateOfWorld {
    volumes: BTreeMap<UniqueVolumeName, ActualVolume>,
}

/// A transition refused by the state machine: a bug in the reconciler,
/// logged by the caller.
#[derive(Debug, thiserror::Error)]
#[error("volume {volume}: {message}")]
pub struct StateError {
    pub volume: UniqueVolumeName,
    pub message: String,
}

impl ActualStateOfWorld {
    pub fn volumes(&self) -> &BTreeMap<UniqueVolumeName, ActualVolume> {
        &self.volumes
    }

    fn entry(
        &mut self,
        unique: &UniqueVolumeName,
        plugin: &Arc<dyn VolumePlugin>,
        spec: &Spec,
    ) -> &mut ActualVolume {
        self.volumes
            .entry(unique.clone())
            .or_insert_with(|| ActualVolume {
                plugin: plugin.clone(),
                spec: spec.clone(),
                device: DeviceMountState::NotMounted,
                device_path: None,
                pods: BTreeMap::new(),
            })
    }

    /// The outcome of a MountDevice / UnmountDevice.
    pub fn device_transition(
        &mut self,
        unique: &UniqueVolumeName,
        (plugin, spec, path): (&Arc<dyn VolumePlugin>, &Spec, &PathBuf),
        t: DeviceMountTransition,
    ) -> Result<(), StateError> {
        let v = self.entry(unique, plugin, spec);
        v.device = v.device.apply(t).map_err(|e| StateError {
            volume: unique.clone(),
            message: e.to_string(),
        })?;
        v.device_path = Some(path.clone());
        self.forget_if_unused(unique);
        Ok(())
    }

    /// The outcome of a SetUp / TearDown, or a remount request, for a pod.
    pub fn pod_transition(
        &mut self,
        unique: &UniqueVolumeName,
        (plugin, spec): (&Arc<dyn VolumePlugin>, &Spec),
        pod: MountedPod,
        t: PodMountTransition,
    ) -> Result<(), StateError> {
        let v = self.entry(unique, plugin, spec);
        let uid = pod.ctx.uid.clone();
        let from = v
            .pods
            .get(&uid)
            .map(|p| p.state)
            .unwrap_or(PodMountState::NotMounted);
        let to = from.apply(t).map_err(|e| StateError {
            volume: unique.clone(),
            message: format!("pod {uid}: {e}"),
        })?;
        if t == PodMountTransition::SetUpSucceeded {
            // The spec of the last set-up (a refreshed object).
            v.spec = spec.clone();
        }
        if to == PodMountState::NotMounted {
            v.pods.remove(&uid);
        } else {
            v.pods.insert(uid, MountedPod { state: to, ..pod });
        }
        self.forget_if_unused(unique);
        Ok(())
    }

    /// The pod was synced: its mounted volumes whose plugin requires it are
    /// set up again (`MarkRemountRequired`).
    pub fn mark_remount_required(&mut self, uid: &PodUid) {
        for v in self.volumes.values_mut() {
            if !v.plugin.requires_remount(&v.spec) {
                continue;
            }
            if let Some(p) = v.pods.get_mut(uid)
                && let Ok(s) = p.state.apply(PodMountTransition::RemountRequested)
            {
                p.state = s;
            }
        }
    }

    /// The pod's mounted volumes, by their name in the pod.
    pub fn mounted_for_pod(&self, uid: &PodUid) -> BTreeMap<String, &MountedPod> {
        self.volumes
            .values()
            .filter_map(|v| v.pods.get(uid))
            .filter(|p| p.state.is_mounted())
            .map(|p| (p.outer.clone(), p))
            .collect()
    }

    /// Whether anything is (or may be) mounted for the pod.
    pub fn pod_has_volumes(&self, uid: &PodUid) -> Vec<String> {
        self.volumes
            .values()
            .filter_map(|v| v.pods.get(uid))
            .map(|p| p.outer.clone())
            .collect()
    }

    fn forget_if_unused(&mut self, unique: &UniqueVolumeName) {
        if self
            .volumes
            .get(unique)
            .is_some_and(|v| v.pods.is_empty() && v.device == DeviceMountState::NotMounted)
        {
            self.volumes.remove(unique);
        }
    }
}
