//! The test driver's gRPC services: CSI Identity and Node, and the plugin
//! registration API answered on the registration socket.
//!
//! NodeStageVolume creates the volume's backing directory
//! (`<state>/volumes/<id>`, with a `volume-id` file holding the id) and
//! bind-mounts it on the staging path; NodePublishVolume bind-mounts the
//! staging path (or, unstaged, the backing directory, created for an
//! ephemeral volume) on the target path, which it creates, read-only if
//! asked; NodeUnpublishVolume unmounts and removes the target (and an
//! ephemeral volume's backing directory); NodeUnstageVolume unmounts the
//! staging path. All are idempotent, as the spec requires. A file
//! `<state>/fail/<id>.<Method>` makes that call fail with `Internal` and the
//! file's text (`Unavailable` if the text starts with `UNAVAILABLE: `); every
//! call is appended to `<state>/calls.jsonl`.

use std::collections::{BTreeMap, HashSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use evpleg_csi_api::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
    registration_server::Registration,
};
use evpleg_csi_api::v1::{self, identity_server::Identity, node_server::Node};
use serde::{Deserialize, Serialize};
use tonic::{Request, Response, Status};

use super::mounts;

/// The driver's settings.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    pub name: String,
    pub node_id: String,
    /// The CSI socket (the endpoint it registers).
    pub csi_socket: PathBuf,
    /// Backing dirs, the call log and the failure files.
    pub state_dir: PathBuf,
    /// Whether NodeGetCapabilities offers STAGE_UNSTAGE_VOLUME.
    pub stage_unstage: bool,
    /// The versions GetInfo reports.
    pub versions: Vec<String>,
}

/// One call the driver got, as logged.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Call {
    pub method: String,
    #[serde(default)]
    pub volume_id: String,
    #[serde(default)]
    pub target_path: String,
    #[serde(default)]
    pub staging_target_path: String,
    #[serde(default)]
    pub readonly: bool,
    #[serde(default)]
    pub volume_context: BTreeMap<String, String>,
    /// NotifyRegistrationStatus: whether the agent registered the driver.
    #[serde(default)]
    pub registered: Option<bool>,
    /// None: success.
    #[serde(default)]
    pub error: Option<String>,
}

/// A volume id as a file name.
pub fn file_name(id: &str) -> String {
    id.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The test driver's state.
#[derive(Debug)]
pub struct TestDriver {
    pub config: DriverConfig,
    ephemeral: Mutex<HashSet<String>>,
    log: Mutex<()>,
}

impl TestDriver {
    pub fn new(config: DriverConfig) -> std::io::Result<Self> {
        std::fs::create_dir_all(config.state_dir.join("volumes"))?;
        std::fs::create_dir_all(config.state_dir.join("fail"))?;
        Ok(Self {
            config,
            ephemeral: Mutex::new(HashSet::new()),
            log: Mutex::new(()),
        })
    }

    fn record(&self, call: &Call) {
        let _g = self.log.lock().unwrap_or_else(|e| e.into_inner());
        let path = self.config.state_dir.join("calls.jsonl");
        let line = serde_json::to_string(call).unwrap_or_default();
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
        {
            let _ = writeln!(f, "{line}");
        }
    }

    fn injected(&self, id: &str, method: &str) -> Option<String> {
        let p = self
            .config
            .state_dir
            .join("fail")
            .join(format!("{}.{method}", file_name(id)));
        std::fs::read_to_string(p).ok()
    }

    fn backing(&self, id: &str) -> PathBuf {
        self.config.state_dir.join("volumes").join(file_name(id))
    }

    fn make_backing(&self, id: &str) -> Result<PathBuf, Status> {
        let dir = self.backing(id);
        std::fs::create_dir_all(&dir).map_err(|e| internal(&dir, e))?;
        std::fs::write(dir.join("volume-id"), id).map_err(|e| internal(&dir, e))?;
        Ok(dir)
    }

    /// Runs `op` for `call`, after the injected failure if any, and logs it.
    fn serve(&self, mut call: Call, op: impl FnOnce() -> Result<(), Status>) -> Result<(), Status> {
        let result = match self.injected(&call.volume_id, &call.method) {
            Some(msg) => Err(injected_status(msg.trim())),
            None => op(),
        };
        call.error = result.as_ref().err().map(|s| s.message().to_owned());
        self.record(&call);
        result
    }

    fn stage(&self, id: &str, staging: &Path) -> Result<(), Status> {
        if mounts::is_mount_point(staging) {
            return Ok(());
        }
        let backing = self.make_backing(id)?;
        std::fs::create_dir_all(staging).map_err(|e| internal(staging, e))?;
        mounts::bind(&backing, staging, false).map_err(|e| internal(staging, e))
    }

    fn unstage(&self, staging: &Path) -> Result<(), Status> {
        mounts::unmount(staging).map_err(|e| internal(staging, e))
    }

    fn publish(&self, r: &v1::NodePublishVolumeRequest) -> Result<(), Status> {
        let target = Path::new(&r.target_path);
        if mounts::is_mount_point(target) {
            return Ok(());
        }
        let parent = target.parent().unwrap_or(Path::new("/"));
        if !parent.is_dir() {
            return Err(Status::failed_precondition(format!(
                "parent of target path {} does not exist",
                target.display()
            )));
        }
        let source = if r.staging_target_path.is_empty() {
            let ephemeral = r
                .volume_context
                .get("csi.storage.k8s.io/ephemeral")
                .is_some_and(|v| v == "true");
            if ephemeral {
                self.ephemeral
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(r.volume_id.clone());
            }
            self.make_backing(&r.volume_id)?
        } else {
            let staging = PathBuf::from(&r.staging_target_path);
            if !mounts::is_mount_point(&staging) {
                return Err(Status::failed_precondition(format!(
                    "volume {} is not staged at {}",
                    r.volume_id,
                    staging.display()
                )));
            }
            staging
        };
        std::fs::create_dir_all(target).map_err(|e| internal(target, e))?;
        mounts::bind(&source, target, r.readonly).map_err(|e| internal(target, e))
    }

    fn unpublish(&self, id: &str, target: &Path) -> Result<(), Status> {
        mounts::unmount(target).map_err(|e| internal(target, e))?;
        match std::fs::remove_dir(target) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(internal(target, e)),
        }
        let ephemeral = self
            .ephemeral
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        if ephemeral {
            let b = self.backing(id);
            std::fs::remove_dir_all(&b).map_err(|e| internal(&b, e))?;
        }
        Ok(())
    }
}

/// The injected failure: `Internal` (a final error) with the text, or
/// `Unavailable` (the kubelet's uncertain outcome) when the text starts with
/// `UNAVAILABLE: `.
fn injected_status(text: &str) -> Status {
    match text.strip_prefix("UNAVAILABLE: ") {
        Some(m) => Status::unavailable(m.to_owned()),
        None => Status::internal(text.to_owned()),
    }
}

fn internal(path: &Path, e: std::io::Error) -> Status {
    Status::internal(format!("{}: {e}", path.display()))
}

fn need(field: &str, value: &str) -> Result<(), Status> {
    if value.is_empty() {
        return Err(Status::invalid_argument(format!(
            "{field} missing in request"
        )));
    }
    Ok(())
}

/// The services share one driver.
#[derive(Clone, Debug)]
pub struct Services(pub std::sync::Arc<TestDriver>);

#[tonic::async_trait]
impl Identity for Services {
    async fn get_plugin_info(
        &self,
        _: Request<v1::GetPluginInfoRequest>,
    ) -> Result<Response<v1::GetPluginInfoResponse>, Status> {
        Ok(Response::new(v1::GetPluginInfoResponse {
            name: self.0.config.name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_owned(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<v1::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<v1::GetPluginCapabilitiesResponse>, Status> {
        // A node-only plugin: no controller service.
        Ok(Response::new(v1::GetPluginCapabilitiesResponse::default()))
    }

    async fn probe(
        &self,
        _: Request<v1::ProbeRequest>,
    ) -> Result<Response<v1::ProbeResponse>, Status> {
        Ok(Response::new(v1::ProbeResponse { ready: Some(true) }))
    }
}

#[tonic::async_trait]
impl Node for Services {
    async fn node_stage_volume(
        &self,
        r: Request<v1::NodeStageVolumeRequest>,
    ) -> Result<Response<v1::NodeStageVolumeResponse>, Status> {
        let r = r.into_inner();
        let call = Call {
            method: "NodeStageVolume".into(),
            volume_id: r.volume_id.clone(),
            staging_target_path: r.staging_target_path.clone(),
            volume_context: r.volume_context.clone().into_iter().collect(),
            ..Default::default()
        };
        self.0.serve(call, || {
            need("volume_id", &r.volume_id)?;
            need("staging_target_path", &r.staging_target_path)?;
            if r.volume_capability.is_none() {
                return Err(Status::invalid_argument(
                    "volume_capability missing in request",
                ));
            }
            if !self.0.config.stage_unstage {
                return Err(Status::unimplemented("STAGE_UNSTAGE_VOLUME not offered"));
            }
            self.0
                .stage(&r.volume_id, Path::new(&r.staging_target_path))
        })?;
        Ok(Response::new(v1::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        r: Request<v1::NodeUnstageVolumeRequest>,
    ) -> Result<Response<v1::NodeUnstageVolumeResponse>, Status> {
        let r = r.into_inner();
        let call = Call {
            method: "NodeUnstageVolume".into(),
            volume_id: r.volume_id.clone(),
            staging_target_path: r.staging_target_path.clone(),
            ..Default::default()
        };
        self.0.serve(call, || {
            need("volume_id", &r.volume_id)?;
            need("staging_target_path", &r.staging_target_path)?;
            self.0.unstage(Path::new(&r.staging_target_path))
        })?;
        Ok(Response::new(v1::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        r: Request<v1::NodePublishVolumeRequest>,
    ) -> Result<Response<v1::NodePublishVolumeResponse>, Status> {
        let r = r.into_inner();
        let call = Call {
            method: "NodePublishVolume".into(),
            volume_id: r.volume_id.clone(),
            target_path: r.target_path.clone(),
            staging_target_path: r.staging_target_path.clone(),
            readonly: r.readonly,
            volume_context: r.volume_context.clone().into_iter().collect(),
            ..Default::default()
        };
        self.0.serve(call, || {
            need("volume_id", &r.volume_id)?;
            need("target_path", &r.target_path)?;
            if r.volume_capability.is_none() {
                return Err(Status::invalid_argument(
                    "volume_capability missing in request",
                ));
            }
            if self.0.config.stage_unstage
                && r.staging_target_path.is_empty()
                && r.volume_context
                    .get("csi.storage.k8s.io/ephemeral")
                    .map(String::as_str)
                    != Some("true")
            {
                return Err(Status::failed_precondition(
                    "staging_target_path missing: a persistent volume must be staged first",
                ));
            }
            self.0.publish(&r)
        })?;
        Ok(Response::new(v1::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        r: Request<v1::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<v1::NodeUnpublishVolumeResponse>, Status> {
        let r = r.into_inner();
        let call = Call {
            method: "NodeUnpublishVolume".into(),
            volume_id: r.volume_id.clone(),
            target_path: r.target_path.clone(),
            ..Default::default()
        };
        self.0.serve(call, || {
            need("volume_id", &r.volume_id)?;
            need("target_path", &r.target_path)?;
            self.0.unpublish(&r.volume_id, Path::new(&r.target_path))
        })?;
        Ok(Response::new(v1::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<v1::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<v1::NodeGetCapabilitiesResponse>, Status> {
        use v1::node_service_capability::{Rpc, Type, rpc};
        let capabilities = if self.0.config.stage_unstage {
            vec![v1::NodeServiceCapability {
                r#type: Some(Type::Rpc(Rpc {
                    r#type: rpc::Type::StageUnstageVolume as i32,
                })),
            }]
        } else {
            Vec::new()
        };
        self.0.record(&Call {
            method: "NodeGetCapabilities".into(),
            ..Default::default()
        });
        Ok(Response::new(v1::NodeGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<v1::NodeGetInfoRequest>,
    ) -> Result<Response<v1::NodeGetInfoResponse>, Status> {
        self.0.record(&Call {
            method: "NodeGetInfo".into(),
            ..Default::default()
        });
        Ok(Response::new(v1::NodeGetInfoResponse {
            node_id: self.0.config.node_id.clone(),
            ..Default::default()
        }))
    }
}

#[tonic::async_trait]
impl Registration for Services {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        self.0.record(&Call {
            method: "GetInfo".into(),
            ..Default::default()
        });
        Ok(Response::new(PluginInfo {
            r#type: evpleg_csi_api::CSI_PLUGIN_TYPE.to_owned(),
            name: self.0.config.name.clone(),
            endpoint: self.0.config.csi_socket.display().to_string(),
            supported_versions: self.0.config.versions.clone(),
        }))
    }

    async fn notify_registration_status(
        &self,
        r: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let r = r.into_inner();
        self.0.record(&Call {
            method: "NotifyRegistrationStatus".into(),
            registered: Some(r.plugin_registered),
            error: (!r.plugin_registered).then_some(r.error),
            ..Default::default()
        });
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}
