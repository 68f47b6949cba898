//! Scans of the cgroup tree: at start-up (containers that were running before the
//! agent) and again when a task shows up in a cgroup the index does not know or
//! the runtime lists a container whose cgroup is not indexed.
//!
//! Walks the cgroup2 tree below the configured roots and teaches the [`Tracker`]
//! every cgroup it does not know, with the processes of each container cgroup
//! (read from `cgroup.procs` of it and its nested cgroups, and `/proc/<pid>/stat`):
//! processes already running make the container's main process uncertain, a
//! container holding only the runtime's init is as good as fresh. The roots found
//! are reported, so that a root whose mkdir was missed reaches the kernel filter.
//! cgroup v1 hierarchies are not scanned (`docs/pleg.md` clause 9).

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use super::event::ProcessKey;
use super::index::{ScanError, ScannedCgroup, scan};
use super::loader::level_of;
use super::roots::FoundRoot;
use super::tracker::{ProcInfo, Tracker, is_runtime_init};
use evpleg_core::cgroup_path::{CgroupClass, CgroupPathError, classify};
use evpleg_core::ids::ContainerId;

/// Scans the cgroup2 hierarchy below the roots.
#[derive(Clone, Debug)]
pub struct Scanner {
    pub cgroup2_mount: PathBuf,
    pub roots: Vec<String>,
}

/// What a scan found.
#[derive(Debug, Default)]
pub struct ScanReport {
    /// Cgroups new to the index.
    pub learned: usize,
    /// The configured roots that exist.
    pub roots: Vec<FoundRoot>,
    /// Cgroups under a root whose path is malformed.
    pub malformed: Vec<(u64, CgroupPathError)>,
    /// Containers learned with an empty cgroup in which processes had run
    /// ([`Tracker::exited_unseen`]): their exits were never read.
    pub exited_unseen: usize,
}

impl Scanner {
    /// Teaches `tracker` every cgroup not yet known, at `now_ns`; `pending` is the
    /// process of the exec record that asked for the scan, if any
    /// ([`super::tracker::scanned_state`]).
    pub fn scan_into(
        &self,
        tracker: &mut Tracker,
        pending: Option<ProcessKey>,
        now_ns: u64,
    ) -> Result<ScanReport, ScanError> {
        let cgroups = scan(&self.cgroup2_mount, &self.roots)?;
        Ok(self.learn(tracker, &cgroups, pending, None, now_ns))
    }

    /// Teaches `tracker` what a walk of the tree found and it does not know
    /// yet, at `now_ns`: every such cgroup, or with `only` the cgroups of
    /// those containers. The walk may be older than the tracker's records
    /// ([`super::walker`]): a cgroup whose directory is gone since is
    /// skipped (its rmdir record is, or will be, read), and `only` keeps it
    /// from learning cgroups whose records are still unread (a container
    /// learned from the tree and not from its exec is never `Fresh`).
    pub fn learn(
        &self,
        tracker: &mut Tracker,
        cgroups: &[ScannedCgroup],
        pending: Option<ProcessKey>,
        only: Option<&HashSet<&ContainerId>>,
        now_ns: u64,
    ) -> ScanReport {
        let mut report = ScanReport::default();
        for cgroup in cgroups {
            let known = tracker.index().get(cgroup.cgroup_id).is_some()
                || tracker.index().is_ignored(cgroup.cgroup_id);
            let root = self
                .roots
                .iter()
                .any(|r| r.trim_end_matches('/') == cgroup.path);
            // A stat only for what may be learned: the known are most.
            if (known && !root) || !cgroup.dir.exists() {
                continue;
            }
            if root {
                report.roots.push(FoundRoot {
                    level: level_of(&cgroup.path),
                    path: cgroup.path.clone(),
                    cgroup_id: cgroup.cgroup_id,
                });
            }
            if known {
                continue;
            }
            let class = classify(&cgroup.path);
            if let Some(only) = only
                && !matches!(&class, Ok(CgroupClass::Container { id, .. }) if only.contains(id))
            {
                continue;
            }
            let container = matches!(class, Ok(CgroupClass::Container { nested: false, .. }));
            let procs = if container {
                processes_below(&cgroup.dir)
            } else {
                Vec::new()
            };
            // An empty container cgroup in which something ran: the processes
            // exited before the tracker could see them (its root reached the
            // filter late). Not so for a scan asked for by an exec record: its
            // process may be what ran, and its records follow.
            let exited = container && procs.is_empty() && pending.is_none() && has_run(&cgroup.dir);
            match tracker.learn_existing(cgroup.cgroup_id, &cgroup.path, &procs, pending, now_ns) {
                Ok(true) => {
                    report.learned += 1;
                    if exited && tracker.exited_unseen(cgroup.cgroup_id) {
                        report.exited_unseen += 1;
                    }
                }
                Ok(false) => {}
                Err(e) => report.malformed.push((cgroup.cgroup_id, e)),
            }
        }
        report
    }
}

/// Whether a task ever ran in cgroup `dir` or below: its `cpu.stat`
/// `usage_usec` (a core cgroup2 file, Linux 4.20, present whether or not the
/// cpu controller is enabled) is not zero. A file that cannot be read says
/// yes: the caller then assumes the worst.
pub fn has_run(dir: &Path) -> bool {
    let Ok(stat) = fs::read_to_string(dir.join("cpu.stat")) else {
        return true;
    };
    stat.lines()
        .find_map(|l| l.strip_prefix("usage_usec "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .is_none_or(|usage| usage > 0)
}

/// The processes in `dir` and the cgroups below it. Processes that exit while
/// being read are skipped.
pub fn processes_below(dir: &Path) -> Vec<ProcInfo> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        if let Ok(procs) = fs::read_to_string(dir.join("cgroup.procs")) {
            out.extend(
                procs
                    .lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .filter_map(proc_info),
            );
        }
        if let Ok(entries) = fs::read_dir(&dir) {
            stack.extend(
                entries
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
    }
    out
}

/// A process's parent, start time and whether it is a runtime's init, from
/// `/proc/<pid>/stat`.
pub fn proc_info(pid: u32) -> Option<ProcInfo> {
    let stat = procfs::process::Process::new(pid as i32)
        .ok()?
        .stat()
        .ok()?;
    Some(ProcInfo {
        pid,
        ppid: stat.ppid as u32,
        start_ticks: stat.starttime,
        runtime_init: is_runtime_init(&stat.comm),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_info() {
        let me = proc_info(std::process::id()).unwrap();
        assert_eq!(me.pid, std::process::id());
        assert_eq!(me.ppid, std::os::unix::process::parent_id());
        assert!(me.start_ticks > 0);
        assert!(!me.runtime_init);
        assert!(proc_info(u32::MAX - 1).is_none());
    }

    #[test]
    fn scan_reports_roots_and_learns_cgroups() {
        let base = std::env::temp_dir().join(format!("evpleg-scanner-{}", std::process::id()));
        let uid = "1b4e28ba-2fa1-11d2-883f-0016d3cca427";
        let id = "c".repeat(64);
        let pod = base.join(format!("kubepods/besteffort/pod{uid}"));
        // Nothing ran in the first; processes ran and left the second; the
        // third says nothing (no cpu.stat): assumed to have run.
        let (ran, unknown) = ("d".repeat(64), "e".repeat(64));
        for (dir, usage) in [(&id, Some(0)), (&ran, Some(15)), (&unknown, None)] {
            fs::create_dir_all(pod.join(dir)).unwrap();
            if let Some(usage) = usage {
                let stat = format!("usage_usec {usage}\nuser_usec 0\nsystem_usec {usage}\n");
                fs::write(pod.join(dir).join("cpu.stat"), stat).unwrap();
            }
        }
        let scanner = Scanner {
            cgroup2_mount: base.clone(),
            roots: vec!["/kubepods".into(), "/k8s.io".into()],
        };
        let mut tracker = Tracker::new(100);
        let report = scanner.scan_into(&mut tracker, None, 7).unwrap();
        // Asked for by an exec: what ran may be its process, whose records follow.
        let mut pending_tracker = Tracker::new(100);
        let pending = crate::kernel::event::ProcessKey {
            pid: 1,
            start_boottime_ns: 1,
        };
        let pending_report = scanner
            .scan_into(&mut pending_tracker, Some(pending), 7)
            .unwrap();
        fs::remove_dir_all(&base).unwrap();
        assert_eq!((report.learned, report.exited_unseen), (6, 2));
        assert_eq!(
            (pending_report.learned, pending_report.exited_unseen),
            (6, 0)
        );
        use crate::kernel::main_state::MainState;
        for (dir, state) in [
            (&ran, MainState::Uncertain(None)),
            (&unknown, MainState::Uncertain(None)),
        ] {
            let cid = evpleg_core::ids::ContainerId::parse(dir).unwrap();
            assert_eq!(tracker.main_state(&cid), Some(state), "{dir}");
            assert_eq!(
                pending_tracker.main_state(&cid),
                Some(MainState::Fresh),
                "{dir}"
            );
        }
        assert_eq!(report.roots.len(), 1);
        assert_eq!(
            (report.roots[0].path.as_str(), report.roots[0].level),
            ("/kubepods", 1)
        );
        // No cgroup.procs in a plain directory: no process, a fresh container.
        let cid = evpleg_core::ids::ContainerId::parse(&id).unwrap();
        assert_eq!(
            tracker.main_state(&cid),
            Some(crate::kernel::main_state::MainState::Fresh)
        );
    }
}
