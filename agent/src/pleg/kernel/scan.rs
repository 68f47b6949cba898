//! The start-up scan: containers that were running before the agent.
//!
//! Walks the cgroup tree below the configured roots and teaches the [`Tracker`]
//! every cgroup it finds, with the processes of each container cgroup (read from
//! `cgroup.procs` of it and its nested cgroups, and `/proc/<pid>/stat`) so that
//! their main process is known and its exit code reported. The same scan runs
//! again when a task shows up in a cgroup the index does not know.

use std::fs;
use std::path::{Path, PathBuf};

use tracing::warn;

use super::index::{CGROUP2_HIERARCHY, ScanError, scan};
use super::tracker::{ProcInfo, Tracker};

/// Scans the hierarchies the kernel PLEG reports.
#[derive(Clone, Debug)]
pub struct Scanner {
    pub cgroup2_mount: PathBuf,
    pub roots: Vec<String>,
    /// v1 hierarchies also indexed: `(hierarchy id, mount point)`.
    pub v1: Vec<(u32, PathBuf)>,
}

impl Scanner {
    /// Teaches `tracker` every cgroup not yet known; returns how many were new.
    pub fn scan_into(&self, tracker: &mut Tracker) -> Result<usize, ScanError> {
        let mut learned = 0;
        let hierarchies = std::iter::once((CGROUP2_HIERARCHY, &self.cgroup2_mount))
            .chain(self.v1.iter().map(|(h, m)| (*h, m)));
        for (hierarchy, mount) in hierarchies {
            for cgroup in scan(mount, &self.roots)? {
                if tracker.index().get(hierarchy, cgroup.cgroup_id).is_some()
                    || tracker.index().is_ignored(hierarchy, cgroup.cgroup_id)
                {
                    continue;
                }
                let procs = if hierarchy == CGROUP2_HIERARCHY {
                    processes_below(&cgroup.dir)
                } else {
                    Vec::new()
                };
                match tracker.learn_existing(hierarchy, cgroup.cgroup_id, &cgroup.path, &procs) {
                    Ok(_) => learned += 1,
                    Err(e) => warn!(error = %e, "cgroup found by the scan not attributed"),
                }
            }
        }
        Ok(learned)
    }
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

/// A process's parent and start time, from `/proc/<pid>/stat`.
pub fn proc_info(pid: u32) -> Option<ProcInfo> {
    let stat = procfs::process::Process::new(pid as i32)
        .ok()?
        .stat()
        .ok()?;
    Some(ProcInfo {
        pid,
        ppid: stat.ppid as u32,
        start_ticks: stat.starttime,
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
        assert!(proc_info(u32::MAX - 1).is_none());
    }
}
