//! The machine's size, as the kubelet's cAdvisor `MachineInfo` gives it: CPUs,
//! memory, and a filesystem's size.

/// The CPUs this process may run on (`available_parallelism`).
pub fn cpus() -> i64 {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1) as i64
}

/// The machine's memory (`MemTotal` in `/proc/meminfo`), in bytes; 0 if unreadable.
pub fn memory_bytes() -> i64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<i64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// Available and total bytes of the filesystem holding `path` (statvfs).
pub fn filesystem_bytes(path: &std::path::Path) -> Option<(u64, u64)> {
    filesystem(path).map(|f| (f.available_bytes, f.capacity_bytes))
}

/// What statvfs says of a filesystem.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Filesystem {
    pub available_bytes: u64,
    pub capacity_bytes: u64,
    pub inodes: u64,
    pub inodes_free: u64,
}

/// The filesystem holding `path` (statvfs); `None` if it cannot be read.
pub fn filesystem(path: &std::path::Path) -> Option<Filesystem> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut s = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a valid C string, `s` a buffer statvfs fills on success.
    if unsafe { libc::statvfs(c.as_ptr(), s.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled `s`.
    let s = unsafe { s.assume_init() };
    // The statvfs fields' widths differ between architectures.
    #[allow(clippy::unnecessary_cast)]
    let (unit, avail, blocks) = (s.f_frsize as u64, s.f_bavail as u64, s.f_blocks as u64);
    #[allow(clippy::unnecessary_cast)]
    let (inodes, inodes_free) = (s.f_files as u64, s.f_ffree as u64);
    Some(Filesystem {
        available_bytes: avail * unit,
        capacity_bytes: blocks * unit,
        inodes,
        inodes_free,
    })
}
