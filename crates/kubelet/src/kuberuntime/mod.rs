//! The kubelet's `pkg/kubelet/kuberuntime`: SyncPod and its parts over the CRI.
//! [`manager`] holds the runtime manager the pod workers call; the rest is
//! split by concern as the kubelet's files are.

pub mod actions;
pub mod backoff;
pub mod cgroups;
pub mod cri_config;
pub mod gc;
pub mod hooks;
pub mod images;
pub mod manager;
pub mod oom_score;
pub mod ordering;
pub mod reasons;
pub mod security_context;
mod sync;
mod terminate;
pub mod termination_message;
