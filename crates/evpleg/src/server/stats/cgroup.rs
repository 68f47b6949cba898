//! A cgroup's CPU and memory use read from its files, as cAdvisor (the
//! kubelet's source of cgroup stats) reads them: cgroup v1 (`cpuacct.usage`,
//! `memory.usage_in_bytes`, `memory.stat`'s `total_*` lines), cgroup v2
//! (`cpu.stat`'s `usage_usec`, `memory.current`, `memory.stat`), and hybrid
//! hosts, where each controller is read in the v1 hierarchy that has it and
//! the unified hierarchy serves the rest. The working set is the usage less
//! the inactive file pages, as cAdvisor's; the RSS is `total_rss` (v1) or
//! `anon` (v2). The v2 root has no `memory.current`: its usage is
//! `MemTotal - MemFree` of `/proc/meminfo`, as runc's.

use std::path::{Path, PathBuf};

/// Errors of reading a cgroup file.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("failed to read cgroup file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cgroup file {} has no {key:?} (or not a number)", path.display())]
    Missing { path: PathBuf, key: &'static str },
}

/// Where one controller's files are.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Controller {
    mount: PathBuf,
    v1: bool,
}

/// The host's cgroup hierarchies, by controller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hierarchies {
    cpu: Option<Controller>,
    memory: Option<Controller>,
    meminfo: PathBuf,
}

/// A cgroup's memory use, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Memory {
    pub usage: u64,
    pub working_set: u64,
    pub rss: u64,
    pub page_faults: u64,
    pub major_page_faults: u64,
    /// The limit, when there is one.
    pub limit: Option<u64>,
}

/// A v1 limit at or above this is no limit (the page-rounded `i64::MAX`).
const V1_UNLIMITED: u64 = 1 << 62;

impl Hierarchies {
    /// `v2`: the unified mount, if any; `v1`: each v1 hierarchy's
    /// comma-separated controllers and mount point.
    pub fn new(v2: Option<PathBuf>, v1: &[(String, PathBuf)], meminfo: PathBuf) -> Self {
        let pick = |name: &str| {
            v1.iter()
                .find(|(c, _)| c.split(',').any(|c| c == name))
                .map(|(_, m)| Controller {
                    mount: m.clone(),
                    v1: true,
                })
                .or_else(|| v2.clone().map(|mount| Controller { mount, v1: false }))
        };
        Self {
            cpu: pick("cpuacct"),
            memory: pick("memory"),
            meminfo,
        }
    }

    /// This host's hierarchies.
    pub fn from_host() -> Self {
        use evpleg_pleg::kernel::index::{cgroup2_mount, v1_hierarchies};
        let v1: Vec<(String, PathBuf)> = v1_hierarchies()
            .unwrap_or_default()
            .into_iter()
            .map(|(_, c, m)| (c, m))
            .collect();
        Self::new(
            cgroup2_mount().ok().flatten(),
            &v1,
            PathBuf::from("/proc/meminfo"),
        )
    }

    /// The directory of cgroup `rel` (`/` the root) in the memory
    /// controller's hierarchy, which every pod's cgroup has.
    pub fn memory_dir(&self, rel: &str) -> Option<PathBuf> {
        self.memory.as_ref().map(|c| join(&c.mount, rel))
    }

    /// Cumulative CPU time of cgroup `rel`, in nanoseconds.
    pub fn cpu_usage_ns(&self, rel: &str) -> Result<u64, CgroupError> {
        let c = self.cpu.as_ref().ok_or_else(|| CgroupError::Missing {
            path: PathBuf::from(rel),
            key: "cpu controller",
        })?;
        let dir = join(&c.mount, rel);
        if c.v1 {
            let path = dir.join("cpuacct.usage");
            let text = read(&path)?;
            text.trim().parse().map_err(|_| CgroupError::Missing {
                path,
                key: "cpuacct.usage",
            })
        } else {
            let path = dir.join("cpu.stat");
            key(&read(&path)?, "usage_usec")
                .map(|us| us * 1000)
                .ok_or(CgroupError::Missing {
                    path,
                    key: "usage_usec",
                })
        }
    }

    /// Memory use of cgroup `rel`.
    pub fn memory(&self, rel: &str) -> Result<Memory, CgroupError> {
        let c = self.memory.as_ref().ok_or_else(|| CgroupError::Missing {
            path: PathBuf::from(rel),
            key: "memory controller",
        })?;
        let dir = join(&c.mount, rel);
        let stat_path = dir.join("memory.stat");
        let stat = read(&stat_path)?;
        let field = |name: &'static str| {
            key(&stat, name).ok_or(CgroupError::Missing {
                path: stat_path.clone(),
                key: name,
            })
        };
        let number = |path: PathBuf, name: &'static str| -> Result<u64, CgroupError> {
            read(&path)?
                .trim()
                .parse()
                .map_err(|_| CgroupError::Missing { path, key: name })
        };
        let (usage, inactive, rss, faults, major, limit) = if c.v1 {
            let limit = number(dir.join("memory.limit_in_bytes"), "memory.limit_in_bytes")?;
            (
                number(dir.join("memory.usage_in_bytes"), "memory.usage_in_bytes")?,
                field("total_inactive_file")?,
                field("total_rss")?,
                field("total_pgfault")?,
                field("total_pgmajfault")?,
                (limit < V1_UNLIMITED).then_some(limit),
            )
        } else {
            let current = dir.join("memory.current");
            let usage = if current.exists() {
                number(current, "memory.current")?
            } else {
                let info = read(&self.meminfo)?;
                let kb = |k: &'static str| {
                    key(&info, k).ok_or(CgroupError::Missing {
                        path: self.meminfo.clone(),
                        key: k,
                    })
                };
                (kb("MemTotal:")? - kb("MemFree:")?) * 1024
            };
            let limit = std::fs::read_to_string(dir.join("memory.max"))
                .ok()
                .and_then(|m| m.trim().parse().ok());
            (
                usage,
                field("inactive_file")?,
                field("anon")?,
                field("pgfault")?,
                field("pgmajfault")?,
                limit,
            )
        };
        Ok(Memory {
            usage,
            working_set: usage.saturating_sub(inactive),
            rss,
            page_faults: faults,
            major_page_faults: major,
            limit,
        })
    }

    /// The cgroup under `rel` whose name holds `id` (a container's cgroup
    /// under its pod's: `<id>` with cgroupfs, `cri-containerd-<id>.scope`
    /// with systemd), relative like `rel`.
    pub fn child_named(&self, rel: &str, id: &str) -> Option<String> {
        let dir = self.memory_dir(rel)?;
        std::fs::read_dir(dir).ok()?.flatten().find_map(|e| {
            let name = e.file_name().into_string().ok()?;
            (name.contains(id) && e.path().is_dir())
                .then(|| format!("{}/{name}", rel.trim_end_matches('/')))
        })
    }

    /// A process in cgroup `rel` or one of its children.
    pub fn any_process(&self, rel: &str) -> Option<u32> {
        fn walk(dir: &Path, depth: u8) -> Option<u32> {
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).ok()?;
            if let Some(pid) = procs.lines().find_map(|l| l.trim().parse().ok()) {
                return Some(pid);
            }
            if depth == 0 {
                return None;
            }
            std::fs::read_dir(dir)
                .ok()?
                .flatten()
                .filter(|e| e.path().is_dir())
                .find_map(|e| walk(&e.path(), depth - 1))
        }
        walk(&self.memory_dir(rel)?, 2)
    }
}

/// `mount` joined with cgroup path `rel`.
fn join(mount: &Path, rel: &str) -> PathBuf {
    mount.join(rel.trim_start_matches('/'))
}

fn read(path: &Path) -> Result<String, CgroupError> {
    std::fs::read_to_string(path).map_err(|source| CgroupError::Read {
        path: path.to_owned(),
        source,
    })
}

/// The number after `name` on its line of a `key value` file.
fn key(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut words = l.split_whitespace();
        (words.next() == Some(name))
            .then(|| words.next()?.parse().ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(name), text).unwrap();
    }

    #[test]
    fn v1_controllers_win_on_a_hybrid_host_and_v2_serves_the_rest() {
        let t = tempfile::tempdir().unwrap();
        let (v2, acct, mem) = (
            t.path().join("unified"),
            t.path().join("cpuacct"),
            t.path().join("memory"),
        );
        let pod = "kubepods/besteffort/podu";
        write(&acct.join(pod), "cpuacct.usage", "123456789\n");
        write(&mem.join(pod), "memory.usage_in_bytes", "10000\n");
        write(
            &mem.join(pod),
            "memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        write(
            &mem.join(pod),
            "memory.stat",
            "cache 1\nrss 2\ntotal_rss 3000\ntotal_inactive_file 4000\ntotal_pgfault 7\ntotal_pgmajfault 1\n",
        );
        let h = Hierarchies::new(
            Some(v2.clone()),
            &[("cpuacct".into(), acct), ("memory".into(), mem)],
            t.path().join("meminfo"),
        );
        assert_eq!(h.cpu_usage_ns(pod).unwrap(), 123_456_789);
        assert_eq!(
            h.memory(pod).unwrap(),
            Memory {
                usage: 10000,
                working_set: 6000,
                rss: 3000,
                page_faults: 7,
                major_page_faults: 1,
                limit: None
            }
        );
        // Unified only: cpu.stat in µs, memory.current, the root from meminfo.
        let h = Hierarchies::new(Some(v2.clone()), &[], t.path().join("meminfo"));
        write(
            &v2.join(pod),
            "cpu.stat",
            "usage_usec 1500\nuser_usec 1000\n",
        );
        write(&v2.join(pod), "memory.current", "8192\n");
        write(&v2.join(pod), "memory.max", "65536\n");
        let stat = "anon 4096\ninactive_file 1024\npgfault 3\npgmajfault 0\n";
        write(&v2.join(pod), "memory.stat", stat);
        write(&v2, "memory.stat", stat);
        write(t.path(), "meminfo", "MemTotal: 100 kB\nMemFree: 40 kB\n");
        assert_eq!(h.cpu_usage_ns(pod).unwrap(), 1_500_000);
        let m = h.memory(pod).unwrap();
        assert_eq!(
            (m.usage, m.working_set, m.rss, m.limit),
            (8192, 7168, 4096, Some(65536))
        );
        assert_eq!(h.memory("/").unwrap().usage, 60 * 1024);
        // A missing key names the file.
        write(&v2.join(pod), "memory.stat", "anon 1\n");
        let e = h.memory(pod).unwrap_err().to_string();
        assert!(
            e.contains("memory.stat") && e.contains("inactive_file"),
            "{e}"
        );
    }
}
