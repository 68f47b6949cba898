//! The kubelet's pod side over the CRI, the PLEG and the volume manager: pod
//! sources and their merge (`pkg/kubelet/config`), admission
//! (`lifecycle/predicate.go`), the sync loop and pod workers
//! (`kubelet.go`, `pod_workers.go`), SyncPod and its parts (`kuberuntime`),
//! probes (`prober`), status (`status`), pod networking details
//! (`network/dns`, `kubelet_pods.go`'s hosts file), the Node's status
//! (`kubelet_node_status.go`) and the kubelet's event messages (`events`).
//! docs/architecture.md maps each module to its kubelet package.

pub mod active_deadline;
pub mod admission;
pub mod credentials;
pub mod env;
pub mod events;
pub mod kuberuntime;
pub mod logs;
pub mod network;
pub mod node_status;
pub mod pod_fate;
pub mod pod_workers;
pub mod prober;
pub mod source;
pub mod status;
pub mod sync_loop;
