//! `/proc` behind a small trait: the identity of the process the runtime names as
//! a container's main process (its start time and cgroup), read on the caller's
//! side of [`super::KernelPleg::reconcile`], never on the real-time reader thread.
//!
//! The kubelet trusts the runtime's pid as is; here it is checked to be a live
//! process in the container's cgroup before it makes the tracker certain, and its
//! start time makes a reused pid harmless.

use std::collections::HashMap;

use super::RuntimeView;
use evpleg_core::ids::ContainerId;

/// A process as `/proc` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcIdentity {
    pub pid: u32,
    /// Start time in clock ticks since boot (`/proc/<pid>/stat` field 22).
    pub start_ticks: u64,
    /// Its cgroup2 path (`0::<path>` in `/proc/<pid>/cgroup`).
    pub cgroup: String,
}

/// Reads a process's identity; tests inject their own.
pub trait ProcSource {
    fn identity(&self, pid: u32) -> Option<ProcIdentity>;
}

/// The real `/proc`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcFs;

impl ProcSource for ProcFs {
    fn identity(&self, pid: u32) -> Option<ProcIdentity> {
        let stat = procfs::process::Process::new(pid as i32)
            .ok()?
            .stat()
            .ok()?;
        let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        Some(ProcIdentity {
            pid,
            start_ticks: stat.starttime,
            cgroup: cgroup2_path(&cgroup)?.to_owned(),
        })
    }
}

/// The cgroup2 line's path in a `/proc/<pid>/cgroup` text.
pub fn cgroup2_path(text: &str) -> Option<&str> {
    text.lines().find_map(|l| l.strip_prefix("0::"))
}

/// A [`RuntimeView`] with the runtime's pids resolved against `/proc`: what the
/// reader thread applies to the tracker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reconciliation {
    pub view: RuntimeView,
    /// For each listed container with a pid that is alive: its identity.
    pub mains: HashMap<ContainerId, ProcIdentity>,
}

/// Resolves every pid of `view` (pid 0, the runtime's "none", is skipped).
pub fn resolve(view: RuntimeView, procs: &dyn ProcSource) -> Reconciliation {
    let mains = view
        .containers
        .iter()
        .filter_map(|c| {
            let pid = c.pid.filter(|p| *p != 0)?;
            Some((c.id.clone(), procs.identity(pid)?))
        })
        .collect();
    Reconciliation { view, mains }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::RuntimeContainer;
    use evpleg_core::ids::PodUid;

    #[test]
    fn cgroup2_line() {
        let hybrid = "12:memory:/kubepods/x\n1:name=systemd:/a\n0::/kubepods/pod1/abc\n";
        assert_eq!(cgroup2_path(hybrid), Some("/kubepods/pod1/abc"));
        assert_eq!(cgroup2_path("4:cpu:/\n"), None);
    }

    #[test]
    fn own_identity_from_proc() {
        let me = ProcFs.identity(std::process::id()).unwrap();
        assert_eq!(me.pid, std::process::id());
        assert!(me.start_ticks > 0);
        assert!(me.cgroup.starts_with('/'), "{}", me.cgroup);
        assert_eq!(ProcFs.identity(u32::MAX - 1), None);
    }

    struct Fake(HashMap<u32, ProcIdentity>);

    impl ProcSource for Fake {
        fn identity(&self, pid: u32) -> Option<ProcIdentity> {
            self.0.get(&pid).cloned()
        }
    }

    #[test]
    fn resolve_keeps_live_pids_only() {
        let id = |c: char| ContainerId::parse(&c.to_string().repeat(64)).unwrap();
        let pod = PodUid::parse("1b4e28ba-2fa1-11d2-883f-0016d3cca427").unwrap();
        let container = |c, pid| RuntimeContainer {
            id: id(c),
            pod: pod.clone(),
            sandbox: false,
            running: true,
            pid,
            contradicted: false,
        };
        let alive = ProcIdentity {
            pid: 10,
            start_ticks: 5,
            cgroup: "/k8s.io/x".into(),
        };
        let fake = Fake(HashMap::from([(10, alive.clone())]));
        let view = RuntimeView {
            listed_at_ns: 1,
            scope: None,
            containers: vec![
                container('a', Some(10)),
                container('b', Some(11)),
                container('c', Some(0)),
                container('d', None),
            ],
        };
        let r = resolve(view.clone(), &fake);
        assert_eq!(r.view, view);
        assert_eq!(r.mains, HashMap::from([(id('a'), alive)]));
    }
}
