//! `evpleg cri-proxy`'s flags (see [`evpleg_cri_proxy`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::{KernelArgs, channel_capacity, duration};

/// The CRI socket the proxy serves by default.
pub const CRI_PROXY_SOCKET: &str = "unix:///run/evpleg/cri.sock";
/// The proxy's HTTP endpoints by default, clear of the kubelet's and `observe`'s.
pub const CRI_PROXY_HTTP: &str = "127.0.0.1:10266";

/// `evpleg cri-proxy`'s flags.
#[derive(Clone, Debug, clap::Args)]
pub struct CriProxyArgs {
    /// The socket the proxy serves the CRI on (unix only: `unix:///path`);
    /// point the kubelet's `--container-runtime-endpoint` at it.
    #[arg(long, env = "EVPLEG_CRI_PROXY_LISTEN", default_value = CRI_PROXY_SOCKET,
          value_parser = unix_socket)]
    pub listen: PathBuf,

    /// The runtime's CRI socket the proxy forwards to (unix only:
    /// `unix:///run/containerd/containerd.sock`).
    #[arg(long, env = "EVPLEG_RUNTIME_ENDPOINT", value_parser = unix_socket)]
    pub runtime_endpoint: PathBuf,

    /// Permission bits of the served socket, in octal.
    #[arg(long, env = "EVPLEG_SOCKET_MODE", default_value = "0660", value_parser = octal_mode)]
    pub socket_mode: u32,

    /// Owner of the served socket, `UID:GID` (numeric); default: the
    /// proxy's own user and group.
    #[arg(long, env = "EVPLEG_SOCKET_OWNER", value_parser = owner)]
    pub socket_owner: Option<(u32, u32)>,

    /// Show a container whose death the kernel saw with certainty as exited in
    /// ListContainers, ContainerStatus and PodSandboxStatus answers while the
    /// runtime still says running (`--overlay=false`: forward them unchanged).
    #[arg(long, env = "EVPLEG_OVERLAY", default_value_t = true, action = clap::ArgAction::Set)]
    pub overlay: bool,

    /// Also subscribe to the runtime's own GetContainerEvents stream
    /// (containerd >= 1.7) and pass on its events the proxy did not serve
    /// (a container created or removed by another client, a death the kernel
    /// missed); an event the proxy served already is suppressed, so none is
    /// served twice. A runtime without a stream (containerd 1.6) is logged
    /// once and the proxy goes on alone.
    #[arg(long, env = "EVPLEG_MERGE_RUNTIME_EVENTS", default_value_t = false,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub merge_runtime_events: bool,

    /// Events buffered for each GetContainerEvents subscriber; a subscriber
    /// this far behind is dropped (its stream ends with RESOURCE_EXHAUSTED).
    #[arg(long, env = "EVPLEG_SUBSCRIBER_BUFFER", default_value_t = 1000,
          value_parser = channel_capacity)]
    pub subscriber_buffer: usize,

    /// Address of the HTTP endpoints (/metrics, /healthz, /readyz).
    #[arg(long, env = "EVPLEG_HTTP_LISTEN", default_value = CRI_PROXY_HTTP)]
    pub http_listen: SocketAddr,

    #[command(flatten)]
    pub http: super::HttpArgs,

    #[command(flatten)]
    pub http_tls: super::HttpTlsArgs,

    /// Full relist period of the proxy's PLEG (its reconciling relist).
    #[arg(long, env = "EVPLEG_RELIST_PERIOD", value_parser = duration::positive)]
    pub relist_period: Option<Duration>,

    #[command(flatten)]
    pub kernel: KernelArgs,

    /// Stop after this long (`0`: run until SIGTERM or SIGINT).
    #[arg(long, env = "EVPLEG_RUN_FOR", default_value = "0", value_parser = duration::parse)]
    pub run_for: Duration,
}

/// `unix:///absolute/path` to the path; anything else (TCP included: the
/// CRI has no authentication) is refused.
fn unix_socket(s: &str) -> Result<PathBuf, String> {
    let path = s
        .strip_prefix("unix://")
        .ok_or_else(|| format!("{s:?}: only unix:///path sockets are served and dialled"))?;
    if !path.starts_with('/') {
        return Err(format!("{s:?}: the socket path must be absolute"));
    }
    Ok(PathBuf::from(path))
}

fn octal_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{s:?}: permission bits in octal (0600, 0660)"))
}

fn owner(s: &str) -> Result<(u32, u32), String> {
    let bad = || format!("{s:?}: numeric UID:GID (0:0)");
    let (u, g) = s.split_once(':').ok_or_else(bad)?;
    Ok((u.parse().map_err(|_| bad())?, g.parse().map_err(|_| bad())?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_flags_are_checked() {
        assert_eq!(
            unix_socket("unix:///a/b.sock").unwrap(),
            PathBuf::from("/a/b.sock")
        );
        assert!(
            unix_socket("tcp://127.0.0.1:1")
                .unwrap_err()
                .contains("only unix")
        );
        assert!(
            unix_socket("unix://rel.sock")
                .unwrap_err()
                .contains("absolute")
        );
        assert_eq!(octal_mode("0660"), Ok(0o660));
        assert!(octal_mode("1777").is_err());
        assert!(octal_mode("rw").is_err());
        assert_eq!(owner("0:995"), Ok((0, 995)));
        assert!(owner("root:root").is_err());
    }

    /// `--merge-runtime-events`: off by default, a switch, or `=true|false`.
    #[test]
    fn merge_runtime_events_is_a_switch_that_takes_a_value() {
        use clap::Parser;
        let parse = |extra: &[&str]| {
            let argv = [
                "evpleg",
                "cri-proxy",
                "--runtime-endpoint",
                "unix:///r.sock",
            ]
            .into_iter()
            .chain(extra.iter().copied());
            match crate::config::Cli::try_parse_from(argv).map(|c| c.command) {
                Ok(crate::config::Command::CriProxy(a)) => Ok(a.merge_runtime_events),
                Ok(_) => panic!("not cri-proxy"),
                Err(e) => Err(e.kind()),
            }
        };
        assert_eq!(parse(&[]), Ok(false));
        assert_eq!(parse(&["--merge-runtime-events"]), Ok(true));
        assert_eq!(parse(&["--merge-runtime-events=true"]), Ok(true));
        assert_eq!(parse(&["--merge-runtime-events=false"]), Ok(false));
        assert_eq!(
            parse(&["--merge-runtime-events=maybe"]),
            Err(clap::error::ErrorKind::InvalidValue)
        );
    }
}
