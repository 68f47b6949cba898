//! The pods' directories under `<root-dir>/pods`: the directory itself is
//! mode 0750, root's (the kubelet's `setupDataDirs`), so no unprivileged host
//! user reaches a pod's volumes, secrets included ([`ensure_pods_dir`]); the
//! directories of pods that no longer exist (deleted while the agent was
//! down) are removed by housekeeping ([`remove_orphaned_pod_dirs`], the
//! kubelet's `cleanupOrphanedPodDirs`).
//!
//! Difference: the kubelet leaves an orphaned directory that still has
//! mounted volumes to its volume reconstruction; here there is no
//! reconstruction, so what is mounted under an orphan (tmpfs volumes,
//! subPath bind mounts) is unmounted, deepest first, and only then is the
//! directory removed, never across a mount and never through a symlink
//! (an entry of `pods/` that is not a directory is removed itself, and a
//! name that is no pod UID is left alone).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use evpleg_core::ids::PodUid;

/// Why the pods' directory or an orphan could not be handled.
#[derive(Debug, thiserror::Error)]
pub enum PodDirError {
    #[error("cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("orphaned pod directory {path}: {message}")]
    Remove { path: PathBuf, message: String },
}

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> PodDirError {
    let path = path.to_path_buf();
    move |source| PodDirError::Io {
        action,
        path,
        source,
    }
}

/// The mode of `<root-dir>/pods`.
pub const PODS_DIR_MODE: u32 = 0o750;

/// Creates `<root-dir>/pods` (and the root dir) when missing and gives it
/// mode 0750, whatever it had.
pub fn ensure_pods_dir(root_dir: &Path) -> Result<PathBuf, PodDirError> {
    let pods = root_dir.join("pods");
    std::fs::create_dir_all(&pods).map_err(io("create", &pods))?;
    std::fs::set_permissions(&pods, std::fs::Permissions::from_mode(PODS_DIR_MODE))
        .map_err(io("chmod", &pods))?;
    Ok(pods)
}

/// Unmounts everything mounted at or under `dir`, deepest first (a
/// mount stacked twice is unmounted twice).
pub fn unmount_all_under(dir: &Path) -> Result<usize, PodDirError> {
    let real = std::fs::canonicalize(dir).map_err(io("resolve", dir))?;
    let mut mounts: Vec<PathBuf> = crate::util::mount_points()
        .map_err(io("read the mounts under", dir))?
        .into_iter()
        .filter(|m| m.starts_with(&real))
        .collect();
    // Deepest first: a mount inside another goes before it.
    mounts.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    for m in &mounts {
        let c = CString::new(m.as_os_str().as_bytes()).map_err(|e| {
            io("unmount", m)(std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
        })?;
        // SAFETY: a NUL-terminated path; UMOUNT_NOFOLLOW: a symlink there is
        // not followed.
        if unsafe { libc::umount2(c.as_ptr(), libc::UMOUNT_NOFOLLOW) } != 0 {
            return Err(io("unmount", m)(std::io::Error::last_os_error()));
        }
    }
    Ok(mounts.len())
}

/// Removes the directories under `<root-dir>/pods` of pods `known` does not
/// know (by UID), unmounting what is mounted in them first; returns the
/// UIDs removed. An error on one directory is logged and the others still
/// go.
pub fn remove_orphaned_pod_dirs(root_dir: &Path, known: &dyn Fn(&PodUid) -> bool) -> Vec<PodUid> {
    let pods = root_dir.join("pods");
    let Ok(entries) = std::fs::read_dir(&pods) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(uid) = name.to_str().and_then(PodUid::parse) else {
            continue;
        };
        // The directory's name must be the UID's own spelling (no case or
        // separator games), so that the path removed is the pod's.
        if known(&uid) || uid.as_str() != name.to_str().unwrap_or_default() {
            continue;
        }
        match remove_orphan(&e.path()) {
            Ok(()) => {
                tracing::info!(pod = %uid, path = %e.path().display(), "housekeeping: removed an orphaned pod directory");
                removed.push(uid);
            }
            Err(err) => {
                tracing::warn!(pod = %uid, error = %err, "housekeeping: cannot remove an orphaned pod directory");
            }
        }
    }
    removed
}

fn remove_orphan(path: &Path) -> Result<(), PodDirError> {
    let m = std::fs::symlink_metadata(path).map_err(io("stat", path))?;
    if !m.is_dir() {
        // A symlink (or a file) is removed itself, never followed.
        return std::fs::remove_file(path).map_err(io("remove", path));
    }
    crate::subpath::clean_pod_sub_paths(path).map_err(|e| PodDirError::Remove {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    unmount_all_under(path)?;
    crate::util::remove_all_one_filesystem(path).map_err(|e| PodDirError::Remove {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests;
