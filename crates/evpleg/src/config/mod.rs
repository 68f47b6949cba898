//! The command line: `evpleg run` (the node agent), `evpleg observe` (the PLEG
//! alone, next to a real kubelet), `evpleg version` and `evpleg describe pod`
//! (a pod and its events, from a running agent), `evpleg cri-proxy` (a CRI
//! proxy serving kernel-speed container events to a stock kubelet). Every flag is also read
//! from an `EVPLEG_*` environment variable; durations are written as the
//! kubelet's are (`1m0s`, `300ms`: [`duration`]). Values that cannot work (a
//! zero period, a zero channel capacity, a ring buffer that is not a power of
//! two, a number without its unit) are refused by the parser with a message
//! naming the flag, never a panic later.

mod cri_proxy;
pub mod duration;
mod kubelet_server;
mod run;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

pub use cri_proxy::{CRI_PROXY_HTTP, CRI_PROXY_SOCKET, CriProxyArgs};
pub use kubelet_server::{AuthorizationModeFlag, KubeletServerArgs};
pub use run::{CgroupDriverFlag, RunArgs};

use evpleg_pleg::PlegMode;
use evpleg_pleg::kernel::{
    DEFAULT_REALTIME_PRIORITY, DEFAULT_RING_BUFFER_BYTES, DEFAULT_ROOTS, KernelPlegConfig,
};

/// evpleg: a node agent whose Pod Lifecycle Event Generator is driven by the
/// kernel (eBPF), reconciled by a slow relist against the CRI runtime.
#[derive(Clone, Debug, Parser)]
#[command(name = "evpleg", version, about, propagate_version = true)]
pub struct Cli {
    /// Log format: `text` for people, `json` (one object per line) for log
    /// collectors. The filter is `RUST_LOG` (default `info`).
    #[arg(long, env = "EVPLEG_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Clone, Debug, Subcommand)]
pub enum Command {
    /// Run the node agent: pods from the manifest directory, a manifest URL or
    /// the API server run on the CRI runtime, driven by the PLEG of `--pleg`,
    /// with their statuses at /pods and in the API.
    Run(Box<RunArgs>),
    /// Shadow mode, safe next to a real kubelet: the PLEG alone, no pod
    /// management and no call that changes the runtime. Prints every lifecycle
    /// event with how much earlier it was seen than by a relist run alongside,
    /// and any disagreement between the two.
    Observe(Box<ObserveArgs>),
    /// Print the version, the commit and the eBPF object built in.
    Version(VersionArgs),
    /// Show a resource as the running agent knows it, as `kubectl describe`
    /// does (`describe pod NAME|UID`: status, containers and events).
    Describe(DescribeArgs),
    /// A CRI proxy between an unmodified kubelet and its runtime: every call
    /// forwarded untouched, GetContainerEvents served from the kernel PLEG,
    /// and (unless `--overlay=false`) deaths the kernel saw with certainty
    /// shown in status answers before the runtime reports them.
    CriProxy(Box<CriProxyArgs>),
}

/// `evpleg describe`'s resources.
#[derive(Clone, Debug, clap::Args)]
pub struct DescribeArgs {
    #[command(subcommand)]
    pub what: Describe,
}

/// What `describe` shows.
#[derive(Clone, Debug, Subcommand)]
pub enum Describe {
    /// A pod: name, namespace, UID, node, phase, conditions, each container's
    /// state, last state, restart count and readiness, and its events, read
    /// from the agent's /pods and /pods/<namespace>/<name>/events.
    Pod(DescribePodArgs),
}

/// `evpleg describe pod`'s flags.
#[derive(Clone, Debug, clap::Args)]
pub struct DescribePodArgs {
    /// The pod's name (as in /pods: static pods end in -<node>) or UID.
    pub pod: String,

    /// The agent's HTTP endpoint (its --listen address).
    #[arg(long, env = "EVPLEG_SERVER", default_value = DESCRIBE_SERVER)]
    pub server: String,

    /// The pod's namespace, when its name is in several.
    #[arg(long, short = 'n', env = "EVPLEG_NAMESPACE")]
    pub namespace: Option<String>,
}

/// `describe`'s default server: `run`'s default listen address.
pub const DESCRIBE_SERVER: &str = "http://127.0.0.1:10255";

/// `--log-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// The CRI sockets tried, in order, when `--cri-endpoint` is not given (the
/// usual containerd, CRI-O and cri-dockerd sockets, as crictl tries them).
pub const CRI_SOCKETS: [&str; 3] = [
    "/run/containerd/containerd.sock",
    "/run/crio/crio.sock",
    "/var/run/cri-dockerd.sock",
];

/// `--pleg`: which PLEG drives the pod workers ([`PlegMode`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PlegFlag {
    /// Kernel events (eBPF), merged with a slow reconciling relist (300 s).
    Ebpf,
    /// The kubelet's generic PLEG: a relist every second.
    Generic,
    /// For comparison: the kubelet 1.37 Evented PLEG ("events are hints"):
    /// the 1 s relist always runs, each CONTAINER_STOPPED of the CRI event
    /// stream (`GetContainerEvents`) relists its pod ([`evented_cri`]). Needs
    /// containerd 1.7 or later; with 1.6 it is the generic PLEG.
    EventedCri,
    /// For comparison: the Evented PLEG of kubelets 1.26 to 1.36 (what a
    /// stock kubelet with the EventedPLEG gate runs): each event's payload is
    /// the pod's status, a 300 s relist, back to the 1 s relist after 5 failed
    /// streams (`evpleg_pleg::evented_payload`).
    #[value(name = "evented-cri-1.26")]
    EventedCriPayload,
}

impl PlegFlag {
    pub fn mode(self) -> PlegMode {
        match self {
            Self::Ebpf => PlegMode::Ebpf,
            Self::Generic => PlegMode::Generic,
            Self::EventedCri => PlegMode::EventedCri,
            Self::EventedCriPayload => PlegMode::EventedCriPayload,
        }
    }
}

/// The flags `run` and `observe` share: the PLEG, the runtime, the kernel
/// programs and the HTTP endpoints.
#[derive(Clone, Debug, clap::Args)]
pub struct Common {
    /// Which PLEG to run.
    #[arg(long, env = "EVPLEG_PLEG", value_enum, default_value = "ebpf")]
    pub pleg: PlegFlag,

    /// The CRI runtime's socket (`unix:///run/containerd/containerd.sock`).
    /// Without it the first of /run/containerd/containerd.sock,
    /// /run/crio/crio.sock and /var/run/cri-dockerd.sock that exists is used;
    /// `none` uses no runtime (observe: kernel events only).
    #[arg(long, env = "EVPLEG_CRI_ENDPOINT")]
    pub cri_endpoint: Option<String>,

    /// Full relist period (default: 5m0s in ebpf and evented-cri-1.26 modes,
    /// the kubelet's 1s in generic and evented-cri modes).
    #[arg(long, env = "EVPLEG_RELIST_PERIOD", value_parser = duration::positive)]
    pub relist_period: Option<Duration>,

    #[command(flatten)]
    pub kernel: KernelArgs,

    /// Capacity of the lifecycle event channel (the kubelet uses 1000).
    #[arg(long, env = "EVPLEG_EVENT_CHANNEL", default_value_t = 1000,
          value_parser = channel_capacity)]
    pub event_channel: usize,

    /// Address of the HTTP endpoints (/metrics, /healthz, /readyz; /pods in
    /// `run`). Default: 127.0.0.1:10255 (the kubelet's read-only port) for
    /// `run`, 127.0.0.1:10265 for `observe`, which runs next to a kubelet.
    #[arg(long, env = "EVPLEG_LISTEN")]
    pub listen: Option<SocketAddr>,

    #[command(flatten)]
    pub http: HttpArgs,

    /// Stop after this long (`0`: run until SIGTERM or SIGINT).
    #[arg(long, env = "EVPLEG_RUN_FOR", default_value = "0", value_parser = duration::parse)]
    pub run_for: Duration,
}

/// The HTTP endpoints' bounds ([`crate::http`]), shared by every subcommand
/// that serves them.
#[derive(Args, Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpArgs {
    /// Time a client has to send a request's headers, also the longest an
    /// idle keep-alive connection stays open.
    #[arg(long, env = "EVPLEG_HTTP_HEADER_TIMEOUT", default_value = "10s",
          value_parser = duration::positive)]
    pub http_header_timeout: Duration,

    /// A connection that moves no byte either way for this long is closed.
    #[arg(long, env = "EVPLEG_HTTP_IDLE_TIMEOUT", default_value = "1m",
          value_parser = duration::positive)]
    pub http_idle_timeout: Duration,

    /// HTTP connections served at once; those beyond are closed as they
    /// arrive.
    #[arg(long, env = "EVPLEG_HTTP_MAX_CONNECTIONS", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub http_max_connections: u32,
}

impl HttpArgs {
    pub fn limits(&self) -> crate::http::HttpLimits {
        crate::http::HttpLimits {
            header_read_timeout: self.http_header_timeout,
            idle_timeout: self.http_idle_timeout,
            max_connections: self.http_max_connections as usize,
            ..Default::default()
        }
    }
}

/// TLS for the observer's and the proxy's HTTP endpoints, for serving them
/// beyond loopback; they have no other authentication, so a client CA makes
/// a client certificate required (mutual TLS). `run` serves beyond loopback
/// on the kubelet server instead (`--port`), with the kubelet's
/// authentication.
#[derive(Args, Debug, Clone, Default, PartialEq, Eq)]
pub struct HttpTlsArgs {
    /// Serve the HTTP endpoints over HTTPS with this certificate (PEM, the
    /// chain); needs `--http-tls-private-key-file`.
    #[arg(
        long,
        env = "EVPLEG_HTTP_TLS_CERT_FILE",
        requires = "http_tls_private_key_file"
    )]
    pub http_tls_cert_file: Option<PathBuf>,

    /// The private key of `--http-tls-cert-file` (PEM).
    #[arg(
        long,
        env = "EVPLEG_HTTP_TLS_PRIVATE_KEY_FILE",
        requires = "http_tls_cert_file"
    )]
    pub http_tls_private_key_file: Option<PathBuf>,

    /// Require a client certificate chaining to this CA (PEM) on the HTTPS
    /// endpoints; a client without one fails the handshake.
    #[arg(
        long,
        env = "EVPLEG_HTTP_CLIENT_CA_FILE",
        requires = "http_tls_cert_file"
    )]
    pub http_client_ca_file: Option<PathBuf>,
}

impl HttpTlsArgs {
    /// The endpoints' TLS on `addr` (`None`: plain HTTP). Serving beyond
    /// loopback without client certificates is allowed, with a warning.
    pub fn server_config(
        &self,
        addr: SocketAddr,
    ) -> Result<Option<std::sync::Arc<rustls::ServerConfig>>, crate::server::tls::TlsError> {
        use crate::server::tls::{ClientCerts, ServingCert, server_config};
        if self.http_client_ca_file.is_none() && !addr.ip().is_loopback() {
            tracing::warn!(%addr, "the http endpoints are served beyond loopback to any client: \
                 give --http-tls-cert-file, --http-tls-private-key-file and --http-client-ca-file \
                 to require a client certificate");
        }
        let (Some(cert), Some(key)) = (&self.http_tls_cert_file, &self.http_tls_private_key_file)
        else {
            return Ok(None);
        };
        let source = ServingCert::Files {
            cert: cert.clone(),
            key: key.clone(),
        };
        let client = self
            .http_client_ca_file
            .as_deref()
            .map_or(ClientCerts::Off, ClientCerts::Required);
        server_config(&source, client).map(Some)
    }
}

/// The kernel PLEG's flags, shared by every subcommand that runs it.
#[derive(Args, Debug, Clone, PartialEq, Eq)]
pub struct KernelArgs {
    /// Load this eBPF object instead of the one embedded at build time.
    #[arg(long, env = "EVPLEG_BPF_OBJECT")]
    pub bpf_object: Option<PathBuf>,

    /// Root cgroups whose tasks and cgroups are reported (repeatable; paths
    /// relative to the cgroup hierarchy root).
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
}

impl KernelArgs {
    /// The kernel PLEG's configuration.
    pub fn config(&self) -> KernelPlegConfig {
        KernelPlegConfig {
            object: self.bpf_object.clone(),
            ring_buffer_bytes: self.ring_buffer_bytes,
            roots: self.cgroup_roots.clone(),
            realtime_priority: (self.realtime_priority > 0).then_some(self.realtime_priority),
            realtime_budget: Default::default(),
            tap: None,
        }
    }
}

/// `run`'s default listen address: the kubelet's read-only port.
pub const RUN_LISTEN: &str = "127.0.0.1:10255";
/// `observe`'s default listen address, clear of the kubelet's ports.
pub const OBSERVE_LISTEN: &str = "127.0.0.1:10265";

/// The host's name, lower-cased (`localhost` when unreadable): the default
/// node name and the Node's `Hostname` address.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_lowercase())
        .unwrap_or_else(|_| "localhost".into())
}

/// The CRI endpoint could not be found.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "no CRI runtime socket found (tried {tried}); pass --cri-endpoint unix:///path/to/runtime.sock"
)]
pub struct NoEndpoint {
    pub tried: String,
}

impl Common {
    /// The runtime's endpoint: the flag (`none`: no runtime), else the first
    /// of [`CRI_SOCKETS`] that exists under `root` (`/` on a node).
    pub fn endpoint(&self, root: &Path) -> Result<Option<String>, NoEndpoint> {
        match self.cri_endpoint.as_deref() {
            Some("none") => Ok(None),
            Some(e) => Ok(Some(e.to_owned())),
            None => CRI_SOCKETS
                .iter()
                .find(|s| {
                    use std::os::unix::fs::FileTypeExt;
                    std::fs::metadata(root.join(s.trim_start_matches('/')))
                        .is_ok_and(|m| m.file_type().is_socket())
                })
                .map(|s| Ok(Some(format!("unix://{s}"))))
                .unwrap_or_else(|| {
                    Err(NoEndpoint {
                        tried: CRI_SOCKETS.join(", "),
                    })
                }),
        }
    }

    /// The listen address, or `default` ([`RUN_LISTEN`], [`OBSERVE_LISTEN`]).
    pub fn listen_or(&self, default: &str) -> SocketAddr {
        self.listen
            .unwrap_or_else(|| default.parse().expect("the default addresses parse"))
    }
}

/// `evpleg observe`'s flags.
#[derive(Clone, Debug, clap::Args)]
pub struct ObserveArgs {
    #[command(flatten)]
    pub common: Common,

    /// How events are printed: `json` (one object per line) or `table` (a
    /// line per event in aligned columns, for a terminal).
    #[arg(long, env = "EVPLEG_OUTPUT", value_enum, default_value_t = OutputFormat::Json)]
    pub output: OutputFormat,

    /// Period of the comparison relist run alongside the PLEG (the kubelet's
    /// generic PLEG: 1s). Each event reports how much earlier the PLEG saw it.
    #[arg(long, env = "EVPLEG_COMPARE_PERIOD", default_value = "1s",
          value_parser = duration::positive)]
    pub compare_period: Duration,

    #[command(flatten)]
    pub http_tls: HttpTlsArgs,
}

/// `--output`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Json,
    Table,
}

/// `evpleg version`'s flags.
#[derive(Clone, Debug, clap::Args)]
pub struct VersionArgs {
    /// Print as one JSON object.
    #[arg(long)]
    pub json: bool,
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn cli(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("evpleg").chain(args.iter().copied()))
    }

    #[test]
    fn the_command_line_is_consistent_and_every_flag_has_help_and_an_env_var() {
        Cli::command().debug_assert();
        let root = Cli::command();
        // Nested subcommands (`describe pod`) too.
        let mut subs: Vec<clap::Command> = root.get_subcommands().cloned().collect();
        let mut i = 0;
        while i < subs.len() {
            let nested: Vec<clap::Command> = subs[i].get_subcommands().cloned().collect();
            subs.extend(nested);
            i += 1;
        }
        for sub in &subs {
            assert!(sub.get_about().is_some(), "{} has no help", sub.get_name());
            for arg in sub.get_arguments() {
                if matches!(arg.get_id().as_str(), "help" | "version") {
                    continue;
                }
                if arg.is_positional() {
                    assert!(
                        arg.get_help().is_some(),
                        "{} {} has no help",
                        sub.get_name(),
                        arg.get_id()
                    );
                    continue;
                }
                assert!(
                    arg.get_help().is_some(),
                    "{} --{} has no help",
                    sub.get_name(),
                    arg.get_id()
                );
                if sub.get_name() != "version" {
                    assert!(
                        arg.get_env().is_some(),
                        "{} --{} has no environment variable",
                        sub.get_name(),
                        arg.get_id()
                    );
                }
            }
        }
    }

    #[test]
    fn subcommands_and_their_defaults() {
        let Command::Run(run) = cli(&["run"]).unwrap().command else {
            panic!("run")
        };
        assert_eq!(
            run.common.kernel.cgroup_roots,
            ["/kubepods", "/kubepods.slice", "/k8s.io"]
        );
        assert_eq!(
            run.common.kernel.config().realtime_priority,
            Some(DEFAULT_REALTIME_PRIORITY)
        );
        assert_eq!(run.common.listen_or(RUN_LISTEN).port(), 10255);
        assert_eq!(run.sync_frequency, Duration::from_secs(60));
        let Command::Observe(obs) = cli(&[
            "--log-format",
            "json",
            "observe",
            "--cgroup-root",
            "/a,/b",
            "--realtime-priority",
            "0",
            "--output",
            "table",
        ])
        .unwrap()
        .command
        else {
            panic!("observe")
        };
        assert_eq!(obs.common.kernel.cgroup_roots, ["/a", "/b"]);
        assert_eq!(obs.common.kernel.config().realtime_priority, None);
        assert_eq!(obs.output, OutputFormat::Table);
        assert_eq!(obs.compare_period, Duration::from_secs(1));
        assert_eq!(obs.common.listen_or(OBSERVE_LISTEN).port(), 10265);
        // The global flag goes after the subcommand too.
        assert_eq!(
            cli(&["version", "--log-format", "json"])
                .unwrap()
                .log_format,
            LogFormat::Json
        );
        assert!(cli(&[]).is_err(), "a subcommand is required");
        let Command::Describe(d) = cli(&["describe", "pod", "web-1"]).unwrap().command else {
            panic!("describe")
        };
        let Describe::Pod(p) = d.what;
        assert_eq!(
            (p.pod.as_str(), p.server.as_str()),
            ("web-1", DESCRIBE_SERVER)
        );
        assert_eq!(p.namespace, None);
        assert!(cli(&["describe", "pod"]).is_err(), "the pod is required");
    }

    #[test]
    fn invalid_values_are_refused_with_a_message_naming_the_flag() {
        let cases: &[(&str, &str)] = &[
            ("--relist-period=0", "more than 0"),
            ("--relist-period=-1s", "negative"),
            ("--relist-period=1", "needs a unit"),
            ("--relist-period=9000h", "at most a year"),
            ("--sync-frequency=0s", "more than 0"),
            ("--crashloop-backoff-initial=-0.5s", "negative"),
            ("--crashloop-backoff-max=abc", "not a duration"),
            ("--event-channel=0", "at least 1"),
            ("--event-channel=-3", "not a capacity"),
            ("--ring-buffer-bytes=5000", "power of two"),
            ("--ring-buffer-bytes=0", "power of two"),
            ("--run-for=10", "needs a unit"),
        ];
        for (flag, want) in cases {
            let err = cli(&["run", flag]).expect_err(flag);
            let text = err.to_string();
            let name = flag.split('=').next().unwrap();
            assert!(text.contains(name) && text.contains(want), "{flag}: {text}");
        }
        let Command::Run(ok) = cli(&[
            "run",
            "--relist-period",
            "500ms",
            "--sync-frequency",
            "2s",
            "--event-channel",
            "1",
            "--ring-buffer-bytes",
            "8192",
        ])
        .unwrap()
        .command
        else {
            panic!("run")
        };
        assert_eq!(ok.common.relist_period, Some(Duration::from_millis(500)));
        assert_eq!(ok.sync_frequency, Duration::from_secs(2));
    }

    #[test]
    fn the_endpoint_is_the_flag_else_the_first_runtime_socket_found() {
        let root = tempfile::tempdir().unwrap();
        let common = |flag: Option<&str>| {
            let mut args = vec!["observe"];
            if let Some(f) = flag {
                args.extend(["--cri-endpoint", f]);
            }
            let Command::Observe(o) = cli(&args).unwrap().command else {
                panic!()
            };
            o.common
        };
        let err = common(None).endpoint(root.path()).unwrap_err();
        assert!(err.to_string().contains("/run/crio/crio.sock"), "{err}");
        assert_eq!(common(Some("none")).endpoint(root.path()), Ok(None));
        assert_eq!(
            common(Some("unix:///x.sock")).endpoint(root.path()),
            Ok(Some("unix:///x.sock".into()))
        );
        // A plain file is not a socket; a listening socket is.
        std::fs::create_dir_all(root.path().join("run/containerd")).unwrap();
        std::fs::write(root.path().join("run/containerd/containerd.sock"), "").unwrap();
        std::fs::create_dir_all(root.path().join("run/crio")).unwrap();
        let _listener =
            std::os::unix::net::UnixListener::bind(root.path().join("run/crio/crio.sock")).unwrap();
        assert_eq!(
            common(None).endpoint(root.path()),
            Ok(Some("unix:///run/crio/crio.sock".into()))
        );
    }
}
