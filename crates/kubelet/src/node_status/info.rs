//! What the Node's status says about the node beside its conditions, as the
//! kubelet's `nodestatus` setters `NodeAddress`, `MachineInfo`'s `nodeInfo`
//! (`VersionInfo`, `ReadyCondition`'s neighbours) and `daemonEndpoints`:
//! the addresses (`InternalIP` the node IP, `Hostname` the host name), the
//! kubelet server's port (where the API server sends `kubectl logs` and
//! the like), and the system's identity: kernel (`/proc/sys/kernel/osrelease`),
//! OS image (`PRETTY_NAME` of `/etc/os-release`), machine and boot ids, the
//! runtime as `<name>://<version>`, the agent's version as the kubelet's.
//!
//! Differences: `kubeletVersion` and `kubeProxyVersion` name evpleg
//! (`v<version>-evpleg`); no `ExternalIP` or cloud addresses; no images.

use k8s_openapi::api::core::v1::{
    DaemonEndpoint, NodeAddress, NodeDaemonEndpoints, NodeSystemInfo,
};

/// What [`super::run`] writes beside the conditions.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeIdentity {
    /// `InternalIP`.
    pub internal_ip: String,
    /// `Hostname`.
    pub hostname: String,
    /// The kubelet server's port, when it serves.
    pub kubelet_port: Option<u16>,
    pub system: NodeSystemInfo,
}

/// The agent's version as the Node shows it.
pub fn agent_version() -> String {
    format!("v{}-evpleg", env!("CARGO_PKG_VERSION"))
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// The OS image: `PRETTY_NAME` of os-release text.
pub fn os_image(os_release: &str) -> String {
    os_release
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map(|v| v.trim().trim_matches('"').to_owned())
        .unwrap_or_else(|| "Linux".into())
}

/// This host's identity, with the runtime `runtime_name` `runtime_version`.
pub fn system_info(runtime_name: &str, runtime_version: &str) -> NodeSystemInfo {
    NodeSystemInfo {
        architecture: crate::admission::node::go_arch().into(),
        boot_id: read_trimmed("/proc/sys/kernel/random/boot_id"),
        container_runtime_version: format!("{runtime_name}://{runtime_version}"),
        kernel_version: read_trimmed("/proc/sys/kernel/osrelease"),
        kube_proxy_version: agent_version(),
        kubelet_version: agent_version(),
        machine_id: read_trimmed("/etc/machine-id"),
        operating_system: "linux".into(),
        os_image: os_image(&std::fs::read_to_string("/etc/os-release").unwrap_or_default()),
        system_uuid: read_trimmed("/sys/class/dmi/id/product_uuid"),
        ..NodeSystemInfo::default()
    }
}

impl NodeIdentity {
    /// The status's addresses.
    pub fn addresses(&self) -> Vec<NodeAddress> {
        [
            ("InternalIP", &self.internal_ip),
            ("Hostname", &self.hostname),
        ]
        .into_iter()
        .filter(|(_, a)| !a.is_empty())
        .map(|(kind, a)| NodeAddress {
            type_: kind.into(),
            address: a.clone(),
        })
        .collect()
    }

    /// The status's daemon endpoints.
    pub fn daemon_endpoints(&self) -> NodeDaemonEndpoints {
        NodeDaemonEndpoints {
            kubelet_endpoint: self
                .kubelet_port
                .map(|p| DaemonEndpoint { port: i32::from(p) }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_identity_as_the_status_shows_it() {
        let id = NodeIdentity {
            internal_ip: "10.0.0.7".into(),
            hostname: "node-7".into(),
            kubelet_port: Some(10250),
            system: system_info("containerd", "1.7.24"),
        };
        let v = serde_json::json!({
            "addresses": id.addresses(),
            "daemonEndpoints": id.daemon_endpoints(),
            "nodeInfo": id.system,
        });
        assert_eq!(
            v["addresses"][0],
            serde_json::json!({"type": "InternalIP", "address": "10.0.0.7"})
        );
        assert_eq!(
            v["addresses"][1],
            serde_json::json!({"type": "Hostname", "address": "node-7"})
        );
        assert_eq!(v["daemonEndpoints"]["kubeletEndpoint"]["Port"], 10250);
        assert_eq!(
            v["nodeInfo"]["containerRuntimeVersion"],
            "containerd://1.7.24"
        );
        assert_eq!(v["nodeInfo"]["kubeletVersion"], agent_version());
        assert_eq!(v["nodeInfo"]["operatingSystem"], "linux");
        assert_eq!(
            v["nodeInfo"]["kernelVersion"],
            std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap()
                .trim()
        );
        assert_eq!(
            os_image("NAME=x\nPRETTY_NAME=\"Debian GNU/Linux 13 (trixie)\"\n"),
            "Debian GNU/Linux 13 (trixie)"
        );
        let none = NodeIdentity::default();
        assert!(none.addresses().is_empty());
        assert_eq!(none.daemon_endpoints().kubelet_endpoint, None);
    }
}
