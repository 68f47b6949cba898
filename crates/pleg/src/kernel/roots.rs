//! The kernel filter's root cgroups (`ROOTS`): one home for deciding which ids it
//! must hold.
//!
//! A configured root (`/kubepods`, ...) that exists is in the filter; one created
//! after start is added when its mkdir is read, and one whose mkdir was lost is
//! found by the next rescan of the tree; a removed root is taken out. No kubelet
//! counterpart (the kubelet has no kernel filter).

use std::collections::HashMap;

use super::event::CgroupChange;
use super::index::CGROUP2_HIERARCHY;

/// A root found on disk by a scan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundRoot {
    pub path: String,
    pub cgroup_id: u64,
    /// Depth below the hierarchy root: `/kubepods` is 1.
    pub level: u32,
}

/// A change to apply to the kernel filter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FilterChange {
    /// `path` is the root's, so that what ran below it before the filter held
    /// it can be accounted for ([`super::tracker::Tracker::filter_opened`]).
    Add {
        cgroup_id: u64,
        level: u32,
        path: String,
    },
    Remove {
        cgroup_id: u64,
    },
}

/// Which id each configured root has in the filter.
#[derive(Debug)]
pub struct RootFilterUpdates {
    roots: Vec<String>,
    known: HashMap<String, u64>,
}

impl RootFilterUpdates {
    /// `roots` are the configured paths.
    pub fn new(roots: &[String]) -> Self {
        Self {
            roots: roots
                .iter()
                .map(|r| r.trim_end_matches('/').to_owned())
                .collect(),
            known: HashMap::new(),
        }
    }

    fn is_root(&self, path: &str) -> bool {
        self.roots.iter().any(|r| r == path.trim_end_matches('/'))
    }

    fn set(&mut self, path: &str, cgroup_id: u64, level: u32, out: &mut Vec<FilterChange>) {
        let path = path.trim_end_matches('/').to_owned();
        match self.known.insert(path.clone(), cgroup_id) {
            Some(old) if old == cgroup_id => {}
            old => {
                if let Some(old) = old {
                    out.push(FilterChange::Remove { cgroup_id: old });
                }
                out.push(FilterChange::Add {
                    cgroup_id,
                    level,
                    path,
                });
            }
        }
    }

    /// A cgroup2 mkdir record.
    pub fn on_mkdir(&mut self, change: &CgroupChange) -> Vec<FilterChange> {
        let mut out = Vec::new();
        if change.hierarchy_id == CGROUP2_HIERARCHY
            && !change.truncated
            && self.is_root(&change.path)
        {
            self.set(&change.path, change.cgroup_id, change.level, &mut out);
        }
        out
    }

    /// Whether `path` lies below a configured root the filter does not hold: the
    /// root's mkdir was missed, and a rescan will find it.
    pub fn below_unknown_root(&self, path: &str) -> bool {
        self.roots.iter().any(|r| {
            !self.known.contains_key(r)
                && path
                    .strip_prefix(r.as_str())
                    .is_some_and(|rest| rest.starts_with('/'))
        })
    }

    /// A cgroup2 rmdir record.
    pub fn on_rmdir(&mut self, change: &CgroupChange) -> Vec<FilterChange> {
        let path = change.path.trim_end_matches('/');
        if change.hierarchy_id == CGROUP2_HIERARCHY
            && self.known.get(path) == Some(&change.cgroup_id)
        {
            self.known.remove(path);
            return vec![FilterChange::Remove {
                cgroup_id: change.cgroup_id,
            }];
        }
        Vec::new()
    }

    /// The roots a scan found on disk.
    pub fn on_scan(&mut self, found: &[FoundRoot]) -> Vec<FilterChange> {
        let mut out = Vec::new();
        for root in found {
            if self.is_root(&root.path) {
                self.set(&root.path, root.cgroup_id, root.level, &mut out);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(path: &str, cgroup_id: u64) -> CgroupChange {
        CgroupChange {
            at_ns: 1,
            hierarchy_id: 0,
            level: 1,
            cgroup_id,
            path: path.into(),
            truncated: false,
        }
    }

    fn found(path: &str, cgroup_id: u64) -> FoundRoot {
        FoundRoot {
            path: path.into(),
            cgroup_id,
            level: 1,
        }
    }

    #[test]
    fn mkdir_rmdir_and_scan() {
        let mut r = RootFilterUpdates::new(&["/kubepods".into(), "/k8s.io/".into()]);
        let add = |cgroup_id, path: &str| FilterChange::Add {
            cgroup_id,
            level: 1,
            path: path.into(),
        };
        assert_eq!(
            r.on_scan(&[found("/kubepods", 10)]),
            vec![add(10, "/kubepods")]
        );
        // Seen again: nothing to do.
        assert_eq!(r.on_scan(&[found("/kubepods", 10)]), vec![]);
        assert_eq!(r.on_mkdir(&change("/kubepods", 10)), vec![]);
        // Not a root, or another hierarchy, or cut short.
        assert_eq!(r.on_mkdir(&change("/kubepods/besteffort", 11)), vec![]);
        let mut v1 = change("/k8s.io", 12);
        v1.hierarchy_id = 3;
        assert_eq!(r.on_mkdir(&v1), vec![]);
        let mut cut = change("/k8s.io", 12);
        cut.truncated = true;
        assert_eq!(r.on_mkdir(&cut), vec![]);
        assert_eq!(r.on_mkdir(&change("/k8s.io", 12)), vec![add(12, "/k8s.io")]);
        assert_eq!(
            r.on_rmdir(&change("/k8s.io", 12)),
            vec![FilterChange::Remove { cgroup_id: 12 }]
        );
        assert_eq!(r.on_rmdir(&change("/k8s.io", 12)), vec![]);
        // /kubepods removed and created again, both records lost: the scan finds
        // the new id.
        assert_eq!(
            r.on_scan(&[found("/kubepods", 20)]),
            vec![FilterChange::Remove { cgroup_id: 10 }, add(20, "/kubepods")]
        );
        // A root's mkdir missed entirely: a cgroup created below it says so, and
        // the scan finds it.
        assert!(r.below_unknown_root("/k8s.io/abc"));
        assert!(!r.below_unknown_root("/k8s.io"));
        assert!(!r.below_unknown_root("/k8s.iox/abc"));
        assert!(!r.below_unknown_root("/kubepods/besteffort"));
        assert_eq!(r.on_scan(&[found("/k8s.io", 30)]), vec![add(30, "/k8s.io")]);
        assert!(!r.below_unknown_root("/k8s.io/abc"));
    }
}
