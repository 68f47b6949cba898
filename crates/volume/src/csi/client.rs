//! The CSI node client: the kubelet's `csiDriverClient` (`csi_client.go`).
//!
//! Reproduces: the driver's endpoint is the unix socket it registered (a bare
//! path, or `unix://` + path); every call has the kubelet's deadline
//! (`csiTimeout`, 2 min, here [`CsiClientConfig::call_timeout`]), sent as
//! `grpc-timeout` and enforced locally; `NodeGetCapabilities` is asked before
//! staging (`hasStageUnstageCapability`). Differs: one lazily made
//! connection per driver, kept and remade by tonic, where the kubelet dials
//! a new connection for every operation.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use evpleg_csi_api::v1;
use evpleg_csi_api::v1::identity_client::IdentityClient;
use evpleg_csi_api::v1::node_client::NodeClient;
use tonic::transport::{Channel, Endpoint};

use super::error::{CsiError, Result};
use super::metrics::CsiMetrics;

/// Deadlines of the CSI client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CsiClientConfig {
    /// Every call's deadline: the kubelet's `csiTimeout` (2 min).
    pub call_timeout: Duration,
    /// Making the connection.
    pub connect_timeout: Duration,
}

impl Default for CsiClientConfig {
    fn default() -> Self {
        Self {
            call_timeout: Duration::from_secs(120),
            connect_timeout: Duration::from_secs(5),
        }
    }
}

/// What a driver's node service can do (`NodeGetCapabilities`), the parts
/// the volume plugin uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeCapabilities {
    /// `STAGE_UNSTAGE_VOLUME`: NodeStageVolume before publishing.
    pub stage_unstage: bool,
}

/// `NodeGetInfo`'s answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    pub node_id: String,
    pub max_volumes_per_node: i64,
    pub topology: HashMap<String, String>,
}

/// A client of one CSI driver's Identity and Node services. Cheap to clone.
#[derive(Clone, Debug)]
pub struct CsiClient {
    driver: Arc<str>,
    endpoint: PathBuf,
    node: NodeClient<Channel>,
    identity: IdentityClient<Channel>,
    config: CsiClientConfig,
    metrics: Arc<CsiMetrics>,
}

/// The socket path of a registered endpoint: `unix:///path` or `/path`.
pub fn socket_path(driver: &str, endpoint: &str) -> Result<PathBuf> {
    let path = endpoint.strip_prefix("unix://").unwrap_or(endpoint);
    if path.starts_with('/') {
        Ok(PathBuf::from(path))
    } else {
        Err(CsiError::InvalidEndpoint {
            driver: driver.to_owned(),
            endpoint: endpoint.to_owned(),
        })
    }
}

impl CsiClient {
    /// A client of `driver` at the unix socket `endpoint`; the connection is
    /// made by the first call. Its calls are observed in `metrics`.
    pub fn new(
        driver: &str,
        endpoint: &Path,
        config: CsiClientConfig,
        metrics: Arc<CsiMetrics>,
    ) -> Result<Self> {
        let channel = Endpoint::from_shared(format!("unix://{}", endpoint.display()))
            .map_err(|_| CsiError::InvalidEndpoint {
                driver: driver.to_owned(),
                endpoint: endpoint.display().to_string(),
            })?
            .connect_timeout(config.connect_timeout)
            .connect_lazy();
        Ok(Self {
            driver: Arc::from(driver),
            endpoint: endpoint.to_owned(),
            node: NodeClient::new(channel.clone()),
            identity: IdentityClient::new(channel),
            config,
            metrics,
        })
    }

    pub fn driver(&self) -> &str {
        &self.driver
    }

    pub fn endpoint(&self) -> &Path {
        &self.endpoint
    }

    /// Runs one call with the deadline, mapping its failure.
    async fn call<T, F>(
        &self,
        method: &'static str,
        volume: &str,
        call: impl FnOnce(Duration) -> F,
    ) -> Result<T>
    where
        F: Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    {
        let after = self.config.call_timeout;
        let start = std::time::Instant::now();
        let result = tokio::time::timeout(after, call(after)).await;
        let code = match &result {
            Ok(Ok(_)) => tonic::Code::Ok,
            Ok(Err(s)) => s.code(),
            Err(_) => tonic::Code::DeadlineExceeded,
        };
        self.metrics
            .observe(&self.driver, method, code, start.elapsed().as_secs_f64());
        match result {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) if s.code() == tonic::Code::DeadlineExceeded => Err(CsiError::Timeout {
                driver: self.driver.to_string(),
                method,
                volume: volume.to_owned(),
                after,
            }),
            Ok(Err(s)) => Err(CsiError::Call {
                driver: self.driver.to_string(),
                method,
                volume: volume.to_owned(),
                code: s.code(),
                message: s.message().to_owned(),
            }),
            Err(_) => Err(CsiError::Timeout {
                driver: self.driver.to_string(),
                method,
                volume: volume.to_owned(),
                after,
            }),
        }
    }

    /// `GetPluginInfo`: the driver's own name and version.
    pub async fn plugin_info(&self) -> Result<v1::GetPluginInfoResponse> {
        let mut c = self.identity.clone();
        self.call("GetPluginInfo", "-", move |t| async move {
            c.get_plugin_info(with_timeout(v1::GetPluginInfoRequest {}, t))
                .await
        })
        .await
    }

    /// `NodeGetInfo`: the driver's id for this node (the kubelet writes it to
    /// the CSINode object and the node's annotation).
    pub async fn node_get_info(&self) -> Result<NodeInfo> {
        let mut c = self.node.clone();
        let r = self
            .call("NodeGetInfo", "-", move |t| async move {
                c.node_get_info(with_timeout(v1::NodeGetInfoRequest {}, t))
                    .await
            })
            .await?;
        if r.node_id.is_empty() {
            return Err(CsiError::InvalidResponse {
                driver: self.driver.to_string(),
                method: "NodeGetInfo",
                reason: "empty node_id".into(),
            });
        }
        Ok(NodeInfo {
            node_id: r.node_id,
            max_volumes_per_node: r.max_volumes_per_node,
            topology: r
                .accessible_topology
                .map(|t| t.segments)
                .unwrap_or_default(),
        })
    }

    /// `NodeGetCapabilities`, as the flags the plugin uses.
    pub async fn node_get_capabilities(&self) -> Result<NodeCapabilities> {
        let mut c = self.node.clone();
        let r = self
            .call("NodeGetCapabilities", "-", move |t| async move {
                c.node_get_capabilities(with_timeout(v1::NodeGetCapabilitiesRequest {}, t))
                    .await
            })
            .await?;
        Ok(capabilities_of(&r))
    }

    pub async fn node_stage_volume(&self, req: v1::NodeStageVolumeRequest) -> Result<()> {
        let volume = req.volume_id.clone();
        let mut c = self.node.clone();
        self.call("NodeStageVolume", &volume, move |t| async move {
            c.node_stage_volume(with_timeout(req, t)).await
        })
        .await
        .map(drop)
    }

    pub async fn node_unstage_volume(&self, req: v1::NodeUnstageVolumeRequest) -> Result<()> {
        let volume = req.volume_id.clone();
        let mut c = self.node.clone();
        self.call("NodeUnstageVolume", &volume, move |t| async move {
            c.node_unstage_volume(with_timeout(req, t)).await
        })
        .await
        .map(drop)
    }

    pub async fn node_publish_volume(&self, req: v1::NodePublishVolumeRequest) -> Result<()> {
        let volume = req.volume_id.clone();
        let mut c = self.node.clone();
        self.call("NodePublishVolume", &volume, move |t| async move {
            c.node_publish_volume(with_timeout(req, t)).await
        })
        .await
        .map(drop)
    }

    pub async fn node_unpublish_volume(&self, req: v1::NodeUnpublishVolumeRequest) -> Result<()> {
        let volume = req.volume_id.clone();
        let mut c = self.node.clone();
        self.call("NodeUnpublishVolume", &volume, move |t| async move {
            c.node_unpublish_volume(with_timeout(req, t)).await
        })
        .await
        .map(drop)
    }
}

fn with_timeout<T>(message: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.set_timeout(timeout);
    r
}

/// The flags of a `NodeGetCapabilities` answer.
pub fn capabilities_of(r: &v1::NodeGetCapabilitiesResponse) -> NodeCapabilities {
    use v1::node_service_capability::{Type, rpc};
    let stage_unstage = r.capabilities.iter().any(|c| {
        matches!(&c.r#type, Some(Type::Rpc(rpc_cap))
            if rpc_cap.r#type == rpc::Type::StageUnstageVolume as i32)
    });
    NodeCapabilities { stage_unstage }
}

#[cfg(test)]
mod tests {
    use super::*;
    use v1::node_service_capability::{Rpc, Type, rpc};

    fn cap(t: rpc::Type) -> v1::NodeServiceCapability {
        v1::NodeServiceCapability {
            r#type: Some(Type::Rpc(Rpc { r#type: t as i32 })),
        }
    }

    #[test]
    fn stage_unstage_is_read_from_the_capabilities() {
        let table = [
            (vec![], false),
            (vec![cap(rpc::Type::GetVolumeStats)], false),
            (
                vec![
                    cap(rpc::Type::GetVolumeStats),
                    cap(rpc::Type::StageUnstageVolume),
                ],
                true,
            ),
        ];
        for (caps, want) in table {
            let r = v1::NodeGetCapabilitiesResponse { capabilities: caps };
            assert_eq!(capabilities_of(&r).stage_unstage, want);
        }
    }

    #[test]
    fn endpoints_are_unix_socket_paths() {
        assert_eq!(
            socket_path("d", "unix:///var/lib/kubelet/plugins/d/csi.sock").unwrap(),
            PathBuf::from("/var/lib/kubelet/plugins/d/csi.sock")
        );
        assert_eq!(
            socket_path("d", "/run/d.sock").unwrap(),
            PathBuf::from("/run/d.sock")
        );
        let e = socket_path("d", "tcp://1.2.3.4:5").unwrap_err();
        assert_eq!(
            e.to_string(),
            "CSI driver d: endpoint \"tcp://1.2.3.4:5\" is not a unix socket path"
        );
    }

    #[tokio::test]
    async fn an_absent_socket_is_a_retryable_unavailable() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = Arc::new(CsiMetrics::default());
        let c = CsiClient::new(
            "d",
            &dir.path().join("none.sock"),
            CsiClientConfig {
                call_timeout: Duration::from_secs(5),
                connect_timeout: Duration::from_secs(1),
            },
            metrics.clone(),
        )
        .unwrap();
        let e = c.node_get_capabilities().await.unwrap_err();
        assert!(e.is_retryable(), "{e}");
        let label = crate::csi::metrics::CsiOperation {
            driver_name: "d".into(),
            method_name: "/csi.v1.Node/NodeGetCapabilities".into(),
            grpc_status_code: "Unavailable".into(),
            migrated: "false".into(),
        };
        assert!(
            metrics.operations.get(&label).is_some(),
            "the failed call observed"
        );
        assert!(
            e.to_string()
                .starts_with("NodeGetCapabilities of CSI driver d"),
            "{e}"
        );
    }
}
