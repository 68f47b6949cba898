//! Rust bindings for the Container Storage Interface (CSI, package `csi.v1`)
//! and the kubelet's plugin registration API (package `pluginregistration`,
//! `k8s.io/kubelet/pkg/apis/pluginregistration/v1`).
//!
//! The messages (prost) and the gRPC clients and servers (tonic) are generated
//! at build time from `proto/csi/csi.proto`, vendored unchanged from
//! `container-storage-interface/spec` **v1.12.0**, and
//! `proto/csi/pluginregistration.proto`, vendored unchanged from Kubernetes
//! (see `proto/csi/README.md`). Compiled in pure Rust by `protox`.
//!
//! * [`csi::v1`]: `IdentityClient` / `NodeClient` for the agent; the
//!   `Identity` / `Node` traits and their servers for the test driver.
//! * [`pluginregistration`]: `RegistrationClient` for the agent's plugin
//!   watcher; the `Registration` trait and server for a plugin.

/// The generated CSI code, in the module layout of the protobuf package.
pub mod csi {
    /// CSI `csi.v1`, generated from `csi.proto`.
    // Generated code; its doc comments are the spec's comments copied verbatim,
    // which trip rustdoc/clippy lints about Markdown that are allowed here only.
    #[allow(
        clippy::doc_lazy_continuation,
        clippy::doc_overindented_list_items,
        clippy::large_enum_variant,
        rustdoc::invalid_html_tags,
        rustdoc::broken_intra_doc_links,
        rustdoc::bare_urls
    )]
    pub mod v1 {
        tonic::include_proto!("csi.v1");
    }
}

/// The kubelet's plugin registration API, generated from
/// `pluginregistration.proto`.
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

pub use csi::v1;

/// The CSI spec release `csi.proto` was taken from.
pub const UPSTREAM_CSI_SPEC_VERSION: &str = "v1.12.0";

/// The plugin type a CSI driver registers with (`PluginInfo.type`), the
/// kubelet's `CSIPlugin` constant.
pub const CSI_PLUGIN_TYPE: &str = "CSIPlugin";

#[cfg(test)]
mod tests {
    use super::{pluginregistration as reg, v1};
    use prost::Message as _;

    #[test]
    fn node_stage_request_round_trips_through_prost() {
        let req = v1::NodeStageVolumeRequest {
            volume_id: "vol-1".into(),
            staging_target_path: "/var/lib/kubelet/plugins/kubernetes.io/csi/d/abc/globalmount"
                .into(),
            volume_capability: Some(v1::VolumeCapability {
                access_type: Some(v1::volume_capability::AccessType::Mount(
                    v1::volume_capability::MountVolume {
                        fs_type: "ext4".into(),
                        ..Default::default()
                    },
                )),
                access_mode: Some(v1::volume_capability::AccessMode {
                    mode: v1::volume_capability::access_mode::Mode::SingleNodeWriter as i32,
                }),
            }),
            ..Default::default()
        };
        let decoded =
            v1::NodeStageVolumeRequest::decode(req.encode_to_vec().as_slice()).expect("decodes");
        assert_eq!(decoded, req);
    }

    #[test]
    fn service_names_are_upstreams() {
        assert_eq!(v1::node_server::SERVICE_NAME, "csi.v1.Node");
        assert_eq!(v1::identity_server::SERVICE_NAME, "csi.v1.Identity");
        assert_eq!(
            reg::registration_server::SERVICE_NAME,
            "pluginregistration.Registration"
        );
    }

    #[test]
    fn plugin_info_field_numbers_are_upstreams() {
        // PluginInfo{type=1 "CSIPlugin"}: tag 0x0a, length 9.
        let info = reg::PluginInfo {
            r#type: super::CSI_PLUGIN_TYPE.into(),
            ..Default::default()
        };
        let bytes = info.encode_to_vec();
        assert_eq!(&bytes[..2], &[0x0a, 9]);
        // supported_versions is field 4 (tag 0x22).
        let info = reg::PluginInfo {
            supported_versions: vec!["1.0.0".into()],
            ..Default::default()
        };
        assert_eq!(info.encode_to_vec()[0], 0x22);
    }
}
