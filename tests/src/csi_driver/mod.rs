//! A real CSI node driver for the tests (issue #14): the `evpleg-csi-driver`
//! binary serves the CSI Identity and Node services on its CSI socket and
//! the kubelet's plugin registration API on a socket in the agent's (or the
//! stock kubelet's) `plugins_registry` directory, as a driver with
//! node-driver-registrar does, behind a relay that gives the stock kubelet's
//! requests an `:authority` h2 accepts ([`authority`]); its volumes are
//! bind-mounted directories ([`service`]).
//! [`CsiDriverProcess`] starts it for a test, injects failures, reads the
//! calls it got, and stops it (its sockets removed, so the agent
//! deregisters it).

pub mod authority;
pub mod fixtures;
pub mod mounts;
pub mod service;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use evpleg_csi_api::pluginregistration::registration_server::RegistrationServer;
use evpleg_csi_api::v1::identity_server::IdentityServer;
use evpleg_csi_api::v1::node_server::NodeServer;
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;

pub use service::{Call, DriverConfig, Services, TestDriver, file_name};

/// The driver's name in the tests.
pub const DRIVER_NAME: &str = "csi.evpleg.test";

/// The incoming connections of a unix listener, for tonic.
fn incoming(
    listener: UnixListener,
) -> impl futures::Stream<Item = std::io::Result<tokio::net::UnixStream>> {
    futures::stream::unfold(listener, |l| async move {
        let r = l.accept().await.map(|(s, _)| s);
        Some((r, l))
    })
}

fn bind(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(p) = path.parent() {
        std::fs::create_dir_all(p)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    UnixListener::bind(path)
}

/// Serves the driver until `shutdown`: the CSI socket first, then the
/// registration socket `registration` (so the agent finds a working driver
/// when it sees the registration socket); both sockets are removed at the
/// end, the registration one first.
pub async fn serve(
    config: DriverConfig,
    registration: &Path,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let csi_socket = config.csi_socket.clone();
    let services = Services(Arc::new(TestDriver::new(config)?));
    let csi = bind(&csi_socket)?;
    let csi_server = tonic::transport::Server::builder()
        .add_service(IdentityServer::new(services.clone()))
        .add_service(NodeServer::new(services.clone()))
        .serve_with_incoming_shutdown(incoming(csi), shutdown.clone().cancelled_owned());
    // The registration service on a socket of the state directory, behind
    // the relay ([`authority`]) on the registration path, bound next to it
    // and renamed into place, so that the watcher sees a socket that already
    // accepts.
    let inner = csi_socket.with_file_name("registration-service.sock");
    let inner_listener = bind(&inner)?;
    let tmp = registration.with_file_name(format!(
        ".{}.tmp",
        registration
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("reg")
    ));
    let relay = bind(&tmp)?;
    std::fs::rename(&tmp, registration)?;
    let reg_server = tonic::transport::Server::builder()
        .add_service(RegistrationServer::new(services))
        .serve_with_incoming_shutdown(incoming(inner_listener), shutdown.clone().cancelled_owned());
    let relay = authority::serve(relay, &inner, shutdown.clone());
    let (a, b, ()) = tokio::join!(csi_server, reg_server, relay);
    let _ = std::fs::remove_file(registration);
    let _ = std::fs::remove_file(&inner);
    let _ = std::fs::remove_file(&csi_socket);
    a.map_err(std::io::Error::other)?;
    b.map_err(std::io::Error::other)
}

/// The test driver running as its own process.
#[derive(Debug)]
pub struct CsiDriverProcess {
    child: Option<Child>,
    pub name: String,
    pub state_dir: PathBuf,
    pub csi_socket: PathBuf,
    pub registration_socket: PathBuf,
}

impl CsiDriverProcess {
    /// Starts `binary` (the test's `env!("CARGO_BIN_EXE_evpleg-csi-driver")`)
    /// as driver `name`, its state and CSI socket under `base`, registering in
    /// `registry_dir`. Waits until its sockets exist.
    pub fn start(
        binary: &str,
        name: &str,
        base: &Path,
        registry_dir: &Path,
        extra: &[&str],
    ) -> std::io::Result<Self> {
        let state_dir = base.join(format!("csi-{name}"));
        std::fs::create_dir_all(&state_dir)?;
        let csi_socket = state_dir.join("csi.sock");
        let registration_socket = registry_dir.join(format!("{name}-reg.sock"));
        let child = Command::new(binary)
            .arg("--name")
            .arg(name)
            .arg("--csi-socket")
            .arg(&csi_socket)
            .arg("--registration-socket")
            .arg(&registration_socket)
            .arg("--state-dir")
            .arg(&state_dir)
            .args(extra)
            .spawn()?;
        let p = Self {
            child: Some(child),
            name: name.to_owned(),
            state_dir,
            csi_socket,
            registration_socket,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !(p.csi_socket.exists() && p.registration_socket.exists()) {
            if Instant::now() > deadline {
                return Err(std::io::Error::other(format!(
                    "CSI driver {name}: sockets not created within 20s"
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(p)
    }

    /// The calls it got so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        std::fs::read_to_string(self.state_dir.join("calls.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Makes `method` fail for volume `id` with `message` until cleared.
    pub fn inject_error(&self, id: &str, method: &str, message: &str) {
        let p = self.fail_path(id, method);
        std::fs::write(&p, message).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    }

    pub fn clear_error(&self, id: &str, method: &str) {
        let _ = std::fs::remove_file(self.fail_path(id, method));
    }

    fn fail_path(&self, id: &str, method: &str) -> PathBuf {
        self.state_dir
            .join("fail")
            .join(format!("{}.{method}", file_name(id)))
    }

    /// The backing directory of volume `id`.
    pub fn backing_dir(&self, id: &str) -> PathBuf {
        self.state_dir.join("volumes").join(file_name(id))
    }

    /// Stops the driver (SIGTERM, then waits); its sockets are removed.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = child.id() as libc::pid_t;
            // SAFETY: signalling our own child by its pid.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                match child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() > deadline => {
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
            let _ = std::fs::remove_file(&self.registration_socket);
            let _ = std::fs::remove_file(&self.csi_socket);
        }
    }
}

impl Drop for CsiDriverProcess {
    fn drop(&mut self) {
        self.stop();
    }
}
