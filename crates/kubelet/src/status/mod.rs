//! Pod status: generation from what the runtime and the kernel observed, and the
//! status manager, the only writer of pod status (the kubelet's
//! `pkg/kubelet/status` and `generateAPIPodStatus`).

pub mod api;
pub mod conditions;
pub mod finish;
pub mod generate;
pub mod local;
pub mod manager;
pub mod start_latency;

use std::future::Future;

use k8s_openapi::api::core::v1::{Pod, PodStatus as ApiPodStatus};

/// A failed status write.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// the destination is unreachable or answered 5xx/429: retry with backoff
    #[error("writing the status of pod {pod}: {message} (retryable)")]
    Retryable { pod: String, message: String },
    /// the pod is gone or the write was rejected for good
    #[error("writing the status of pod {pod}: {message}")]
    Permanent { pod: String, message: String },
    /// the Node authorizer refused: the pod is not bound to this node as far
    /// as the API server's graph knows, not yet (a pod just bound: the graph
    /// lags the node's own watch, and the kubelet retries) or no longer
    /// (deleted); retried while the pod is on the node, for good once removed
    #[error("writing the status of pod {pod}: {message}")]
    Unbound { pod: String, message: String },
}

/// Where statuses go: the API server (a merge patch on the status subresource) or
/// the local store served at `/pods`.
pub trait StatusWriter: Send + Sync + 'static {
    fn write(
        &self,
        pod: &Pod,
        status: &ApiPodStatus,
    ) -> impl Future<Output = Result<(), WriteError>> + Send;
    /// The pod was removed from the node: forget it (the local store drops it; the
    /// API writer has nothing to do).
    fn forget(&self, pod: &Pod) -> impl Future<Output = ()> + Send;
    /// Deletes a gracefully deleted pod for good once it finished terminating
    /// (the API writer: grace period 0, the pod's UID as precondition; a pod
    /// already gone is fine). Nothing to do without an API server.
    fn delete(&self, _pod: &Pod) -> impl Future<Output = Result<(), WriteError>> + Send {
        async { Ok(()) }
    }
}
