//! evpleg: a node agent whose Pod Lifecycle Event Generator is driven by the kernel.
//!
//! The binary's crate: the command line (all of clap), logging, the agent's
//! wiring, `observe`, `describe`, the CRI proxy's wiring, the HTTP server and
//! the metrics registry. The subsystems live in the crates below it; see
//! `docs/architecture.md` for the crate graph and the data flow.

pub mod agent;
pub mod config;
pub mod cri_proxy;
pub mod describe;
pub mod http;
pub mod metrics;
pub mod observe;
pub mod server;
pub mod telemetry;
