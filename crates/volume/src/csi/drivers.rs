//! The registered CSI drivers by name: the kubelet's `csiDrivers` store
//! (`csi_plugin.go`), filled by the plugin registration handler
//! ([`super::registration`]) and read by the volume plugin.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use super::client::CsiClient;
use super::error::{CsiError, Result};
use super::metrics::CsiMetrics;
use super::registration::Version;

/// One registered driver.
#[derive(Clone, Debug)]
pub struct Driver {
    pub name: String,
    /// The driver's CSI socket (the endpoint it registered, or its
    /// registration socket when it gave none).
    pub endpoint: PathBuf,
    /// The highest CSI version it supports that evpleg accepts.
    pub highest_version: Version,
    /// `NodeGetInfo`'s node id.
    pub node_id: String,
    pub client: CsiClient,
}

/// The drivers, shared by the registration handler and the volume plugin.
#[derive(Clone, Debug, Default)]
pub struct CsiDrivers {
    inner: Arc<RwLock<BTreeMap<String, Driver>>>,
    /// The drivers' clients' call metrics.
    metrics: Arc<CsiMetrics>,
}

impl CsiDrivers {
    pub fn new() -> Self {
        Self::default()
    }

    /// The `csi_operations_seconds` histogram the clients observe into.
    pub fn metrics(&self) -> Arc<CsiMetrics> {
        self.metrics.clone()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Driver>> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Driver>> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }

    pub fn get(&self, name: &str) -> Option<Driver> {
        self.read().get(name).cloned()
    }

    /// The client of `name`, or the kubelet's "not found in the list of
    /// registered CSI drivers" (retryable).
    pub fn client(&self, name: &str) -> Result<CsiClient> {
        self.get(name)
            .map(|d| d.client)
            .ok_or_else(|| CsiError::DriverNotRegistered {
                driver: name.to_owned(),
            })
    }

    /// The names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.read().keys().cloned().collect()
    }

    /// Adds or replaces the driver.
    pub fn insert(&self, driver: Driver) {
        self.write().insert(driver.name.clone(), driver);
    }

    /// Removes `name` if it is still the one registered at `endpoint` (a
    /// newer registration of the same name at another socket stays, as with
    /// the kubelet's `DeRegisterPlugin`). Returns whether it was removed.
    pub fn remove(&self, name: &str, endpoint: &std::path::Path) -> bool {
        let mut map = self.write();
        if map.get(name).is_some_and(|d| d.endpoint == endpoint) {
            map.remove(name);
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csi::client::CsiClientConfig;

    fn driver(name: &str, endpoint: &str) -> Driver {
        Driver {
            name: name.into(),
            endpoint: endpoint.into(),
            highest_version: Version::parse("1.0.0").unwrap(),
            node_id: "n".into(),
            client: CsiClient::new(
                name,
                endpoint.as_ref(),
                CsiClientConfig::default(),
                Default::default(),
            )
            .unwrap(),
        }
    }

    #[tokio::test]
    async fn remove_only_the_registration_at_that_endpoint() {
        let d = CsiDrivers::new();
        assert!(matches!(
            d.client("a"),
            Err(CsiError::DriverNotRegistered { .. })
        ));
        d.insert(driver("a", "/run/a1.sock"));
        d.insert(driver("b", "/run/b.sock"));
        assert_eq!(d.names(), ["a", "b"]);
        assert!(!d.remove("a", "/run/a2.sock".as_ref()));
        assert!(d.get("a").is_some());
        assert!(d.remove("a", "/run/a1.sock".as_ref()));
        assert!(d.get("a").is_none());
        assert_eq!(d.client("b").unwrap().driver(), "b");
    }
}
