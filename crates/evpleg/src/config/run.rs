//! `evpleg run`'s flags: the pod sources, the node, and the kubelet's knobs
//! for restarts, image pulls and garbage collection, with the kubelet's
//! defaults.

use std::path::PathBuf;
use std::time::Duration;

use super::{Common, duration};

/// `evpleg run`: the node agent.
#[derive(Clone, Debug, clap::Parser)]
#[command(name = "evpleg run")]
pub struct RunArgs {
    #[command(flatten)]
    pub common: Common,

    #[command(flatten)]
    pub server: super::KubeletServerArgs,

    /// How often a pod worker syncs its pod without another reason (the
    /// kubelet's `--sync-frequency`).
    #[arg(long, env = "EVPLEG_SYNC_FREQUENCY", default_value = "1m",
          value_parser = duration::positive)]
    pub sync_frequency: Duration,

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

    /// The agent's state directory (the kubelet's `--root-dir`): each pod's
    /// managed /etc/hosts is `<dir>/pods/<uid>/etc-hosts`.
    #[arg(long, env = "EVPLEG_ROOT_DIR", default_value = "/var/lib/evpleg")]
    pub root_dir: PathBuf,

    /// DNS server IPs of pods with dnsPolicy ClusterFirst, comma-separated (the
    /// kubelet's `--cluster-dns`); without them such pods fall back to Default.
    #[arg(long, env = "EVPLEG_CLUSTER_DNS", value_delimiter = ',')]
    pub cluster_dns: Vec<std::net::IpAddr>,

    /// The cluster's DNS domain (the kubelet's `--cluster-domain`): the search
    /// domains of ClusterFirst pods and the domain of pods with a subdomain.
    #[arg(long, env = "EVPLEG_CLUSTER_DOMAIN", default_value = "")]
    pub cluster_domain: String,

    /// The resolver configuration pods with dnsPolicy Default get (the
    /// kubelet's `--resolv-conf`); empty: none, such pods ask 127.0.0.1.
    #[arg(long, env = "EVPLEG_RESOLV_CONF", default_value = "/etc/resolv.conf")]
    pub resolv_conf: String,

    /// Directory for container logs.
    #[arg(
        long,
        env = "EVPLEG_POD_LOG_DIR",
        default_value = "/var/log/evpleg/pods"
    )]
    pub pod_log_dir: PathBuf,

    /// The size at which a running container's log file is rotated (the
    /// kubelet's `--container-log-max-size`; a quantity: 10Mi, 500Ki).
    #[arg(long, env = "EVPLEG_CONTAINER_LOG_MAX_SIZE", default_value = "10Mi",
          value_parser = log_size)]
    pub container_log_max_size: u64,

    /// How many log files a container keeps, the live one included (the
    /// kubelet's `--container-log-max-files`; at least 2).
    #[arg(long, env = "EVPLEG_CONTAINER_LOG_MAX_FILES", default_value_t = 5,
          value_parser = clap::value_parser!(u32).range(2..))]
    pub container_log_max_files: u32,

    /// How often the log files are looked at for rotation (the kubelet's
    /// `containerLogMonitorInterval`, a configuration-file field).
    #[arg(long, env = "EVPLEG_CONTAINER_LOG_MONITOR_INTERVAL", default_value = "10s",
          value_parser = duration::positive)]
    pub container_log_monitor_interval: Duration,

    /// Serve /pods and /pods/<namespace>/<name>/events (every pod's spec,
    /// env values included) on --listen; `false` leaves /metrics, /healthz
    /// and /readyz only (the kubelet's read-only port turned off).
    #[arg(long, env = "EVPLEG_PODS_ENDPOINT", default_value_t = true,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub pods_endpoint: bool,

    /// CrashLoopBackOff: the first delay (the kubelet's 10s).
    #[arg(long, env = "EVPLEG_CRASHLOOP_BACKOFF_INITIAL", default_value = "10s",
          value_parser = duration::positive)]
    pub crashloop_backoff_initial: Duration,

    /// CrashLoopBackOff: the longest delay (the kubelet's 5m).
    #[arg(long, env = "EVPLEG_CRASHLOOP_BACKOFF_MAX", default_value = "5m",
          value_parser = duration::positive)]
    pub crashloop_backoff_max: Duration,

    /// ImagePullBackOff: the first delay after a failed pull (the kubelet's 10s).
    #[arg(long, env = "EVPLEG_IMAGE_PULL_BACKOFF_INITIAL", default_value = "10s",
          value_parser = duration::positive)]
    pub image_pull_backoff_initial: Duration,

    /// ImagePullBackOff: the longest delay (the kubelet's 5m).
    #[arg(long, env = "EVPLEG_IMAGE_PULL_BACKOFF_MAX", default_value = "5m",
          value_parser = duration::positive)]
    pub image_pull_backoff_max: Duration,

    /// The cgroup driver of pod cgroups, as the kubelet's `--cgroup-driver`:
    /// `auto` asks the runtime (CRI RuntimeConfig) and falls back to cgroupfs
    /// when it does not answer.
    #[arg(long, env = "EVPLEG_CGROUP_DRIVER", value_enum, default_value_t = CgroupDriverFlag::Auto)]
    pub cgroup_driver: CgroupDriverFlag,

    /// Container garbage collection: how often (the kubelet's 1m).
    #[arg(long, env = "EVPLEG_CONTAINER_GC_PERIOD", default_value = "1m",
          value_parser = duration::positive)]
    pub container_gc_period: Duration,

    /// Container garbage collection: dead containers younger than this stay
    /// (the kubelet's `--minimum-container-ttl-duration`, 0).
    #[arg(long, env = "EVPLEG_MINIMUM_CONTAINER_TTL_DURATION", default_value = "0",
          value_parser = duration::parse)]
    pub minimum_container_ttl_duration: Duration,

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
    #[arg(long, env = "EVPLEG_MAXIMUM_DEAD_CONTAINERS", default_value_t = -1,
          allow_negative_numbers = true)]
    pub maximum_dead_containers: i32,

    /// Pods the node runs at most; one more is rejected with OutOfpods (the
    /// kubelet's, default 110).
    #[arg(long, env = "EVPLEG_MAX_PODS", default_value_t = evpleg_kubelet::admission::DEFAULT_MAX_PODS)]
    pub max_pods: i64,

    /// Sysctls (or prefixes ending in `*`) admitted beyond the kubelet's
    /// safe set, comma-separated, each known to be namespaced; a pod setting
    /// any other is rejected with SysctlForbidden (the kubelet's).
    #[arg(long, env = "EVPLEG_ALLOWED_UNSAFE_SYSCTLS", default_value = "")]
    pub allowed_unsafe_sysctls: String,

    /// Labels of the node, `key=value,...`, beside kubernetes.io/hostname,
    /// kubernetes.io/os and kubernetes.io/arch; admission matches nodeSelector
    /// and node affinity against them.
    #[arg(long, env = "EVPLEG_NODE_LABELS", default_value = "")]
    pub node_labels: String,

    /// Taints of the node, `key[=value]:Effect,...`; admission rejects a pod
    /// from the API not tolerating a NoExecute one (TaintToleration).
    #[arg(long, env = "EVPLEG_REGISTER_WITH_TAINTS", default_value = "")]
    pub register_with_taints: String,

    /// Resources set aside for the system (`cpu=500m,memory=1Gi,ephemeral-storage=10Gi`), taken
    /// from the node's allocatable.
    #[arg(long, env = "EVPLEG_SYSTEM_RESERVED", default_value = "")]
    pub system_reserved: String,

    /// With --kubeconfig: the node's Lease duration in kube-node-lease; the
    /// lease is renewed every quarter of it (the kubelet's, default 40).
    #[arg(long, env = "EVPLEG_NODE_LEASE_DURATION_SECONDS", default_value_t = 40,
          value_parser = clap::value_parser!(i32).range(1..))]
    pub node_lease_duration_seconds: i32,

    /// With --kubeconfig: how often the node's conditions are checked; a
    /// change is written at once, else every 5 minutes (the kubelet's
    /// --node-status-update-frequency).
    #[arg(long, env = "EVPLEG_NODE_STATUS_UPDATE_FREQUENCY", default_value = "10s",
          value_parser = duration::positive)]
    pub node_status_update_frequency: Duration,

    /// Resources set aside for the agent and the runtime, as
    /// --system-reserved.
    #[arg(long, env = "EVPLEG_KUBE_RESERVED", default_value = "")]
    pub kube_reserved: String,

    /// How often the runtime's CRI Status is asked (the kubelet's fixed 5 s);
    /// with no answer for six periods the node is not Ready ("container
    /// runtime is down").
    #[arg(long, env = "EVPLEG_RUNTIME_STATUS_PERIOD", default_value = "5s",
          value_parser = duration::positive)]
    pub runtime_status_period: Duration,

    /// The PLEG is unhealthy (`/healthz` fails, the node is not Ready) when
    /// its last complete relist is older than this, or than two relist
    /// periods (the kubelet's fixed relistThreshold, 3 min).
    #[arg(long, env = "EVPLEG_PLEG_HEALTH_THRESHOLD", default_value = "3m0s",
          value_parser = duration::positive)]
    pub pleg_health_threshold: Duration,
}

impl RunArgs {
    /// The node name: the flag, else the host name.
    pub fn node_name(&self) -> String {
        self.node_name.clone().unwrap_or_else(super::host_name)
    }

    /// The pods' DNS settings from `--cluster-dns`, `--cluster-domain` and
    /// `--resolv-conf`.
    pub fn dns(&self) -> evpleg_kubelet::network::dns::Configurer {
        evpleg_kubelet::network::dns::Configurer {
            cluster_dns: self.cluster_dns.clone(),
            cluster_domain: self.cluster_domain.clone(),
            resolv_conf: Some(PathBuf::from(&self.resolv_conf))
                .filter(|p| !p.as_os_str().is_empty()),
            node_ip: self.node_ip().parse().ok(),
        }
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
}

/// `--cgroup-driver`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CgroupDriverFlag {
    /// Ask the runtime; cgroupfs if it does not say.
    Auto,
    Cgroupfs,
    Systemd,
}

impl CgroupDriverFlag {
    /// The driver asked for; `None` for `auto` (ask the runtime).
    pub fn driver(self) -> Option<evpleg_core::cgroup_path::CgroupDriver> {
        use evpleg_core::cgroup_path::CgroupDriver;
        match self {
            Self::Auto => None,
            Self::Cgroupfs => Some(CgroupDriver::Cgroupfs),
            Self::Systemd => Some(CgroupDriver::Systemd),
        }
    }
}

/// A log size quantity (`10Mi`), above 0.
fn log_size(s: &str) -> Result<u64, String> {
    match evpleg_core::quantity::parse_units(s) {
        Ok(n) if n > 0 => Ok(n as u64),
        Ok(n) => Err(format!("{s:?}: the size must be above 0, got {n}")),
        Err(e) => Err(format!("{s:?} is not a quantity: {e}")),
    }
}
