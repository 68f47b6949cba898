//! A volume mount's `subPath` (the kubelet's `makeMounts` with its
//! `pkg/volume/util/subpath`): relative, no `..` element; the missing
//! directories are created with the mode of the volume's directory (the
//! kubelet's `SafeMakeDir`), one component at a time through descriptors
//! opened beneath the volume, so a symlink in the way is never followed out
//! of it; the subPath is then opened beneath the volume and that descriptor
//! (`/proc/self/fd/N`) is bind-mounted on a per-container path,
//! `<pod dir>/volume-subpaths/<volume>/<container>/<index>` (the kubelet's
//! `doBindSubPath`), which is what the container mounts: what is mounted is
//! what was checked, whatever a container swaps in afterwards. Those bind
//! mounts are removed when the volume is torn down ([`clean_sub_paths`],
//! `doCleanSubPaths`) and with the pod's directory ([`clean_pod_sub_paths`]).
//!
//! Difference: "beneath" is the kernel's `openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_MAGICLINKS)` rather than the kubelet's `EvalSymlinks` and a
//! walk with `O_NOFOLLOW`: a symlink inside the volume that stays inside it
//! is followed (as the kubelet does), and the check and the open are one
//! atomic resolution; an absolute symlink is refused even when it names a
//! path inside the volume (it names a path in the container).

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

/// The pod directory's child that holds the subPath bind mounts.
pub const SUBPATH_DIR: &str = "volume-subpaths";

/// Why a subPath cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SubPathError {
    #[error("error SubPath {0:?} must not be an absolute path")]
    Absolute(String),
    #[error("error SubPath {0:?} must not contain '..'")]
    Backsteps(String),
    #[error("subpath {path:?} not within volume path {volume:?}")]
    Outside { path: PathBuf, volume: PathBuf },
    #[error("{what} {name:?} cannot name a directory (empty, '.', '..' or holding '/')")]
    BadName { what: &'static str, name: String },
    #[error("cannot {action} subpath {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> SubPathError {
    let path = path.to_path_buf();
    move |source| SubPathError::Io {
        action,
        path,
        source,
    }
}

/// One container's volume mount with a subPath (the kubelet's `Subpath`).
#[derive(Clone, Copy, Debug)]
pub struct SubPath<'a> {
    /// The volume's host path, as set up.
    pub volume_path: &'a Path,
    /// The mount's `subPath`.
    pub sub_path: &'a str,
    /// `<root-dir>/pods/<uid>`.
    pub pod_dir: &'a Path,
    pub volume_name: &'a str,
    pub container_name: &'a str,
    /// The mount's index in the container's `volumeMounts`.
    pub index: usize,
}

/// The relative path of a subPath, refused when absolute or with `..`.
fn relative(sub_path: &str) -> Result<&Path, SubPathError> {
    let rel = Path::new(sub_path);
    if rel.is_absolute() {
        return Err(SubPathError::Absolute(sub_path.into()));
    }
    if rel.components().any(|c| c == Component::ParentDir) {
        return Err(SubPathError::Backsteps(sub_path.into()));
    }
    Ok(rel)
}

/// `name` as one path component, or why not.
fn component<'a>(what: &'static str, name: &'a str) -> Result<&'a str, SubPathError> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(SubPathError::BadName {
            what,
            name: name.into(),
        });
    }
    Ok(name)
}

fn c_path(path: &Path) -> Result<CString, SubPathError> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io("use", path)(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))
}

/// Opens `rel` beneath `dir` (`openat2` with `RESOLVE_BENEATH |
/// RESOLVE_NO_MAGICLINKS`): a resolution that would leave `dir` (an absolute
/// symlink, a `..` too many) fails with `EXDEV`.
fn open_beneath(dir: &OwnedFd, rel: &Path, flags: i32) -> std::io::Result<OwnedFd> {
    openat2(
        dir,
        rel,
        flags,
        0,
        libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS,
    )
}

/// `openat2(dir, rel)` with `flags`, `mode` (for `O_CREAT`) and `resolve`.
fn openat2(
    dir: &OwnedFd,
    rel: &Path,
    flags: i32,
    mode: u32,
    resolve: u64,
) -> std::io::Result<OwnedFd> {
    let name = CString::new(rel.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: open_how is plain data; all-zero is its empty value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.mode = u64::from(mode);
    how.resolve = resolve;
    loop {
        // SAFETY: a valid directory descriptor, a NUL-terminated name and
        // an open_how of the size passed.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dir.as_raw_fd(),
                name.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        };
        if fd >= 0 {
            // SAFETY: a descriptor the kernel just returned, owned by nobody else.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) });
        }
        let err = std::io::Error::last_os_error();
        // EAGAIN: a rename raced the resolution; the kernel asks to retry.
        if err.raw_os_error() != Some(libc::EAGAIN) {
            return Err(err);
        }
    }
}

fn open_dir(path: &Path) -> Result<OwnedFd, SubPathError> {
    let c = c_path(path)?;
    // SAFETY: a NUL-terminated path.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io("open", path)(std::io::Error::last_os_error()));
    }
    // SAFETY: a descriptor the kernel just returned.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn fstat(fd: &OwnedFd, path: &Path) -> Result<libc::stat, SubPathError> {
    // SAFETY: stat is plain data, filled by the kernel.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and a stat to fill.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io("stat", path)(std::io::Error::last_os_error()));
    }
    Ok(st)
}

/// An `openat2` error as the subPath's: leaving the volume is `Outside`.
fn beneath_error(volume: &Path, path: &Path, e: std::io::Error) -> SubPathError {
    match e.raw_os_error() {
        Some(libc::EXDEV | libc::ELOOP) => SubPathError::Outside {
            path: path.to_path_buf(),
            volume: volume.to_path_buf(),
        },
        _ => io("open", path)(e),
    }
}

/// Creates the missing directories of `rel` beneath the volume `base`
/// (`doSafeMakeDir`): the existing prefix is opened beneath the volume, each
/// missing component is made with `mkdirat` in the directory just opened and
/// entered without following a symlink, then given `mode` exactly (umask
/// aside).
fn safe_make_dir(base: &OwnedFd, volume: &Path, rel: &Path, mode: u32) -> Result<(), SubPathError> {
    let parts: Vec<&std::ffi::OsStr> = rel
        .components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect();
    // The longest prefix that exists, opened beneath the volume.
    let mut existing = parts.len();
    let mut dir = loop {
        let prefix: PathBuf = parts[..existing].iter().collect();
        let full = volume.join(&prefix);
        if existing == 0 {
            break base.try_clone().map_err(io("open", volume))?;
        }
        // The whole path may be a file (a subPath naming one); a prefix
        // must be a directory.
        let whole = existing == parts.len();
        let flags = libc::O_PATH | if whole { 0 } else { libc::O_DIRECTORY };
        match open_beneath(base, &prefix, flags) {
            Ok(_) if whole => return Ok(()),
            Ok(fd) => break fd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => existing -= 1,
            Err(e) => return Err(beneath_error(volume, &full, e)),
        }
    };
    let mut path: PathBuf = volume.join(parts[..existing].iter().collect::<PathBuf>());
    for part in &parts[existing..] {
        path.push(part);
        let name = CString::new(part.as_bytes()).map_err(|e| {
            io("create", &path)(std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
        })?;
        // SAFETY: a valid directory descriptor and a NUL-terminated name.
        if unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), mode) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::AlreadyExists {
                return Err(io("create", &path)(e));
            }
        }
        // SAFETY: as above; O_NOFOLLOW: a symlink swapped in is refused.
        let fd = unsafe {
            libc::openat(
                dir.as_raw_fd(),
                name.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(beneath_error(
                volume,
                &path,
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: a descriptor the kernel just returned.
        dir = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a valid descriptor.
        if unsafe { libc::fchmod(dir.as_raw_fd(), mode) } != 0 {
            return Err(io("chmod", &path)(std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// Opens the subPath beneath its volume, its missing directories created
/// first: the descriptor of what the container will see.
pub fn open(volume: &Path, sub_path: &str) -> Result<OwnedFd, SubPathError> {
    let rel = relative(sub_path)?;
    let base = open_dir(volume)?;
    let mode = fstat(&base, volume)?.st_mode & 0o7777;
    safe_make_dir(&base, volume, rel, mode)?;
    let path = volume.join(rel);
    if rel.as_os_str().is_empty() {
        return Ok(base);
    }
    open_beneath(&base, rel, libc::O_PATH).map_err(|e| beneath_error(volume, &path, e))
}

/// Creates (or truncates) the file `rel` beneath `base`, mode `file_mode`
/// exactly, its missing directories made with `dir_mode`, following no
/// symlink on the way: each component is made with `mkdirat` and entered
/// with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`, and so is the
/// file. For the agent's own files under its root directory (a
/// termination-message file), where a symlink planted in the path must not
/// make it create or chmod anything elsewhere: such a path fails with
/// `ELOOP` (a symlink) or `EXDEV` (leaving `base`). `base` itself is
/// trusted (the operator's).
pub fn create_file_no_symlinks(
    base: &Path,
    rel: &Path,
    dir_mode: u32,
    file_mode: u32,
) -> std::io::Result<()> {
    const RESOLVE: u64 = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS;
    let bad = || {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a plain relative path",
        )
    };
    let mut parts = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(n) => parts.push(n),
            _ => return Err(bad()),
        }
    }
    let file = parts.pop().ok_or_else(bad)?;
    let mut dir = open_dir(base).map_err(|e| match e {
        SubPathError::Io { source, .. } => source,
        other => std::io::Error::other(other.to_string()),
    })?;
    for part in parts {
        let name = CString::new(part.as_bytes()).map_err(|_| bad())?;
        // SAFETY: a valid directory descriptor and a NUL-terminated name.
        if unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), dir_mode) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::AlreadyExists {
                return Err(e);
            }
        }
        dir = openat2(
            &dir,
            Path::new(part),
            libc::O_PATH | libc::O_DIRECTORY,
            0,
            RESOLVE,
        )?;
    }
    let fd = openat2(
        &dir,
        Path::new(file),
        libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC,
        file_mode,
        RESOLVE,
    )?;
    // Whatever the umask.
    // SAFETY: a valid descriptor.
    if unsafe { libc::fchmod(fd.as_raw_fd(), file_mode) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `<pod dir>/volume-subpaths/<volume>/<container>/<index>`.
pub fn bind_target(sp: &SubPath<'_>) -> Result<PathBuf, SubPathError> {
    Ok(sp
        .pod_dir
        .join(SUBPATH_DIR)
        .join(component("volume name", sp.volume_name)?)
        .join(component("container name", sp.container_name)?)
        .join(sp.index.to_string()))
}

/// The subPath opened safely and bind-mounted on its per-container path,
/// which is returned: the container's mount source (`PrepareSafeSubpath`).
/// A target already bound to the same file is kept.
pub fn prepare(sp: &SubPath<'_>) -> Result<PathBuf, SubPathError> {
    let target = bind_target(sp)?;
    let fd = open(sp.volume_path, sp.sub_path)?;
    let st = fstat(&fd, &sp.volume_path.join(sp.sub_path))?;
    if crate::util::is_mounted(&target).map_err(io("read mounts for", &target))? {
        let same =
            std::fs::metadata(&target).is_ok_and(|m| m.dev() == st.st_dev && m.ino() == st.st_ino);
        if same {
            return Ok(target);
        }
        unmount(&target)?;
    }
    let parent = target.parent().unwrap_or(sp.pod_dir);
    std::fs::create_dir_all(parent).map_err(io("create", parent))?;
    for dir in [sp.pod_dir.join(SUBPATH_DIR), parent.to_path_buf()] {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o750))
            .map_err(io("chmod", &dir))?;
    }
    if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
        match std::fs::create_dir(&target) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                return Err(io("create", &target)(e));
            }
            _ => {}
        }
    } else if std::fs::symlink_metadata(&target).is_err() {
        std::fs::write(&target, b"").map_err(io("create", &target))?;
    }
    let source = c_path(Path::new(&format!("/proc/self/fd/{}", fd.as_raw_fd())))?;
    let c_target = c_path(&target)?;
    // SAFETY: NUL-terminated strings that outlive the call; a bind mount
    // takes no file system type or data.
    let r = unsafe {
        libc::mount(
            source.as_ptr(),
            c_target.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    };
    if r != 0 {
        let e = io("bind-mount", &target)(std::io::Error::last_os_error());
        let _ = remove_target(&target);
        return Err(e);
    }
    Ok(target)
}

fn unmount(target: &Path) -> Result<(), SubPathError> {
    let c = c_path(target)?;
    // SAFETY: a NUL-terminated path. UMOUNT_NOFOLLOW: the target is ours,
    // a symlink there is not followed.
    if unsafe { libc::umount2(c.as_ptr(), libc::UMOUNT_NOFOLLOW) } != 0 {
        return Err(io("unmount", target)(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Unmounts `target` while something is mounted there, then removes it.
fn remove_target(target: &Path) -> Result<(), SubPathError> {
    while crate::util::is_mounted(target).map_err(io("read mounts for", target))? {
        unmount(target)?;
    }
    let m = match std::fs::symlink_metadata(target) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io("stat", target)(e)),
    };
    if m.is_dir() {
        std::fs::remove_dir(target).map_err(io("remove", target))
    } else {
        std::fs::remove_file(target).map_err(io("remove", target))
    }
}

/// Removes `dir` if it is empty.
fn remove_if_empty(dir: &Path) -> Result<(), SubPathError> {
    match std::fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENOTEMPTY | libc::EEXIST | libc::ENOENT)
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(io("remove", dir)(e)),
    }
}

fn entries(dir: &Path) -> Result<Vec<PathBuf>, SubPathError> {
    match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .map(|e| e.map(|e| e.path()).map_err(io("read", dir)))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(io("read", dir)(e)),
    }
}

/// Unmounts and removes the subPath bind mounts of one volume of the pod
/// (`doCleanSubPaths`), then its directory and `volume-subpaths` when empty.
/// Never descends into a mount: each `<container>/<index>` is unmounted
/// before it is removed, and only empty directories are removed.
pub fn clean_sub_paths(pod_dir: &Path, volume_name: &str) -> Result<(), SubPathError> {
    let top = pod_dir.join(SUBPATH_DIR);
    let vol_dir = top.join(component("volume name", volume_name)?);
    for container in entries(&vol_dir)? {
        let m = std::fs::symlink_metadata(&container).map_err(io("stat", &container))?;
        if !m.is_dir() {
            continue;
        }
        for target in entries(&container)? {
            remove_target(&target)?;
        }
        remove_if_empty(&container)?;
    }
    remove_if_empty(&vol_dir)?;
    remove_if_empty(&top)
}

/// The subPath bind mounts of every volume of the pod (a pod whose volumes
/// a previous run mounted, or an orphaned pod directory).
pub fn clean_pod_sub_paths(pod_dir: &Path) -> Result<(), SubPathError> {
    for vol in entries(&pod_dir.join(SUBPATH_DIR))? {
        let name = vol.file_name().map(|n| n.to_string_lossy().into_owned());
        clean_sub_paths(pod_dir, &name.unwrap_or_default())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
