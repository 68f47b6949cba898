//! The container index: which container (and pod) a cgroup belongs to.
//!
//! Keys are cgroup2 ids (task records carry cgroup2 ids; cgroup v1 hierarchies
//! are not indexed, `docs/pleg.md` clause 9). Entries come from the kernel's
//! mkdir/rmdir reports and from [`scan`] of the existing tree, so containers that
//! started before the agent are known. Nested cgroups below a container cgroup map
//! to that container, as Tetragon and Inspektor Gadget do. Every entry records
//! when it was learned, so that a reconcile with the runtime can forget what the
//! runtime no longer lists without forgetting what was learned since.

use super::{FastMap as HashMap, FastSet as HashSet};
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use evpleg_core::cgroup_path::{CgroupClass, CgroupPathError, classify};
use evpleg_core::ids::{ContainerId, PodUid};

/// The cgroup2 hierarchy's id (the only one indexed).
pub const CGROUP2_HIERARCHY: u32 = 0;

/// What the index knows about one cgroup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexEntry {
    pub path: String,
    pub class: CgroupClass,
    /// CLOCK_MONOTONIC ns when it was learned.
    pub learned_at_ns: u64,
}

impl IndexEntry {
    /// The container this cgroup belongs to (itself or, nested, an ancestor).
    pub fn container(&self) -> Option<(&ContainerId, Option<&PodUid>, bool)> {
        match &self.class {
            CgroupClass::Container {
                id, pod, nested, ..
            } => Some((id, pod.as_ref().map(|(uid, _)| uid), *nested)),
            _ => None,
        }
    }

    /// The container a container, nested or helper cgroup serves.
    pub fn container_id(&self) -> Option<&ContainerId> {
        match &self.class {
            CgroupClass::Container { id, .. } | CgroupClass::RuntimeHelper { id } => Some(id),
            _ => None,
        }
    }

    /// The pod of a pod cgroup, or of a container cgroup whose path names it.
    pub fn pod(&self) -> Option<&PodUid> {
        match &self.class {
            CgroupClass::Pod { uid, .. } => Some(uid),
            CgroupClass::Container { pod, .. } => pod.as_ref().map(|(uid, _)| uid),
            _ => None,
        }
    }
}

/// cgroup2 id to what the cgroup is.
#[derive(Clone, Debug, Default)]
pub struct ContainerIndex {
    entries: HashMap<u64, IndexEntry>,
    /// Cgroups known to be outside Kubernetes (under a configured root such as
    /// `/system.slice` but not a container) or with a malformed path, with when
    /// they were learned: tasks in them are ignored without a rescan.
    ignored: HashMap<u64, u64>,
    /// The entries by the pod their path names and by the container they
    /// serve, so that a pod's reconcile visits that pod's entries only
    /// ([`ContainerIndex::retain_scoped`]).
    by_pod: HashMap<PodUid, HashSet<u64>>,
    by_container: HashMap<ContainerId, HashSet<u64>>,
}

impl ContainerIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a cgroup learned at `at_ns`. Paths outside Kubernetes' roots are not
    /// kept (`Ok(None)`); malformed ones are an error naming the path.
    pub fn insert(
        &mut self,
        cgroup_id: u64,
        path: &str,
        at_ns: u64,
    ) -> Result<Option<&IndexEntry>, CgroupPathError> {
        let class = match classify(path) {
            Ok(class) => class,
            Err(CgroupPathError::NotKubernetes { .. }) => {
                self.ignored.insert(cgroup_id, at_ns);
                return Ok(None);
            }
            Err(e) => {
                // Kept out of the index, and not rescanned for on every exec.
                self.ignored.insert(cgroup_id, at_ns);
                return Err(e);
            }
        };
        let entry = IndexEntry {
            path: path.to_owned(),
            class,
            learned_at_ns: at_ns,
        };
        if let Some(old) = self.entries.remove(&cgroup_id) {
            unlink(&mut self.by_pod, &mut self.by_container, cgroup_id, &old);
        }
        link(&mut self.by_pod, &mut self.by_container, cgroup_id, &entry);
        self.entries.insert(cgroup_id, entry);
        Ok(self.entries.get(&cgroup_id))
    }

    pub fn remove(&mut self, cgroup_id: u64) -> Option<IndexEntry> {
        self.ignored.remove(&cgroup_id);
        let old = self.entries.remove(&cgroup_id)?;
        unlink(&mut self.by_pod, &mut self.by_container, cgroup_id, &old);
        Some(old)
    }

    /// Whether the cgroup is known to be outside Kubernetes.
    pub fn is_ignored(&self, cgroup_id: u64) -> bool {
        self.ignored.contains_key(&cgroup_id)
    }

    pub fn get(&self, cgroup_id: u64) -> Option<&IndexEntry> {
        self.entries.get(&cgroup_id)
    }

    /// Keeps the entries for which `keep` holds; returns how many were
    /// removed. Only what is removed is unlinked (rebuilding the by-pod and
    /// by-container maps cloned every pod uid and container id: most of a
    /// full view's 130 ms at 21 000 pods, on the real-time reader).
    pub fn retain(&mut self, mut keep: impl FnMut(&IndexEntry) -> bool) -> usize {
        let doomed: Vec<u64> = (self.entries.iter())
            .filter(|(_, e)| !keep(e))
            .map(|(id, _)| *id)
            .collect();
        for id in &doomed {
            if let Some(old) = self.entries.remove(id) {
                unlink(&mut self.by_pod, &mut self.by_container, *id, &old);
            }
        }
        doomed.len()
    }

    /// As [`ContainerIndex::retain`], visiting only the entries whose path
    /// names `pod` and those serving one of `containers`: `keep` must hold
    /// for every other entry. Costs the pod's entries, not the node's.
    pub fn retain_scoped(
        &mut self,
        pod: &PodUid,
        containers: &[ContainerId],
        mut keep: impl FnMut(&IndexEntry) -> bool,
    ) -> usize {
        let serving = containers.iter().flat_map(|c| self.by_container.get(c));
        let doomed: Vec<u64> = (self.by_pod.get(pod).into_iter().chain(serving))
            .flatten()
            .copied()
            .filter(|id| self.entries.get(id).is_some_and(|e| !keep(e)))
            .collect();
        let mut removed = 0;
        for id in doomed {
            // An entry both of the pod and of a container is listed twice.
            if let Some(old) = self.entries.remove(&id) {
                unlink(&mut self.by_pod, &mut self.by_container, id, &old);
                removed += 1;
            }
        }
        removed
    }

    /// Forgets the ignored cgroups learned before `ns` (a rescan learns those that
    /// still exist again); returns how many.
    pub fn forget_ignored_before(&mut self, ns: u64) -> usize {
        let before = self.ignored.len();
        self.ignored.retain(|_, at| *at >= ns);
        before - self.ignored.len()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn ignored_len(&self) -> usize {
        self.ignored.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Adds entry `id` to the by-pod and by-container maps.
fn link(
    by_pod: &mut HashMap<PodUid, HashSet<u64>>,
    by_container: &mut HashMap<ContainerId, HashSet<u64>>,
    id: u64,
    e: &IndexEntry,
) {
    if let Some(pod) = e.pod() {
        by_pod.entry(pod.clone()).or_default().insert(id);
    }
    if let Some(c) = e.container_id() {
        by_container.entry(c.clone()).or_default().insert(id);
    }
}

/// Removes entry `id` from the by-pod and by-container maps.
fn unlink(
    by_pod: &mut HashMap<PodUid, HashSet<u64>>,
    by_container: &mut HashMap<ContainerId, HashSet<u64>>,
    id: u64,
    e: &IndexEntry,
) {
    if let Some(pod) = e.pod()
        && let Some(set) = by_pod.get_mut(pod)
    {
        set.remove(&id);
        if set.is_empty() {
            by_pod.remove(pod);
        }
    }
    if let Some(c) = e.container_id()
        && let Some(set) = by_container.get_mut(c)
    {
        set.remove(&id);
        if set.is_empty() {
            by_container.remove(c);
        }
    }
}

/// A cgroup found by [`scan`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScannedCgroup {
    /// The path relative to the hierarchy's root (`/kubepods/...`).
    pub path: String,
    /// The directory's inode number: the cgroup id on cgroup2 and kernfs v1.
    pub cgroup_id: u64,
    /// The directory on disk.
    pub dir: PathBuf,
}

/// Errors of the start-up scan.
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    /// reading a cgroup directory failed
    #[error("cannot read cgroup directory {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
}

/// Walks the cgroup tree mounted at `mount`, below each of `roots` (paths relative to
/// the hierarchy root such as `/kubepods`), and returns every cgroup directory found,
/// roots included. A root that does not exist is skipped; a directory that vanishes
/// during the walk is skipped (it was removed, and its rmdir is reported by the
/// kernel).
pub fn scan(mount: &Path, roots: &[String]) -> Result<Vec<ScannedCgroup>, ScanError> {
    let mut out = Vec::new();
    for root in roots {
        let dir = mount.join(root.trim_start_matches('/'));
        let meta = match fs::metadata(&dir) {
            Ok(m) if m.is_dir() => m,
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(source) => return Err(ScanError::Read { path: dir, source }),
        };
        let mut stack = vec![(root.trim_end_matches('/').to_owned(), dir, meta.ino())];
        while let Some((path, dir, ino)) = stack.pop() {
            let entries = match fs::read_dir(&dir) {
                Ok(entries) => entries,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(source) => return Err(ScanError::Read { path: dir, source }),
            };
            for entry in entries.flatten() {
                let Ok(file_type) = entry.file_type() else {
                    continue;
                };
                if !file_type.is_dir() {
                    continue;
                }
                let Ok(meta) = entry.metadata() else { continue };
                let name = entry.file_name().to_string_lossy().into_owned();
                stack.push((format!("{path}/{name}"), entry.path(), meta.ino()));
            }
            out.push(ScannedCgroup {
                path,
                cgroup_id: ino,
                dir,
            });
        }
    }
    Ok(out)
}

/// Where the cgroup2 hierarchy is mounted (`/sys/fs/cgroup` on cgroup2-only hosts,
/// `/sys/fs/cgroup/unified` on hybrid ones), from `/proc/self/mountinfo`.
pub fn cgroup2_mount() -> io::Result<Option<PathBuf>> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo")?;
    Ok(parse_cgroup2_mount(&mountinfo))
}

fn parse_cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let fstype = right.split_whitespace().next()?;
        let mount_point = left.split_whitespace().nth(4)?;
        (fstype == "cgroup2").then(|| PathBuf::from(mount_point.replace("\\040", " ")))
    })
}

/// The v1 hierarchies mounted on a hybrid host: `(hierarchy id, controllers, mount
/// point)`, from `/proc/self/cgroup` and `/proc/self/mountinfo`; empty on
/// cgroup2-only hosts. The kernel PLEG does not use them (it needs cgroup2); the
/// runtime side uses the mount points.
pub fn v1_hierarchies() -> io::Result<Vec<(u32, String, PathBuf)>> {
    let cgroup = fs::read_to_string("/proc/self/cgroup")?;
    let mountinfo = fs::read_to_string("/proc/self/mountinfo")?;
    Ok(parse_v1_hierarchies(&cgroup, &mountinfo))
}

fn parse_v1_hierarchies(cgroup: &str, mountinfo: &str) -> Vec<(u32, String, PathBuf)> {
    let mut out = Vec::new();
    for line in cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers)) = (parts.next(), parts.next()) else {
            continue;
        };
        let Ok(id) = id.parse::<u32>() else { continue };
        if id == 0 || controllers.is_empty() {
            continue;
        }
        let mount = mountinfo.lines().find_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let mut r = right.split_whitespace();
            if r.next()? != "cgroup" {
                return None;
            }
            let options = r.nth(1)?;
            let wanted: Vec<&str> = controllers.split(',').collect();
            let opts: Vec<&str> = options.split(',').collect();
            wanted
                .iter()
                .all(|c| opts.contains(c))
                .then(|| PathBuf::from(left.split_whitespace().nth(4).unwrap_or_default()))
        });
        if let Some(mount) = mount {
            out.push((id, controllers.to_owned(), mount));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "1b4e28ba-2fa1-11d2-883f-0016d3cca427";

    fn cid(c: char) -> String {
        std::iter::repeat_n(c, 64).collect()
    }

    #[test]
    fn insert_lookup_remove() {
        let mut index = ContainerIndex::new();
        let path = format!("/kubepods/besteffort/pod{UID}/{}", cid('a'));
        let entry = index.insert(100, &path, 5).unwrap().unwrap();
        let (id, pod, nested) = entry.container().unwrap();
        assert_eq!(id.as_str(), cid('a'));
        assert_eq!(pod.unwrap().as_str(), UID);
        assert!(!nested);
        assert_eq!(entry.learned_at_ns, 5);
        assert!(index.get(101).is_none());
        assert!(
            index
                .insert(7, "/user.slice/user-0.slice", 5)
                .unwrap()
                .is_none()
        );
        assert!(index.is_ignored(7));
        assert!(index.insert(8, "/kubepods/besteffort/podZZ/x", 9).is_err());
        assert!(index.is_ignored(8));
        assert_eq!(index.len(), 1);
        assert_eq!(index.remove(100).unwrap().path, path);
        assert!(index.is_empty());
    }

    #[test]
    fn pruning_keeps_what_was_learned_since() {
        let mut index = ContainerIndex::new();
        let a = format!("/kubepods/besteffort/pod{UID}/{}", cid('a'));
        let b = format!("/kubepods/besteffort/pod{UID}/{}", cid('b'));
        index.insert(1, &a, 10).unwrap();
        index.insert(2, &b, 10).unwrap();
        index.insert(3, &format!("{a}/init.scope"), 10).unwrap();
        let gone = ContainerId::parse(&cid('a')).unwrap();
        let removed = index.retain(|e| e.container_id() != Some(&gone));
        assert_eq!(removed, 2, "the container and its nested cgroup");
        assert!(index.get(2).is_some());
        index.insert(7, "/user.slice/a", 10).unwrap();
        index.insert(8, "/user.slice/b", 30).unwrap();
        assert_eq!(index.forget_ignored_before(20), 1);
        assert!(!index.is_ignored(7) && index.is_ignored(8));
        assert_eq!(index.ignored_len(), 1);
    }

    #[test]
    fn nested_cgroups_inherit_their_container() {
        let mut index = ContainerIndex::new();
        let path = format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{}.scope/init.scope",
            UID.replace('-', "_"),
            cid('b')
        );
        let entry = index.insert(5, &path, 0).unwrap().unwrap();
        let (id, pod, nested) = entry.container().unwrap();
        assert_eq!(
            (id.as_str(), pod.unwrap().as_str(), nested),
            (cid('b').as_str(), UID, true)
        );
    }

    #[test]
    fn scan_walks_a_tree_with_inode_ids() {
        let base = std::env::temp_dir().join(format!("evpleg-scan-{}", std::process::id()));
        let leaf = base.join(format!("kubepods/besteffort/pod{UID}/{}", cid('c')));
        fs::create_dir_all(&leaf).unwrap();
        fs::create_dir_all(base.join("other/x")).unwrap();
        let found = scan(&base, &["/kubepods".into(), "/absent".into()]).unwrap();
        let mut paths: Vec<&str> = found.iter().map(|c| c.path.as_str()).collect();
        paths.sort();
        let expected_leaf = format!("/kubepods/besteffort/pod{UID}/{}", cid('c'));
        assert_eq!(
            paths,
            vec![
                "/kubepods",
                "/kubepods/besteffort",
                &format!("/kubepods/besteffort/pod{UID}"),
                &expected_leaf,
            ]
        );
        let leaf_entry = found.iter().find(|c| c.path == expected_leaf).unwrap();
        assert_eq!(leaf_entry.cgroup_id, fs::metadata(&leaf).unwrap().ino());
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn mount_discovery() {
        let mountinfo = "\
35 24 0:30 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
36 35 0:31 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw
37 35 0:32 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
38 35 0:33 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
39 35 0:34 / /sys/fs/cgroup/systemd rw,nosuid - cgroup cgroup rw,xattr,name=systemd
";
        assert_eq!(
            parse_cgroup2_mount(mountinfo).unwrap(),
            PathBuf::from("/sys/fs/cgroup/unified")
        );
        let cgroup = "12:memory:/\n4:cpu,cpuacct:/\n1:name=systemd:/\n0::/\n";
        let v1 = parse_v1_hierarchies(cgroup, mountinfo);
        assert_eq!(
            v1,
            vec![
                (
                    12,
                    "memory".to_owned(),
                    PathBuf::from("/sys/fs/cgroup/memory")
                ),
                (
                    4,
                    "cpu,cpuacct".to_owned(),
                    PathBuf::from("/sys/fs/cgroup/cpu,cpuacct")
                ),
                (
                    1,
                    "name=systemd".to_owned(),
                    PathBuf::from("/sys/fs/cgroup/systemd")
                ),
            ]
        );
        assert_eq!(
            parse_cgroup2_mount("1 2 0:1 / /proc rw - proc proc rw\n"),
            None
        );
    }
}
