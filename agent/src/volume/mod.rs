//! Volumes. See `csi` for CSI volumes.

pub mod csi;
