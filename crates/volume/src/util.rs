//! Mount and file helpers of the volume plugins and the manager (the
//! kubelet's `mount-utils` `IsLikelyNotMountPoint`, `removeall`'s
//! `RemoveAllOneFilesystem`, `volume.SetVolumeOwnership`).

use std::ffi::CString;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::plugin::PluginError;

/// Whether `path` is a mount point: its device differs from its parent's
/// (`IsLikelyNotMountPoint`; a bind mount of the same file system is not
/// seen, as there).
pub fn is_mount_point(path: &Path) -> Result<bool, PluginError> {
    let m = std::fs::symlink_metadata(path).map_err(PluginError::io("stat", path))?;
    let parent = path.parent().unwrap_or(Path::new("/"));
    let p = std::fs::metadata(parent).map_err(PluginError::io("stat", parent))?;
    Ok(m.dev() != p.dev() || m.ino() == p.ino())
}

fn c_path(path: &Path) -> Result<CString, PluginError> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| PluginError::Failed(format!("path {} holds a NUL byte", path.display())))
}

/// Mounts a tmpfs on `path`, `size` bytes at most (tmpfs's default, half the
/// memory, when `None`).
pub fn mount_tmpfs(path: &Path, size: Option<i64>) -> Result<(), PluginError> {
    let mut options = String::from("mode=0777");
    if let Some(s) = size {
        options.push_str(&format!(",size={s}"));
    }
    let target = c_path(path)?;
    let opts = CString::new(options).map_err(|_| PluginError::Failed("tmpfs options".into()))?;
    // SAFETY: every pointer is a NUL-terminated string that outlives the call.
    let r = unsafe {
        libc::mount(
            c"tmpfs".as_ptr(),
            target.as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            opts.as_ptr().cast(),
        )
    };
    if r != 0 {
        return Err(PluginError::io("mount a tmpfs on", path)(
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Unmounts `path`.
pub fn unmount(path: &Path) -> Result<(), PluginError> {
    let target = c_path(path)?;
    // SAFETY: a NUL-terminated path.
    if unsafe { libc::umount2(target.as_ptr(), 0) } != 0 {
        return Err(PluginError::io("unmount", path)(
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// The mount points of this process's mount namespace
/// (`/proc/self/mountinfo`'s fifth field, its octal escapes decoded).
pub fn mount_points() -> std::io::Result<Vec<PathBuf>> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(std::ffi::OsString::from_vec(unescape_octal(p))))
        .collect())
}

/// `\040` and the like (mountinfo's escapes of space, tab, newline and `\`).
fn unescape_octal(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

/// Whether something is mounted on `path` itself, a bind mount of the same
/// file system included (mountinfo, not the device numbers). A missing path
/// is not.
pub fn is_mounted(path: &Path) -> std::io::Result<bool> {
    let real = match std::fs::canonicalize(path) {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    Ok(mount_points()?.contains(&real))
}

/// Removes `dir` and what is under it, refusing to cross into another file
/// system or a mount, a bind mount of the same file system included (a
/// mount left there would lose its data): `RemoveAllOneFilesystem`. A
/// missing `dir` is removed.
pub fn remove_all_one_filesystem(dir: &Path) -> Result<(), PluginError> {
    let top = match std::fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(PluginError::io("stat", dir)(e)),
    };
    if top.is_dir() {
        let real = std::fs::canonicalize(dir).map_err(PluginError::io("resolve", dir))?;
        let mounts = mount_points().map_err(PluginError::io("read the mounts under", dir))?;
        if let Some(m) = mounts.iter().find(|m| m.starts_with(&real)) {
            return Err(PluginError::Failed(format!(
                "refusing to remove {}: {} is mounted (a mount left behind)",
                dir.display(),
                m.display()
            )));
        }
    }
    remove_under(dir, top.dev())
}

fn remove_under(path: &Path, dev: u64) -> Result<(), PluginError> {
    let m = std::fs::symlink_metadata(path).map_err(PluginError::io("stat", path))?;
    if m.dev() != dev {
        return Err(PluginError::Failed(format!(
            "refusing to remove {}: it is on another file system (a mount left behind)",
            path.display()
        )));
    }
    if m.is_dir() {
        for e in std::fs::read_dir(path).map_err(PluginError::io("read", path))? {
            let e = e.map_err(PluginError::io("read", path))?;
            remove_under(&e.path(), dev)?;
        }
        std::fs::remove_dir(path).map_err(PluginError::io("remove", path))
    } else {
        std::fs::remove_file(path).map_err(PluginError::io("remove", path))
    }
}

/// The pod's `fsGroup` on a volume (`SetVolumeOwnership`): every file and
/// directory (not followed through symlinks) gets the group, group read
/// (and write unless `read_only`), directories also the set-gid bit and
/// group search.
pub fn set_volume_ownership(path: &Path, gid: i64, read_only: bool) -> Result<(), PluginError> {
    let gid = u32::try_from(gid)
        .map_err(|_| PluginError::Failed(format!("fsGroup {gid} is not a valid group id")))?;
    let mask = if read_only { 0o440 } else { 0o660 };
    let mut stack = vec![path.to_path_buf()];
    while let Some(p) = stack.pop() {
        let m = std::fs::symlink_metadata(&p).map_err(PluginError::io("stat", &p))?;
        if m.file_type().is_symlink() {
            continue;
        }
        std::os::unix::fs::lchown(&p, None, Some(gid)).map_err(PluginError::io("chown", &p))?;
        let mut mode = m.permissions().mode() | mask;
        if m.is_dir() {
            mode |= 0o2000 | 0o110;
            for e in std::fs::read_dir(&p).map_err(PluginError::io("read", &p))? {
                stack.push(e.map_err(PluginError::io("read", &p))?.path());
            }
        }
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode & 0o7777))
            .map_err(PluginError::io("chmod", &p))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removal_and_ownership_on_one_file_system() {
        let root = tempfile::tempdir().unwrap();
        let d = root.path().join("a/b");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("f"), "x").unwrap();
        std::fs::set_permissions(d.join("f"), std::fs::Permissions::from_mode(0o600)).unwrap();
        let gid = std::fs::metadata(root.path()).unwrap().gid();
        set_volume_ownership(&root.path().join("a"), i64::from(gid), false).unwrap();
        let f = std::fs::metadata(d.join("f")).unwrap().permissions().mode();
        assert_eq!(f & 0o777, 0o660);
        let b = std::fs::metadata(&d).unwrap().permissions().mode();
        assert_eq!(b & 0o2070, 0o2070);
        assert!(!is_mount_point(&d).unwrap());
        remove_all_one_filesystem(&root.path().join("a")).unwrap();
        assert!(!root.path().join("a").exists());
        remove_all_one_filesystem(&root.path().join("a")).unwrap();
    }
}
