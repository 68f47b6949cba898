//! The desired state of the world (the kubelet's
//! `cache/desired_state_of_world.go`): for each pod that should run, the
//! volumes to mount, each with its plugin, spec and unique name, and the
//! errors met building them (a claim not bound, no plugin): what
//! `WaitForAttachAndMount` reports as "failed to process volumes". Filled
//! and emptied by the populator ([`super::populator`]); read by the
//! reconciler.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::plugin::{PodContext, Spec, UniqueVolumeName, VolumePlugin};
use evpleg_core::ids::PodUid;

/// A volume a pod should have.
#[derive(Clone, Debug)]
pub struct DesiredVolume {
    pub unique: UniqueVolumeName,
    pub plugin: Arc<dyn VolumePlugin>,
    pub spec: Spec,
    pub device_mountable: bool,
    pub requires_remount: bool,
}

/// A pod's volumes, by their name in the pod.
#[derive(Clone, Debug)]
pub struct DesiredPod {
    pub ctx: PodContext,
    pub volumes: BTreeMap<String, DesiredVolume>,
    /// Volumes that could not be processed, with why.
    pub errors: BTreeMap<String, String>,
}

#[derive(Debug, Default)]
pub struct DesiredStateOfWorld {
    pods: BTreeMap<PodUid, DesiredPod>,
}

impl DesiredStateOfWorld {
    /// Sets the pod's volumes (`AddPodToVolume` for each, in one step).
    pub fn set_pod(&mut self, pod: DesiredPod) {
        self.pods.insert(pod.ctx.uid.clone(), pod);
    }

    /// The pod is no longer desired (`DeletePodFromVolume` for each).
    pub fn remove_pod(&mut self, uid: &PodUid) -> bool {
        self.pods.remove(uid).is_some()
    }

    pub fn pod(&self, uid: &PodUid) -> Option<&DesiredPod> {
        self.pods.get(uid)
    }

    /// Every (pod, volume name, volume) to mount (`GetVolumesToMount`).
    pub fn volumes_to_mount(&self) -> impl Iterator<Item = (&DesiredPod, &str, &DesiredVolume)> {
        self.pods
            .values()
            .flat_map(|p| p.volumes.iter().map(move |(n, v)| (p, n.as_str(), v)))
    }
}
