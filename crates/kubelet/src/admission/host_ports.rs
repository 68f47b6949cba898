//! Host ports: the kubelet's admission re-runs the scheduler's NodePorts
//! filter (`lifecycle/predicate.go`, `nodeports`), so two admitted pods never
//! ask for the same host port; a pod that would is rejected with reason
//! `NodePorts`. The same list of ports becomes the sandbox's port mappings
//! (`generatePodSandboxConfig`).
//!
//! As the API server's defaulting (and the kubelet's for static pods), a
//! host-network pod's port without a `hostPort` uses its `containerPort`.

use k8s_openapi::api::core::v1::Pod;

/// The reason of a pod refused because a host port it asks for is taken.
pub const NODE_PORTS_REASON: &str = "NodePorts";

/// The message that goes with it (the kubelet's `PredicateFailureError`).
pub const NODE_PORTS_MESSAGE: &str =
    "Predicate NodePorts failed: node(s) didn't have free ports for the requested pod ports";

/// One port of one of the pod's containers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodPort {
    /// `TCP`, `UDP` or `SCTP`.
    pub protocol: String,
    pub container_port: i32,
    /// 0 when the port is not published on the host.
    pub host_port: i32,
    /// Empty: every address.
    pub host_ip: String,
}

impl PodPort {
    /// Whether two published ports cannot both be bound.
    pub fn conflicts_with(&self, other: &PodPort) -> bool {
        let any = |ip: &str| ip.is_empty() || ip == "0.0.0.0" || ip == "::";
        self.host_port != 0
            && self.host_port == other.host_port
            && self.protocol == other.protocol
            && (any(&self.host_ip) || any(&other.host_ip) || self.host_ip == other.host_ip)
    }
}

/// The ports of the pod's app containers and sidecars (init containers with
/// `restartPolicy: Always`, which keep running), defaulted.
pub fn pod_ports(pod: &Pod) -> Vec<PodPort> {
    let Some(spec) = &pod.spec else {
        return Vec::new();
    };
    let host_network = spec.host_network.unwrap_or(false);
    let sidecars = spec
        .init_containers
        .iter()
        .flatten()
        .filter(|c| c.restart_policy.as_deref() == Some("Always"));
    sidecars
        .chain(spec.containers.iter())
        .flat_map(|c| c.ports.iter().flatten())
        .map(|p| PodPort {
            protocol: p.protocol.clone().unwrap_or_else(|| "TCP".into()),
            container_port: p.container_port,
            host_port: match p.host_port {
                Some(h) if h != 0 => h,
                _ if host_network => p.container_port,
                _ => 0,
            },
            host_ip: p.host_ip.clone().unwrap_or_default(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(host_network: bool, ports: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "spec": {"hostNetwork": host_network,
                     "initContainers": [{"name": "s", "restartPolicy": "Always", "ports": [{"containerPort": 9000}]},
                                        {"name": "i", "ports": [{"containerPort": 9001}]}],
                     "containers": [{"name": "a", "ports": ports}]}
        }))
        .unwrap()
    }

    #[test]
    fn ports_are_defaulted_as_the_api_server_does() {
        let p = pod(
            true,
            serde_json::json!([{"containerPort": 80}, {"containerPort": 53, "protocol": "UDP"}]),
        );
        let ports: Vec<_> = pod_ports(&p)
            .into_iter()
            .map(|p| (p.protocol, p.container_port, p.host_port))
            .collect();
        assert_eq!(
            ports,
            [
                ("TCP".into(), 9000, 9000),
                ("TCP".into(), 80, 80),
                ("UDP".into(), 53, 53)
            ],
            "sidecar ports count, a plain init container's do not"
        );
        let p = pod(
            false,
            serde_json::json!([{"containerPort": 80}, {"containerPort": 81, "hostPort": 8081}]),
        );
        let hosts: Vec<_> = pod_ports(&p).iter().map(|p| p.host_port).collect();
        assert_eq!(hosts, [0, 0, 8081]);
    }

    #[test]
    fn conflicts_need_the_same_port_protocol_and_overlapping_address() {
        let port = |proto: &str, host: i32, ip: &str| PodPort {
            protocol: proto.into(),
            container_port: 1,
            host_port: host,
            host_ip: ip.into(),
        };
        let table = [
            (port("TCP", 80, ""), port("TCP", 80, ""), true),
            (port("TCP", 80, ""), port("UDP", 80, ""), false),
            (port("TCP", 80, ""), port("TCP", 81, ""), false),
            (
                port("TCP", 80, "0.0.0.0"),
                port("TCP", 80, "10.0.0.1"),
                true,
            ),
            (
                port("TCP", 80, "10.0.0.2"),
                port("TCP", 80, "10.0.0.1"),
                false,
            ),
            (
                port("TCP", 80, "10.0.0.1"),
                port("TCP", 80, "10.0.0.1"),
                true,
            ),
            (port("TCP", 0, ""), port("TCP", 0, ""), false),
        ];
        for (a, b, want) in table {
            assert_eq!(a.conflicts_with(&b), want, "{a:?} {b:?}");
            assert_eq!(b.conflicts_with(&a), want, "{b:?} {a:?}");
        }
    }
}
