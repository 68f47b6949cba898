//! The CSI plugin's paths and names, as the kubelet's (`csi_attacher.go`
//! `makeDeviceMountPath`, `csi_plugin.go` `makeVolumeHandle`,
//! `csi_util.go` `saveVolumeData`):
//!
//! - staging (the "device mount path"):
//!   `<root-dir>/plugins/kubernetes.io/csi/<driver>/<sha256(volume handle)>/globalmount`,
//!   with `vol_data.json` (driver name and volume handle) beside it;
//! - publish target: `<pod volume dir>/mount` with `vol_data.json` in the pod
//!   volume dir (`<root-dir>/pods/<uid>/volumes/kubernetes.io~csi/<name>`);
//! - the handle of an inline ephemeral volume: `csi-` + sha256(pod UID +
//!   volume name).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::error::{CsiError, Result};

/// The CSI plugin's name, as the kubelet's.
pub const PLUGIN_NAME: &str = "kubernetes.io/csi";
/// The escaped plugin name of pod volume dirs.
pub const PLUGIN_DIR_NAME: &str = "kubernetes.io~csi";
pub const GLOBAL_MOUNT: &str = "globalmount";
pub const VOL_DATA_FILE: &str = "vol_data.json";

fn hex_sha256(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The staging path of `handle` of `driver`.
pub fn staging_path(root_dir: &Path, driver: &str, handle: &str) -> PathBuf {
    root_dir
        .join("plugins")
        .join(PLUGIN_NAME)
        .join(driver)
        .join(hex_sha256(handle))
        .join(GLOBAL_MOUNT)
}

/// The publish target inside a pod volume dir.
pub fn target_path(pod_volume_dir: &Path) -> PathBuf {
    pod_volume_dir.join("mount")
}

/// The kubelet's pod volume dir of a CSI volume.
pub fn pod_volume_dir(root_dir: &Path, pod_uid: &str, volume: &str) -> PathBuf {
    root_dir
        .join("pods")
        .join(pod_uid)
        .join("volumes")
        .join(PLUGIN_DIR_NAME)
        .join(volume)
}

/// The volume handle of an inline ephemeral volume.
pub fn ephemeral_handle(pod_uid: &str, volume: &str) -> String {
    format!("csi-{}", hex_sha256(&format!("{pod_uid}{volume}")))
}

/// Writes `vol_data.json` into `dir` (created).
pub fn save_volume_data(dir: &Path, data: &BTreeMap<&str, String>) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| CsiError::io("volume data dir", dir, e))?;
    let path = dir.join(VOL_DATA_FILE);
    let json = serde_json::to_vec(data).unwrap_or_default();
    std::fs::write(&path, json).map_err(|e| CsiError::io("volume data file", path, e))
}

/// Removes `path` if it is an empty directory or absent, then its
/// `vol_data.json` sibling and their parent if empty: the kubelet's
/// `removeMountDir`. A path still mounted is not empty (an error names it).
pub fn remove_mount_dir(path: &Path) -> Result<()> {
    match std::fs::remove_dir(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(CsiError::io("mount dir", path, e)),
    }
    if let Some(parent) = path.parent() {
        let data = parent.join(VOL_DATA_FILE);
        match std::fs::remove_file(&data) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(CsiError::io("volume data file", data, e)),
        }
        match std::fs::remove_dir(parent) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(CsiError::io("volume dir", parent, e)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_the_kubelets() {
        let root = Path::new("/var/lib/kubelet");
        // sha256("vol-1")
        assert_eq!(
            staging_path(root, "csi.example.com", "vol-1"),
            PathBuf::from(format!(
                "/var/lib/kubelet/plugins/kubernetes.io/csi/csi.example.com/{}/globalmount",
                hex_sha256("vol-1")
            ))
        );
        assert_eq!(
            hex_sha256("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            target_path(&pod_volume_dir(root, "u1", "data")),
            PathBuf::from("/var/lib/kubelet/pods/u1/volumes/kubernetes.io~csi/data/mount")
        );
        assert_eq!(
            ephemeral_handle("u1", "data"),
            format!("csi-{}", hex_sha256("u1data"))
        );
    }

    #[test]
    fn remove_mount_dir_takes_the_dir_its_data_and_parent() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("v");
        let mount = dir.join("mount");
        std::fs::create_dir_all(&mount).unwrap();
        save_volume_data(&dir, &BTreeMap::from([("driverName", "d".to_owned())])).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join(VOL_DATA_FILE)).unwrap(),
            r#"{"driverName":"d"}"#
        );
        remove_mount_dir(&mount).unwrap();
        assert!(!dir.exists());
        // Idempotent.
        remove_mount_dir(&mount).unwrap();
        // A non-empty (still mounted) target stays, with an error naming it.
        std::fs::create_dir_all(mount.join("x")).unwrap();
        let e = remove_mount_dir(&mount).unwrap_err();
        assert!(e.to_string().contains("/v/mount"), "{e}");
    }
}
