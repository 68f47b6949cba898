//! A CSI volume as the plugin sees it, from an inline `csi:` pod volume or a
//! PV's `spec.csi`, and the CSI requests made from it (the kubelet's
//! `csi_mounter.go` `SetUpAt` and `csi_attacher.go` `MountDevice`).
//!
//! As the kubelet: an inline volume is ephemeral (its handle made from the
//! pod UID and the volume name, access mode ReadWriteOnce, never staged); a
//! PV's access mode is its first one, mapped to CSI's (ReadWriteOnce ->
//! SINGLE_NODE_WRITER, ReadOnlyMany -> MULTI_NODE_READER_ONLY, ReadWriteMany
//! -> MULTI_NODE_MULTI_WRITER, ReadWriteOncePod -> SINGLE_NODE_WRITER); the
//! volume is read-only if the source or the pod's claim reference says so;
//! publish gets the volume attributes plus the pod info keys
//! (`csi.storage.k8s.io/pod.name`, `pod.namespace`, `pod.uid`,
//! `serviceAccount.name`, `ephemeral`); stage gets the attributes alone and
//! the PV's fsType. Differs: there are no CSIDriver objects, so the pod info
//! is always sent (the kubelet sends it only with `podInfoOnMount: true`) and
//! inline volumes are allowed for every driver (the kubelet requires the
//! driver's `Ephemeral` lifecycle mode); secrets (`nodeStageSecretRef`,
//! `nodePublishSecretRef`) are refused with a clear error; no
//! VolumeAttachment, so `publish_context` is empty; no block volumes;
//! SINGLE_NODE_MULTI_WRITER capabilities are not asked for.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use evpleg_csi_api::v1;
use evpleg_csi_api::v1::volume_capability::{AccessMode, AccessType, MountVolume, access_mode};
use k8s_openapi::api::core::v1::{CSIVolumeSource, PersistentVolume, Pod};

use super::error::{CsiError, Result};
use super::paths::ephemeral_handle;

pub const POD_NAME_KEY: &str = "csi.storage.k8s.io/pod.name";
pub const POD_NAMESPACE_KEY: &str = "csi.storage.k8s.io/pod.namespace";
pub const POD_UID_KEY: &str = "csi.storage.k8s.io/pod.uid";
pub const SERVICE_ACCOUNT_KEY: &str = "csi.storage.k8s.io/serviceAccount.name";
pub const EPHEMERAL_KEY: &str = "csi.storage.k8s.io/ephemeral";

/// The kubelet's `VolumeLifecycleMode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LifecycleMode {
    Persistent,
    Ephemeral,
}

/// One CSI volume of one pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CsiVolume {
    /// The pod's volume name.
    pub name: String,
    pub driver: String,
    pub handle: String,
    pub mode: LifecycleMode,
    pub read_only: bool,
    pub fs_type: String,
    pub attributes: BTreeMap<String, String>,
    pub access_mode: access_mode::Mode,
    pub mount_options: Vec<String>,
    /// The PV's name, for a persistent volume.
    pub pv_name: Option<String>,
}

fn no_secrets(volume: &str, field: &str, set: bool) -> Result<()> {
    if set {
        return Err(CsiError::InvalidSpec {
            volume: volume.to_owned(),
            reason: format!("{field} is not supported by evpleg (no Secret access)"),
        });
    }
    Ok(())
}

fn non_empty_driver(volume: &str, driver: &str) -> Result<()> {
    if driver.is_empty() {
        return Err(CsiError::InvalidSpec {
            volume: volume.to_owned(),
            reason: "csi.driver is empty".into(),
        });
    }
    Ok(())
}

/// The kubelet's `asCSIAccessModeV1` without the multi-writer capability.
pub fn csi_access_mode(k8s: &str) -> access_mode::Mode {
    match k8s {
        "ReadOnlyMany" => access_mode::Mode::MultiNodeReaderOnly,
        "ReadWriteMany" => access_mode::Mode::MultiNodeMultiWriter,
        _ => access_mode::Mode::SingleNodeWriter,
    }
}

impl CsiVolume {
    /// An inline ephemeral volume (`volumes[].csi`) of the pod with `pod_uid`.
    pub fn inline(pod_uid: &str, name: &str, src: &CSIVolumeSource) -> Result<Self> {
        non_empty_driver(name, &src.driver)?;
        no_secrets(
            name,
            "csi.nodePublishSecretRef",
            src.node_publish_secret_ref.is_some(),
        )?;
        Ok(Self {
            name: name.to_owned(),
            driver: src.driver.clone(),
            handle: ephemeral_handle(pod_uid, name),
            mode: LifecycleMode::Ephemeral,
            read_only: src.read_only.unwrap_or(false),
            fs_type: src.fs_type.clone().unwrap_or_default(),
            attributes: src.volume_attributes.clone().unwrap_or_default(),
            access_mode: access_mode::Mode::SingleNodeWriter,
            mount_options: Vec::new(),
            pv_name: None,
        })
    }

    /// A PV with `spec.csi`, mounted as the pod's volume `name`;
    /// `claim_read_only` is the pod's `persistentVolumeClaim.readOnly`.
    pub fn persistent(name: &str, pv: &PersistentVolume, claim_read_only: bool) -> Result<Self> {
        let pv_name = pv.metadata.name.clone().unwrap_or_default();
        let spec = pv.spec.as_ref();
        let src = spec
            .and_then(|s| s.csi.as_ref())
            .ok_or_else(|| CsiError::InvalidSpec {
                volume: name.to_owned(),
                reason: format!("persistent volume {pv_name} has no spec.csi"),
            })?;
        non_empty_driver(name, &src.driver)?;
        if src.volume_handle.is_empty() {
            return Err(CsiError::InvalidSpec {
                volume: name.to_owned(),
                reason: format!("persistent volume {pv_name}: spec.csi.volumeHandle is empty"),
            });
        }
        no_secrets(
            name,
            "spec.csi.nodeStageSecretRef",
            src.node_stage_secret_ref.is_some(),
        )?;
        no_secrets(
            name,
            "spec.csi.nodePublishSecretRef",
            src.node_publish_secret_ref.is_some(),
        )?;
        let access = spec
            .and_then(|s| s.access_modes.as_ref())
            .and_then(|m| m.first())
            .map_or(access_mode::Mode::SingleNodeWriter, |m| csi_access_mode(m));
        Ok(Self {
            name: name.to_owned(),
            driver: src.driver.clone(),
            handle: src.volume_handle.clone(),
            mode: LifecycleMode::Persistent,
            read_only: src.read_only.unwrap_or(false) || claim_read_only,
            fs_type: src.fs_type.clone().unwrap_or_default(),
            attributes: src.volume_attributes.clone().unwrap_or_default(),
            access_mode: access,
            mount_options: spec
                .and_then(|s| s.mount_options.clone())
                .unwrap_or_default(),
            pv_name: Some(pv_name),
        })
    }

    fn capability(&self) -> v1::VolumeCapability {
        v1::VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume {
                fs_type: self.fs_type.clone(),
                mount_flags: self.mount_options.clone(),
                volume_mount_group: String::new(),
            })),
            access_mode: Some(AccessMode {
                mode: self.access_mode as i32,
            }),
        }
    }

    /// Whether the volume is staged when the driver can: persistent ones.
    pub fn stages(&self) -> bool {
        self.mode == LifecycleMode::Persistent
    }

    pub fn stage_request(&self, staging: &Path) -> v1::NodeStageVolumeRequest {
        v1::NodeStageVolumeRequest {
            volume_id: self.handle.clone(),
            publish_context: HashMap::new(),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(self.capability()),
            secrets: HashMap::new(),
            volume_context: self.attributes.clone().into_iter().collect(),
        }
    }

    pub fn unstage_request(&self, staging: &Path) -> v1::NodeUnstageVolumeRequest {
        v1::NodeUnstageVolumeRequest {
            volume_id: self.handle.clone(),
            staging_target_path: staging.display().to_string(),
        }
    }

    /// NodePublishVolume for `pod` at `target`, staged at `staging` if any.
    pub fn publish_request(
        &self,
        pod: &Pod,
        target: &Path,
        staging: Option<&Path>,
    ) -> v1::NodePublishVolumeRequest {
        let mut context: HashMap<String, String> = self.attributes.clone().into_iter().collect();
        context.extend(pod_info(pod, self.mode));
        v1::NodePublishVolumeRequest {
            volume_id: self.handle.clone(),
            publish_context: HashMap::new(),
            staging_target_path: staging.map(|s| s.display().to_string()).unwrap_or_default(),
            target_path: target.display().to_string(),
            volume_capability: Some(self.capability()),
            readonly: self.read_only,
            secrets: HashMap::new(),
            volume_context: context,
        }
    }

    pub fn unpublish_request(&self, target: &Path) -> v1::NodeUnpublishVolumeRequest {
        v1::NodeUnpublishVolumeRequest {
            volume_id: self.handle.clone(),
            target_path: target.display().to_string(),
        }
    }
}

/// The pod info keys the kubelet adds (`podAttributes`).
pub fn pod_info(pod: &Pod, mode: LifecycleMode) -> Vec<(String, String)> {
    let m = &pod.metadata;
    let sa = pod
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .unwrap_or_else(|| "default".to_owned());
    vec![
        (POD_NAME_KEY.into(), m.name.clone().unwrap_or_default()),
        (
            POD_NAMESPACE_KEY.into(),
            m.namespace.clone().unwrap_or_else(|| "default".into()),
        ),
        (POD_UID_KEY.into(), m.uid.clone().unwrap_or_default()),
        (SERVICE_ACCOUNT_KEY.into(), sa),
        (
            EPHEMERAL_KEY.into(),
            (mode == LifecycleMode::Ephemeral).to_string(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        CSIPersistentVolumeSource, PersistentVolumeSpec, SecretReference,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn pod() -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("p".into()),
                namespace: Some("ns".into()),
                uid: Some("u1".into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn pv(modes: &[&str], ro: Option<bool>) -> PersistentVolume {
        PersistentVolume {
            metadata: ObjectMeta {
                name: Some("pv1".into()),
                ..Default::default()
            },
            spec: Some(PersistentVolumeSpec {
                access_modes: Some(modes.iter().map(|m| m.to_string()).collect()),
                mount_options: Some(vec!["noatime".into()]),
                csi: Some(CSIPersistentVolumeSource {
                    driver: "d".into(),
                    volume_handle: "h1".into(),
                    fs_type: Some("ext4".into()),
                    read_only: ro,
                    volume_attributes: Some(BTreeMap::from([("k".into(), "v".into())])),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn inline_volumes_are_ephemeral_with_pod_info() {
        let src = CSIVolumeSource {
            driver: "d".into(),
            read_only: Some(true),
            volume_attributes: Some(BTreeMap::from([("size".into(), "1".into())])),
            ..Default::default()
        };
        let v = CsiVolume::inline("u1", "data", &src).unwrap();
        assert_eq!(v.handle, ephemeral_handle("u1", "data"));
        assert!(!v.stages());
        let r = v.publish_request(&pod(), Path::new("/t"), None);
        assert!(r.readonly);
        assert_eq!(r.staging_target_path, "");
        let ctx: BTreeMap<_, _> = r.volume_context.into_iter().collect();
        assert_eq!(
            ctx,
            BTreeMap::from([
                ("size".to_owned(), "1".to_owned()),
                (POD_NAME_KEY.to_owned(), "p".to_owned()),
                (POD_NAMESPACE_KEY.to_owned(), "ns".to_owned()),
                (POD_UID_KEY.to_owned(), "u1".to_owned()),
                (SERVICE_ACCOUNT_KEY.to_owned(), "default".to_owned()),
                (EPHEMERAL_KEY.to_owned(), "true".to_owned()),
            ])
        );
    }

    #[test]
    fn persistent_volumes_map_access_modes_and_read_only() {
        let table = [
            (
                &["ReadWriteOnce"][..],
                None,
                false,
                access_mode::Mode::SingleNodeWriter,
                false,
            ),
            (
                &["ReadOnlyMany", "ReadWriteOnce"][..],
                None,
                false,
                access_mode::Mode::MultiNodeReaderOnly,
                false,
            ),
            (
                &["ReadWriteMany"][..],
                Some(true),
                false,
                access_mode::Mode::MultiNodeMultiWriter,
                true,
            ),
            (
                &["ReadWriteOncePod"][..],
                None,
                true,
                access_mode::Mode::SingleNodeWriter,
                true,
            ),
            (
                &[][..],
                None,
                false,
                access_mode::Mode::SingleNodeWriter,
                false,
            ),
        ];
        for (modes, src_ro, claim_ro, want_mode, want_ro) in table {
            let v = CsiVolume::persistent("data", &pv(modes, src_ro), claim_ro).unwrap();
            assert_eq!(
                (v.access_mode, v.read_only),
                (want_mode, want_ro),
                "{modes:?}"
            );
            assert!(v.stages());
        }
        let v = CsiVolume::persistent("data", &pv(&["ReadWriteOnce"], None), false).unwrap();
        let s = v.stage_request(Path::new("/s"));
        assert_eq!(s.volume_id, "h1");
        assert_eq!(s.volume_context.get("k").map(String::as_str), Some("v"));
        let Some(AccessType::Mount(m)) = s.volume_capability.unwrap().access_type else {
            panic!("mount")
        };
        assert_eq!(
            (m.fs_type.as_str(), m.mount_flags),
            ("ext4", vec!["noatime".to_owned()])
        );
        let p = v.publish_request(&pod(), Path::new("/t"), Some(Path::new("/s")));
        assert_eq!(p.staging_target_path, "/s");
        assert_eq!(
            p.volume_context.get(EPHEMERAL_KEY).map(String::as_str),
            Some("false")
        );
    }

    #[test]
    fn bad_specs_are_refused_naming_the_volume() {
        let mut p = pv(&["ReadWriteOnce"], None);
        p.spec
            .as_mut()
            .unwrap()
            .csi
            .as_mut()
            .unwrap()
            .node_stage_secret_ref = Some(SecretReference::default());
        let e = CsiVolume::persistent("data", &p, false).unwrap_err();
        assert_eq!(
            e.to_string(),
            "volume data: spec.csi.nodeStageSecretRef is not supported by evpleg (no Secret access)"
        );
        let mut p = pv(&["ReadWriteOnce"], None);
        p.spec.as_mut().unwrap().csi = None;
        assert_eq!(
            CsiVolume::persistent("data", &p, false)
                .unwrap_err()
                .to_string(),
            "volume data: persistent volume pv1 has no spec.csi"
        );
        let e = CsiVolume::inline("u", "v", &CSIVolumeSource::default()).unwrap_err();
        assert_eq!(e.to_string(), "volume v: csi.driver is empty");
    }
}
