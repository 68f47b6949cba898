//! The probe handlers, as the kubelet's `prober.go` (`runProbe`) and its
//! `pkg/probe` probers, with their messages (the `Unhealthy` event's text):
//!
//! * `exec` (`probe/exec`'s `Probe` over CRI `ExecSync`): exit code 0 is
//!   success; any other is a failure whose message is the command's output
//!   only, stdout then stderr (`RunInContainer`), at most 10 KiB; the
//!   runtime's timeout is a failure, `command timed out: "<cmd>" timed out
//!   after 1s` (cri-client's `ErrCommandTimedOut`); any other error of the
//!   runtime means the probe could not run ([`ProbeError`]);
//! * `httpGet` ([`super::http`]): 200 to 299 is success, 300 to 399 success
//!   with a warning;
//! * `tcpSocket` (`probe/tcp`'s `DoTCPProbe`): a connection is success; a
//!   failure says Go's dial error, `dial tcp <addr>: connect: connection
//!   refused` ([`dial_error`]);
//! * `grpc` (`probe/grpc`'s `Probe`): the health protocol's `Check` for the
//!   probe's service (SERVING is success), the connection retried, as Go's
//!   blocking dial, until the timeout: a server that never answers is
//!   `timeout: failed to connect service "<addr>" within 1s: context deadline
//!   exceeded`.
//!
//! Each is bounded by `timeoutSeconds`. A probe that could not be run (the
//! runtime did not answer) is an error: the worker tries it three times
//! (`runProbeWithRetries`), records `<Kind> probe errored and resulted in
//! unknown state: <error>` and throws its result away, as the kubelet does.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, HTTPGetAction, Probe};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

pub use super::http::Outcome;
use super::http::{Scheme, Target};
use crate::kuberuntime::backoff::go_duration;
use evpleg_core::ids::ContainerId;
use evpleg_cri::CriClient;

/// Why a probe could not run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProbeError {
    #[error("probe of container {container}: no handler (exec, httpGet, tcpSocket or grpc)")]
    NoHandler { container: String },
    #[error("probe of container {container}: port {port:?} is not a port of the container")]
    Port { container: String, port: String },
    /// The runtime could not run the command (its error as Go's gRPC client
    /// prints it, `rpc error: code = NotFound desc = ...`).
    #[error("{message}")]
    Exec { container: String, message: String },
}

/// The longest output of an exec probe kept for its message (the kubelet's
/// `maxReadLength`).
pub const MAX_EXEC_OUTPUT: usize = 10 * 1024;

/// A CRI error as Go's gRPC client prints it (`status.Error`'s text), which
/// the kubelet's messages carry.
pub fn go_rpc_error(e: &evpleg_cri::CriError) -> String {
    match e {
        evpleg_cri::CriError::Rpc { code, message, .. } => go_status(*code, message),
        other => other.to_string(),
    }
}

/// `rpc error: code = <Code> desc = <message>`.
fn go_status(code: tonic::Code, message: &str) -> String {
    let code = match code {
        tonic::Code::Ok => "OK".to_owned(),
        other => format!("{other:?}"),
    };
    format!("rpc error: code = {code} desc = {message}")
}

/// A failed TCP connection to `authority` (`host:port`) as Go's dialer says
/// it (`net.OpError`): `dial tcp <addr>: connect: connection refused`; the
/// system's error text without Rust's ` (os error N)`, lower-cased as Go's
/// errno strings are.
pub fn dial_error(authority: &str, e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(n) => {
            let text = std::io::Error::from_raw_os_error(n).to_string();
            let text = text
                .strip_suffix(&format!(" (os error {n})"))
                .unwrap_or(&text);
            let mut chars = text.chars();
            let text: String = match chars.next() {
                Some(first) => first.to_lowercase().chain(chars).collect(),
                None => String::new(),
            };
            format!("dial tcp {authority}: connect: {text}")
        }
        None if e.kind() == std::io::ErrorKind::TimedOut => {
            format!("dial tcp {authority}: i/o timeout")
        }
        None => format!("dial tcp {authority}: {e}"),
    }
}

/// `net.JoinHostPort`: an IPv6 host in brackets.
fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The message of an exec probe that exited non-zero: its output (stdout
/// then stderr, as `RunInContainer` joins them), at most
/// [`MAX_EXEC_OUTPUT`] bytes.
pub fn exec_output(stdout: &[u8], stderr: &[u8]) -> String {
    let mut out = [stdout, stderr].concat();
    out.truncate(MAX_EXEC_OUTPUT);
    String::from_utf8_lossy(&out).into_owned()
}

/// What the handlers need.
#[derive(Clone, Debug)]
pub struct Handlers {
    pub cri: CriClient,
    /// Where the probes go when they name no host: the node's IP, or the
    /// pod's ([`Handlers::at_pod`]).
    pub host_ip: String,
}

/// The probe's timeout (`timeoutSeconds`, 1 by default, at least 1).
pub fn timeout(probe: &Probe) -> Duration {
    Duration::from_secs(probe.timeout_seconds.unwrap_or(1).max(1) as u64)
}

/// A port by number, or by the name of one of the container's ports.
fn port(c: &Container, port: &IntOrString) -> Result<u16, ProbeError> {
    let bad = || ProbeError::Port {
        container: c.name.clone(),
        port: match port {
            IntOrString::Int(n) => n.to_string(),
            IntOrString::String(s) => s.clone(),
        },
    };
    match port {
        IntOrString::Int(n) => u16::try_from(*n).ok().filter(|p| *p > 0).ok_or_else(bad),
        IntOrString::String(name) => c
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name.as_str()))
            .and_then(|p| u16::try_from(p.container_port).ok())
            .or_else(|| name.parse().ok())
            .ok_or_else(bad),
    }
}

impl Handlers {
    /// These handlers aimed at the pod, as the kubelet aims a probe without a
    /// host at the pod's IP: the node's for a host-network pod, else the
    /// pod's first IP (empty while it has none, and the probe fails, as the
    /// kubelet's).
    pub fn at_pod(&self, pod: &k8s_openapi::api::core::v1::Pod, pod_ips: &[String]) -> Handlers {
        let host_network = pod.spec.as_ref().and_then(|s| s.host_network) == Some(true);
        Handlers {
            cri: self.cri.clone(),
            host_ip: if host_network {
                self.host_ip.clone()
            } else {
                pod_ips.first().cloned().unwrap_or_default()
            },
        }
    }

    /// The request of an httpGet action (a probe's or a hook's), as the
    /// kubelet's `NewRequestForHTTPGetAction`: its scheme (`HTTP` by
    /// default), host (else where these handlers aim), port by number or
    /// name, path (`/` by default) and headers.
    pub fn http_request(
        &self,
        c: &Container,
        http: &HTTPGetAction,
    ) -> Result<(Target, Vec<(String, String)>), ProbeError> {
        let path = http.path.as_deref().unwrap_or("/");
        let target = Target {
            scheme: Scheme::parse(http.scheme.as_deref()),
            host: http
                .host
                .clone()
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| self.host_ip.clone()),
            port: port(c, &http.port)?,
            path: if path.starts_with('/') {
                path.to_owned()
            } else {
                format!("/{path}")
            },
        };
        let headers = http
            .http_headers
            .iter()
            .flatten()
            .map(|h| (h.name.clone(), h.value.clone()))
            .collect();
        Ok((target, headers))
    }

    /// Runs `probe` against the container once: the outcome, with what
    /// failed or warned (the kubelet's probe output, for its event).
    pub async fn run(
        &self,
        c: &Container,
        id: &ContainerId,
        probe: &Probe,
    ) -> Result<Outcome, ProbeError> {
        let ok = |r: Result<(), String>| match r {
            Ok(()) => Outcome::Success,
            Err(why) => Outcome::Failure(why),
        };
        let limit = timeout(probe);
        if let Some(exec) = &probe.exec {
            let cmd: Vec<&str> = exec.command.iter().flatten().map(String::as_str).collect();
            return match self.cri.exec_sync(id.as_str(), &cmd, limit).await {
                Ok(r) if r.exit_code == 0 => Ok(ok(Ok(()))),
                Ok(r) => Ok(ok(Err(exec_output(&r.stdout, &r.stderr)))),
                // The runtime's own timeout: the kubelet counts it a failure,
                // with cri-client's `ErrCommandTimedOut`.
                Err(e)
                    if e.code() == Some(tonic::Code::DeadlineExceeded)
                        || e.to_string().contains("timeout") =>
                {
                    Ok(ok(Err(format!(
                        "command timed out: {:?} timed out after {}",
                        cmd.join(" "),
                        go_duration(limit)
                    ))))
                }
                Err(e) => Err(ProbeError::Exec {
                    container: c.name.clone(),
                    message: go_rpc_error(&e),
                }),
            };
        }
        if let Some(http) = &probe.http_get {
            let (target, headers) = self.http_request(c, http)?;
            let url = target.url();
            return Ok(
                match tokio::time::timeout(limit, super::http::probe(target, &headers)).await {
                    Ok(outcome) => outcome,
                    Err(_) => Outcome::Failure(format!(
                        "Get \"{url}\": context deadline exceeded (Client.Timeout exceeded while awaiting headers)"
                    )),
                },
            );
        }
        if let Some(grpc) = &probe.grpc {
            let port = u16::try_from(grpc.port)
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| ProbeError::Port {
                    container: c.name.clone(),
                    port: grpc.port.to_string(),
                })?;
            let service = grpc.service.clone().unwrap_or_default();
            let why = grpc_check(&self.host_ip, port, service, limit).await;
            return Ok(ok(why));
        }
        if let Some(tcp) = &probe.tcp_socket {
            let host = (tcp.host.clone())
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| self.host_ip.clone());
            let port = port(c, &tcp.port)?;
            let addr = join_host_port(&host, port);
            let connect = tokio::net::TcpStream::connect((host.as_str(), port));
            return Ok(ok(match tokio::time::timeout(limit, connect).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(dial_error(&addr, &e)),
                Err(_) => Err(format!("dial tcp {addr}: i/o timeout")),
            }));
        }
        Err(ProbeError::NoHandler {
            container: c.name.clone(),
        })
    }
}

/// The gRPC health protocol's `Check` (`grpc.health.v1`) of `service`
/// (empty: the server), as the kubelet's `probe/grpc`: one deadline, `limit`,
/// for the connection and the call; the connection is tried again until then
/// (Go's blocking dial), so a server that refuses or never answers fails at
/// the deadline. `Ok` when SERVING, else the kubelet's failure message.
async fn grpc_check(host: &str, port: u16, service: String, limit: Duration) -> Result<(), String> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let addr = join_host_port(host, port);
    let deadline = tokio::time::Instant::now() + limit;
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| format!("error: failed to connect service at {addr:?}: {e}"))?
        .user_agent(concat!("kube-probe/evpleg-", env!("CARGO_PKG_VERSION")))
        .map_err(|e| format!("error: failed to connect service at {addr:?}: {e}"))?;
    let connect = async {
        loop {
            match endpoint.connect().await {
                Ok(channel) => return channel,
                Err(e) => {
                    tracing::debug!(addr, error = %e, "grpc probe: not connected yet");
                    tokio::time::sleep(GRPC_REDIAL).await;
                }
            }
        }
    };
    let Ok(channel) = tokio::time::timeout_at(deadline, connect).await else {
        return Err(format!(
            "timeout: failed to connect service {addr:?} within {}: context deadline exceeded",
            go_duration(limit)
        ));
    };
    let mut client = HealthClient::new(channel);
    let check = client.check(HealthCheckRequest { service });
    let response = match tokio::time::timeout_at(deadline, check).await {
        Ok(Ok(r)) => r.into_inner(),
        Ok(Err(s)) if s.code() == tonic::Code::Unimplemented => {
            return Err(format!(
                "error: this server does not implement the grpc health protocol (grpc.health.v1.Health): {}",
                s.message()
            ));
        }
        Ok(Err(s)) if s.code() == tonic::Code::DeadlineExceeded => {
            return Err(format!(
                "timeout: health rpc did not complete within {}",
                go_duration(limit)
            ));
        }
        Ok(Err(s)) => {
            return Err(format!(
                "error: health rpc probe failed: {}",
                go_status(s.code(), s.message())
            ));
        }
        Err(_) => {
            return Err(format!(
                "timeout: health rpc did not complete within {}",
                go_duration(limit)
            ));
        }
    };
    match ServingStatus::try_from(response.status) {
        Ok(ServingStatus::Serving) => Ok(()),
        status => Err(format!(
            "service unhealthy (responded with {:?})",
            status.map_or("UNKNOWN", |s| s.as_str_name())
        )),
    }
}

/// How long a gRPC probe waits before dialling again within its deadline.
const GRPC_REDIAL: Duration = Duration::from_millis(100);

#[cfg(test)]
mod tests {
    use super::*;

    /// Go's dial errors: the system's text without Rust's `(os error N)`,
    /// lower-cased; an IPv6 address in brackets.
    #[test]
    fn dial_errors_read_as_go_s() {
        let cases = [
            (
                "127.0.0.1:80",
                std::io::Error::from_raw_os_error(111), // ECONNREFUSED
                "dial tcp 127.0.0.1:80: connect: connection refused",
            ),
            (
                "[::1]:80",
                std::io::Error::from_raw_os_error(113), // EHOSTUNREACH
                "dial tcp [::1]:80: connect: no route to host",
            ),
            (
                "10.0.0.1:80",
                std::io::Error::from(std::io::ErrorKind::TimedOut),
                "dial tcp 10.0.0.1:80: i/o timeout",
            ),
        ];
        for (addr, e, want) in cases {
            assert_eq!(dial_error(addr, &e), want, "{e:?}");
        }
        assert_eq!(join_host_port("::1", 80), "[::1]:80");
    }

    /// An exec probe's message is its output only, stdout then stderr, at
    /// most 10 KiB; a runtime error reads as Go's gRPC error.
    #[test]
    fn exec_messages_are_the_output_only() {
        let cases: [(&[u8], &[u8], String); 3] = [
            (b"", b"", String::new()),
            (b"out\n", b"err\n", "out\nerr\n".to_owned()),
            (&[b'x'; 12 * 1024], b"lost", "x".repeat(MAX_EXEC_OUTPUT)),
        ];
        for (stdout, stderr, want) in cases {
            assert_eq!(exec_output(stdout, stderr), want);
        }
        let e = evpleg_cri::CriError::from_status(
            "ExecSync",
            evpleg_cri::Target::Container("c".into()),
            &tonic::Status::not_found("failed to exec in container: task c not found"),
        );
        assert_eq!(
            go_rpc_error(&e),
            "rpc error: code = NotFound desc = failed to exec in container: task c not found"
        );
        let e = ProbeError::Exec {
            container: "app".into(),
            message: go_rpc_error(&e),
        };
        assert_eq!(
            super::super::worker::errored_event(super::super::ProbeKind::Readiness, &e).1,
            "Readiness probe errored and resulted in unknown state: rpc error: code = NotFound desc = failed to exec in container: task c not found"
        );
    }

    /// A TCP and a gRPC probe of a port nothing listens on fail with the
    /// kubelet's messages; the gRPC one only at its timeout (Go's blocking
    /// dial tries again until then).
    #[tokio::test]
    async fn tcp_and_grpc_probes_of_a_closed_port_fail_as_the_kubelet_s() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let handlers = Handlers {
            cri: evpleg_cri::CriClient::connect_unchecked(
                "unix:///nonexistent/evpleg-test.sock",
                evpleg_cri::CriClientConfig::default(),
            )
            .await
            .unwrap(),
            host_ip: "127.0.0.1".into(),
        };
        let c = Container {
            name: "app".into(),
            ..Container::default()
        };
        let id = ContainerId::parse(&"c".repeat(64)).unwrap();
        let tcp: Probe = serde_json::from_value(serde_json::json!({
            "tcpSocket": {"port": port}
        }))
        .unwrap();
        let grpc: Probe = serde_json::from_value(serde_json::json!({
            "grpc": {"port": port}, "timeoutSeconds": 1
        }))
        .unwrap();
        let cases = [
            (
                tcp,
                format!("dial tcp 127.0.0.1:{port}: connect: connection refused"),
                Duration::ZERO,
            ),
            (
                grpc,
                format!(
                    "timeout: failed to connect service \"127.0.0.1:{port}\" within 1s: context deadline exceeded"
                ),
                Duration::from_millis(900),
            ),
        ];
        for (probe, want, at_least) in cases {
            let started = std::time::Instant::now();
            let got = handlers.run(&c, &id, &probe).await;
            assert_eq!(got, Ok(Outcome::Failure(want)));
            assert!(started.elapsed() >= at_least, "{:?}", started.elapsed());
        }
    }

    #[test]
    fn ports_by_number_or_name() {
        let c: Container = serde_json::from_value(serde_json::json!({
            "name": "app", "ports": [{"name": "http", "containerPort": 8080}]
        }))
        .unwrap();
        assert_eq!(port(&c, &IntOrString::Int(80)), Ok(80));
        assert_eq!(port(&c, &IntOrString::String("http".into())), Ok(8080));
        assert_eq!(port(&c, &IntOrString::String("9090".into())), Ok(9090));
        let err = port(&c, &IntOrString::String("grpc".into())).unwrap_err();
        assert_eq!(
            err.to_string(),
            "probe of container app: port \"grpc\" is not a port of the container"
        );
        assert!(port(&c, &IntOrString::Int(0)).is_err());
        assert!(port(&c, &IntOrString::Int(70000)).is_err());
    }
}
