//! `/stats/summary`: the kubelet's summary API
//! (`k8s.io/kubelet/pkg/apis/stats/v1alpha1`, served by its
//! `server/stats` handler), which metrics-server and `kubectl top` read.
//! Pods are the runtime's ready sandboxes and their running containers (CRI
//! `ListPodSandbox`, `ListContainers`), as the kubelet's CRI stats provider
//! lists them. CPU and memory come from the cgroup files ([`cgroup`]): the
//! node's root cgroup, each pod's cgroup and each container's under it.
//! `usageNanoCores` is computed from the last sample, kept per cgroup, as the
//! CRI stats provider's `getAndUpdateContainerUsageNanoCores`: the first
//! request after a start has none; a full summary updates the cache, an
//! `only_cpu_and_memory=true` one (metrics-server's) reads it without
//! updating; entries not refreshed for 2 min are dropped. A container's
//! `rootfs` is its writable layer from CRI `ListContainerStats` on the image
//! filesystem (CRI `ImageFsInfo`), `logs` its log directory's files; a pod's
//! network is `/proc/<pid>/net/dev` of a process in its cgroup (cAdvisor's
//! way: `lo`, `veth*` and `docker*` left out, `eth0` the default), volumes
//! are those under `<root-dir>/pods/<uid>/volumes` other than CSI's, and
//! `ephemeral-storage` adds the containers' rootfs and logs, the emptyDir and
//! configMap volumes and the pod's `etc-hosts`.
//!
//! Differences: no `systemContainers` (kubelet, runtime, pods), `rlimit`,
//! swap, accelerators or CSI volume stats; volume stats are walked at each
//! request (the kubelet caches them, refreshed in the background); pod CPU and
//! memory are always the pod cgroup's, also where the runtime implements
//! `ListPodSandboxStats` (the kubelet takes the runtime's with its
//! `PodAndContainerStatsFromCRI` gate).

pub mod cgroup;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use evpleg_core::cgroup_path::{CgroupDriver, QosClass, pod_cgroup_path};
use evpleg_core::ids::PodUid;
use evpleg_core::machine::filesystem;
use evpleg_cri::CriClient;
use evpleg_cri_api::v1;
use evpleg_kubelet::status::local::LocalStore;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use serde::Serialize;

use cgroup::Hierarchies;

/// How long an unused CPU sample is kept.
const CPU_CACHE_TTL_NS: i64 = 120_000_000_000;

/// Errors of building a summary.
#[derive(Debug, thiserror::Error)]
pub enum StatsError {
    #[error("failed to list {what} from the runtime: {source}")]
    Cri {
        what: &'static str,
        source: evpleg_cri::CriError,
    },
    #[error(transparent)]
    Cgroup(#[from] cgroup::CgroupError),
}

/// The summary (`Summary`).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Summary {
    pub node: NodeStats,
    pub pods: Vec<PodStats>,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeStats {
    pub node_name: String,
    pub start_time: Timestamp,
    pub cpu: CpuStats,
    pub memory: MemoryStats,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkStats>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fs: Option<FsStats>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime: Option<RuntimeStats>,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeStats {
    pub image_fs: FsStats,
    pub container_fs: FsStats,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct PodReference {
    pub name: String,
    pub namespace: String,
    pub uid: String,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PodStats {
    pub pod_ref: PodReference,
    pub start_time: Timestamp,
    pub containers: Vec<ContainerStats>,
    pub cpu: CpuStats,
    pub memory: MemoryStats,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkStats>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub volume: Vec<VolumeStats>,
    #[serde(rename = "ephemeral-storage", skip_serializing_if = "Option::is_none")]
    pub ephemeral_storage: Option<FsStats>,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ContainerStats {
    pub name: String,
    pub start_time: Timestamp,
    pub cpu: CpuStats,
    pub memory: MemoryStats,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rootfs: Option<FsStats>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logs: Option<FsStats>,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CpuStats {
    pub time: Timestamp,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage_nano_cores: Option<u64>,
    pub usage_core_nano_seconds: u64,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct MemoryStats {
    pub time: Timestamp,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub available_bytes: Option<u64>,
    pub usage_bytes: u64,
    pub working_set_bytes: u64,
    pub rss_bytes: u64,
    pub page_faults: u64,
    pub major_page_faults: u64,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct InterfaceStats {
    pub name: String,
    pub rx_bytes: u64,
    pub rx_errors: u64,
    pub tx_bytes: u64,
    pub tx_errors: u64,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NetworkStats {
    pub time: Timestamp,
    #[serde(flatten)]
    pub default: InterfaceStats,
    pub interfaces: Vec<InterfaceStats>,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct FsStats {
    pub time: Timestamp,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub available_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity_bytes: Option<u64>,
    pub used_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inodes_free: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inodes: Option<u64>,
    pub inodes_used: u64,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct VolumeStats {
    #[serde(flatten)]
    pub fs: FsStats,
    pub name: String,
}

/// The last CPU sample of a cgroup.
#[derive(Clone, Copy, Debug)]
struct CpuRecord {
    usage_ns: u64,
    at_ns: i64,
    nano_cores: Option<u64>,
}

/// What the summary is built from.
#[derive(Debug)]
pub struct StatsProvider {
    pub node_name: String,
    pub cri: CriClient,
    pub pods: Arc<LocalStore>,
    pub cgroups: Hierarchies,
    pub driver: CgroupDriver,
    pub root_dir: PathBuf,
    pub log_dir: PathBuf,
    /// `/proc`: where `<pid>/net/dev` and `stat` are read.
    pub proc: PathBuf,
    cpu: Mutex<HashMap<String, CpuRecord>>,
}

/// A sandbox and its running containers.
type PodEntry<'a> = (&'a v1::PodSandbox, Vec<&'a v1::Container>);

impl StatsProvider {
    pub fn new(
        node_name: String,
        cri: CriClient,
        pods: Arc<LocalStore>,
        driver: CgroupDriver,
        root_dir: PathBuf,
        log_dir: PathBuf,
    ) -> Self {
        Self {
            node_name,
            cri,
            pods,
            cgroups: Hierarchies::from_host(),
            driver,
            root_dir,
            log_dir,
            proc: PathBuf::from("/proc"),
            cpu: Mutex::default(),
        }
    }

    /// The summary; `only_cpu_and_memory` leaves out networks and
    /// filesystems and does not update the CPU samples.
    pub async fn summary(&self, only_cpu_and_memory: bool) -> Result<Summary, StatsError> {
        let cri = |what| move |source| StatsError::Cri { what, source };
        let ready = v1::PodSandboxFilter {
            state: Some(v1::PodSandboxStateValue {
                state: v1::PodSandboxState::SandboxReady as i32,
            }),
            ..Default::default()
        };
        let sandboxes = self
            .cri
            .list_pod_sandboxes(Some(ready))
            .await
            .map_err(cri("pod sandboxes"))?;
        let running = v1::ContainerFilter {
            state: Some(v1::ContainerStateValue {
                state: v1::ContainerState::ContainerRunning as i32,
            }),
            ..Default::default()
        };
        let containers = self
            .cri
            .list_containers(Some(running))
            .await
            .map_err(cri("containers"))?;
        let (layers, image_fs) = if only_cpu_and_memory {
            (HashMap::new(), None)
        } else {
            let stats = self
                .cri
                .list_container_stats(None)
                .await
                .map_err(cri("container stats"))?;
            let layers: HashMap<String, v1::FilesystemUsage> = stats
                .into_iter()
                .filter_map(|s| Some((s.attributes?.id, s.writable_layer?)))
                .collect();
            let image_fs = self
                .cri
                .image_fs_info()
                .await
                .map_err(cri("image filesystems"))?;
            (layers, Some(image_fs))
        };
        let update = !only_cpu_and_memory;
        let now = Timestamp::now();
        let mut by_sandbox: HashMap<&str, PodEntry> = sandboxes
            .iter()
            .map(|s| (s.id.as_str(), (s, Vec::new())))
            .collect();
        for c in &containers {
            if let Some(entry) = by_sandbox.get_mut(c.pod_sandbox_id.as_str()) {
                entry.1.push(c);
            }
        }
        let image_root = image_fs
            .as_ref()
            .and_then(|f| f.image_filesystems.first())
            .and_then(|f| f.fs_id.as_ref())
            .map(|f| PathBuf::from(&f.mountpoint));
        let mut pods = Vec::new();
        let mut entries: Vec<&PodEntry> = by_sandbox.values().collect();
        entries.sort_by_key(|(s, _)| s.created_at);
        for (sandbox, containers) in entries {
            let files = (!only_cpu_and_memory).then_some((&layers, image_root.as_deref()));
            match self.pod_stats(sandbox, containers, files, update) {
                Ok(Some(p)) => pods.push(p),
                Ok(None) => {}
                Err(e) => {
                    tracing::debug!(sandbox = %sandbox.id, error = %e, "no stats for the pod");
                }
            }
        }
        let mem = self.cgroups.memory("/")?;
        let total = evpleg_core::machine::memory_bytes() as u64;
        let mut node = NodeStats {
            node_name: self.node_name.clone(),
            start_time: self.boot_time().unwrap_or(now),
            cpu: self.cpu("/", "/", update)?,
            memory: MemoryStats {
                available_bytes: Some(total.saturating_sub(mem.working_set)),
                ..memory_stats(&mem)
            },
            ..Default::default()
        };
        if !only_cpu_and_memory {
            node.network = network(&self.proc.join("1/net/dev"));
            node.fs = fs_of(&self.root_dir, 0, 0);
            if let (Some(info), Some(root)) = (image_fs, &image_root) {
                let usage = info.image_filesystems.first();
                let used = usage.and_then(|u| u.used_bytes).map_or(0, |u| u.value);
                let inodes = usage.and_then(|u| u.inodes_used).map_or(0, |u| u.value);
                if let Some(image) = fs_of(root, used, inodes) {
                    node.runtime = Some(RuntimeStats {
                        container_fs: image.clone(),
                        image_fs: image,
                    });
                }
            }
        }
        if update {
            let mut cache = self.cpu.lock().unwrap_or_else(|e| e.into_inner());
            let cut = now.as_nanosecond() as i64 - CPU_CACHE_TTL_NS;
            cache.retain(|_, r| r.at_ns >= cut);
        }
        Ok(Summary { node, pods })
    }

    /// One pod's stats; `None` when its cgroup is gone. `files`: the
    /// writable layers and the image filesystem, for a full summary.
    fn pod_stats(
        &self,
        sandbox: &v1::PodSandbox,
        containers: &[&v1::Container],
        files: Option<(&HashMap<String, v1::FilesystemUsage>, Option<&Path>)>,
        update: bool,
    ) -> Result<Option<PodStats>, StatsError> {
        let meta = sandbox.metadata.clone().unwrap_or_default();
        let Some(uid) = PodUid::parse(&meta.uid) else {
            return Ok(None);
        };
        let spec: Option<Pod> = self.find(&meta.uid);
        let Some(pod_cg) = [
            QosClass::Guaranteed,
            QosClass::Burstable,
            QosClass::BestEffort,
        ]
        .into_iter()
        .map(|q| pod_cgroup_path(self.driver, q, &uid))
        .find(|p| self.cgroups.memory_dir(p).is_some_and(|d| d.is_dir())) else {
            return Ok(None);
        };
        let log_dir = self
            .log_dir
            .join(format!("{}_{}_{}", meta.namespace, meta.name, meta.uid));
        let mut out = Vec::new();
        for c in containers {
            let Some(cg) = self.cgroups.child_named(&pod_cg, &c.id) else {
                continue;
            };
            let name = c.metadata.as_ref().map_or("", |m| m.name.as_str());
            let mut stats = ContainerStats {
                name: name.to_owned(),
                start_time: ns_time(c.created_at),
                cpu: self.cpu(&c.id, &cg, update)?,
                memory: memory_stats(&self.cgroups.memory(&cg)?),
                ..Default::default()
            };
            if let Some((layers, image_root)) = files {
                let layer = layers.get(&c.id);
                let used = layer.and_then(|l| l.used_bytes).map_or(0, |u| u.value);
                let inodes = layer.and_then(|l| l.inodes_used).map_or(0, |u| u.value);
                stats.rootfs = image_root.and_then(|r| fs_of(r, used, inodes));
                let dir = log_dir.join(name);
                let (used, inodes) = disk_usage(&dir);
                stats.logs = fs_of(&dir, used, inodes);
            }
            out.push(stats);
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        let mut pod = PodStats {
            pod_ref: PodReference {
                name: meta.name,
                namespace: meta.namespace,
                uid: meta.uid.clone(),
            },
            start_time: ns_time(sandbox.created_at),
            cpu: self.cpu(&sandbox.id, &pod_cg, update)?,
            memory: memory_stats(&self.cgroups.memory(&pod_cg)?),
            containers: out,
            ..Default::default()
        };
        if files.is_some() {
            let pid = self.cgroups.any_process(&pod_cg);
            pod.network = pid.and_then(|p| network(&self.proc.join(format!("{p}/net/dev"))));
            let (volumes, ephemeral) = self.volumes(&meta.uid, spec.as_ref());
            pod.volume = volumes;
            let hosts = self.root_dir.join("pods").join(&meta.uid).join("etc-hosts");
            let hosts = std::fs::metadata(&hosts).map_or(0, |m| m.len());
            let (mut used, mut inodes) = (ephemeral.0 + hosts, ephemeral.1 + u64::from(hosts > 0));
            for c in &pod.containers {
                for f in [&c.rootfs, &c.logs].into_iter().flatten() {
                    used += f.used_bytes;
                    inodes += f.inodes_used;
                }
            }
            pod.ephemeral_storage = fs_of(&self.root_dir, used, inodes);
        }
        Ok(Some(pod))
    }

    /// The pod of `uid` in the local store.
    fn find(&self, uid: &str) -> Option<Pod> {
        let list = self.pods.pod_list();
        list["items"].as_array()?.iter().find_map(|p| {
            (p["metadata"]["uid"] == uid)
                .then(|| serde_json::from_value(p.clone()).ok())
                .flatten()
        })
    }

    /// The pod's volumes under `<root-dir>/pods/<uid>/volumes` but CSI's, and
    /// the bytes and inodes of the ephemeral ones (emptyDir not in memory,
    /// configMap, gitRepo), as the kubelet's `isEphemeralVolume`.
    fn volumes(&self, uid: &str, pod: Option<&Pod>) -> (Vec<VolumeStats>, (u64, u64)) {
        let ephemeral = |name: &str| {
            pod.and_then(|p| p.spec.as_ref())
                .and_then(|s| s.volumes.as_ref())
                .and_then(|vs| vs.iter().find(|v| v.name == name))
                .is_some_and(|v| {
                    v.config_map.is_some()
                        || v.git_repo.is_some()
                        || v.empty_dir
                            .as_ref()
                            .is_some_and(|e| e.medium.as_deref().unwrap_or_default() != "Memory")
                })
        };
        let (mut out, mut sum) = (Vec::new(), (0, 0));
        let dir = self.root_dir.join("pods").join(uid).join("volumes");
        for plugin in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if plugin.file_name() == evpleg_volume::csi::paths::PLUGIN_DIR_NAME {
                continue;
            }
            for volume in std::fs::read_dir(plugin.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let name = volume.file_name().to_string_lossy().into_owned();
                let (used, inodes) = disk_usage(&volume.path());
                if ephemeral(&name) {
                    sum = (sum.0 + used, sum.1 + inodes);
                }
                if let Some(fs) = fs_of(&volume.path(), used, inodes) {
                    out.push(VolumeStats { fs, name });
                }
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        (out, sum)
    }

    /// CPU stats of cgroup `rel`, its rate from the last sample under `key`
    /// (kept as the new sample when `update`).
    fn cpu(&self, key: &str, rel: &str, update: bool) -> Result<CpuStats, StatsError> {
        let usage_ns = self.cgroups.cpu_usage_ns(rel)?;
        let time = Timestamp::now();
        let at_ns = time.as_nanosecond() as i64;
        let mut cache = self.cpu.lock().unwrap_or_else(|e| e.into_inner());
        let last = cache.get(key).copied();
        let nano_cores = if update {
            let rate = last.and_then(|l| nano_cores(&l, usage_ns, at_ns));
            cache.insert(
                key.to_owned(),
                CpuRecord {
                    usage_ns,
                    at_ns,
                    nano_cores: rate,
                },
            );
            rate
        } else {
            last.and_then(|l| l.nano_cores)
        };
        Ok(CpuStats {
            time,
            usage_nano_cores: nano_cores,
            usage_core_nano_seconds: usage_ns,
        })
    }

    /// The boot time (`btime` of `/proc/stat`): the root cgroup's start.
    fn boot_time(&self) -> Option<Timestamp> {
        let stat = std::fs::read_to_string(self.proc.join("stat")).ok()?;
        let secs: i64 = stat
            .lines()
            .find_map(|l| l.strip_prefix("btime "))?
            .trim()
            .parse()
            .ok()?;
        Timestamp::from_second(secs).ok()
    }
}

/// The rate between sample `last` and `usage_ns` at `at_ns`, in nanocores;
/// none when the counter went back or no time passed.
fn nano_cores(last: &CpuRecord, usage_ns: u64, at_ns: i64) -> Option<u64> {
    let span = at_ns - last.at_ns;
    if usage_ns < last.usage_ns || span <= 0 {
        return None;
    }
    Some(((usage_ns - last.usage_ns) as f64 / span as f64 * 1e9) as u64)
}

fn memory_stats(m: &cgroup::Memory) -> MemoryStats {
    MemoryStats {
        time: Timestamp::now(),
        available_bytes: m.limit.map(|l| l.saturating_sub(m.working_set)),
        usage_bytes: m.usage,
        working_set_bytes: m.working_set,
        rss_bytes: m.rss,
        page_faults: m.page_faults,
        major_page_faults: m.major_page_faults,
    }
}

/// A CRI time (ns since the epoch).
fn ns_time(ns: i64) -> Timestamp {
    Timestamp::from_nanosecond(i128::from(ns)).unwrap_or_default()
}

/// `used` bytes and `inodes` of the filesystem holding `path`.
fn fs_of(path: &Path, used: u64, inodes_used: u64) -> Option<FsStats> {
    let f = filesystem(path)?;
    Some(FsStats {
        time: Timestamp::now(),
        available_bytes: Some(f.available_bytes),
        capacity_bytes: Some(f.capacity_bytes),
        used_bytes: used,
        inodes_free: Some(f.inodes_free),
        inodes: Some(f.inodes),
        inodes_used,
    })
}

/// Bytes (allocated blocks) and inodes under `path`, symlinks not followed,
/// as the kubelet's `du`-like volume metrics.
pub fn disk_usage(path: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return (0, 0);
    };
    let (mut bytes, mut inodes) = (meta.blocks() * 512, 1);
    if meta.is_dir() {
        for e in std::fs::read_dir(path).into_iter().flatten().flatten() {
            let (b, i) = disk_usage(&e.path());
            bytes += b;
            inodes += i;
        }
    }
    (bytes, inodes)
}

/// The interfaces of a `/proc/<pid>/net/dev`, as cAdvisor reads them (`lo`,
/// `veth*`, `docker*` left out), `eth0` the default one; `None` when the file
/// cannot be read.
pub fn network(path: &Path) -> Option<NetworkStats> {
    let text = std::fs::read_to_string(path).ok()?;
    let interfaces = parse_net_dev(&text);
    let default = interfaces
        .iter()
        .find(|i| i.name == "eth0")
        .cloned()
        .unwrap_or_default();
    Some(NetworkStats {
        time: Timestamp::now(),
        default,
        interfaces,
    })
}

/// The lines of a `net/dev` file.
pub fn parse_net_dev(text: &str) -> Vec<InterfaceStats> {
    let mut out: Vec<InterfaceStats> = text
        .lines()
        .skip(2)
        .filter_map(|l| {
            let (name, rest) = l.split_once(':')?;
            let name = name.trim();
            if name == "lo" || name.starts_with("veth") || name.starts_with("docker") {
                return None;
            }
            let f: Vec<u64> = rest
                .split_whitespace()
                .map(|w| w.parse().ok())
                .collect::<Option<_>>()?;
            (f.len() >= 16).then(|| InterfaceStats {
                name: name.to_owned(),
                rx_bytes: f[0],
                rx_errors: f[2],
                tx_bytes: f[8],
                tx_errors: f[10],
            })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

#[cfg(test)]
mod tests;
