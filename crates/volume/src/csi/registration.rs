//! Registering a plugin found in the registration directory: the kubelet's
//! operation executor (`pluginmanager/operationexecutor`,
//! `generateRegisterPluginFunc`) and the CSI plugin's registration handler
//! (`csi_plugin.go` `RegistrationHandler`).
//!
//! As the kubelet: `GetInfo` on the plugin's registration socket; the type
//! must be `CSIPlugin`; an empty endpoint means the registration socket
//! itself; the versions are validated (the highest one whose major is at
//! most 1; a driver of that name already registered with an equal or higher
//! version refuses the newcomer); the driver is stored, then `NodeGetInfo`
//! asked (a failure undoes the registration); the plugin is told the outcome
//! with `NotifyRegistrationStatus` (the error's text when it failed).
//! Differs: no CSINode object or node annotation is written with the node id
//! (it is kept in the registry and logged); no DevicePlugin/DRA handlers, so
//! any other type is refused.

use std::path::{Path, PathBuf};
use std::time::Duration;

use evpleg_csi_api::CSI_PLUGIN_TYPE;
use evpleg_csi_api::pluginregistration::registration_client::RegistrationClient;
use evpleg_csi_api::pluginregistration::{InfoRequest, PluginInfo, RegistrationStatus};
use tonic::transport::Endpoint;
use tracing::{info, warn};

use super::client::{CsiClient, CsiClientConfig, socket_path};
use super::drivers::{CsiDrivers, Driver};
use super::error::CsiError;

/// The kubelet's dial/call timeout for a registration socket (10 s).
pub const REGISTRATION_TIMEOUT: Duration = Duration::from_secs(10);

/// A plugin version as the kubelet's `utilversion.ParseGeneric` reads it:
/// an optional `v`, then at least two dot-separated numbers; anything after
/// them is ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    pub major: u64,
    pub minor: u64,
    pub patch: u64,
}

impl Version {
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        let s = s.strip_prefix('v').unwrap_or(s);
        let end = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(s.len());
        let nums: Vec<&str> = s[..end].trim_end_matches('.').split('.').collect();
        if nums.len() < 2 || nums.iter().any(|n| n.is_empty()) {
            return None;
        }
        let n = |i: usize| nums.get(i).map_or(Some(0), |x| x.parse().ok());
        Some(Self {
            major: n(0)?,
            minor: n(1)?,
            patch: n(2)?,
        })
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Why a plugin was not registered. The text is what the plugin is told.
#[derive(Debug, thiserror::Error)]
pub enum RegistrationError {
    #[error("registration socket {}: GetInfo failed (retryable): {message}", .socket.display())]
    GetInfo { socket: PathBuf, message: String },
    #[error("no handler registered for plugin type: {kind} at socket {}", .socket.display())]
    UnknownType { kind: String, socket: PathBuf },
    #[error("registration socket {}: plugin name is empty", .socket.display())]
    EmptyName { socket: PathBuf },
    #[error(
        "RegisterPlugin for CSI driver {driver} failed: plugin returned an empty list for supported versions"
    )]
    NoVersions { driver: String },
    #[error(
        "RegisterPlugin for CSI driver {driver} failed: none of the versions specified {versions:?} are supported"
    )]
    UnsupportedVersions {
        driver: String,
        versions: Vec<String>,
    },
    #[error(
        "RegisterPlugin for CSI driver {driver} failed: another driver with the same name is already registered with a higher supported version: {existing}"
    )]
    AlreadyRegistered { driver: String, existing: Version },
    #[error("RegisterPlugin for CSI driver {driver} failed: {source}")]
    Csi {
        driver: String,
        #[source]
        source: CsiError,
    },
}

/// The highest version the kubelet accepts: major 0 or 1 (CSI 2.x need not
/// be compatible); unparsable entries are skipped.
pub fn highest_supported_version(versions: &[String]) -> Option<Version> {
    versions
        .iter()
        .filter_map(|v| Version::parse(v))
        .filter(|v| v.major <= 1)
        .max()
}

/// The handler's `ValidatePlugin`: the version to use, or why not.
pub fn validate(
    drivers: &CsiDrivers,
    name: &str,
    versions: &[String],
) -> Result<Version, RegistrationError> {
    if versions.is_empty() {
        return Err(RegistrationError::NoVersions {
            driver: name.to_owned(),
        });
    }
    let highest = highest_supported_version(versions).ok_or_else(|| {
        RegistrationError::UnsupportedVersions {
            driver: name.to_owned(),
            versions: versions.to_vec(),
        }
    })?;
    if let Some(existing) = drivers.get(name)
        && existing.highest_version >= highest
    {
        return Err(RegistrationError::AlreadyRegistered {
            driver: name.to_owned(),
            existing: existing.highest_version,
        });
    }
    Ok(highest)
}

/// What a registered socket stands for, to undo it when the socket goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registered {
    pub driver: String,
    pub endpoint: PathBuf,
}

/// Registers the plugin at `socket`: GetInfo, validation, the driver stored
/// and its NodeGetInfo, then NotifyRegistrationStatus with the outcome.
pub async fn register(
    drivers: &CsiDrivers,
    socket: &Path,
    config: CsiClientConfig,
) -> Result<Registered, RegistrationError> {
    let channel = Endpoint::from_shared(format!("unix://{}", socket.display()))
        .map_err(|e| RegistrationError::GetInfo {
            socket: socket.to_owned(),
            message: e.to_string(),
        })?
        .connect_timeout(REGISTRATION_TIMEOUT)
        .connect_lazy();
    let mut client = RegistrationClient::new(channel);
    let mut req = tonic::Request::new(InfoRequest {});
    req.set_timeout(REGISTRATION_TIMEOUT);
    let info = tokio::time::timeout(REGISTRATION_TIMEOUT, client.get_info(req))
        .await
        .map_err(|_| RegistrationError::GetInfo {
            socket: socket.to_owned(),
            message: format!("no answer within {REGISTRATION_TIMEOUT:?}"),
        })?
        .map_err(|s| RegistrationError::GetInfo {
            socket: socket.to_owned(),
            message: format!("code = {:?} desc = {}", s.code(), s.message()),
        })?
        .into_inner();
    let outcome = handle(drivers, socket, &info, config).await;
    let status = match &outcome {
        Ok(_) => RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        },
        Err(e) => RegistrationStatus {
            plugin_registered: false,
            error: e.to_string(),
        },
    };
    let mut req = tonic::Request::new(status);
    req.set_timeout(REGISTRATION_TIMEOUT);
    match tokio::time::timeout(REGISTRATION_TIMEOUT, client.notify_registration_status(req)).await {
        Ok(Ok(_)) => {}
        Ok(Err(s)) => {
            warn!(socket = %socket.display(), error = %s.message(), "NotifyRegistrationStatus failed")
        }
        Err(_) => warn!(socket = %socket.display(), "NotifyRegistrationStatus: no answer"),
    }
    outcome
}

async fn handle(
    drivers: &CsiDrivers,
    socket: &Path,
    info: &PluginInfo,
    config: CsiClientConfig,
) -> Result<Registered, RegistrationError> {
    if info.r#type != CSI_PLUGIN_TYPE {
        return Err(RegistrationError::UnknownType {
            kind: info.r#type.clone(),
            socket: socket.to_owned(),
        });
    }
    let name = info.name.clone();
    if name.is_empty() {
        return Err(RegistrationError::EmptyName {
            socket: socket.to_owned(),
        });
    }
    let endpoint = if info.endpoint.is_empty() {
        socket.to_owned()
    } else {
        socket_path(&name, &info.endpoint).map_err(|source| RegistrationError::Csi {
            driver: name.clone(),
            source,
        })?
    };
    let highest = validate(drivers, &name, &info.supported_versions)?;
    let csi = |source| RegistrationError::Csi {
        driver: name.clone(),
        source,
    };
    let client = CsiClient::new(&name, &endpoint, config, drivers.metrics()).map_err(csi)?;
    let node = client.node_get_info().await.map_err(csi)?;
    info!(
        driver = %name,
        endpoint = %endpoint.display(),
        version = %highest,
        node_id = %node.node_id,
        "CSI driver registered"
    );
    drivers.insert(Driver {
        name: name.clone(),
        endpoint: endpoint.clone(),
        highest_version: highest,
        node_id: node.node_id,
        client,
    });
    Ok(Registered {
        driver: name,
        endpoint,
    })
}

/// The handler's `DeRegisterPlugin`.
pub fn deregister(drivers: &CsiDrivers, registered: &Registered) {
    if drivers.remove(&registered.driver, &registered.endpoint) {
        info!(driver = %registered.driver, endpoint = %registered.endpoint.display(), "CSI driver deregistered");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn versions_parse_as_parse_generic() {
        let table = [
            ("1.0.0", Some((1, 0, 0))),
            ("v1.2.3", Some((1, 2, 3))),
            ("1.5", Some((1, 5, 0))),
            (" 0.3.0 ", Some((0, 3, 0))),
            ("1.2.3-rc1", Some((1, 2, 3))),
            ("1", None),
            ("x1.0", None),
            ("", None),
        ];
        for (s, want) in table {
            let got = Version::parse(s).map(|v| (v.major, v.minor, v.patch));
            assert_eq!(got, want, "{s:?}");
        }
    }

    #[test]
    fn the_highest_version_with_major_at_most_one_wins() {
        let table: [(&[&str], Option<&str>); 5] = [
            (&["1.0.0"], Some("1.0.0")),
            (&["0.3.0", "1.0.0", "v1.2.0"], Some("1.2.0")),
            (&["2.0.0", "1.1.0"], Some("1.1.0")),
            (&["2.0.0", "junk"], None),
            (&["junk", "0.2"], Some("0.2.0")),
        ];
        for (versions, want) in table {
            assert_eq!(
                highest_supported_version(&v(versions)).map(|x| x.to_string()),
                want.map(str::to_owned),
                "{versions:?}"
            );
        }
    }

    #[tokio::test]
    async fn validation_refuses_empty_unsupported_and_not_newer() {
        let drivers = CsiDrivers::new();
        let e = validate(&drivers, "d", &[]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "RegisterPlugin for CSI driver d failed: plugin returned an empty list for supported versions"
        );
        assert!(matches!(
            validate(&drivers, "d", &v(&["2.0.0"])),
            Err(RegistrationError::UnsupportedVersions { .. })
        ));
        assert_eq!(
            validate(&drivers, "d", &v(&["1.0.0"])).unwrap(),
            Version::parse("1.0.0").unwrap()
        );
        drivers.insert(Driver {
            name: "d".into(),
            endpoint: "/run/d.sock".into(),
            highest_version: Version::parse("1.0.0").unwrap(),
            node_id: "n".into(),
            client: CsiClient::new(
                "d",
                "/run/d.sock".as_ref(),
                CsiClientConfig::default(),
                Default::default(),
            )
            .unwrap(),
        });
        assert!(matches!(
            validate(&drivers, "d", &v(&["1.0.0"])),
            Err(RegistrationError::AlreadyRegistered { .. })
        ));
        assert_eq!(
            validate(&drivers, "d", &v(&["1.1.0"])).unwrap().to_string(),
            "1.1.0"
        );
    }
}
