//! The probe handlers, as the kubelet's `prober.go`: `exec` runs the command in
//! the container (CRI `ExecSync`, exit code 0 is success, a timeout is a
//! failure), `httpGet` asks `http://host:port/path` (or `https://`, by its
//! `scheme`) with the probe's headers ([`super::http`]: 200 to 299 is
//! success, 300 to 399 success with a warning),
//! `tcpSocket` opens a connection, and `grpc` asks the gRPC health protocol's
//! `Check` for the probe's service (SERVING is success). Each is bounded by `timeoutSeconds`. A
//! probe that could not be run (the runtime did not answer) is an error, and
//! the worker throws its result away, as the kubelet does.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, HTTPGetAction, Probe};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

pub use super::http::Outcome;
use super::http::{Scheme, Target};
use evpleg_core::ids::ContainerId;
use evpleg_cri::CriClient;

/// Why a probe could not run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProbeError {
    #[error("probe of container {container}: no handler (exec, httpGet, tcpSocket or grpc)")]
    NoHandler { container: String },
    #[error("probe of container {container}: port {port:?} is not a port of the container")]
    Port { container: String, port: String },
    #[error("exec probe of container {container} failed (retryable): {message}")]
    Exec { container: String, message: String },
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
                Ok(r) => Ok(ok(Err(format!(
                    "command {:?} exited with {}: {}",
                    cmd.join(" "),
                    r.exit_code,
                    String::from_utf8_lossy(&r.stdout).trim()
                )))),
                // The runtime's own timeout: the kubelet counts it a failure.
                Err(e)
                    if e.code() == Some(tonic::Code::DeadlineExceeded)
                        || e.to_string().contains("timeout") =>
                {
                    Ok(ok(Err(format!("command timed out after {limit:?}"))))
                }
                Err(e) => Err(ProbeError::Exec {
                    container: c.name.clone(),
                    message: e.to_string(),
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
            let check = grpc_check(&self.host_ip, port, service, limit);
            return Ok(ok(match tokio::time::timeout(limit, check).await {
                Ok(Ok(true)) => Ok(()),
                Ok(Ok(false)) => Err("service unhealthy (responded with \"NOT_SERVING\")".into()),
                Ok(Err(e)) => Err(format!("rpc error: {}", e.message())),
                Err(_) => Err(format!(
                    "timeout: health rpc did not complete within {limit:?}"
                )),
            }));
        }
        if let Some(tcp) = &probe.tcp_socket {
            let host = tcp.host.clone().unwrap_or_else(|| self.host_ip.clone());
            let port = port(c, &tcp.port)?;
            let connect = tokio::net::TcpStream::connect((host.as_str(), port));
            return Ok(ok(match tokio::time::timeout(limit, connect).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(format!("dial tcp {host}:{port}: {e}")),
                Err(_) => Err(format!("dial tcp {host}:{port}: i/o timeout")),
            }));
        }
        Err(ProbeError::NoHandler {
            container: c.name.clone(),
        })
    }
}

/// The gRPC health protocol's `Check` (`grpc.health.v1`): whether the
/// service (empty: the server) is SERVING.
async fn grpc_check(
    host: &str,
    port: u16,
    service: String,
    limit: Duration,
) -> Result<bool, tonic::Status> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{host}:{port}"))
        .map_err(|e| tonic::Status::invalid_argument(e.to_string()))?
        .connect_timeout(limit)
        .timeout(limit)
        .user_agent(concat!("kube-probe/evpleg-", env!("CARGO_PKG_VERSION")))
        .map_err(|e| tonic::Status::invalid_argument(e.to_string()))?;
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let response = HealthClient::new(channel)
        .check(HealthCheckRequest { service })
        .await?;
    Ok(response.into_inner().status == ServingStatus::Serving as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

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
