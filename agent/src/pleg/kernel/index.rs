//! The container index: which container (and pod) a cgroup belongs to.
//!
//! Keys are `(hierarchy id, cgroup id)`: cgroup ids are unique only within one
//! hierarchy, and hybrid hosts mount several (cgroup2 is hierarchy 0; task events
//! carry cgroup2 ids). Entries come from the kernel's mkdir/rmdir reports and from
//! [`scan`] of the existing tree at start-up, so containers that started before the
//! agent are known. Nested cgroups below a container cgroup map to that container,
//! as Tetragon and Inspektor Gadget do.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::cgroup_path::{CgroupClass, CgroupPathError, classify};
use crate::pleg::{ContainerId, PodUid};

/// The cgroup2 hierarchy's id.
pub const CGROUP2_HIERARCHY: u32 = 0;

/// What the index knows about one cgroup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexEntry {
    pub path: String,
    pub class: CgroupClass,
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
}

/// `(hierarchy id, cgroup id)` to what the cgroup is.
#[derive(Debug, Default)]
pub struct ContainerIndex {
    entries: HashMap<(u32, u64), IndexEntry>,
    /// Cgroups known to be outside Kubernetes (under a configured root such as
    /// `/system.slice` but not a container) or with a malformed path: tasks in them
    /// are ignored without a rescan.
    ignored: HashSet<(u32, u64)>,
}

impl ContainerIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a cgroup. Paths outside Kubernetes' roots are not kept (`Ok(None)`);
    /// malformed ones are an error naming the path.
    pub fn insert(
        &mut self,
        hierarchy: u32,
        cgroup_id: u64,
        path: &str,
    ) -> Result<Option<&IndexEntry>, CgroupPathError> {
        let class = match classify(path) {
            Ok(class) => class,
            Err(CgroupPathError::NotKubernetes { .. }) => {
                self.ignored.insert((hierarchy, cgroup_id));
                return Ok(None);
            }
            Err(e) => {
                // Kept out of the index, and not rescanned for on every exec.
                self.ignored.insert((hierarchy, cgroup_id));
                return Err(e);
            }
        };
        let key = (hierarchy, cgroup_id);
        self.entries.insert(
            key,
            IndexEntry {
                path: path.to_owned(),
                class,
            },
        );
        Ok(self.entries.get(&key))
    }

    pub fn remove(&mut self, hierarchy: u32, cgroup_id: u64) -> Option<IndexEntry> {
        self.ignored.remove(&(hierarchy, cgroup_id));
        self.entries.remove(&(hierarchy, cgroup_id))
    }

    /// Whether the cgroup is known to be outside Kubernetes.
    pub fn is_ignored(&self, hierarchy: u32, cgroup_id: u64) -> bool {
        self.ignored.contains(&(hierarchy, cgroup_id))
    }

    pub fn get(&self, hierarchy: u32, cgroup_id: u64) -> Option<&IndexEntry> {
        self.entries.get(&(hierarchy, cgroup_id))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
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

/// The v1 hierarchies: `(hierarchy id, mount point)`, from `/proc/self/cgroup` and
/// `/proc/self/mountinfo`. Empty on cgroup2-only hosts.
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
        let entry = index.insert(0, 100, &path).unwrap().unwrap();
        let (id, pod, nested) = entry.container().unwrap();
        assert_eq!(id.as_str(), cid('a'));
        assert_eq!(pod.unwrap().as_str(), UID);
        assert!(!nested);
        // The same id in another hierarchy is another cgroup.
        assert!(index.get(3, 100).is_none());
        assert!(
            index
                .insert(0, 7, "/user.slice/user-0.slice")
                .unwrap()
                .is_none()
        );
        assert!(index.is_ignored(0, 7));
        assert!(index.insert(0, 8, "/kubepods/besteffort/podZZ/x").is_err());
        assert_eq!(index.len(), 1);
        assert_eq!(index.remove(0, 100).unwrap().path, path);
        assert!(index.is_empty());
    }

    #[test]
    fn nested_cgroups_inherit_their_container() {
        let mut index = ContainerIndex::new();
        let path = format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{}.scope/init.scope",
            UID.replace('-', "_"),
            cid('b')
        );
        let entry = index.insert(0, 5, &path).unwrap().unwrap();
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
