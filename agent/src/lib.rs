//! evpleg: a node agent whose Pod Lifecycle Event Generator is driven by the kernel.
//!
//! The modules are named after the kubelet concepts they implement; see
//! `docs/architecture.md` for the data flow.

pub mod admission;
pub mod agent;
pub mod clock;
pub mod config;
pub mod container;
pub mod cri;
pub mod cri_proxy;
pub mod describe;
pub mod events;
pub mod metrics;
pub mod network;
pub mod node_status;
pub mod observe;
pub mod pleg;
pub mod pod_fate;
pub mod pod_workers;
pub mod prober;
pub mod runtime;
pub mod server;
pub mod source;
pub mod status;
pub mod sync_loop;
pub mod tasks;
pub mod telemetry;
pub mod volume;
