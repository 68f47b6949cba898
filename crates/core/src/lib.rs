//! evpleg's vocabulary, below every other crate: what the kubelet keeps in
//! `pkg/kubelet/container` (the pod status cache, the runtime interface, the
//! container states) and `pkg/kubelet/types`, with the PLEG's lifecycle events
//! and the pieces every subsystem shares (one clock, tasks, metrics buckets,
//! pod-spec quantities and QoS, cgroup naming, the machine's size).
//!
//! No aya, tonic, kube or clap here: a crate that needs only the vocabulary
//! builds without them.

pub mod cache;
pub mod cgroup_path;
pub mod clock;
pub mod container;
pub mod ids;
pub mod labels;
pub mod lifecycle;
pub mod machine;
pub mod metrics;
pub mod names;
pub mod qos;
pub mod quantity;
pub mod runtime;
pub mod tasks;
