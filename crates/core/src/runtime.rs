//! The container runtime as the PLEG and the pod workers use it: the kubelet's
//! `kubecontainer.Runtime` (`pkg/kubelet/container/runtime.go`), cut to the
//! two calls the relist makes (`GetPods`, `GetPodStatus`) and the PLEG's view
//! of a container's state.

use std::future::Future;

use crate::container::{ContainerState, PodStatus};
use crate::ids::{ContainerId, PodUid};

/// A container's state as the PLEG compares it (`plegContainerState`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PlegState {
    Running,
    Exited,
    /// Created or unknown: the kubelet does not act on it.
    Unknown,
    NonExistent,
}

impl From<ContainerState> for PlegState {
    fn from(s: ContainerState) -> Self {
        match s {
            ContainerState::Running => Self::Running,
            ContainerState::Exited => Self::Exited,
            ContainerState::Created | ContainerState::Unknown => Self::Unknown,
        }
    }
}

/// One sandbox or container as the runtime lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuntimeEntry {
    pub pod: PodUid,
    pub id: ContainerId,
    pub sandbox: bool,
    pub state: PlegState,
}

/// A failed runtime call, as the relist sees it. Retryable: the relist tries again.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RuntimeError(pub String);

/// The runtime, as the relist uses it (the kubelet's `GetPods` and
/// `GetPodStatus`). The CRI implementation is the `evpleg-cri` crate's `CriRuntime`; tests use
/// in-memory values.
pub trait PodRuntime: Send + Sync {
    /// Every sandbox and container, or those of one pod.
    fn list(
        &self,
        pod: Option<&PodUid>,
    ) -> impl Future<Output = Result<Vec<RuntimeEntry>, RuntimeError>> + Send;
    /// A pod's full status.
    fn pod_status(
        &self,
        pod: &PodUid,
    ) -> impl Future<Output = Result<PodStatus, RuntimeError>> + Send;
}

/// A shared runtime is a runtime (tests share one between the relist and
/// their own checks).
impl<R: PodRuntime + ?Sized> PodRuntime for std::sync::Arc<R> {
    fn list(
        &self,
        pod: Option<&PodUid>,
    ) -> impl Future<Output = Result<Vec<RuntimeEntry>, RuntimeError>> + Send {
        (**self).list(pod)
    }

    fn pod_status(
        &self,
        pod: &PodUid,
    ) -> impl Future<Output = Result<PodStatus, RuntimeError>> + Send {
        (**self).pod_status(pod)
    }
}
