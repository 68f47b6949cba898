//! A private containerd 1.6 (CRI plugin, runc, cgroupfs driver) for tests, for
//! `cargo xtask run` and for the benchmark; or containerd 1.7 from Debian trixie
//! ([`fetch_containerd_17`], [`Containerd::start_with`]), whose CRI plugin
//! implements `GetContainerEvents`.
//!
//! [`Containerd::start`] builds two OCI images locally (busybox and a tiny pause
//! program, cached under `target/evpleg-images/`), writes a configuration that
//! keeps every path containerd owns under one base directory in the temp dir,
//! starts `containerd`, waits until it answers the CRI `Version` call and
//! imports the images. Dropping it (also while a test panics) removes the pod
//! sandboxes over CRI, stops containerd, kills what is left of this instance's
//! shims and containers, unmounts what is mounted under the base directory,
//! removes the cgroups this instance's pods used and removes the base directory.
//! See `/work/shared/notes/cri-runtime.md` for why the configuration is as it is.
//!
//! The runtime matrix (docs/stock-kubelet.md): with `EVPLEG_TEST_CONTAINERD`
//! naming another `containerd` binary (`cargo xtask test --containerd 2` sets it
//! to the containerd 2.x that setup builds), [`Containerd::start`] runs that one,
//! so the whole suite runs on it.

use std::collections::BTreeSet;
use std::fs;
use std::future::Future;
use std::io::{self, Read as _, Seek as _, SeekFrom};
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use evpleg_cri_api::v1;
use evpleg_cri_api::{ImageServiceClient, RuntimeServiceClient};
use tonic::transport::{Channel, Endpoint};

use crate::cni::{CniNetwork, CniSetup};

/// The tag of the locally built images. Not `latest`: a pod's unset
/// `imagePullPolicy` means Always for `:latest` (the kubelet's defaulting), and
/// these images are imported, not pulled.
pub const LOCAL_TAG: &str = "local";
/// The busybox image, as the CRI plugin knows it after the import.
pub const BUSYBOX_IMAGE: &str = "localhost/busybox:local";
/// The pause image, the CRI plugin's `sandbox_image`.
pub const PAUSE_IMAGE: &str = "localhost/pause:local";
/// The containerd namespace of the CRI plugin.
pub const CRI_NAMESPACE: &str = "k8s.io";

const CONTAINERD: &str = "/usr/bin/containerd";
/// Variable naming the `containerd` binary [`Containerd::start`] runs instead of
/// Debian's (its shim and `ctr` are taken from its directory when there).
pub const CONTAINERD_VAR: &str = "EVPLEG_TEST_CONTAINERD";
const CTR: &str = "/usr/bin/ctr";
const RUNC: &str = "/usr/sbin/runc";
/// umoci, which builds the images.
pub const UMOCI: &str = "/usr/bin/umoci";
const BUSYBOX: &str = "/bin/busybox";
const GCC: &str = "gcc";

/// How long containerd may take to answer `Version` after it was started.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long containerd may take to exit after SIGTERM before it gets SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// The bound of the whole CRI part of the teardown.
const TEARDOWN_CRI_TIMEOUT: Duration = Duration::from_secs(60);
/// The bound of one CRI call of the teardown.
const TEARDOWN_CALL_TIMEOUT: Duration = Duration::from_secs(20);
/// How long an imported image may take to show up in the CRI image store.
const IMAGE_VISIBLE_TIMEOUT: Duration = Duration::from_secs(10);

/// Bump when the way images are built changes, to rebuild cached ones.
const IMAGE_RECIPE: u32 = 2;

/// An error of the harness; each names the command or path that failed.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A program the harness needs is not installed.
    #[error("missing {path}: install it with `{install}` (or run `cargo xtask setup`)")]
    MissingTool {
        /// The program's path.
        path: String,
        /// How to install it.
        install: &'static str,
    },
    /// A file system operation failed.
    #[error("cannot {action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// Why it failed.
        source: io::Error,
    },
    /// A command could not be run or exited with an error.
    #[error("`{command}` failed: {detail}")]
    Command {
        /// The command line.
        command: String,
        /// Exit status and the end of its stderr, or why it did not run.
        detail: String,
    },
    /// containerd exited while it was starting.
    #[error(
        "containerd --config {}/config.toml exited while starting ({status}); end of {}/containerd.log:\n{tail}",
        base.display(),
        base.display()
    )]
    Exited {
        /// The instance's base directory (config.toml, containerd.log).
        base: PathBuf,
        /// Its exit status.
        status: String,
        /// The end of its log.
        tail: String,
    },
    /// containerd did not answer `Version` in time.
    #[error(
        "containerd --config {}/config.toml did not answer Version on {}/containerd.sock within {timeout:?} (last error: {last_error}); end of {}/containerd.log:\n{tail}",
        base.display(),
        base.display(),
        base.display()
    )]
    NotReady {
        /// The instance's base directory (config.toml, containerd.sock,
        /// containerd.log).
        base: PathBuf,
        /// How long the harness waited.
        timeout: Duration,
        /// The last error of the `Version` call.
        last_error: String,
        /// The end of its log.
        tail: String,
    },
    /// An imported image did not become visible to the CRI plugin.
    #[error("image {image} imported from {archive} is not visible over CRI on {socket}: {detail}")]
    ImageNotVisible {
        /// The image reference.
        image: String,
        /// The archive it was imported from.
        archive: PathBuf,
        /// The CRI socket.
        socket: PathBuf,
        /// The last `ImageStatus` answer or error.
        detail: String,
    },
    /// Something the harness fetches cannot be had (not in the archive, or the
    /// archive cannot be reached).
    #[error("{what} is not available: {detail}")]
    Unavailable {
        /// What was to be fetched.
        what: String,
        /// Why not.
        detail: String,
    },
}

pub type Result<T, E = HarnessError> = std::result::Result<T, E>;

fn io_err(
    action: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(io::Error) -> HarnessError {
    let path = path.into();
    move |source| HarnessError::Io {
        action,
        path,
        source,
    }
}

/// Number of [`Containerd`] instances alive in this process: the last one
/// removes the shared cgroup ancestors (`/kubepods/besteffort`) it created.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// Ancestors of tracked cgroup parents (`/kubepods`, `/kubepods/besteffort`)
/// that did not exist when an instance of this process tracked them: the last
/// instance to go removes them (if empty).
static CREATED_ANCESTORS: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// A private containerd with the CRI plugin. See the module documentation.
#[derive(Debug)]
pub struct Containerd {
    /// The `containerd` binary this instance runs.
    binary: PathBuf,
    /// The `ctr` binary that imports the images.
    ctr: PathBuf,
    base: PathBuf,
    socket: PathBuf,
    child: Option<Child>,
    /// Pod cgroup parents (relative to a hierarchy's root) of this instance's pods.
    cgroups: Mutex<Vec<String>>,
    /// containerd answered at least once on this base (the teardown may then
    /// start it again to remove pods).
    was_ready: bool,
    torn_down: bool,
    /// The CNI network of pods without hostNetwork ([`crate::cni`]).
    cni: Option<CniNetwork>,
}

impl Containerd {
    /// Builds the images if needed, starts a private containerd, waits until it
    /// answers CRI `Version` and imports the images.
    pub fn start() -> Result<Containerd> {
        Self::start_with(&default_binary())
    }

    /// [`start`](Self::start) with Debian's containerd, whatever
    /// `$EVPLEG_TEST_CONTAINERD` says.
    pub fn start_debian() -> Result<Containerd> {
        Self::start_with(Path::new(CONTAINERD))
    }

    /// [`start`](Self::start) with another `containerd` binary, e.g. the 1.7 of
    /// [`fetch_containerd_17`]. The shim (`containerd-shim-runc-v2`) and `ctr`
    /// next to it are used when they are there: its directory comes first in
    /// containerd's `PATH`, where containerd looks the shim up.
    pub fn start_with(binary: &Path) -> Result<Containerd> {
        Self::start_full(binary, &CniSetup::Bridge)
    }

    /// [`start`](Self::start) with this CNI configuration ([`CniSetup::Broken`]:
    /// every pod network setup fails).
    pub fn start_with_cni(cni: &CniSetup) -> Result<Containerd> {
        Self::start_full(&default_binary(), cni)
    }

    fn start_full(binary: &Path, cni: &CniSetup) -> Result<Containerd> {
        let binary = binary.to_path_buf();
        let bin_dir = binary.parent().unwrap_or(Path::new("/"));
        let ctr = Some(bin_dir.join("ctr"))
            .filter(|p| p.is_file())
            .unwrap_or_else(|| PathBuf::from(CTR));
        let binary_name = binary.display().to_string();
        let ctr_name = ctr.display().to_string();
        for (path, install) in [
            (binary_name.as_str(), "apt-get install containerd"),
            (ctr_name.as_str(), "apt-get install containerd"),
            (RUNC, "apt-get install runc"),
            (UMOCI, "apt-get install umoci"),
            (BUSYBOX, "apt-get install busybox-static"),
        ] {
            if !Path::new(path).exists() {
                return Err(HarnessError::MissingTool {
                    path: path.to_owned(),
                    install,
                });
            }
        }
        let images = build_images()?;

        let base = std::env::temp_dir().join(format!(
            "evpleg-containerd-{}-{:012x}",
            std::process::id(),
            crate::unique_u64() & 0xffff_ffff_ffff
        ));
        fs::create_dir(&base).map_err(io_err("create", &base))?;
        LIVE.fetch_add(1, Ordering::SeqCst);
        // From here on, dropping `this` cleans up whatever was done.
        let mut this = Containerd {
            binary,
            ctr,
            socket: base.join("containerd.sock"),
            base,
            child: None,
            cgroups: Mutex::new(Vec::new()),
            was_ready: false,
            torn_down: false,
            cni: None,
        };
        let cni_dir = this.base.join("cni");
        fs::create_dir_all(&cni_dir).map_err(io_err("create", &cni_dir))?;
        let bin = cni_dir.join("bin");
        std::os::unix::fs::symlink(crate::cni::PLUGIN_DIR, &bin).map_err(io_err("link", &bin))?;
        this.cni = Some(CniNetwork::create(
            &cni_dir.join("conf"),
            &cni_dir.join("ipam"),
            cni,
        )?);
        let config = this.config_path();
        fs::write(&config, config_toml(&this.base)).map_err(io_err("write", &config))?;
        let gated = crate::start_gate::wrapper_path(&this.base);
        crate::start_gate::install(&this.base, RUNC).map_err(io_err("write", &gated))?;
        let ctr = this.ctr.display().to_string();
        crate::oci_hooks::install(&this.base, &ctr).map_err(|e| HarnessError::Command {
            command: format!("{ctr} oci spec"),
            detail: e.to_string(),
        })?;
        this.spawn()?;
        let started = Instant::now();
        for image in &images {
            this.import(image)?;
        }
        this.wait_images_visible(&images)?;
        tracing::info!(
            base = %this.base.display(),
            elapsed = ?started.elapsed(),
            "containerd: images imported"
        );
        Ok(this)
    }

    /// The CRI socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The CRI endpoint, `unix:///…/containerd.sock`.
    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// The base directory holding everything of this instance.
    pub fn base(&self) -> &Path {
        &self.base
    }

    /// containerd's log file.
    pub fn log_path(&self) -> PathBuf {
        self.base.join("containerd.log")
    }

    /// The CNI network of this instance's pods.
    pub fn cni(&self) -> &CniNetwork {
        self.cni.as_ref().expect("configured at start")
    }

    /// containerd's configuration file.
    pub fn config_path(&self) -> PathBuf {
        self.base.join("config.toml")
    }

    /// The CRI plugin's registry `config_path`: one `<host>/hosts.toml` per
    /// registry ([`crate::registry::Registry::configure_containerd`]).
    pub fn registry_config_dir(&self) -> PathBuf {
        self.base.join("certs.d")
    }

    /// The `containerd` binary this instance runs.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// containerd's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stops containerd (by pid; SIGTERM, SIGKILL after a bound) and starts it
    /// again on the same base directory. Shims and containers keep running.
    pub fn restart(&mut self) -> Result<()> {
        let started = Instant::now();
        self.stop();
        self.spawn()?;
        tracing::info!(elapsed = ?started.elapsed(), "containerd: restarted");
        Ok(())
    }

    /// Stops containerd, leaving its shims, containers and state in place
    /// ([`restart`](Self::restart) picks them up again). The teardown starts it
    /// again to remove the pods.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pid = child.id();
        if let Ok(Some(status)) = child.try_wait() {
            tracing::warn!(pid, %status, "containerd: had already exited");
            return;
        }
        signal(pid, libc::SIGTERM);
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => {
                    tracing::info!(pid, %status, "containerd: stopped");
                    return;
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                _ => {
                    tracing::warn!(pid, "containerd: no exit after SIGTERM; SIGKILL");
                    signal(pid, libc::SIGKILL);
                    let _ = child.wait();
                    return;
                }
            }
        }
    }

    /// Registers a cgroup parent (`/kubepods/besteffort/pod<uid>`, relative to a
    /// hierarchy's root) that pods of this instance use: the teardown kills what
    /// is left in it and removes it from every hierarchy, with its ancestors that
    /// did not exist yet (when no other instance of this process is alive).
    pub fn track_cgroup_parent(&self, path: &str) {
        let path = format!("/{}", path.trim_matches('/'));
        let mut tracked = self.cgroups.lock().unwrap_or_else(|e| e.into_inner());
        if tracked.contains(&path) {
            return;
        }
        let mounts = cgroup_mounts();
        let exists = |rel: &str| {
            mounts
                .iter()
                .any(|m| m.join(rel.trim_start_matches('/')).exists())
        };
        let mut created = CREATED_ANCESTORS.lock().unwrap_or_else(|e| e.into_inner());
        let mut ancestor = String::new();
        let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        for part in &parts[..parts.len().saturating_sub(1)] {
            ancestor.push('/');
            ancestor.push_str(part);
            if !exists(&ancestor) {
                created.insert(ancestor.clone());
            }
        }
        tracked.push(path);
    }

    /// Registers a root cgroup that this instance's containers may create
    /// without a cgroup parent (containerd's `/k8s.io/<id>`, as critest's
    /// do): the last instance's teardown removes it, when empty, if it did
    /// not exist yet (full runs left `/k8s.io` in every hierarchy).
    pub fn track_root_cgroup(&self, root: &str) {
        let root = format!("/{}", root.trim_matches('/'));
        let exists = cgroup_mounts()
            .iter()
            .any(|m| m.join(root.trim_start_matches('/')).exists());
        if !exists {
            CREATED_ANCESTORS
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(root);
        }
    }

    /// A host-network pod sandbox config for pod `name` with `uid`, under
    /// `cgroup_parent` (cgroupfs form, e.g. [`pod_cgroup_parent`]`(uid)`), which
    /// is tracked for the teardown. The hostname stays empty: a host-network
    /// sandbox has no UTS namespace of its own to set it in. The log directory
    /// is created under the base directory.
    pub fn sandbox_config(
        &self,
        name: &str,
        uid: &str,
        cgroup_parent: &str,
    ) -> v1::PodSandboxConfig {
        self.track_cgroup_parent(cgroup_parent);
        let log_directory = self.base.join("pod-logs").join(uid);
        if let Err(e) = fs::create_dir_all(&log_directory) {
            tracing::warn!(dir = %log_directory.display(), "cannot create the pod log directory: {e}");
        }
        v1::PodSandboxConfig {
            metadata: Some(v1::PodSandboxMetadata {
                name: name.to_owned(),
                uid: uid.to_owned(),
                namespace: "evpleg-test".to_owned(),
                attempt: 0,
            }),
            hostname: String::new(),
            log_directory: log_directory.display().to_string(),
            labels: [("evpleg.test/pod".to_owned(), name.to_owned())].into(),
            linux: Some(v1::LinuxPodSandboxConfig {
                cgroup_parent: cgroup_parent.to_owned(),
                security_context: Some(v1::LinuxSandboxSecurityContext {
                    namespace_options: Some(v1::NamespaceOption {
                        network: v1::NamespaceMode::Node as i32,
                        pid: v1::NamespaceMode::Pod as i32,
                        ipc: v1::NamespaceMode::Pod as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// The shim socket containerd-shim-runc-v2 listens on for the task (or pod)
    /// `id` of this instance: `/run/containerd/s/<sha256 of "<socket>/k8s.io/<id>">`.
    pub fn shim_socket_path(&self, id: &str) -> Option<PathBuf> {
        let key = format!("{}/{CRI_NAMESPACE}/{id}", self.socket.display());
        let out = Command::new("sha256sum")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                use std::io::Write as _;
                if let Some(mut stdin) = child.stdin.take() {
                    stdin.write_all(key.as_bytes())?;
                }
                child.wait_with_output()
            })
            .ok()?;
        let hex = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()?
            .to_owned();
        Some(Path::new("/run/containerd/s").join(hex))
    }

    // ---- starting ------------------------------------------------------------

    /// Starts containerd on the base directory and waits until it answers.
    fn spawn(&mut self) -> Result<()> {
        let log_path = self.log_path();
        let config = self.config_path();
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(io_err("open", &log_path))?;
        let log2 = log.try_clone().map_err(io_err("duplicate", &log_path))?;
        let started = Instant::now();
        let mut command = Command::new(&self.binary);
        if let Some(dir) = self.binary.parent() {
            // containerd finds its shim on PATH first: the one beside it.
            let path = std::env::var_os("PATH").unwrap_or_default();
            let dirs = std::iter::once(dir.to_path_buf()).chain(std::env::split_paths(&path));
            if let Ok(joined) = std::env::join_paths(dirs) {
                command.env("PATH", joined);
            }
        }
        let child = command
            .arg("--config")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|e| HarnessError::Command {
                command: format!("{} --config {}", self.binary.display(), config.display()),
                detail: e.to_string(),
            })?;
        let pid = child.id();
        self.child = Some(child);
        self.wait_ready()?;
        self.was_ready = true;
        tracing::info!(
            pid,
            socket = %self.socket.display(),
            elapsed = ?started.elapsed(),
            "containerd: answering CRI Version"
        );
        Ok(())
    }

    /// Polls CRI `Version` until it answers, containerd exits or the bound passes.
    fn wait_ready(&mut self) -> Result<()> {
        let socket = self.socket.clone();
        let deadline = Instant::now() + START_TIMEOUT;
        let mut last_error = String::from("the socket does not exist yet");
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                return Err(HarnessError::Exited {
                    base: self.base.clone(),
                    status: status.to_string(),
                    tail: log_tail(&self.log_path()),
                });
            }
            if socket.exists() {
                match block_on(cri_version(&socket, Duration::from_secs(2))) {
                    Ok(version) => {
                        tracing::debug!(?version, "containerd: Version");
                        return Ok(());
                    }
                    Err(e) => last_error = e,
                }
            }
            if Instant::now() > deadline {
                return Err(HarnessError::NotReady {
                    base: self.base.clone(),
                    timeout: START_TIMEOUT,
                    last_error,
                    tail: log_tail(&self.log_path()),
                });
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// `ctr images import` of one image archive.
    fn import(&self, image: &BuiltImage) -> Result<()> {
        let mut cmd = Command::new(&self.ctr);
        cmd.arg("-a")
            .arg(&self.socket)
            .args(["-n", CRI_NAMESPACE, "images", "import", "--base-name"])
            .arg(format!("localhost/{}", image.name))
            .arg(&image.archive);
        run(&mut cmd)?;
        Ok(())
    }

    /// Waits until the CRI plugin's image store has the imported images (it
    /// learns about them from containerd's events, asynchronously).
    fn wait_images_visible(&self, images: &[BuiltImage]) -> Result<()> {
        let socket = self.socket.clone();
        for image in images {
            let reference = format!("localhost/{}:{LOCAL_TAG}", image.name);
            let deadline = Instant::now() + IMAGE_VISIBLE_TIMEOUT;
            loop {
                let detail = match block_on(cri_image_present(&socket, &reference)) {
                    Ok(true) => break,
                    Ok(false) => "not in the image store".to_owned(),
                    Err(e) => e,
                };
                if Instant::now() > deadline {
                    return Err(HarnessError::ImageNotVisible {
                        image: reference,
                        archive: image.archive.clone(),
                        socket,
                        detail,
                    });
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    // ---- teardown ------------------------------------------------------------

    fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    fn teardown(&mut self) {
        if self.torn_down {
            return;
        }
        self.torn_down = true;
        let started = Instant::now();

        // 1. Pods over CRI: containerd stops their containers and shims and
        //    releases their mounts. Start it again if a test stopped it.
        if !self.running() && self.was_ready {
            tracing::info!("teardown: starting containerd again to remove the pods");
            if let Err(e) = self.spawn() {
                tracing::warn!("teardown: {e}");
            }
        }
        if self.running() {
            let socket = self.socket.clone();
            match block_on(remove_all_pods(&socket)) {
                Ok(removed) if removed.is_empty() => {}
                Ok(removed) => tracing::info!(?removed, "teardown: removed pod sandboxes"),
                Err(e) => tracing::warn!("teardown: removing pods over CRI: {e}"),
            }
        }

        // 2. containerd itself.
        self.stop();

        // 3. Shims left over (their pods could not be removed) and their sockets.
        for (pid, id) in self.shims() {
            tracing::warn!(pid, id, "teardown: killing leftover shim");
            signal(pid, libc::SIGKILL);
            wait_gone(pid, Duration::from_secs(5));
            if let Some(sock) = self.shim_socket_path(&id)
                && sock.exists()
            {
                match fs::remove_file(&sock) {
                    Ok(()) => {
                        tracing::info!(path = %sock.display(), "teardown: removed shim socket")
                    }
                    Err(e) => {
                        tracing::warn!(path = %sock.display(), "teardown: cannot remove shim socket: {e}")
                    }
                }
            }
        }

        // 4. Cgroups of the tracked pod parents (killing what is still in them).
        let tracked = std::mem::take(&mut *self.cgroups.lock().unwrap_or_else(|e| e.into_inner()));
        let mounts = cgroup_mounts();
        for path in &tracked {
            remove_cgroup_tree(&mounts, path);
        }
        {
            let mut created = CREATED_ANCESTORS.lock().unwrap_or_else(|e| e.into_inner());
            if LIVE.fetch_sub(1, Ordering::SeqCst) == 1 {
                let mut ancestors: Vec<String> =
                    std::mem::take(&mut *created).into_iter().collect();
                ancestors.sort_by_key(|a| std::cmp::Reverse(a.matches('/').count()));
                for a in ancestors {
                    for m in &mounts {
                        let dir = m.join(a.trim_start_matches('/'));
                        if fs::remove_dir(&dir).is_ok() {
                            tracing::info!(dir = %dir.display(), "teardown: removed cgroup");
                        }
                    }
                }
            }
        }

        // 5. Mounts under the base directory (network namespaces too), deepest
        //    first, then the CNI bridge (the pods' veths went with them).
        unmount_below(&self.base);
        drop(self.cni.take());

        // 6. The base directory.
        match fs::remove_dir_all(&self.base) {
            Ok(()) => {
                tracing::info!(base = %self.base.display(), elapsed = ?started.elapsed(), "teardown: done")
            }
            Err(e) => tracing::warn!(base = %self.base.display(), "teardown: cannot remove: {e}"),
        }
    }

    /// Shim processes of this instance: `(pid, task or pod id)` (at
    /// teardown, those left; the benchmark's runtime load, their CPU).
    pub fn shims(&self) -> Vec<(u32, String)> {
        let socket = self.socket.display().to_string();
        let mut found = Vec::new();
        let Ok(entries) = fs::read_dir("/proc") else {
            return found;
        };
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(cmdline) = fs::read(entry.path().join("cmdline")) else {
                continue;
            };
            let args: Vec<String> = cmdline
                .split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            if !args.first().is_some_and(|a| a.contains("containerd-shim")) {
                continue;
            }
            let value = |flag: &str| {
                args.iter()
                    .position(|a| a == flag)
                    .and_then(|i| args.get(i + 1))
                    .cloned()
            };
            if value("-address").as_deref() == Some(socket.as_str()) {
                found.push((pid, value("-id").unwrap_or_default()));
            }
        }
        found
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// The `containerd` of [`Containerd::start`]: `$EVPLEG_TEST_CONTAINERD`, or
/// Debian's.
pub fn default_binary() -> PathBuf {
    match std::env::var_os(CONTAINERD_VAR) {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => PathBuf::from(CONTAINERD),
    }
}

/// The cgroupfs cgroup parent the kubelet gives a best-effort pod.
pub fn pod_cgroup_parent(uid: &str) -> String {
    format!("/kubepods/besteffort/pod{uid}")
}

/// A busybox container config running `command` (e.g. `["sh", "-c", "exit 7"]`),
/// sharing the host network as its sandbox does, logging to `<name>.log` in the
/// pod's log directory.
pub fn container_config(name: &str, command: &[&str]) -> v1::ContainerConfig {
    v1::ContainerConfig {
        metadata: Some(v1::ContainerMetadata {
            name: name.to_owned(),
            attempt: 0,
        }),
        image: Some(v1::ImageSpec {
            image: BUSYBOX_IMAGE.to_owned(),
            ..Default::default()
        }),
        command: command.iter().map(|s| (*s).to_owned()).collect(),
        log_path: format!("{name}.log"),
        labels: [("evpleg.test/container".to_owned(), name.to_owned())].into(),
        linux: Some(v1::LinuxContainerConfig {
            security_context: Some(v1::LinuxContainerSecurityContext {
                namespace_options: Some(v1::NamespaceOption {
                    network: v1::NamespaceMode::Node as i32,
                    pid: v1::NamespaceMode::Container as i32,
                    ipc: v1::NamespaceMode::Pod as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Sends logs of the harness and of evpleg to the test output (`RUST_LOG`
/// overrides the default `info`). Safe to call from every test.
pub fn init_test_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

// ---- configuration -------------------------------------------------------------

/// containerd's configuration: every path under `base`.
fn config_toml(base: &Path) -> String {
    let b = base.display();
    let gated = crate::start_gate::wrapper_path(base);
    let gated = gated.display();
    const GATED: &str = crate::start_gate::HANDLER;
    let hooked_spec = crate::oci_hooks::spec_path(base);
    let hooked_spec = hooked_spec.display();
    const HOOKED: &str = crate::oci_hooks::HANDLER;
    format!(
        r#"# Written by evpleg's test harness (tests/src/containerd.rs).
version = 2
root = "{b}/root"
state = "{b}/state"
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = "{b}/containerd.sock"

[ttrpc]
  address = "{b}/containerd.sock.ttrpc"

[debug]
  address = "{b}/debug.sock"
  level = "info"

[metrics]
  address = ""

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = "{b}/opt"

  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "{PAUSE_IMAGE}"
    disable_apparmor = true
    enable_selinux = false
    # Required here: without CAP_SYS_RESOURCE the sandbox fails with "can't get
    # final child's PID from pipe: EOF".
    restrict_oom_score_adj = true
    # Network namespaces under state (removed with it), not /var/run/netns.
    netns_mounts_under_state_dir = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"

    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"

        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          BinaryName = "{RUNC}"
          Root = "{b}/runc-root"
          SystemdCgroup = false

      # runc with held starts, for tests of the runtime's lag at a start
      # (tests/src/start_gate.rs).
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{GATED}]
        runtime_type = "io.containerd.runc.v2"

        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{GATED}.options]
          BinaryName = "{gated}"
          Root = "{b}/runc-root"
          SystemdCgroup = false

      # runc whose containers run an OCI createContainer hook in their
      # cgroup before the entrypoint (tests/src/oci_hooks.rs).
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{HOOKED}]
        runtime_type = "io.containerd.runc.v2"
        base_runtime_spec = "{hooked_spec}"

        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{HOOKED}.options]
          BinaryName = "{RUNC}"
          Root = "{b}/runc-root"
          SystemdCgroup = false

    # The instance's own CNI network (tests/src/cni.rs); bin is a link to
    # Debian's plugins.
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "{b}/cni/bin"
      conf_dir = "{b}/cni/conf"
      max_conf_num = 1

    # Registry hosts (hosts.toml per host, read at each pull): the private
    # test registry's (tests/src/registry.rs), never the system's.
    [plugins."io.containerd.grpc.v1.cri".registry]
      config_path = "{b}/certs.d"
"#
    )
}

// ---- CRI calls of the harness ----------------------------------------------------

/// Runs `future` to completion on a private current-thread runtime in a helper
/// thread, so that it works whether or not the caller is inside a runtime
/// (a test's Drop may run on a Tokio worker).
fn block_on<F>(future: F) -> F::Output
where
    F: Future + Send,
    F::Output: Send,
{
    std::thread::scope(|scope| {
        let handle = scope.spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a current-thread Tokio runtime")
                .block_on(future)
        });
        match handle.join() {
            Ok(output) => output,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

async fn channel(socket: &Path, timeout: Duration) -> Result<Channel, String> {
    let endpoint = Endpoint::from_shared(format!("unix://{}", socket.display()))
        .map_err(|e| format!("endpoint unix://{}: {e}", socket.display()))?
        .connect_timeout(timeout)
        .timeout(timeout);
    endpoint
        .connect()
        .await
        .map_err(|e| format!("connect to {}: {e}", socket.display()))
}

/// CRI `Version` through the generated client.
async fn cri_version(socket: &Path, timeout: Duration) -> Result<v1::VersionResponse, String> {
    let mut client = RuntimeServiceClient::new(channel(socket, timeout).await?);
    client
        .version(v1::VersionRequest {
            version: "v1".to_owned(),
        })
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| format!("Version: {:?}: {}", s.code(), s.message()))
}

/// Whether the CRI image store has `reference`.
async fn cri_image_present(socket: &Path, reference: &str) -> Result<bool, String> {
    let mut client = ImageServiceClient::new(channel(socket, Duration::from_secs(5)).await?);
    let status = client
        .image_status(v1::ImageStatusRequest {
            image: Some(v1::ImageSpec {
                image: reference.to_owned(),
                ..Default::default()
            }),
            verbose: false,
        })
        .await
        .map_err(|s| {
            format!(
                "ImageStatus of {reference}: {:?}: {}",
                s.code(),
                s.message()
            )
        })?;
    Ok(status.into_inner().image.is_some())
}

/// Stops and removes every pod sandbox (their containers go with them).
/// Returns the ids removed.
async fn remove_all_pods(socket: &Path) -> Result<Vec<String>, String> {
    let work = async {
        let mut client = RuntimeServiceClient::new(channel(socket, TEARDOWN_CALL_TIMEOUT).await?);
        let sandboxes = client
            .list_pod_sandbox(v1::ListPodSandboxRequest { filter: None })
            .await
            .map_err(|s| format!("ListPodSandbox: {}", s.message()))?
            .into_inner()
            .items;
        let mut removed = Vec::new();
        for sandbox in sandboxes {
            let id = sandbox.id;
            if let Err(s) = client
                .stop_pod_sandbox(v1::StopPodSandboxRequest {
                    pod_sandbox_id: id.clone(),
                })
                .await
            {
                tracing::warn!(
                    id,
                    "teardown: StopPodSandbox: {:?}: {}",
                    s.code(),
                    s.message()
                );
            }
            match client
                .remove_pod_sandbox(v1::RemovePodSandboxRequest {
                    pod_sandbox_id: id.clone(),
                })
                .await
            {
                Ok(_) => removed.push(id),
                Err(s) => {
                    tracing::warn!(
                        id,
                        "teardown: RemovePodSandbox: {:?}: {}",
                        s.code(),
                        s.message()
                    )
                }
            }
        }
        Ok(removed)
    };
    tokio::time::timeout(TEARDOWN_CRI_TIMEOUT, work)
        .await
        .unwrap_or_else(|_| Err(format!("not done within {TEARDOWN_CRI_TIMEOUT:?}")))
}

// ---- processes, cgroups and mounts ----------------------------------------------

fn signal(pid: u32, sig: libc::c_int) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(pid, sig) };
}

/// Waits (bounded) until `/proc/<pid>` is gone; for processes that are not our
/// children.
fn wait_gone(pid: u32, bound: Duration) {
    let deadline = Instant::now() + bound;
    while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Mount points of every cgroup (v1) and cgroup2 hierarchy.
pub(crate) fn cgroup_mounts() -> Vec<PathBuf> {
    let Ok(mountinfo) = fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut mounts: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fstype = right.split_whitespace().next()?;
            let mount_point = left.split_whitespace().nth(4)?;
            matches!(fstype, "cgroup" | "cgroup2")
                .then(|| PathBuf::from(unescape_mount(mount_point)))
        })
        .collect();
    mounts.sort();
    mounts.dedup();
    mounts
}

/// Removes the cgroup `rel` and everything below it from every hierarchy,
/// killing processes still in them first.
pub(crate) fn remove_cgroup_tree(mounts: &[PathBuf], rel: &str) {
    for mount in mounts {
        let top = mount.join(rel.trim_start_matches('/'));
        if !top.is_dir() {
            continue;
        }
        let mut dirs = Vec::new();
        collect_dirs(&top, &mut dirs);
        dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        for dir in dirs {
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                match fs::remove_dir(&dir) {
                    Ok(()) => {
                        tracing::info!(dir = %dir.display(), "teardown: removed cgroup");
                        break;
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    Err(e) if Instant::now() > deadline => {
                        tracing::warn!(dir = %dir.display(), "teardown: cannot remove cgroup: {e}");
                        break;
                    }
                    Err(_) => {
                        for pid in cgroup_procs(&dir) {
                            tracing::warn!(pid, dir = %dir.display(), "teardown: killing a leftover process");
                            signal(pid, libc::SIGKILL);
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
        }
    }
}

fn collect_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_path_buf());
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                collect_dirs(&entry.path(), out);
            }
        }
    }
}

fn cgroup_procs(dir: &Path) -> Vec<u32> {
    fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Detaches every mount at or below `base`, deepest first.
fn unmount_below(base: &Path) {
    let Ok(mountinfo) = fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut points: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|line| line.split_whitespace().nth(4))
        .map(|p| PathBuf::from(unescape_mount(p)))
        .filter(|p| p.starts_with(base))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points.dedup();
    for point in points {
        let Ok(c) = std::ffi::CString::new(point.as_os_str().as_encoded_bytes()) else {
            continue;
        };
        // SAFETY: a valid NUL-terminated path.
        let rc = unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        if rc == 0 {
            tracing::info!(path = %point.display(), "teardown: unmounted");
        } else {
            tracing::warn!(path = %point.display(), "teardown: cannot unmount: {}", io::Error::last_os_error());
        }
    }
}

/// Undoes mountinfo's octal escapes (`\040` for a space, …).
fn unescape_mount(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let v = (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The last lines of a log file, for error messages.
fn log_tail(path: &Path) -> String {
    const TAIL: u64 = 4096;
    let Ok(mut file) = fs::File::open(path) else {
        return format!("(cannot read {})", path.display());
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(TAIL)));
    let mut buf = Vec::new();
    let _ = file.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

// ---- commands ----------------------------------------------------------------------

fn command_line(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Garbage-collects an OCI layout and archives it as `archive`, written
/// beside and renamed into place, so that a cut-off build leaves no half
/// archive.
pub fn archive_layout(layout: &Path, archive: &Path) -> Result<()> {
    run(Command::new(UMOCI).arg("gc").arg("--layout").arg(layout))?;
    let partial = archive.with_extension("tar.partial");
    run(Command::new("tar")
        .arg("-C")
        .arg(layout)
        .arg("-cf")
        .arg(&partial)
        .args(["oci-layout", "index.json", "blobs"]))?;
    fs::rename(&partial, archive).map_err(io_err("rename into place", archive))?;
    Ok(())
}

/// Runs `cmd` to completion; an error names it, with its status and stderr.
pub fn run(cmd: &mut Command) -> Result<std::process::Output> {
    let line = command_line(cmd);
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| HarnessError::Command {
            command: line.clone(),
            detail: e.to_string(),
        })?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(10).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return Err(HarnessError::Command {
            command: line,
            detail: format!("{}: {}", out.status, tail.join("\n")),
        });
    }
    Ok(out)
}

// ---- containerd 1.7 from Debian trixie -----------------------------------------------

/// The containerd 1.7 build fetched from Debian trixie when the archive still has
/// it; otherwise the newest 1.7 build trixie has (Debian drops superseded
/// builds). Checked with `apt-cache policy containerd` under the private apt
/// configuration of [`fetch_containerd_17`].
pub const CONTAINERD_17_VERSION: &str = "1.7.24~ds1-6+deb13u1";

/// The private apt sources of [`fetch_containerd_17`]: trixie and its security
/// updates (bookworm's Debian keyring carries the trixie keys).
const TRIXIE_SOURCES: &str = "\
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian-security trixie-security main
";

/// Where containerd 1.7 is unpacked: `<workspace>/.cache/containerd-1.7/`
/// (`.cache` is git-ignored). `root/` holds the package's files, `version` the
/// build, `apt/` the private apt configuration.
pub fn containerd_17_dir() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .unwrap_or(manifest)
        .join(".cache")
        .join("containerd-1.7")
}

/// Opens `lock_path` and holds an exclusive `flock` on it until the returned
/// file drops: one process at a time builds or fetches into a shared cache.
pub fn lock_exclusive(lock_path: &Path) -> Result<fs::File> {
    let lock = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(lock_path)
        .map_err(io_err("open", lock_path))?;
    // SAFETY: flock on an fd we own; the lock goes with the fd when `lock` drops.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(io_err("lock", lock_path)(io::Error::last_os_error()));
    }
    Ok(lock)
}

/// Fetches containerd 1.7 from Debian trixie once and returns the path of its
/// `containerd` binary (with `ctr` and `containerd-shim-runc-v2` beside it).
///
/// Idempotent and serialised between threads and processes by a lock file: once
/// unpacked, no network. Otherwise `apt-get update` / `apt-cache madison` /
/// `apt-get download` run with a private configuration under
/// `.cache/containerd-1.7/apt/` (its own sources list, sources.list.d, lists
/// and cache directories, passed with `-o Dir::…`), so that the system's apt is
/// untouched, and the package is unpacked with `dpkg -x` (not installed). It
/// needs libc6 >= 2.34, which bookworm has. Callable from tests and from
/// `cargo xtask`.
pub fn fetch_containerd_17() -> Result<PathBuf> {
    let dir = containerd_17_dir();
    fs::create_dir_all(&dir).map_err(io_err("create", &dir))?;
    let lock_path = dir.join(".lock");
    let lock = lock_exclusive(&lock_path)?;
    let binary = dir.join("root/usr/bin/containerd");
    let stamp = dir.join("version");
    if binary.is_file() && fs::read_to_string(&stamp).is_ok_and(|v| v.trim().starts_with("1.7.")) {
        return Ok(binary);
    }
    let started = Instant::now();
    let apt = PrivateApt::trixie(&dir.join("apt"))?;
    let mut version = apt.containerd_17_version();
    let mut update_said = String::new();
    if version.is_none() {
        update_said = apt.update()?;
        version = apt.containerd_17_version();
    }
    let version = version.ok_or_else(|| HarnessError::Unavailable {
        what: "containerd 1.7 in Debian trixie".to_owned(),
        detail: format!(
            "`apt-cache madison containerd` lists no 1.7 build after `apt-get update`, which said:\n{update_said}"
        ),
    })?;
    if version != CONTAINERD_17_VERSION {
        tracing::warn!(
            wanted = CONTAINERD_17_VERSION,
            found = version,
            "containerd {CONTAINERD_17_VERSION} is gone from trixie; using {version}"
        );
    }
    let download = dir.join("download");
    let _ = fs::remove_dir_all(&download);
    fs::create_dir_all(&download).map_err(io_err("create", &download))?;
    let mut cmd = apt.command("apt-get");
    cmd.current_dir(&download)
        .args(["-q", "download"])
        .arg(format!("containerd={version}"));
    run(&mut cmd)?;
    let deb = fs::read_dir(&download)
        .map_err(io_err("list", &download))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| HarnessError::Unavailable {
            what: format!("containerd={version}"),
            detail: format!("apt-get download left no .deb in {}", download.display()),
        })?;
    let partial = dir.join("root.partial");
    let _ = fs::remove_dir_all(&partial);
    run(Command::new("dpkg").arg("-x").arg(&deb).arg(&partial))?;
    let unpacked = partial.join("usr/bin/containerd");
    let out = run(Command::new(&unpacked).arg("--version"))?;
    let reported = String::from_utf8_lossy(&out.stdout);
    if !reported.contains(" 1.7.") {
        return Err(HarnessError::Unavailable {
            what: format!("containerd={version}"),
            detail: format!("{} --version says {reported:?}", unpacked.display()),
        });
    }
    let root = dir.join("root");
    let _ = fs::remove_dir_all(&root);
    fs::rename(&partial, &root).map_err(io_err("rename into place", &root))?;
    fs::write(&stamp, format!("{version}\n")).map_err(io_err("write", &stamp))?;
    let _ = fs::remove_dir_all(&download);
    tracing::info!(version, binary = %binary.display(), elapsed = ?started.elapsed(), "containerd 1.7 fetched");
    drop(lock);
    Ok(binary)
}

/// containerd 1.7 for a test that needs it ([`fetch_containerd_17`]). `None`
/// when it cannot be had, after printing why, so that the test can return; under
/// `CI=true` that is a failure instead.
pub fn containerd_17_for(test: &str) -> Option<PathBuf> {
    match fetch_containerd_17() {
        Ok(binary) => Some(binary),
        Err(e) => {
            let reason = format!("{test}: needs containerd 1.7 from Debian trixie: {e}");
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{reason}; CI=true, so this is a failure, not a skip");
            }
            eprintln!("SKIPPED {reason}");
            None
        }
    }
}

/// apt with a private configuration: its own sources list, sources.list.d,
/// lists and cache directories.
#[derive(Debug)]
struct PrivateApt {
    options: Vec<String>,
}

impl PrivateApt {
    fn trixie(dir: &Path) -> Result<Self> {
        for sub in ["sources.list.d", "lists/partial", "cache/archives/partial"] {
            let d = dir.join(sub);
            fs::create_dir_all(&d).map_err(io_err("create", &d))?;
        }
        let sources = dir.join("sources.list");
        if fs::read_to_string(&sources).ok().as_deref() != Some(TRIXIE_SOURCES) {
            fs::write(&sources, TRIXIE_SOURCES).map_err(io_err("write", &sources))?;
        }
        let opt = |k: &str, v: &Path| format!("{k}={}", v.display());
        Ok(Self {
            options: vec![
                opt("Dir::Etc::SourceList", &sources),
                opt("Dir::Etc::SourceParts", &dir.join("sources.list.d")),
                opt("Dir::State::Lists", &dir.join("lists")),
                opt("Dir::Cache", &dir.join("cache")),
                // The directories belong to root, not to apt's _apt user.
                "APT::Sandbox::User=root".to_owned(),
            ],
        })
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        for o in &self.options {
            cmd.args(["-o", o]);
        }
        cmd
    }

    /// `apt-get update`; returns the end of what it printed (it exits 0 even
    /// when the archive cannot be reached).
    fn update(&self) -> Result<String> {
        let mut cmd = self.command("apt-get");
        cmd.args(["update", "-q"]);
        let out = run(&mut cmd).map_err(|e| HarnessError::Unavailable {
            what: "Debian trixie's package lists".to_owned(),
            detail: e.to_string(),
        })?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let lines: Vec<&str> = text.lines().collect();
        Ok(lines[lines.len().saturating_sub(8)..].join("\n"))
    }

    /// [`CONTAINERD_17_VERSION`] when the lists have it, else the newest 1.7
    /// build they list.
    fn containerd_17_version(&self) -> Option<String> {
        let mut cmd = self.command("apt-cache");
        cmd.args(["madison", "containerd"]);
        let out = run(&mut cmd).ok()?;
        let versions: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split('|').nth(1).map(|v| v.trim().to_owned()))
            .filter(|v| v.starts_with("1.7."))
            .collect();
        if versions.iter().any(|v| v == CONTAINERD_17_VERSION) {
            return Some(CONTAINERD_17_VERSION.to_owned());
        }
        versions.into_iter().next()
    }
}

// ---- images ------------------------------------------------------------------------

/// An OCI image archive ready for `ctr images import`.
#[derive(Debug, Clone)]
struct BuiltImage {
    /// `busybox` or `pause`: imported as `localhost/<name>:`[`LOCAL_TAG`].
    name: &'static str,
    archive: PathBuf,
}

/// The image cache: `<workspace>/target/evpleg-images/`.
pub fn image_cache_dir() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .unwrap_or(manifest)
        .join("target")
        .join("evpleg-images")
}

/// The archive of the locally built image `name` (`busybox` or `pause`; an OCI
/// layout in a tar, its image tagged [`LOCAL_TAG`]), built if needed.
pub fn local_image_archive(name: &str) -> Result<PathBuf> {
    build_images()?
        .into_iter()
        .find(|i| i.name == name)
        .map(|i| i.archive)
        .ok_or_else(|| HarnessError::Unavailable {
            what: format!("the local image {name:?}"),
            detail: "the harness builds busybox and pause only".to_owned(),
        })
}

/// The file only the registry's image has ([`registry_busybox_archive`]).
pub const REGISTRY_MARKER: &str = "/evpleg-registry";

/// An image that is never imported, only pushed to the test registry
/// (tests/src/registry.rs): busybox with one more layer holding
/// [`REGISTRY_MARKER`], so that its manifest, config and that layer are not in
/// containerd's content store and a pull really transfers them. Tagged
/// [`LOCAL_TAG`] in an OCI archive; built from the busybox archive once and
/// cached beside it.
pub fn registry_busybox_archive() -> Result<PathBuf> {
    let busybox = local_image_archive("busybox")?;
    let cache = image_cache_dir();
    let lock_path = cache.join(".lock");
    let lock = lock_exclusive(&lock_path)?;
    let base_key_path = cache.join("busybox.tar.key");
    let base_key = fs::read_to_string(&base_key_path).map_err(io_err("read", &base_key_path))?;
    let key = format!("{base_key}; plus {REGISTRY_MARKER}, recipe 1");
    let archive = cache.join("busybox-registry.tar");
    let key_path = cache.join("busybox-registry.tar.key");
    if archive.exists() && fs::read_to_string(&key_path).is_ok_and(|k| k == key) {
        return Ok(archive);
    }
    let started = Instant::now();
    let work = cache.join("busybox-registry.build");
    if work.exists() {
        fs::remove_dir_all(&work).map_err(io_err("remove", &work))?;
    }
    let layout = work.join("layout");
    fs::create_dir_all(&layout).map_err(io_err("create", &layout))?;
    run(Command::new("tar")
        .arg("-C")
        .arg(&layout)
        .arg("-xf")
        .arg(&busybox))?;
    let marker = work.join("marker");
    fs::write(&marker, "pulled from evpleg's test registry\n").map_err(io_err("write", &marker))?;
    let image = format!("{}:{LOCAL_TAG}", layout.display());
    run(Command::new(UMOCI)
        .args(["insert", "--image", &image])
        .arg(&marker)
        .arg(REGISTRY_MARKER))?;
    archive_layout(&layout, &archive)?;
    fs::write(&key_path, &key).map_err(io_err("write", &key_path))?;
    fs::remove_dir_all(&work).map_err(io_err("remove", &work))?;
    tracing::info!(archive = %archive.display(), elapsed = ?started.elapsed(), "image built");
    drop(lock);
    Ok(archive)
}

/// The pause program's source.
fn pause_source() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("images")
        .join("pause.c")
}

/// Builds the busybox and pause images unless the cache has them for the same
/// inputs. Serialised between processes by a lock file in the cache.
fn build_images() -> Result<Vec<BuiltImage>> {
    let cache = image_cache_dir();
    fs::create_dir_all(&cache).map_err(io_err("create", &cache))?;
    let lock_path = cache.join(".lock");
    let lock = lock_exclusive(&lock_path)?;

    let busybox_meta = fs::metadata(BUSYBOX).map_err(io_err("stat", BUSYBOX))?;
    let busybox_key = format!(
        "recipe {IMAGE_RECIPE}; {BUSYBOX} size {} mtime {}.{}",
        busybox_meta.len(),
        busybox_meta.mtime(),
        busybox_meta.mtime_nsec()
    );
    let source = pause_source();
    let pause_c = fs::read(&source).map_err(io_err("read", &source))?;
    let pause_key = format!(
        "recipe {IMAGE_RECIPE}; pause.c fnv1a {:016x}",
        fnv1a(&pause_c)
    );

    let images = [
        (
            "busybox",
            busybox_key,
            populate_busybox as fn(&Path) -> Result<()>,
            vec![
                "--config.cmd",
                "/bin/sh",
                "--config.env",
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            ],
        ),
        (
            "pause",
            pause_key,
            populate_pause as fn(&Path) -> Result<()>,
            vec!["--config.entrypoint", "/pause"],
        ),
    ];
    let mut built = Vec::new();
    for (name, key, populate, config) in images {
        let archive = cache.join(format!("{name}.tar"));
        let key_path = cache.join(format!("{name}.tar.key"));
        let cached = archive.exists() && fs::read_to_string(&key_path).is_ok_and(|k| k == key);
        if cached {
            tracing::debug!(archive = %archive.display(), "image cached");
        } else {
            let started = Instant::now();
            build_image(&cache, name, populate, &config, &archive)?;
            fs::write(&key_path, &key).map_err(io_err("write", &key_path))?;
            tracing::info!(archive = %archive.display(), elapsed = ?started.elapsed(), "image built");
        }
        built.push(BuiltImage { name, archive });
    }
    drop(lock);
    Ok(built)
}

/// One image in its own OCI layout: `umoci init/new/unpack`, `populate` the
/// rootfs, `umoci repack/config/gc`, then a tar of the layout (index.json at
/// the top, as `ctr images import` expects).
fn build_image(
    cache: &Path,
    name: &str,
    populate: fn(&Path) -> Result<()>,
    config: &[&str],
    archive: &Path,
) -> Result<()> {
    let work = cache.join(format!("{name}.build"));
    if work.exists() {
        fs::remove_dir_all(&work).map_err(io_err("remove", &work))?;
    }
    fs::create_dir(&work).map_err(io_err("create", &work))?;
    let layout = work.join("layout");
    let bundle = work.join("bundle");
    let image = format!("{}:{LOCAL_TAG}", layout.display());

    run(Command::new(UMOCI).arg("init").arg("--layout").arg(&layout))?;
    run(Command::new(UMOCI).args(["new", "--image", &image]))?;
    run(Command::new(UMOCI)
        .args(["unpack", "--image", &image])
        .arg(&bundle))?;
    populate(&bundle.join("rootfs"))?;
    run(Command::new(UMOCI)
        .args(["repack", "--image", &image])
        .arg(&bundle))?;
    run(Command::new(UMOCI)
        .args(["config", "--image", &image])
        .args(config))?;
    archive_layout(&layout, archive)?;
    fs::remove_dir_all(&work).map_err(io_err("remove", &work))?;
    Ok(())
}

/// busybox with its applet links, a root user and a few directories.
fn populate_busybox(rootfs: &Path) -> Result<()> {
    for dir in ["bin", "etc", "tmp", "root", "proc", "sys", "dev"] {
        let d = rootfs.join(dir);
        fs::create_dir_all(&d).map_err(io_err("create", &d))?;
    }
    let target = rootfs.join("bin/busybox");
    fs::copy(BUSYBOX, &target).map_err(io_err("copy /bin/busybox to", &target))?;
    run(Command::new("chroot")
        .arg(rootfs)
        .args(["/bin/busybox", "--install", "-s", "/bin"]))?;
    let passwd = rootfs.join("etc/passwd");
    fs::write(
        &passwd,
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
    )
    .map_err(io_err("write", &passwd))?;
    let group = rootfs.join("etc/group");
    fs::write(&group, "root:x:0:\nnobody:x:65534:\n").map_err(io_err("write", &group))?;
    Ok(())
}

/// The static pause program at `/pause`.
fn populate_pause(rootfs: &Path) -> Result<()> {
    let libc_a = Path::new("/usr/lib/x86_64-linux-gnu/libc.a");
    if cfg!(target_arch = "x86_64") && !libc_a.exists() {
        return Err(HarnessError::MissingTool {
            path: libc_a.display().to_string(),
            install: "apt-get install libc6-dev",
        });
    }
    run(Command::new(GCC)
        .args(["-static", "-O2", "-o"])
        .arg(rootfs.join("pause"))
        .arg(pause_source()))?;
    Ok(())
}

/// FNV-1a, 64 bits: a stable fingerprint of the inputs (not cryptographic).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// How long [`wait_container_status`] waits, and how often it asks.
pub const STATUS_TIMEOUT: Duration = Duration::from_secs(20);
const STATUS_POLL: Duration = Duration::from_millis(20);

impl Containerd {
    /// A CRI client of this instance (version checked).
    pub async fn client(&self) -> evpleg_cri::CriClient {
        evpleg_cri::CriClient::connect(&self.endpoint(), evpleg_cri::CriClientConfig::default())
            .await
            .unwrap_or_else(|e| panic!("connect: {e}"))
    }

    /// The sandboxes of the pod with this UID, as this runtime lists them now.
    pub async fn pod_sandboxes(&self, uid: &str) -> Vec<v1::PodSandbox> {
        self.client()
            .await
            .list_pod_sandboxes(Some(v1::PodSandboxFilter {
                label_selector: [(evpleg_core::labels::POD_UID.to_owned(), uid.to_owned())].into(),
                ..Default::default()
            }))
            .await
            .expect("ListPodSandbox")
    }

    /// The containers of the pod with this UID, as this runtime lists them now.
    pub async fn pod_containers(&self, uid: &str) -> Vec<v1::Container> {
        self.client()
            .await
            .list_containers(Some(v1::ContainerFilter {
                label_selector: [(evpleg_core::labels::POD_UID.to_owned(), uid.to_owned())].into(),
                ..Default::default()
            }))
            .await
            .expect("ListContainers")
    }
}

/// Polls ContainerStatus of `id` until `done` holds, for at most
/// [`STATUS_TIMEOUT`] (containerd 1.6 has no event stream to wait on).
pub async fn wait_container_status(
    client: &evpleg_cri::CriClient,
    id: &str,
    what: &str,
    done: impl Fn(&v1::ContainerStatus) -> bool,
) -> v1::ContainerStatus {
    let deadline = Instant::now() + STATUS_TIMEOUT;
    loop {
        let status = client
            .container_status(id, false)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .status
            .expect("the client checks that a status is present");
        if done(&status) {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "container {id} not {what} within {STATUS_TIMEOUT:?}: {status:?}"
        );
        tokio::time::sleep(STATUS_POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape_mount("/a\\040b"), "/a b");
        assert_eq!(unescape_mount("/plain"), "/plain");
        assert_eq!(unescape_mount("/tail\\04"), "/tail\\04");
    }

    #[test]
    fn config_keeps_every_path_under_base() {
        let toml = config_toml(Path::new("/tmp/evpleg-x"));
        for line in toml.lines() {
            if let Some((_, value)) = line.split_once(" = \"/")
                && !value.starts_with("usr/sbin/runc")
            {
                assert!(value.starts_with("tmp/evpleg-x"), "{line}");
            }
        }
        assert!(toml.contains("restrict_oom_score_adj = true"));
        assert!(toml.contains("SystemdCgroup = false"));
        assert!(toml.contains(r#"sandbox_image = "localhost/pause:local""#));
        assert!(toml.contains(r#"config_path = "/tmp/evpleg-x/certs.d""#));
    }

    #[test]
    fn errors_name_what_failed() {
        let base = PathBuf::from("/tmp/evpleg-containerd-1-abc");
        let not_ready = HarnessError::NotReady {
            base: base.clone(),
            timeout: Duration::from_secs(20),
            last_error: "connect: refused".into(),
            tail: "level=fatal msg=boom".into(),
        };
        assert_eq!(
            not_ready.to_string(),
            "containerd --config /tmp/evpleg-containerd-1-abc/config.toml did not answer Version \
             on /tmp/evpleg-containerd-1-abc/containerd.sock within 20s (last error: connect: \
             refused); end of /tmp/evpleg-containerd-1-abc/containerd.log:\nlevel=fatal msg=boom"
        );
        let exited = HarnessError::Exited {
            base,
            status: "exit status: 1".into(),
            tail: "boom".into(),
        };
        assert!(exited.to_string().starts_with(
            "containerd --config /tmp/evpleg-containerd-1-abc/config.toml exited while starting"
        ));
        let io = io_err("read", "/nope")(io::Error::from(io::ErrorKind::NotFound));
        assert_eq!(io.to_string(), "cannot read /nope: entity not found");
        let failed = run(&mut Command::new("false")).unwrap_err();
        assert!(
            failed
                .to_string()
                .starts_with("`false` failed: exit status: 1"),
            "{failed}"
        );
    }

    #[test]
    fn fnv1a_is_stable() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
