//! Cgroups that look like the kubelet's, created by a test and removed when dropped,
//! with any process still in them killed first.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use evpleg_pleg::kernel::index::{cgroup2_mount, v1_hierarchies};

/// The kubelet's cgroup layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `/kubepods/besteffort/pod<uid>/<id>`
    Cgroupfs,
    /// `/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid_>.slice/cri-containerd-<id>.scope`
    Systemd,
    /// `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/cri-containerd-<id>.scope`
    SystemdBurstable,
    /// `/kubepods.slice/kubepods-pod<uid_>.slice/cri-containerd-<id>.scope` (a
    /// guaranteed pod: no QoS level)
    SystemdGuaranteed,
    /// `/k8s.io/<id>` (containerd without a cgroup parent)
    ContainerdNoParent,
    /// `/docker/<id>` (Docker's cgroupfs driver; not a default root: a PLEG
    /// watches it only when configured to)
    Docker,
}

impl Layout {
    /// The levels above the pod's (or the container's, without a pod level),
    /// which containers of other pods share.
    fn shared_parts(self) -> Vec<String> {
        let parts: &[&str] = match self {
            Layout::Cgroupfs => &["kubepods", "besteffort"],
            Layout::Systemd => &["kubepods.slice", "kubepods-besteffort.slice"],
            Layout::SystemdBurstable => &["kubepods.slice", "kubepods-burstable.slice"],
            Layout::SystemdGuaranteed => &["kubepods.slice"],
            Layout::ContainerdNoParent => &["k8s.io"],
            Layout::Docker => &["docker"],
        };
        parts.iter().map(|p| p.to_string()).collect()
    }
}

/// Ancestors shared between tests of one process, with how many tests use them;
/// the last user removes those this process created.
fn shared() -> &'static Mutex<HashMap<PathBuf, (usize, bool)>> {
    static SHARED: OnceLock<Mutex<HashMap<PathBuf, (usize, bool)>>> = OnceLock::new();
    SHARED.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The cgroup2 mount point.
pub fn cgroup2() -> PathBuf {
    cgroup2_mount()
        .ok()
        .flatten()
        .expect("a cgroup2 hierarchy (checked by privileged())")
}

/// The v1 memory hierarchy's id and mount point, on hybrid hosts.
pub fn v1_memory() -> Option<(u32, PathBuf)> {
    v1_hierarchies()
        .ok()?
        .into_iter()
        .find_map(|(id, controllers, mount)| {
            controllers
                .split(',')
                .any(|c| c == "memory")
                .then_some((id, mount))
        })
}

/// A container cgroup (and its pod cgroup) under one or more hierarchies.
#[derive(Debug)]
pub struct ContainerCgroup {
    pub pod_uid: String,
    pub container_id: String,
    /// The path relative to the hierarchy root.
    pub path: String,
    /// Mount points the cgroup exists under (cgroup2 first).
    mounts: Vec<PathBuf>,
    /// Directories this cgroup owns (the pod and container levels), per mount.
    owned: Vec<PathBuf>,
    /// Its shared ancestors, held until the pod and container levels are
    /// removed (a field: dropped after `drop` ran).
    shared: SharedAncestors,
}

impl ContainerCgroup {
    /// A new container cgroup with a fresh pod UID and container id, in cgroup2.
    pub fn new(layout: Layout) -> Self {
        Self::create(layout, false, &crate::pod_uid(), &crate::container_id())
    }

    /// As [`new`](Self::new), also in the v1 memory hierarchy when there is one
    /// (hybrid hosts put the memory controller there).
    pub fn with_v1_memory(layout: Layout) -> Self {
        Self::create(layout, true, &crate::pod_uid(), &crate::container_id())
    }

    /// Another container of the same pod.
    pub fn sibling(&self, layout: Layout) -> Self {
        Self::create(layout, false, &self.pod_uid, &crate::container_id())
    }

    fn create(layout: Layout, v1_memory_too: bool, uid: &str, id: &str) -> Self {
        let shared_parts = layout.shared_parts();
        let owned_parts: Vec<String> = match layout {
            Layout::Cgroupfs => vec![format!("pod{uid}"), id.to_owned()],
            Layout::Systemd => vec![
                format!("kubepods-besteffort-pod{}.slice", uid.replace('-', "_")),
                format!("cri-containerd-{id}.scope"),
            ],
            Layout::SystemdBurstable => vec![
                format!("kubepods-burstable-pod{}.slice", uid.replace('-', "_")),
                format!("cri-containerd-{id}.scope"),
            ],
            Layout::SystemdGuaranteed => vec![
                format!("kubepods-pod{}.slice", uid.replace('-', "_")),
                format!("cri-containerd-{id}.scope"),
            ],
            Layout::ContainerdNoParent | Layout::Docker => vec![id.to_owned()],
        };
        let mut mounts = vec![cgroup2()];
        if v1_memory_too && let Some((_, mount)) = v1_memory() {
            mounts.push(mount);
        }
        let mut cg = Self {
            pod_uid: uid.to_owned(),
            container_id: id.to_owned(),
            path: format!("/{}/{}", shared_parts.join("/"), owned_parts.join("/")),
            mounts: mounts.clone(),
            owned: Vec::new(),
            shared: SharedAncestors(Vec::new()),
        };
        for mount in &mounts {
            let mut dir = cg.shared.hold(mount, &shared_parts);
            for part in &owned_parts {
                dir.push(part);
                if !dir.exists() {
                    fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
                    cg.owned.push(dir.clone());
                }
            }
        }
        cg
    }

    /// The container cgroup's directory in cgroup2.
    pub fn dir(&self) -> PathBuf {
        self.mounts[0].join(self.path.trim_start_matches('/'))
    }

    /// The container cgroup's directory under every mount.
    pub fn dirs(&self) -> Vec<PathBuf> {
        self.mounts
            .iter()
            .map(|m| m.join(self.path.trim_start_matches('/')))
            .collect()
    }

    /// The cgroup2 id (the directory's inode number).
    pub fn id(&self) -> u64 {
        fs::metadata(self.dir()).expect("cgroup exists").ino()
    }

    /// Limits memory (bytes) and swap, in the v1 memory hierarchy when the cgroup
    /// is there, else in cgroup2 (enabling the controller on the way).
    pub fn limit_memory(&self, bytes: u64) {
        if let Some(v1) = self.dirs().get(1) {
            write(&v1.join("memory.limit_in_bytes"), &bytes.to_string());
            let memsw = v1.join("memory.memsw.limit_in_bytes");
            if memsw.exists() {
                write(&memsw, &bytes.to_string());
            }
            return;
        }
        let mount = &self.mounts[0];
        let mut dir = mount.clone();
        for part in self.path.trim_start_matches('/').split('/') {
            write(&dir.join("cgroup.subtree_control"), "+memory");
            dir.push(part);
        }
        write(&dir.join("memory.max"), &bytes.to_string());
        let swap = dir.join("memory.swap.max");
        if swap.exists() {
            write(&swap, "0");
        }
    }

    /// A command whose process joins this cgroup (in every hierarchy) before it
    /// execs, as a runtime's init does.
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        let procs: Vec<CString> = self
            .dirs()
            .iter()
            .map(|d| path_cstring(&d.join("cgroup.procs")))
            .collect();
        // SAFETY: between fork and exec the closure only calls async-signal-safe
        // functions on strings built before the fork; it does not allocate.
        unsafe {
            cmd.pre_exec(move || {
                for p in &procs {
                    join_cgroup(p)?;
                }
                Ok(())
            });
        }
        cmd
    }

    /// Pids in the cgroup and below.
    pub fn pids(&self) -> Vec<i32> {
        evpleg_pleg::kernel::scan::processes_below(&self.dir())
            .into_iter()
            .map(|p| p.pid as i32)
            .collect()
    }

    /// Kills everything in the cgroup and waits (bounded) until it is empty.
    pub fn kill_all(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let pids = self.pids();
            if pids.is_empty() || Instant::now() > deadline {
                return;
            }
            for pid in pids {
                // SAFETY: sending a signal has no memory-safety preconditions.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            std::thread::yield_now();
        }
    }

    /// Removes the container's cgroup directories now (the pod's stay), returning
    /// whether they were removed.
    pub fn remove_container(&mut self) {
        self.kill_all();
        let leafs: Vec<PathBuf> = self.dirs();
        for leaf in leafs {
            rmdir_retry(&leaf);
            self.owned.retain(|d| *d != leaf);
        }
    }
}

pub fn path_cstring(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).expect("no NUL in a cgroup path")
}

/// Moves the calling process into the cgroup whose `cgroup.procs` is `procs`.
/// Async-signal-safe: usable between fork and exec.
pub fn join_cgroup(procs: &CString) -> std::io::Result<()> {
    // SAFETY: a valid NUL-terminated path; the fd is closed before returning.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let ok = libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        if ok { Ok(()) } else { Err(err) }
    }
}

fn write(path: &Path, value: &str) {
    fs::write(path, value).unwrap_or_else(|e| panic!("write {value:?} to {}: {e}", path.display()));
}

/// rmdir, retried briefly: a cgroup whose last process just exited may still be
/// busy for a moment.
fn rmdir_retry(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) if Instant::now() > deadline => {
                eprintln!("cleanup: cannot remove {}: {e}", dir.display());
                return;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

impl Drop for ContainerCgroup {
    fn drop(&mut self) {
        self.kill_all();
        // Deepest first.
        let mut owned = std::mem::take(&mut self.owned);
        owned.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        for dir in owned {
            rmdir_retry(&dir);
        }
    }
}

/// Shared ancestors of container cgroups (`/kubepods/besteffort`, ...) held
/// while this lives: the first holder in the process creates what is missing,
/// the last removes what this process created.
#[derive(Debug)]
pub struct SharedAncestors(Vec<PathBuf>);

impl SharedAncestors {
    /// `layout`'s shared ancestors in cgroup2. A kernel PLEG under test holds
    /// the cgroupfs ones from before it starts, as a kubelet makes `/kubepods`
    /// before any pod: otherwise a test's first cgroup makes the root, which
    /// reaches the kernel filter only when its mkdir is read, and a process
    /// run below it at once is (rightly) uncertain. A root made after the
    /// start is its own test (`containers_below_a_root_made_while_the_reader_lagged_lose_nothing`).
    pub fn of(layout: Layout) -> Self {
        let mut held = Self(Vec::new());
        held.hold(&cgroup2(), &layout.shared_parts());
        held
    }

    /// Holds `parts` below `mount`, one below the other; returns the deepest.
    fn hold(&mut self, mount: &Path, parts: &[String]) -> PathBuf {
        let mut registry = shared().lock().unwrap_or_else(|e| e.into_inner());
        let mut dir = mount.to_path_buf();
        for part in parts {
            dir.push(part);
            let entry = registry.entry(dir.clone()).or_insert((0, false));
            if entry.0 == 0 && !dir.exists() {
                fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
                entry.1 = true;
            }
            entry.0 += 1;
            self.0.push(dir.clone());
        }
        dir
    }
}

impl Drop for SharedAncestors {
    fn drop(&mut self) {
        let mut registry = shared().lock().unwrap_or_else(|e| e.into_inner());
        let mut held = std::mem::take(&mut self.0);
        held.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        for dir in held {
            if let Some(entry) = registry.get_mut(&dir) {
                entry.0 -= 1;
                if entry.0 == 0 {
                    if entry.1 {
                        rmdir_retry(&dir);
                    }
                    registry.remove(&dir);
                }
            }
        }
    }
}

/// A cgroup outside every Kubernetes root, for the filter test.
#[derive(Debug)]
pub struct OutsideCgroup {
    dir: PathBuf,
}

impl OutsideCgroup {
    pub fn new() -> Self {
        let dir = cgroup2().join(format!("evpleg-outside-{:x}", crate::unique_u64()));
        fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        Self { dir }
    }

    pub fn id(&self) -> u64 {
        fs::metadata(&self.dir).expect("cgroup exists").ino()
    }

    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        let procs = path_cstring(&self.dir.join("cgroup.procs"));
        // SAFETY: as in ContainerCgroup::command.
        unsafe {
            cmd.pre_exec(move || join_cgroup(&procs));
        }
        cmd
    }
}

impl Default for OutsideCgroup {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for OutsideCgroup {
    fn drop(&mut self) {
        rmdir_retry(&self.dir);
    }
}
