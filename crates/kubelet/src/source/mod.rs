//! Pod sources and their mux: the kubelet's `pkg/kubelet/config`.
//!
//! Each source (the static manifest directory, a manifest URL, the API server)
//! sends [`PodUpdate`]s; the [`mux`] merges them per source with the kubelet's
//! semantics and hands the sync loop one stream of changes.

pub mod api;
pub mod file;
pub mod mux;
pub mod url;

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;

/// The kubelet's `PodOperation`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// The source's full set of pods: pods it no longer lists are removed.
    Set,
    /// New pods.
    Add,
    /// Changed pods (spec or metadata).
    Update,
    /// Pods to terminate gracefully (deletion requested, still present).
    Delete,
    /// Pods gone from the source: terminate and forget.
    Remove,
    /// Only the status changed (from the API server): nothing to run.
    Reconcile,
}

/// Which source a pod came from (the `kubernetes.io/config.source` annotation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SourceName {
    /// Static pods from the manifest directory (`file`).
    File,
    /// Static pods from a manifest URL (`http`).
    Http,
    /// Pods bound to this node in the API server (`api`).
    Api,
}

impl SourceName {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::File => "file",
            Self::Http => "http",
            Self::Api => "api",
        }
    }

    /// Static pods are run without the API server's say and get mirror pods.
    pub fn is_static(&self) -> bool {
        !matches!(self, Self::Api)
    }
}

/// A change from one source.
#[derive(Clone, Debug)]
pub struct PodUpdate {
    pub op: Op,
    pub source: SourceName,
    pub pods: Vec<Arc<Pod>>,
}

/// Annotations the kubelet sets on pods from sources.
pub mod annotations {
    /// `file`, `http` or `api`.
    pub const CONFIG_SOURCE: &str = "kubernetes.io/config.source";
    /// Hash of a static pod's manifest (its UID is derived from it).
    pub const CONFIG_HASH: &str = "kubernetes.io/config.hash";
    /// Set on mirror pods: the static pod's hash.
    pub const CONFIG_MIRROR: &str = "kubernetes.io/config.mirror";
    pub const CONFIG_SEEN: &str = "kubernetes.io/config.seen";
}
