//! A volume mount's `subPath` (the kubelet's `makeMounts` with its
//! `subpath` package): relative, no `..` element; the directory is created
//! when missing (mode of the volume's directory, as the kubelet's
//! `SafeMakeDir`), and the resolved path (symlinks followed) must stay
//! inside the volume. Difference: the kubelet then bind-mounts the checked
//! path under `volume-subpaths/` so that a symlink swapped in afterwards
//! cannot escape; here the checked, resolved path is what the runtime
//! bind-mounts, which leaves the window between the check and the
//! container's creation.

use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

/// Why a subPath cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SubPathError {
    #[error("error SubPath {0:?} must not be an absolute path")]
    Absolute(String),
    #[error("error SubPath {0:?} must not contain '..'")]
    Backsteps(String),
    #[error("subpath {path:?} not within volume path {volume:?}")]
    Outside { path: PathBuf, volume: PathBuf },
    #[error("cannot {action} subpath {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The host path of `sub_path` in the volume at `volume`.
pub fn resolve(volume: &Path, sub_path: &str) -> Result<PathBuf, SubPathError> {
    let rel = Path::new(sub_path);
    if rel.is_absolute() {
        return Err(SubPathError::Absolute(sub_path.into()));
    }
    if rel.components().any(|c| c == Component::ParentDir) {
        return Err(SubPathError::Backsteps(sub_path.into()));
    }
    let io = |action, path: &Path| {
        let path = path.to_path_buf();
        move |source| SubPathError::Io {
            action,
            path,
            source,
        }
    };
    let base = volume.canonicalize().map_err(io("resolve", volume))?;
    let path = volume.join(rel);
    if std::fs::symlink_metadata(&path).is_err() {
        let mode = std::fs::metadata(&base)
            .map(|m| m.permissions().mode() & 0o7777)
            .unwrap_or(0o755);
        std::fs::create_dir_all(&path).map_err(io("create", &path))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
            .map_err(io("chmod", &path))?;
    }
    let resolved = path.canonicalize().map_err(io("resolve", &path))?;
    if !resolved.starts_with(&base) {
        return Err(SubPathError::Outside {
            path: resolved,
            volume: base,
        });
    }
    Ok(resolved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_paths_stay_inside_their_volume() {
        let root = tempfile::tempdir().unwrap();
        let vol = root.path().join("vol");
        std::fs::create_dir(&vol).unwrap();
        std::fs::set_permissions(&vol, std::fs::Permissions::from_mode(0o777)).unwrap();
        std::fs::write(vol.join("file"), "x").unwrap();
        std::os::unix::fs::symlink("/etc", vol.join("escape")).unwrap();
        std::os::unix::fs::symlink("file", vol.join("inside")).unwrap();
        let base = vol.canonicalize().unwrap();
        assert_eq!(resolve(&vol, "file").unwrap(), base.join("file"));
        assert_eq!(resolve(&vol, "inside").unwrap(), base.join("file"));
        // A missing directory is created with the volume's mode.
        let made = resolve(&vol, "a/b").unwrap();
        assert!(made.is_dir());
        let mode = std::fs::metadata(&made).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o777);
        let cases = [
            ("/etc", "must not be an absolute path"),
            ("a/../../x", "must not contain '..'"),
            ("escape", "not within volume path"),
        ];
        for (sub, want) in cases {
            let err = resolve(&vol, sub).unwrap_err().to_string();
            assert!(err.contains(want), "{sub}: {err}");
        }
    }
}
