//! The CNI network of a private containerd ([`crate::containerd`]): Debian's
//! `containernetworking-plugins` (`bridge` with `host-local` IPAM, then
//! `portmap`; containerd adds `loopback` itself) on a bridge of its own, with
//! addresses that exist only inside this machine.
//!
//! Several harnesses run at once (the test binaries run in parallel, each
//! test with its own containerd), and every bridge lives in the host's network
//! namespace, so each instance takes a slot `n` in 0..[`SLOTS`]: the bridge
//! `evpleg-n<n>` (at most 15 characters, the kernel's limit) and the subnet
//! `10.231.<n>.0/24` (the bridge holds `.1`, the gateway). A slot is held by
//! an exclusive `flock` on `<temp>/evpleg-cni-slots/<n>.lock`, which the
//! kernel releases when the process ends however it ends; so a slot whose lock
//! can be taken belongs to nobody, and a bridge left behind by a killed run is
//! deleted before the slot is used again. host-local's allocations (its
//! `dataDir`) live under the instance's base directory, removed with it; the
//! bridge is deleted at teardown.

use std::fs;
use std::os::fd::AsRawFd as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::containerd::{HarnessError, Result};

/// How many networks may exist at once.
pub const SLOTS: u8 = 250;
/// Debian's plugin directory.
pub const PLUGIN_DIR: &str = "/usr/lib/cni";
/// The plugins the configuration uses (containerd runs `loopback` itself).
pub const PLUGINS: [&str; 4] = ["bridge", "host-local", "portmap", "loopback"];
const IP: &str = "/usr/sbin/ip";

/// What the instance's CNI configuration directory holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum CniSetup {
    /// The bridge network of a slot of its own.
    #[default]
    Bridge,
    /// A configuration the bridge plugin refuses at every ADD (an IPAM subnet
    /// that is no CIDR): every pod without hostNetwork fails to get its
    /// network, with the plugin's error.
    Broken,
}

/// One instance's network: its slot, held until dropped.
#[derive(Debug)]
pub struct CniNetwork {
    pub slot: u8,
    /// The bridge's name (`evpleg-n<slot>`).
    pub bridge: String,
    /// The CNI network's name (also host-local's directory under `data_dir`).
    pub name: String,
    /// `10.231.<slot>.0/24`.
    pub subnet: String,
    /// The bridge's own address, the pods' gateway.
    pub gateway: String,
    /// host-local's `dataDir`: one file per allocated address.
    pub data_dir: PathBuf,
    /// Held for the instance's life: the slot's lock.
    _lock: fs::File,
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> HarnessError {
    let path = path.to_path_buf();
    move |source| HarnessError::Io {
        action,
        path,
        source,
    }
}

/// Whether Debian's plugins are installed (`cargo xtask setup` installs them).
pub fn plugins_present() -> Result<()> {
    for p in PLUGINS {
        let path = Path::new(PLUGIN_DIR).join(p);
        if !path.exists() {
            return Err(HarnessError::MissingTool {
                path: path.display().to_string(),
                install: "apt-get install containernetworking-plugins",
            });
        }
    }
    Ok(())
}

fn bridge_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

fn delete_bridge(name: &str) {
    if !bridge_exists(name) {
        return;
    }
    match Command::new(IP).args(["link", "delete", name]).output() {
        Ok(o) if o.status.success() => tracing::info!(bridge = name, "cni: bridge deleted"),
        Ok(o) => tracing::warn!(
            bridge = name,
            "cni: ip link delete failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => tracing::warn!(bridge = name, "cni: cannot run {IP}: {e}"),
    }
}

impl CniNetwork {
    /// Takes a free slot and writes the configuration of `setup` into
    /// `conf_dir`, with host-local's data under `data_dir`.
    pub fn create(conf_dir: &Path, data_dir: &Path, setup: &CniSetup) -> Result<CniNetwork> {
        plugins_present()?;
        let locks = std::env::temp_dir().join("evpleg-cni-slots");
        fs::create_dir_all(&locks).map_err(io_err("create", &locks))?;
        for slot in 0..SLOTS {
            let path = locks.join(format!("{slot}.lock"));
            let file = fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .map_err(io_err("open", &path))?;
            // SAFETY: flock on a descriptor this function owns.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                continue;
            }
            let net = CniNetwork {
                slot,
                bridge: format!("evpleg-n{slot}"),
                name: format!("evpleg-{slot}"),
                subnet: format!("10.231.{slot}.0/24"),
                gateway: format!("10.231.{slot}.1"),
                data_dir: data_dir.to_path_buf(),
                _lock: file,
            };
            // Nobody holds the slot: a bridge of that name is a killed run's.
            delete_bridge(&net.bridge);
            fs::create_dir_all(conf_dir).map_err(io_err("create", conf_dir))?;
            let conf = conf_dir.join("10-evpleg.conflist");
            fs::write(&conf, net.conflist(setup)).map_err(io_err("write", &conf))?;
            tracing::info!(bridge = %net.bridge, subnet = %net.subnet, "cni: network configured");
            return Ok(net);
        }
        Err(HarnessError::Io {
            action: "find a free CNI slot in",
            path: locks,
            source: std::io::Error::other(format!("all {SLOTS} slots are in use")),
        })
    }

    /// The conflist: bridge (host-local IPAM) then portmap.
    pub fn conflist(&self, setup: &CniSetup) -> String {
        let subnet = match setup {
            CniSetup::Bridge => self.subnet.as_str(),
            CniSetup::Broken => "not-a-subnet",
        };
        serde_json::to_string_pretty(&serde_json::json!({
            "cniVersion": "0.4.0",
            "name": self.name,
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": true,
                    // No masquerade: the pods talk to each other and to this
                    // host only; no iptables rule is left behind.
                    "ipMasq": false,
                    "hairpinMode": true,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": self.data_dir,
                        "ranges": [[{"subnet": subnet, "gateway": self.gateway}]],
                        "routes": [{"dst": "0.0.0.0/0"}]
                    }
                },
                {"type": "portmap", "capabilities": {"portMappings": true}}
            ]
        }))
        .expect("json")
    }

    /// The addresses host-local holds (its files named by address).
    pub fn allocated(&self) -> Vec<String> {
        let dir = self.data_dir.join(&self.name);
        let mut out: Vec<String> = fs::read_dir(&dir)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.parse::<std::net::IpAddr>().is_ok())
                    .collect()
            })
            .unwrap_or_default();
        out.sort();
        out
    }

    /// Whether the bridge exists now.
    pub fn bridge_exists(&self) -> bool {
        bridge_exists(&self.bridge)
    }
}

impl Drop for CniNetwork {
    fn drop(&mut self) {
        delete_bridge(&self.bridge);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bridge_names_fit_the_kernel_limit() {
        assert!(format!("evpleg-n{}", SLOTS - 1).len() <= 15);
    }
}
