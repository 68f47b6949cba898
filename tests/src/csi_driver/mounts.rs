//! Bind mounts for the test CSI driver (root only).

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(io::Error::other)
}

/// Bind-mounts `source` on `target`; read-only if asked (a bind mount is
/// made read-only by a remount).
pub fn bind(source: &Path, target: &Path, read_only: bool) -> io::Result<()> {
    let (s, t) = (cstr(source)?, cstr(target)?);
    // SAFETY: valid NUL-terminated paths; null fstype and data are allowed
    // for MS_BIND.
    let rc = unsafe {
        libc::mount(
            s.as_ptr(),
            t.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    if read_only {
        // SAFETY: as above; remounting the bind mount just made.
        let rc = unsafe {
            libc::mount(
                std::ptr::null(),
                t.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY,
                std::ptr::null(),
            )
        };
        if rc != 0 {
            let e = io::Error::last_os_error();
            let _ = unmount(target);
            return Err(e);
        }
    }
    Ok(())
}

/// Unmounts `target`; not mounted is success.
pub fn unmount(target: &Path) -> io::Result<()> {
    if !is_mount_point(target) {
        return Ok(());
    }
    let t = cstr(target)?;
    // SAFETY: valid NUL-terminated path.
    let rc = unsafe { libc::umount2(t.as_ptr(), 0) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether `path` is a mount point of this mount namespace
/// (`/proc/self/mountinfo`'s fifth field, octal escapes undone).
pub fn is_mount_point(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.as_os_str().as_bytes();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|m| unescape(m) == want)
}

/// Whether the mount at `path` is read-only.
pub fn is_read_only(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.as_os_str().as_bytes();
    info.lines()
        .rfind(|l| l.split(' ').nth(4).is_some_and(|m| unescape(m) == want))
        .and_then(|l| l.split(' ').nth(5))
        .is_some_and(|opts| opts.split(',').any(|o| o == "ro"))
}

fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(super::unescape(r"/a\040b"), b"/a b");
        assert_eq!(super::unescape("/plain"), b"/plain");
    }
}
