//! The agent's configuration: command-line flags, each also read from an
//! `EVPLEG_*` environment variable. Defaults are named constants with units.
//! Values that cannot work (zero or negative periods, a zero channel capacity, a
//! ring buffer that is not a power of two) are refused by the parser with a
//! message naming the flag, never a panic later.

use std::path::PathBuf;

use clap::Parser;

use crate::pleg::PlegMode;
use crate::pleg::kernel::{
    DEFAULT_REALTIME_PRIORITY, DEFAULT_RING_BUFFER_BYTES, DEFAULT_ROOTS, KernelPlegConfig,
};

/// evpleg: a node agent whose PLEG is driven by the kernel.
#[derive(Clone, Debug, Parser)]
#[command(version, about)]
pub struct Args {
    /// Which PLEG to run.
    #[arg(long, env = "EVPLEG_PLEG", value_enum, default_value = "ebpf")]
    pub pleg: PlegMode,

    /// The CRI runtime's socket (`unix:///run/containerd/containerd.sock`). Without
    /// it only kernel events are reported (no relist, no pods).
    #[arg(long, env = "EVPLEG_CRI_ENDPOINT")]
    pub cri_endpoint: Option<String>,

    /// Relist period in seconds (default: 300 in ebpf mode, 1 in generic mode).
    #[arg(long, env = "EVPLEG_RELIST_PERIOD_SECONDS", value_parser = positive_seconds)]
    pub relist_period_seconds: Option<f64>,

    /// How often a pod worker syncs its pod without another reason, in seconds
    /// (the kubelet's `--sync-frequency`, 1 min).
    #[arg(long, env = "EVPLEG_SYNC_FREQUENCY_SECONDS", default_value_t = 60.0,
          value_parser = positive_seconds)]
    pub sync_frequency_seconds: f64,

    /// This node's name (spec.nodeName of its pods; static pod names get it as a
    /// suffix). Defaults to the host name.
    #[arg(long, env = "EVPLEG_NODE_NAME")]
    pub node_name: Option<String>,

    /// This node's IP (status.hostIP; the pod IP of host-network pods). Defaults
    /// to the first non-loopback IPv4 address, else 127.0.0.1.
    #[arg(long, env = "EVPLEG_NODE_IP")]
    pub node_ip: Option<String>,

    /// Static pod manifests directory, watched with inotify.
    #[arg(long, env = "EVPLEG_MANIFEST_DIR")]
    pub manifest_dir: Option<PathBuf>,

    /// Static pod manifest URL, polled (the kubelet's legacy HTTP source).
    #[arg(long, env = "EVPLEG_MANIFEST_URL")]
    pub manifest_url: Option<String>,

    /// Watch the API server for this node's pods and write their status there:
    /// with a kubeconfig path, or "in-cluster".
    #[arg(long, env = "EVPLEG_KUBECONFIG")]
    pub kubeconfig: Option<String>,

    /// Directory for container logs.
    #[arg(
        long,
        env = "EVPLEG_POD_LOG_DIR",
        default_value = "/var/log/evpleg/pods"
    )]
    pub pod_log_dir: PathBuf,

    /// CrashLoopBackOff: first delay in seconds (the kubelet's 10).
    #[arg(long, env = "EVPLEG_CRASHLOOP_INITIAL_SECONDS", default_value_t = 10.0,
          value_parser = positive_seconds)]
    pub crashloop_initial_seconds: f64,

    /// CrashLoopBackOff: longest delay in seconds (the kubelet's 300).
    #[arg(long, env = "EVPLEG_CRASHLOOP_MAX_SECONDS", default_value_t = 300.0,
          value_parser = positive_seconds)]
    pub crashloop_max_seconds: f64,

    /// The cgroup driver of pod cgroups, as the kubelet's `--cgroup-driver`:
    /// `auto` asks the runtime (CRI RuntimeConfig) and falls back to cgroupfs
    /// when it does not answer.
    #[arg(long, env = "EVPLEG_CGROUP_DRIVER", value_enum, default_value_t = CgroupDriverFlag::Auto)]
    pub cgroup_driver: CgroupDriverFlag,

    /// Container garbage collection: how often, in seconds (the kubelet's 1 min).
    #[arg(
        long,
        env = "EVPLEG_CONTAINER_GC_PERIOD_SECONDS",
        default_value_t = 60.0
    )]
    pub container_gc_period_seconds: f64,

    /// Container garbage collection: dead containers younger than this many
    /// seconds stay (the kubelet's `--minimum-container-ttl-duration`).
    #[arg(
        long,
        env = "EVPLEG_MINIMUM_CONTAINER_TTL_SECONDS",
        default_value_t = 0.0
    )]
    pub minimum_container_ttl_seconds: f64,

    /// Container garbage collection: dead containers kept per pod and container
    /// name; negative: no limit (the kubelet's, default 1).
    #[arg(
        long,
        env = "EVPLEG_MAXIMUM_DEAD_CONTAINERS_PER_CONTAINER",
        default_value_t = 1,
        allow_negative_numbers = true
    )]
    pub maximum_dead_containers_per_container: i32,

    /// Container garbage collection: dead containers kept on the node;
    /// negative: no limit (the kubelet's, default -1).
    #[arg(long, env = "EVPLEG_MAXIMUM_DEAD_CONTAINERS", default_value_t = -1, allow_negative_numbers = true)]
    pub maximum_dead_containers: i32,

    /// ImagePullBackOff: first delay in seconds after a failed pull (the kubelet's 10).
    #[arg(
        long,
        env = "EVPLEG_IMAGE_PULL_BACKOFF_INITIAL_SECONDS",
        default_value_t = 10.0
    )]
    pub image_pull_backoff_initial_seconds: f64,

    /// ImagePullBackOff: longest delay in seconds (the kubelet's 300).
    #[arg(
        long,
        env = "EVPLEG_IMAGE_PULL_BACKOFF_MAX_SECONDS",
        default_value_t = 300.0
    )]
    pub image_pull_backoff_max_seconds: f64,

    /// Load this eBPF object instead of the one embedded at build time.
    #[arg(long, env = "EVPLEG_BPF_OBJECT")]
    pub bpf_object: Option<PathBuf>,

    /// Root cgroups whose tasks and cgroups are reported (repeatable; paths relative
    /// to the cgroup hierarchy root).
    #[arg(long = "cgroup-root", env = "EVPLEG_CGROUP_ROOTS", value_delimiter = ',',
          default_values_t = DEFAULT_ROOTS.map(String::from))]
    pub cgroup_roots: Vec<String>,

    /// Ring buffer size in bytes (a power of two, at least a page).
    #[arg(long, env = "EVPLEG_RING_BUFFER_BYTES", default_value_t = DEFAULT_RING_BUFFER_BYTES,
          value_parser = ring_buffer_bytes)]
    pub ring_buffer_bytes: u32,

    /// SCHED_FIFO priority of the ring-buffer reader; 0 disables real-time.
    #[arg(long, env = "EVPLEG_REALTIME_PRIORITY", default_value_t = DEFAULT_REALTIME_PRIORITY)]
    pub realtime_priority: i32,

    /// Capacity of the lifecycle event channel (the kubelet uses 1000).
    #[arg(long, env = "EVPLEG_EVENT_CHANNEL", default_value_t = 1000,
          value_parser = channel_capacity)]
    pub event_channel: usize,

    /// Address of the HTTP endpoints (/metrics, /healthz); the kubelet's read-only
    /// port by default.
    #[arg(long, env = "EVPLEG_LISTEN", default_value = "127.0.0.1:10255")]
    pub listen: std::net::SocketAddr,

    /// Stop after this many seconds (0: run until interrupted).
    #[arg(long, env = "EVPLEG_RUN_FOR_SECONDS", default_value_t = 0)]
    pub run_for_seconds: u64,
}

/// The longest period a flag takes (a year), so that `Duration` never overflows.
const MAX_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

/// A period in seconds: a finite number above zero, at most a year.
fn positive_seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !v.is_finite() || v <= 0.0 {
        return Err(format!("{s:?}: the period must be more than 0 seconds"));
    }
    if v > MAX_SECONDS {
        return Err(format!(
            "{s:?}: the period must be at most {MAX_SECONDS} seconds (a year)"
        ));
    }
    Ok(v)
}

/// A channel capacity: at least 1 (Tokio's channels cannot have 0).
fn channel_capacity(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("the capacity must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "{s:?} is not a capacity (a whole number of events)"
        )),
    }
}

/// The ring buffer's size: a power of two, at least a page (4096 bytes).
fn ring_buffer_bytes(s: &str) -> Result<u32, String> {
    let n: u32 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of bytes"))?;
    if n < 4096 || !n.is_power_of_two() {
        return Err(format!(
            "{n}: the ring buffer must be a power of two of at least 4096 bytes"
        ));
    }
    Ok(n)
}

impl Args {
    /// The node name: the flag, else the host name.
    pub fn node_name(&self) -> String {
        self.node_name.clone().unwrap_or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_lowercase())
                .unwrap_or_else(|_| "localhost".into())
        })
    }

    /// The node IP: the flag, else the first non-loopback IPv4 address of the
    /// host (from /proc/net/fib_trie's local routes), else 127.0.0.1.
    pub fn node_ip(&self) -> String {
        if let Some(ip) = &self.node_ip {
            return ip.clone();
        }
        let trie = std::fs::read_to_string("/proc/net/fib_trie").unwrap_or_default();
        let mut last = None;
        for line in trie.lines() {
            let t = line.trim();
            if let Some(addr) = t.strip_prefix("|-- ") {
                last = Some(addr.to_owned());
            } else if t.contains("/32 host LOCAL")
                && let Some(a) = &last
                && !a.starts_with("127.")
            {
                return a.clone();
            }
        }
        "127.0.0.1".into()
    }

    pub fn kernel_pleg(&self) -> KernelPlegConfig {
        KernelPlegConfig {
            object: self.bpf_object.clone(),
            ring_buffer_bytes: self.ring_buffer_bytes,
            roots: self.cgroup_roots.clone(),
            realtime_priority: (self.realtime_priority > 0).then_some(self.realtime_priority),
            tap: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_overrides() {
        let args = Args::try_parse_from(["evpleg"]).unwrap();
        assert_eq!(
            args.cgroup_roots,
            ["/kubepods", "/kubepods.slice", "/k8s.io"]
        );
        assert_eq!(
            args.kernel_pleg().realtime_priority,
            Some(DEFAULT_REALTIME_PRIORITY)
        );
        let args = Args::try_parse_from([
            "evpleg",
            "--cgroup-root",
            "/a,/b",
            "--realtime-priority",
            "0",
        ])
        .unwrap();
        assert_eq!(args.cgroup_roots, ["/a", "/b"]);
        assert_eq!(args.kernel_pleg().realtime_priority, None);
    }

    #[test]
    fn invalid_values_are_refused_with_a_message_naming_the_flag() {
        let cases: &[(&str, &str)] = &[
            ("--relist-period-seconds=0", "more than 0"),
            ("--relist-period-seconds=-1", "more than 0"),
            ("--relist-period-seconds=NaN", "more than 0"),
            ("--relist-period-seconds=1e300", "at most"),
            ("--sync-frequency-seconds=0", "more than 0"),
            ("--crashloop-initial-seconds=-0.5", "more than 0"),
            ("--crashloop-max-seconds=abc", "not a number"),
            ("--event-channel=0", "at least 1"),
            ("--event-channel=-3", "not a capacity"),
            ("--ring-buffer-bytes=5000", "power of two"),
            ("--ring-buffer-bytes=0", "power of two"),
        ];
        for (flag, want) in cases {
            let err = Args::try_parse_from(["evpleg", flag]).expect_err(flag);
            let text = err.to_string();
            let name = flag.split('=').next().unwrap();
            assert!(text.contains(name) && text.contains(want), "{flag}: {text}");
        }
        let ok = Args::try_parse_from([
            "evpleg",
            "--relist-period-seconds",
            "0.5",
            "--sync-frequency-seconds",
            "2",
            "--event-channel",
            "1",
            "--ring-buffer-bytes",
            "8192",
        ])
        .unwrap();
        assert_eq!(ok.relist_period_seconds, Some(0.5));
        assert_eq!(ok.sync_frequency_seconds, 2.0);
        assert_eq!(
            Args::try_parse_from(["evpleg"])
                .unwrap()
                .sync_frequency_seconds,
            60.0
        );
    }
}

/// `--cgroup-driver`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CgroupDriverFlag {
    /// Ask the runtime; cgroupfs if it does not say.
    Auto,
    Cgroupfs,
    Systemd,
}
