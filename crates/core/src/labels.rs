//! The labels and annotations the kubelet puts on sandboxes and containers
//! (`pkg/kubelet/types/labels.go`, `kuberuntime/labels.go`); the relist uses them
//! to attribute runtime objects to pods.

pub const POD_NAME: &str = "io.kubernetes.pod.name";
pub const POD_NAMESPACE: &str = "io.kubernetes.pod.namespace";
pub const POD_UID: &str = "io.kubernetes.pod.uid";
pub const CONTAINER_NAME: &str = "io.kubernetes.container.name";
/// Hex hash of the container's spec: a changed spec means a new container.
pub const CONTAINER_HASH: &str = "io.kubernetes.container.hash";
pub const CONTAINER_RESTART_COUNT: &str = "io.kubernetes.container.restartCount";
pub const TERMINATION_GRACE_PERIOD: &str = "io.kubernetes.pod.terminationGracePeriod";
