//! The stock kubelet (built from `k8s.io/kubernetes` by `cargo xtask setup`,
//! docs/stock-kubelet.md) run standalone for tests: static pods from a
//! manifest directory, statuses read from its read-only port's `/pods` (a
//! standalone kubelet serves its static pods there with the status manager's
//! status, `Kubelet.GetPods`), its CRI endpoint the caller's (containerd
//! directly, or `evpleg cri-proxy` in front of it).
//!
//! The host is not the kubelet's to change. At start the kubelet sets six
//! kernel tunables it wants (`setupKernelTunables`: `vm.overcommit_memory=1`,
//! `kernel.panic=10`, `kernel.panic_on_oops=1`, ...), makes its root directory
//! a shared mount, keeps symlinks in the hard-coded `/var/log/containers` (and
//! removes the dead ones there) and its device plugin socket in the
//! hard-coded `/var/lib/kubelet/device-plugins`. So it runs in a private
//! mount namespace whose mounts do not propagate to the host: there, files
//! holding the values it wants are bound over those `/proc/sys` entries (it
//! reads them, finds nothing to change and writes nothing), and directories
//! of its own over `/var/log` and `/var/lib`. Its pod logs go to a directory of the test's
//! (`podLogsDir`), which containerd, in the host's namespace, writes. What
//! this costs: a volume the kubelet mounts (a secret's tmpfs) is not seen by
//! the runtime, so pods here use no such volumes.
//!
//! Its cgroups ([`KubeletCgroups`]): by default a cgroup root of its own
//! (`--cgroup-root`, `/evpleg-stock-<pid>-<n>`, made in every hierarchy
//! before it starts), so that its pods' cgroups are
//! `<root>/kubepods/<qos>/pod<uid>`. It removes the pod cgroups under its
//! `kubepods` that it does not know (`cleanupOrphanedPodCgroups`, killing
//! their processes): with the default root (`/kubepods`) those would be the
//! pods of every other test on the machine (the agent's pods are there), so
//! the root is never the default one. The kernel PLEG classifies
//! `/kubepods/...` paths only (`evpleg_core::cgroup_path`), so an `evpleg
//! cri-proxy` or `evpleg observe` beside such a kubelet would learn of its
//! pods' deaths by relisting only; the tests of those run it with
//! [`KubeletCgroups::ContainerdNamespace`]: no pod cgroups at all
//! (`cgroupsPerQOS: false`, hence no orphan clean-up either) and its
//! containers in containerd's `/k8s.io/<id>`, which the kernel PLEG
//! classifies. When it is dropped, the cgroups of a private root that are
//! empty are removed; the rest with [`remove_cgroups`] once the runtime has
//! removed the containers.
//!
//! Against an API server ([`StockKubelet::start_against`]): the kubelet is
//! given a kubeconfig (the node's identity, `system:node:<name>`, under the
//! Node authorizer and NodeRestriction, as the agent's real-API tests run it),
//! registers its Node and runs the pods bound to it; their statuses and
//! events are read from the API server, not from `/pods`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The kernel tunables the kubelet sets at start, with the values it wants
/// (`k8s.io/component-helpers/node/util/sysctl`).
const KUBELET_TUNABLES: [(&str, &str); 6] = [
    ("vm/overcommit_memory", "1"),
    ("vm/panic_on_oom", "0"),
    ("kernel/panic", "10"),
    ("kernel/panic_on_oops", "1"),
    ("kernel/keys/root_maxkeys", "1000000"),
    ("kernel/keys/root_maxbytes", "25000000"),
];

/// How long the kubelet may take to serve its read-only port.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Whether the stock kubelet can run here: [`crate::runtime_available`] and
/// its binary built. Prints why not; under `CI=true` that is a failure.
pub fn available(test: &str) -> bool {
    if !crate::runtime_available(test) {
        return false;
    }
    if let Err(e) = crate::go_tools::binary("kubelet") {
        crate::skip(test, &e.to_string());
        return false;
    }
    true
}

#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    #[error("stock kubelet: {0}")]
    Binary(crate::go_tools::GoToolsError),
    #[error("stock kubelet: {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("stock kubelet: no free port on 127.0.0.1: {0}")]
    Port(std::io::Error),
    #[error(
        "stock kubelet: exited before serving /pods ({status}); its errors:\n{errors}\nits log {log} ends:\n{tail}"
    )]
    Exited {
        status: std::process::ExitStatus,
        log: PathBuf,
        /// Its log's error and fatal lines, first: a test's output may keep
        /// only a failure message's beginning.
        errors: String,
        tail: String,
    },
    #[error("stock kubelet: /pods not served within {0:?}; its log {1}:\n{2}")]
    NotReady(Duration, PathBuf, String),
}

/// How to run it.
#[derive(Debug, Clone)]
pub struct KubeletOptions {
    /// `unix:///...` of the runtime (or of the proxy in front of it).
    pub endpoint: String,
    /// The node name (`--hostname-override`): static pods are `<name>-<node>`.
    pub node: String,
    /// `--feature-gates=EventedPLEG=true`.
    pub evented_pleg: bool,
    /// Where its pods' cgroups are.
    pub cgroups: KubeletCgroups,
}

/// Where a stock kubelet's pods' cgroups are: never under the default
/// `/kubepods`, where it would kill the other tests' pods.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KubeletCgroups {
    /// Pod cgroups as on a node (`cgroupsPerQOS`), under a cgroup root of its
    /// own: `<root>/kubepods/<qos>/pod<uid>`.
    #[default]
    PrivateRoot,
    /// No pod cgroups (`cgroupsPerQOS: false`, no node allocatable
    /// enforcement), its containers in `/k8s.io/<id>` (`cgroupRoot: /k8s.io`):
    /// where the kernel PLEG of a proxy or observer beside it sees them.
    ContainerdNamespace,
}

/// The cgroup root of [`KubeletCgroups::ContainerdNamespace`].
const CONTAINERD_NAMESPACE_ROOT: &str = "/k8s.io";

/// A running stock kubelet; stopped (SIGTERM, then SIGKILL) when dropped.
/// Its containers are the runtime's to remove (the containerd harness's
/// teardown does), then its cgroups the caller's ([`remove_cgroups`]).
#[derive(Debug)]
pub struct StockKubelet {
    child: Option<Child>,
    /// `unshare`'s arguments: the private mount namespace's set-up, then the
    /// kubelet's command line.
    argv: Vec<std::ffi::OsString>,
    base: PathBuf,
    manifests: PathBuf,
    log: PathBuf,
    /// Its read-only port (`/pods`, `/metrics`).
    pub read_only: std::net::SocketAddr,
    uids: std::sync::Mutex<std::collections::BTreeSet<String>>,
    cgroup_root: String,
}

/// The kubelet's `--root-dir` under its base.
fn root_dir(base: &Path) -> PathBuf {
    base.join("root")
}

/// A cgroup root no other kubelet of this machine uses: the test process's pid
/// and a counter.
fn private_cgroup_root() -> String {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("/evpleg-stock-{}-{n}", std::process::id())
}

/// The cgroup hierarchies' mount points: cgroup2's root, or on a hybrid host
/// each v1 controller's directory and the unified one under it.
fn hierarchies() -> Vec<PathBuf> {
    let base = PathBuf::from("/sys/fs/cgroup");
    if base.join("cgroup.controllers").exists() {
        return vec![base];
    }
    std::fs::read_dir(&base)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.join("cgroup.procs").exists())
                .collect()
        })
        .unwrap_or_default()
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> KubeletError + 'a {
    move |source| KubeletError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

impl StockKubelet {
    /// Starts the kubelet under `base` (its root, manifests, logs and
    /// configuration all below it) and waits until it serves `/pods`.
    pub async fn start(base: &Path, opts: &KubeletOptions) -> Result<Self, KubeletError> {
        Self::start_against(base, opts, None).await
    }

    /// As [`Self::start`], with `kubeconfig` (when given) the API server it
    /// registers its Node with and takes its pods from.
    pub async fn start_against(
        base: &Path,
        opts: &KubeletOptions,
        kubeconfig: Option<&Path>,
    ) -> Result<Self, KubeletError> {
        let base = base.join("stock-kubelet");
        let manifests = base.join("manifests");
        let root = root_dir(&base);
        let pod_logs = base.join("pod-logs");
        let var_log = base.join("var-log");
        let var_lib = base.join("var-lib");
        let certs = base.join("pki");
        let tunables = base.join("tunables");
        for dir in [
            &manifests, &root, &pod_logs, &var_log, &var_lib, &certs, &tunables,
        ] {
            std::fs::create_dir_all(dir).map_err(io("create", dir))?;
        }
        let free_port = || crate::ports::free_port().map_err(KubeletError::Port);
        let (port, read_only, healthz) = (free_port()?, free_port()?, free_port()?);
        // Its cgroup root must exist in every hierarchy before it starts.
        let cgroup_root = match opts.cgroups {
            KubeletCgroups::PrivateRoot => private_cgroup_root(),
            KubeletCgroups::ContainerdNamespace => CONTAINERD_NAMESPACE_ROOT.to_owned(),
        };
        for hierarchy in hierarchies() {
            let dir = hierarchy.join(cgroup_root.trim_start_matches('/'));
            std::fs::create_dir_all(&dir).map_err(io("create", &dir))?;
        }
        let config = base.join("config.yaml");
        let ports = Ports {
            port,
            read_only,
            healthz,
        };
        std::fs::write(
            &config,
            config_yaml(
                opts,
                &manifests,
                &pod_logs,
                &cgroup_root,
                ports,
                kubeconfig.is_some(),
            ),
        )
        .map_err(io("write", &config))?;
        // The private mount namespace's set-up, then the kubelet itself.
        let mut script = String::from("set -e\n");
        for (name, value) in KUBELET_TUNABLES {
            let file = tunables.join(name.replace('/', "."));
            std::fs::write(&file, format!("{value}\n")).map_err(io("write", &file))?;
            script.push_str(&format!(
                "mount --bind '{}' /proc/sys/{name}\n",
                file.display()
            ));
        }
        for (private, public) in [(&var_log, "/var/log"), (&var_lib, "/var/lib")] {
            script.push_str(&format!("mount --bind '{}' {public}\n", private.display()));
        }
        script.push_str("exec \"$@\"\n");
        let log = base.join("kubelet.log");
        std::fs::File::create(&log).map_err(io("create", &log))?;
        let kubelet = crate::go_tools::binary("kubelet").map_err(KubeletError::Binary)?;
        let mut argv: Vec<std::ffi::OsString> =
            ["--mount", "--propagation", "slave", "--", "sh", "-c"]
                .iter()
                .map(Into::into)
                .collect();
        argv.extend([script.into(), "sh".into(), kubelet.into_os_string()]);
        if let Some(kubeconfig) = kubeconfig {
            argv.push(format!("--kubeconfig={}", kubeconfig.display()).into());
        }
        argv.extend([
            format!("--config={}", config.display()).into(),
            format!("--root-dir={}", root.display()).into(),
            format!("--cert-dir={}", certs.display()).into(),
            format!("--hostname-override={}", opts.node).into(),
            "--v=2".into(),
        ]);
        let mut this = Self {
            child: None,
            argv,
            base,
            manifests,
            log,
            read_only: ([127, 0, 0, 1], read_only).into(),
            uids: Default::default(),
            cgroup_root,
        };
        this.spawn()?;
        this.wait_ready().await?;
        Ok(this)
    }

    /// Runs the kubelet's command line, its output appended to its log.
    fn spawn(&mut self) -> Result<(), KubeletError> {
        let out = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.log)
            .map_err(io("open", &self.log))?;
        let err = out.try_clone().map_err(io("open", &self.log))?;
        let child = Command::new("unshare")
            .args(&self.argv)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(io("spawn", Path::new("unshare")))?;
        self.child = Some(child);
        Ok(())
    }

    /// Stops the kubelet ([`Self::stop`]: its pods keep running) and starts
    /// it again with the same flags, configuration, state and ports, as an
    /// operator's `systemctl restart kubelet`; waits until it serves `/pods`.
    pub async fn restart(&mut self) -> Result<(), KubeletError> {
        self.stop();
        self.spawn()?;
        self.wait_ready().await
    }

    async fn wait_ready(&mut self) -> Result<(), KubeletError> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                return Err(KubeletError::Exited {
                    status,
                    log: self.log.clone(),
                    errors: self.log_errors(),
                    tail: self.log_tail(),
                });
            }
            if self.pods().await.is_some() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(KubeletError::NotReady(
                    START_TIMEOUT,
                    self.log.clone(),
                    self.log_tail(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The last lines of its log, for failure messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// The last error and fatal lines of its log (klog's `E`/`F` lines).
    fn log_errors(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let errors: Vec<&str> = text.lines().filter(|l| is_klog_error(l)).collect();
        errors[errors.len().saturating_sub(10)..].join("\n")
    }

    /// Writes a static pod manifest (renamed in, never seen half written).
    pub fn write(&self, file: &str, yaml: &str) {
        let tmp = self.base.join(format!(".{file}.tmp"));
        std::fs::write(&tmp, yaml).expect("write manifest");
        std::fs::rename(&tmp, self.manifests.join(file)).expect("rename manifest");
    }

    /// Removes a static pod manifest.
    pub fn remove(&self, file: &str) {
        std::fs::remove_file(self.manifests.join(file)).expect("remove manifest");
    }

    /// Its `/pods` now, `None` when it does not answer.
    pub async fn pods(&self) -> Option<Value> {
        pods_at(self.read_only).await
    }

    /// Its `/metrics` now (the read-only port serves them), `None` when it
    /// does not answer.
    pub async fn metrics(&self) -> Option<String> {
        get(self.read_only, "/metrics").await
    }

    /// The pod `<name>-<node>` as the kubelet serves it now.
    pub async fn pod(&self, name: &str, node: &str) -> Option<Value> {
        let list = self.pods().await?;
        let full = format!("{name}-{node}");
        let pod = list["items"]
            .as_array()?
            .iter()
            .find(|p| p["metadata"]["name"] == full.as_str())
            .cloned()?;
        if let Some(uid) = pod["metadata"]["uid"].as_str() {
            self.uids
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(uid.to_owned());
        }
        Some(pod)
    }

    /// Polls `/pods` every `every` until the pod satisfies `check` (bounded by
    /// `deadline`); returns it and when it was first seen so.
    pub async fn wait_for(
        &self,
        name: &str,
        node: &str,
        what: &str,
        deadline: Duration,
        every: Duration,
        check: impl Fn(&Value) -> bool,
    ) -> (Value, Instant) {
        let end = Instant::now() + deadline;
        loop {
            if let Some(p) = self.pod(name, node).await
                && check(&p)
            {
                return (p, Instant::now());
            }
            assert!(
                Instant::now() < end,
                "stock kubelet: pod {name}: {what} not seen within {deadline:?}; last: {:#}\nkubelet log:\n{}",
                self.pod(name, node).await.unwrap_or(Value::Null),
                self.log_tail()
            );
            tokio::time::sleep(every).await;
        }
    }

    /// The kubelet's process id while it runs (`unshare` and `sh` exec into
    /// it, so the child's pid is the kubelet's).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stops the kubelet: SIGTERM, then SIGKILL after 10 s.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // SAFETY: kill has no memory preconditions; the pid is our child's.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Its cgroup root (`--cgroup-root`): its pods' cgroups are
    /// `<root>/kubepods/<qos>/pod<uid>` with [`KubeletCgroups::PrivateRoot`],
    /// its containers' `<root>/<id>` with the other.
    pub fn cgroup_root(&self) -> &str {
        &self.cgroup_root
    }

    /// Its `--root-dir` (its `plugins_registry/` there).
    pub fn root_dir(&self) -> PathBuf {
        root_dir(&self.base)
    }

    /// Its own cgroup root, the caller's to remove with [`remove_cgroups`];
    /// `None` when it shares containerd's.
    pub fn private_cgroup_root(&self) -> Option<&str> {
        (self.cgroup_root != CONTAINERD_NAMESPACE_ROOT).then_some(self.cgroup_root.as_str())
    }

    /// The pod UIDs it served (of the pods asked for by name).
    pub fn uids(&self) -> Vec<String> {
        self.uids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }
}

impl Drop for StockKubelet {
    /// Stops it and removes what of its cgroups is empty already; the rest
    /// is the caller's to remove with [`remove_cgroups`] once the runtime has
    /// removed the containers.
    fn drop(&mut self) {
        self.stop();
        if let Some(root) = self.private_cgroup_root() {
            remove_cgroups(root);
        }
    }
}

/// Removes a stock kubelet's own cgroup `root`
/// ([`StockKubelet::private_cgroup_root`]) with everything below it (its pod
/// cgroups and QoS levels), deepest first, in every hierarchy: call it once
/// the runtime has removed the pods' containers (a cgroup still holding a
/// process stays). The root is this kubelet's alone, so nothing else's goes.
pub fn remove_cgroups(root: &str) {
    let relative = root.trim_start_matches('/');
    if relative.is_empty() || root == CONTAINERD_NAMESPACE_ROOT {
        return;
    }
    for hierarchy in hierarchies() {
        remove_tree(&hierarchy.join(relative));
    }
}

/// rmdir of `dir` after its subdirectories (a cgroup's files go with it).
fn remove_tree(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_tree(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// Whether a klog line is an error's or a fatal's (`E1206 01:32:53.25 ...`).
fn is_klog_error(line: &str) -> bool {
    let b = line.as_bytes();
    b.len() > 5 && matches!(b[0], b'E' | b'F') && b[1..5].iter().all(u8::is_ascii_digit)
}

/// The kubelet's three ports.
#[derive(Debug, Clone, Copy)]
struct Ports {
    port: u16,
    read_only: u16,
    healthz: u16,
}

fn config_yaml(
    opts: &KubeletOptions,
    manifests: &Path,
    pod_logs: &Path,
    cgroup_root: &str,
    Ports {
        port,
        read_only,
        healthz,
    }: Ports,
    register_node: bool,
) -> String {
    let cgroups = match opts.cgroups {
        KubeletCgroups::PrivateRoot => "cgroupsPerQOS: true",
        KubeletCgroups::ContainerdNamespace => "cgroupsPerQOS: false\nenforceNodeAllocatable: []",
    };
    let gates = if opts.evented_pleg {
        "featureGates:\n  EventedPLEG: true\n"
    } else {
        ""
    };
    format!(
        "apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: {port}
readOnlyPort: {read_only}
healthzBindAddress: 127.0.0.1
healthzPort: {healthz}
staticPodPath: {manifests}
fileCheckFrequency: 1s
podLogsDir: {pod_logs}
containerRuntimeEndpoint: {endpoint}
imageServiceEndpoint: {endpoint}
cgroupDriver: cgroupfs
cgroupRoot: {cgroup_root}
{cgroups}
failSwapOn: false
failCgroupV1: false
registerNode: {register_node}
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
crashLoopBackOff:
  maxContainerRestartPeriod: 1s
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 1Mi
  nodefs.available: 1%
  imagefs.available: 1%
{gates}",
        manifests = manifests.display(),
        pod_logs = pod_logs.display(),
        endpoint = opts.endpoint,
    )
}

/// The `/pods` a kubelet's port at `addr` serves (the stock kubelet's
/// read-only one, evpleg's own), `None` when it does not answer.
pub(crate) async fn pods_at(addr: std::net::SocketAddr) -> Option<Value> {
    let body = get(addr, "/pods").await?;
    serde_json::from_str(&body).ok()
}

/// One HTTP/1.1 GET: the body of a 200 answer, or `None` when the peer is
/// not (yet) there or answers otherwise; bounded at 5 s.
async fn get(addr: std::net::SocketAddr, path: &str) -> Option<String> {
    use http_body_util::BodyExt;
    tokio::time::timeout(Duration::from_secs(5), async {
        let stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .ok()?;
        tokio::spawn(conn);
        let request = hyper::Request::get(path)
            .header(hyper::header::HOST, addr.to_string())
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .ok()?;
        let response = sender.send_request(request).await.ok()?;
        if response.status() != hyper::StatusCode::OK {
            return None;
        }
        let body = response.into_body().collect().await.ok()?.to_bytes();
        String::from_utf8(body.to_vec()).ok()
    })
    .await
    .ok()?
}

#[cfg(test)]
mod tests {
    use super::is_klog_error;

    #[test]
    fn klog_error_and_fatal_lines_are_told_from_the_others() {
        assert!(is_klog_error(
            r#"E1206 01:32:53.3 12980 server.go:213] "Failed to listen and serve""#
        ));
        assert!(is_klog_error("F1206 01:32:53.3 12980 server.go:1] fatal"));
        assert!(!is_klog_error(
            "I1206 01:32:53.3 12980 kubelet.go:518] standalone"
        ));
        assert!(!is_klog_error("Error: unknown flag"));
        assert!(!is_klog_error("E"));
    }
}
