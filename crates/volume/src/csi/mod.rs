//! CSI volumes through the CSI node API: the kubelet's CSI volume plugin
//! (`pkg/volume/csi`) and, for CSI drivers, its plugin manager
//! (`pkg/kubelet/pluginmanager`). See `docs/csi.md`.
//!
//! # What it reproduces from the kubelet
//!
//! - Drivers register themselves by putting a socket in
//!   `<root-dir>/plugins_registry/` that serves the plugin registration API
//!   (what node-driver-registrar does for a driver): [`watcher`] sees it,
//!   [`registration`] asks `GetInfo`, validates (type `CSIPlugin`, a supported
//!   version), asks the driver `NodeGetInfo`, stores it in [`drivers`] and
//!   answers `NotifyRegistrationStatus`; the socket's removal deregisters.
//! - [`client`]: NodeGetInfo, NodeGetCapabilities, NodeStage/Unstage,
//!   NodePublish/Unpublish, each with the kubelet's 2 min deadline; errors
//!   say whether the operation may still be under way ([`error`]).
//! - [`spec`]: inline ephemeral volumes (`volumes[].csi`, handle
//!   `csi-<sha256(pod UID + name)>`, `csi.storage.k8s.io/ephemeral=true` and
//!   the pod info in the volume context) and PVs with `spec.csi`.
//! - [`paths`]: the kubelet's staging path
//!   `<root-dir>/plugins/kubernetes.io/csi/<driver>/<sha256(handle)>/globalmount`,
//!   the publish target `<pod volume dir>/mount`, `vol_data.json`.
//! - [`state`]: staging shared by the pods that publish a volume, unstaged
//!   after the last one; uncertain outcomes undone like certain ones.
//! - [`metrics`]: `csi_operations_seconds` by driver, method and status.
//!
//! # Where it differs
//!
//! No CSIDriver or CSINode objects (pod info always sent, inline volumes
//! allowed for every driver, node id not published), no VolumeAttachment
//! (no attach/detach, empty publish context), no secrets, no block volumes,
//! no volume stats/expansion, no SELinux mount option; the watcher follows
//! only the top level of the registration directory. Each module says more.

pub mod client;
pub mod drivers;
pub mod error;
pub mod metrics;
pub mod paths;
pub mod plugin;
pub mod registration;
pub mod spec;
pub mod state;
pub mod watcher;

pub use client::{CsiClient, CsiClientConfig, NodeCapabilities};
pub use drivers::{CsiDrivers, Driver};
pub use error::CsiError;
pub use watcher::{PLUGINS_REGISTRY_DIR, PluginWatcher};
