//! A real control plane for the tests of the agent's API paths: etcd and
//! kube-apiserver (built from their Go modules by `cargo xtask setup`, found
//! by [`binary`]) on loopback, on ports free at start, each instance with its
//! own data directory under the temporary directory, stopped and removed when
//! dropped.
//!
//! As on a real cluster (kubeadm's defaults): TLS with a CA made at test time
//! ([`pki`]); client certificates, an admin in `system:masters` and one per
//! node as `system:node:<name>` in `system:nodes`; authorization `Node,RBAC`;
//! the default admission plugins plus `NodeRestriction`; a service-account
//! signing key, so that TokenRequest works. Unlike a cluster: no
//! kube-controller-manager and no scheduler (tests bind pods by
//! `spec.nodeName`; nothing creates a namespace's `default` ServiceAccount,
//! so [`ControlPlane::namespace`] does, with `automountServiceAccountToken:
//! false`, as the `ServiceAccount` admission plugin refuses pods without
//! it; no garbage collector, no namespace deletion); the `kubernetes`
//! Service's endpoints are not reconciled (`--endpoint-reconciler-type=none`:
//! a loopback address is not a valid endpoint); etcd runs with
//! `--unsafe-no-fsync`.
//!
//! Every request is written to an audit log (level `Request`: who, verb,
//! URI, answer code and the request's body), which the tests read back
//! ([`ControlPlane::audit`]) to see what the agent sent and what the API
//! server refused.
//!
//! [`ControlPlane::shared`] gives the tests of one test binary one instance
//! while any of them holds it (tests use their own namespaces and node
//! names); the last one to drop it stops it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Service, ServiceAccount};
use kube::Api;
use kube::api::PostParams;
use serde_json::{Value, json};

pub mod pki;

pub use pki::{Issued, Pki, kubeconfig};

/// Bound of the start of both processes.
pub const START_TIMEOUT: Duration = Duration::from_secs(90);

/// Errors of the control plane harness.
#[derive(Debug, thiserror::Error)]
pub enum ControlPlaneError {
    #[error("control plane: {0}")]
    MissingBinary(crate::go_tools::GoToolsError),
    #[error("openssl, {what}: {message}")]
    Openssl { what: String, message: String },
    #[error("{action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{name} exited before it was ready ({status}); the end of {}:\n{tail}", log.display())]
    Exited {
        name: &'static str,
        status: ExitStatus,
        log: PathBuf,
        tail: String,
    },
    #[error("{name} not ready within {timeout:?} (last: {last}); the end of {}:\n{tail}", log.display())]
    NotReady {
        name: &'static str,
        timeout: Duration,
        last: String,
        log: PathBuf,
        tail: String,
    },
    #[error("a client from {}: {message}", path.display())]
    Client { path: PathBuf, message: String },
}

impl ControlPlaneError {
    pub(crate) fn io(action: &'static str, path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            action,
            path: path.to_owned(),
            source,
        }
    }
}

/// The binary `name` (`kube-apiserver`, `etcd`) as `cargo xtask setup`
/// built it ([`crate::go_tools::binary`]).
pub fn binary(name: &str) -> Result<PathBuf, ControlPlaneError> {
    crate::go_tools::binary(name).map_err(ControlPlaneError::MissingBinary)
}

/// Whether the control plane can run here (its binaries found). Prints why
/// not and returns `false`; under `CI=true` that is a failure instead.
pub fn available(test: &str) -> bool {
    let missing: Vec<String> = ["etcd", "kube-apiserver"]
        .into_iter()
        .filter_map(|name| binary(name).err().map(|e| e.to_string()))
        .collect();
    if missing.is_empty() {
        return true;
    }
    crate::skip(test, &missing.join("; "));
    false
}

/// A port free on 127.0.0.1 now ([`crate::ports`]; should another take it
/// first, [`ControlPlane::start`] tries again).
fn free_port() -> Result<u16, ControlPlaneError> {
    crate::ports::free_port()
        .map_err(|e| ControlPlaneError::io("find a free port on", Path::new("127.0.0.1"), e))
}

/// A child process logging to a file; stopped (SIGTERM, then SIGKILL after
/// 3 s: kube-apiserver drains for longer, and its data is thrown away) when
/// dropped.
#[derive(Debug)]
struct Process {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Process {
    fn spawn(
        name: &'static str,
        binary: &Path,
        args: &[String],
        log: PathBuf,
    ) -> Result<Self, ControlPlaneError> {
        let out =
            std::fs::File::create(&log).map_err(|e| ControlPlaneError::io("create", &log, e))?;
        let err = out
            .try_clone()
            .map_err(|e| ControlPlaneError::io("open", &log, e))?;
        let child = Command::new(binary)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| ControlPlaneError::io("start", binary, e))?;
        tracing::info!(name, pid = child.id(), log = %log.display(), "control plane: started");
        Ok(Self { name, child, log })
    }

    /// The last lines of its log.
    fn tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// An error when it has exited.
    fn check(&mut self) -> Result<(), ControlPlaneError> {
        match self.child.try_wait() {
            Ok(Some(status)) => Err(ControlPlaneError::Exited {
                name: self.name,
                status,
                log: self.log.clone(),
                tail: self.tail(),
            }),
            _ => Ok(()),
        }
    }

    fn not_ready(&self, timeout: Duration, last: String) -> ControlPlaneError {
        ControlPlaneError::NotReady {
            name: self.name,
            timeout,
            last,
            log: self.log.clone(),
            tail: self.tail(),
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let pid = self.child.id();
        if let Ok(pid) = i32::try_from(pid) {
            // SAFETY: kill(2) on the pid of our own child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Ok(None) => {
                    tracing::warn!(
                        name = self.name,
                        pid,
                        "control plane: no exit after SIGTERM; SIGKILL"
                    );
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break;
                }
            }
        }
        tracing::info!(name = self.name, pid, "control plane: stopped");
    }
}

/// The running control plane; stopped and its directory removed when dropped.
#[derive(Debug)]
pub struct ControlPlane {
    dir: PathBuf,
    pki: Pki,
    url: String,
    admin_kubeconfig: PathBuf,
    apiserver: Option<Process>,
    etcd: Option<Process>,
    /// How long the start took, to readiness.
    pub started_in: Duration,
}

/// One request as the audit log recorded it.
#[derive(Clone, Debug)]
pub struct AuditRecord {
    /// The authenticated user, e.g. `system:node:n1`.
    pub user: String,
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`.
    pub verb: String,
    /// Path and query.
    pub uri: String,
    /// The answer's code (0 when none was recorded).
    pub code: u16,
    /// The answer's message, for a refusal.
    pub message: String,
    /// The request's body, for writes.
    pub body: Option<Value>,
}

impl AuditRecord {
    pub fn path(&self) -> &str {
        self.uri.split('?').next().unwrap_or_default()
    }

    /// The value of a query parameter, percent-decoded.
    pub fn query(&self, key: &str) -> Option<String> {
        let (_, query) = self.uri.split_once('?')?;
        form_urlencoded::parse(query.as_bytes())
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.into_owned())
    }
}

static SHARED: tokio::sync::Mutex<Weak<ControlPlane>> = tokio::sync::Mutex::const_new(Weak::new());

impl ControlPlane {
    /// The instance the tests of this binary share while any holds it, started
    /// now when none does. Panics when it cannot start (callers check
    /// [`available`] first).
    pub async fn shared() -> Arc<Self> {
        let mut slot = SHARED.lock().await;
        if let Some(cp) = slot.upgrade() {
            return cp;
        }
        let cp = Arc::new(
            Self::start()
                .await
                .unwrap_or_else(|e| panic!("control plane: {e}")),
        );
        *slot = Arc::downgrade(&cp);
        cp
    }

    /// Starts etcd and kube-apiserver and waits until the API server is ready
    /// (its `/readyz`, and its system namespaces); tries three times when a
    /// process exits at start (a port taken meanwhile).
    pub async fn start() -> Result<Self, ControlPlaneError> {
        let etcd = binary("etcd")?;
        let apiserver = binary("kube-apiserver")?;
        let started = Instant::now();
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::start_once(&etcd, &apiserver, started).await {
                Err(e @ ControlPlaneError::Exited { .. }) if attempt < 3 => {
                    tracing::warn!(attempt, "control plane: {e}; again on other ports");
                }
                other => return other,
            }
        }
    }

    async fn start_once(
        etcd_bin: &Path,
        apiserver_bin: &Path,
        started: Instant,
    ) -> Result<Self, ControlPlaneError> {
        let dir = std::env::temp_dir().join(format!(
            "evpleg-control-plane-{}-{:012x}",
            std::process::id(),
            crate::unique_u64() & 0xffff_ffff_ffff
        ));
        std::fs::create_dir_all(&dir).map_err(|e| ControlPlaneError::io("create", &dir, e))?;
        // Removed on any error from here on.
        let cleanup = RemoveOnDrop(Some(dir.clone()));
        let pki = Pki::create(&dir.join("pki"))?;
        let serving = pki.issue(
            "apiserver",
            "/CN=kube-apiserver",
            &[
                "IP:127.0.0.1",
                "DNS:localhost",
                "DNS:kubernetes.default.svc",
            ],
        )?;
        let admin = pki.issue("admin", "/O=system:masters/CN=evpleg-test-admin", &[])?;
        // The API server's identity towards kubelets (kubeadm's
        // apiserver-kubelet-client, here in system:masters).
        let kubelet_client = pki.issue(
            "apiserver-kubelet-client",
            "/O=system:masters/CN=kube-apiserver-kubelet-client",
            &[],
        )?;
        let signing = pki.signing_key("service-account")?;
        let policy = dir.join("audit-policy.yaml");
        std::fs::write(&policy, AUDIT_POLICY)
            .map_err(|e| ControlPlaneError::io("write", &policy, e))?;

        let (client, peer, secure) = (free_port()?, free_port()?, free_port()?);
        let etcd_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let etcd_args: Vec<String> = [
            "--name=evpleg-test".to_owned(),
            format!("--data-dir={}", dir.join("etcd").display()),
            format!("--listen-client-urls={etcd_url}"),
            format!("--advertise-client-urls={etcd_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster=evpleg-test={peer_url}"),
            "--unsafe-no-fsync".to_owned(),
            "--log-level=warn".to_owned(),
        ]
        .into();
        let mut etcd = Process::spawn("etcd", etcd_bin, &etcd_args, dir.join("etcd.log"))?;
        wait_etcd(&mut etcd, client).await?;

        let url = format!("https://127.0.0.1:{secure}");
        let d = |p: &Path| p.display().to_string();
        let apiserver_args: Vec<String> = [
            format!("--etcd-servers={etcd_url}"),
            "--bind-address=127.0.0.1".to_owned(),
            "--advertise-address=127.0.0.1".to_owned(),
            format!("--secure-port={secure}"),
            format!("--cert-dir={}", dir.join("apiserver-certs").display()),
            format!("--tls-cert-file={}", d(&serving.cert)),
            format!("--tls-private-key-file={}", d(&serving.key)),
            format!("--client-ca-file={}", d(&pki.ca().cert)),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".to_owned(),
            format!("--service-account-key-file={}", d(&signing.cert)),
            format!("--service-account-signing-key-file={}", d(&signing.key)),
            "--service-cluster-ip-range=10.96.0.0/16".to_owned(),
            "--authorization-mode=Node,RBAC".to_owned(),
            "--enable-admission-plugins=NodeRestriction".to_owned(),
            "--allow-privileged=true".to_owned(),
            "--endpoint-reconciler-type=none".to_owned(),
            "--profiling=false".to_owned(),
            format!("--audit-policy-file={}", d(&policy)),
            format!("--kubelet-client-certificate={}", d(&kubelet_client.cert)),
            format!("--kubelet-client-key={}", d(&kubelet_client.key)),
            // A node's InternalIP first: its Hostname need not resolve here.
            "--kubelet-preferred-address-types=InternalIP,Hostname".to_owned(),
            format!("--audit-log-path={}", dir.join("audit.log").display()),
        ]
        .into();
        let mut apiserver = Process::spawn(
            "kube-apiserver",
            apiserver_bin,
            &apiserver_args,
            dir.join("kube-apiserver.log"),
        )?;
        let admin_kubeconfig = dir.join("admin.kubeconfig");
        let yaml = kubeconfig(&url, &pki.ca().cert, "evpleg-test-admin", &admin);
        std::fs::write(&admin_kubeconfig, yaml)
            .map_err(|e| ControlPlaneError::io("write", &admin_kubeconfig, e))?;
        let admin_client = client_from(&admin_kubeconfig).await?;
        wait_apiserver(&mut apiserver, &mut etcd, &admin_client, started).await?;
        let started_in = started.elapsed();
        tracing::info!(?started_in, %url, dir = %dir.display(), "control plane: ready");
        std::mem::forget(cleanup);
        Ok(Self {
            dir,
            pki,
            url,
            admin_kubeconfig,
            apiserver: Some(apiserver),
            etcd: Some(etcd),
            started_in,
        })
    }

    /// The API server's URL, `https://127.0.0.1:<port>`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The directory holding everything of this instance.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The CA the API server's certificate and the clients' chain to.
    pub fn ca(&self) -> &Path {
        &self.pki.ca().cert
    }

    /// A kubeconfig of the admin (`system:masters`).
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin_kubeconfig
    }

    /// A new client as the admin (made per call: a client's connections live
    /// on the runtime that made it, and each test has its own).
    pub async fn admin(&self) -> kube::Client {
        client_from(&self.admin_kubeconfig)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// A kubeconfig for the agent of node `node`: its own client certificate
    /// (`system:node:<node>`, `system:nodes`), made now.
    pub fn node_kubeconfig(&self, node: &str) -> PathBuf {
        let identity = self
            .pki
            .node(node)
            .unwrap_or_else(|e| panic!("the certificate of node {node}: {e}"));
        let path = self.dir.join(format!("node-{node}.kubeconfig"));
        let yaml = kubeconfig(
            &self.url,
            self.ca(),
            &format!("system:node:{node}"),
            &identity,
        );
        std::fs::write(&path, yaml).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        path
    }

    /// A client as node `node`, built as the agent builds its own: no retries
    /// inside the client.
    pub async fn node_client(&self, node: &str) -> kube::Client {
        let path = self.node_kubeconfig(node);
        let mut config = config_from(&path).await.unwrap_or_else(|e| panic!("{e}"));
        config.default_retry = false;
        kube::Client::try_from(config)
            .unwrap_or_else(|e| panic!("a client from {}: {e}", path.display()))
    }

    /// A new namespace named `<prefix>-<random>`, with its `default`
    /// ServiceAccount (no token automount), which no controller makes here.
    pub async fn namespace(&self, prefix: &str) -> String {
        let name = format!("{prefix}-{:08x}", crate::unique_u64() & 0xffff_ffff);
        self.ensure_namespace(&name).await;
        name
    }

    /// Namespace `name` and its `default` ServiceAccount, created when missing.
    pub async fn ensure_namespace(&self, name: &str) {
        let client = self.admin().await;
        let namespace: Namespace =
            serde_json::from_value(json!({"metadata": {"name": name}})).expect("a namespace");
        create_or_keep(&Api::<Namespace>::all(client.clone()), &namespace, name).await;
        let account: ServiceAccount = serde_json::from_value(json!({
            "metadata": {"name": "default", "namespace": name},
            "automountServiceAccountToken": false,
        }))
        .expect("a service account");
        create_or_keep(
            &Api::<ServiceAccount>::namespaced(client, name),
            &account,
            &format!("{name}/default"),
        )
        .await;
    }

    /// The requests recorded so far (read requests of the API server's own
    /// loopback client and health checks left out, by the audit policy).
    pub fn audit(&self) -> Vec<AuditRecord> {
        let path = self.dir.join("audit.log");
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        text.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .map(|v| AuditRecord {
                user: v["user"]["username"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                verb: v["verb"].as_str().unwrap_or_default().to_owned(),
                uri: v["requestURI"].as_str().unwrap_or_default().to_owned(),
                code: v["responseStatus"]["code"]
                    .as_u64()
                    .and_then(|c| u16::try_from(c).ok())
                    .unwrap_or(0),
                message: v["responseStatus"]["message"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                body: v.get("requestObject").cloned(),
            })
            .collect()
    }

    /// The requests of `user` the API server refused: a 4xx other than 404,
    /// 409 and a 403 on reading a pod, which the agent expects and handles
    /// (the Node authorizer's answer to a node reading a pod not bound to
    /// it, also one that does not exist).
    pub fn refused(&self, user: &str) -> Vec<AuditRecord> {
        self.audit()
            .into_iter()
            .filter(|r| r.user == user && (400..500).contains(&r.code))
            .filter(|r| r.code != 404 && r.code != 409)
            .filter(|r| !(r.code == 403 && r.verb == "get" && r.path().contains("/pods/")))
            .collect()
    }

    /// The API server's log, for a failure's message.
    pub fn apiserver_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("kube-apiserver.log")).unwrap_or_default()
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        // The API server before its etcd, both before their directory.
        drop(self.apiserver.take());
        drop(self.etcd.take());
        match std::fs::remove_dir_all(&self.dir) {
            Ok(()) => tracing::info!(dir = %self.dir.display(), "control plane: removed"),
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), "control plane: cannot remove: {e}")
            }
        }
    }
}

/// Removes a directory when dropped (the start's cleanup on an error).
struct RemoveOnDrop(Option<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// What the audit log records: every request at level `Request` (with its
/// body), but not the API server's own loopback client nor health checks.
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: None
  users: [\"system:apiserver\"]
- level: None
  nonResourceURLs: [\"/readyz*\", \"/healthz*\", \"/livez*\"]
- level: Request
";

/// A kube client configuration from a kubeconfig file.
async fn config_from(path: &Path) -> Result<kube::Config, ControlPlaneError> {
    let error = |message: String| ControlPlaneError::Client {
        path: path.to_owned(),
        message,
    };
    let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| error(e.to_string()))?;
    kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
        .await
        .map_err(|e| error(e.to_string()))
}

/// A kube client from a kubeconfig file.
async fn client_from(path: &Path) -> Result<kube::Client, ControlPlaneError> {
    let config = config_from(path).await?;
    kube::Client::try_from(config).map_err(|e| ControlPlaneError::Client {
        path: path.to_owned(),
        message: e.to_string(),
    })
}

/// Waits until etcd answers `/health` with `"health":"true"`.
async fn wait_etcd(etcd: &mut Process, port: u16) -> Result<(), ControlPlaneError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let deadline = Instant::now() + START_TIMEOUT;
    let mut last: String;
    loop {
        etcd.check()?;
        let answer = async {
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
            s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                .await?;
            let mut out = String::new();
            s.read_to_string(&mut out).await?;
            Ok::<_, std::io::Error>(out)
        };
        match tokio::time::timeout(Duration::from_secs(2), answer).await {
            Ok(Ok(out)) if out.contains("\"health\":\"true\"") => return Ok(()),
            Ok(Ok(out)) => last = out,
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = "no answer within 2 s".into(),
        }
        if Instant::now() > deadline {
            return Err(etcd.not_ready(START_TIMEOUT, last));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the API server's `/readyz` says `ok`, the namespaces it
/// makes itself (`default`, `kube-system`, `kube-node-lease`) exist, and so
/// does the `default/kubernetes` Service: its bootstrap controller writes
/// that after `/readyz` can already say `ok`, and a pod's service variables
/// (`KUBERNETES_SERVICE_HOST`) come from it.
async fn wait_apiserver(
    apiserver: &mut Process,
    etcd: &mut Process,
    client: &kube::Client,
    started: Instant,
) -> Result<(), ControlPlaneError> {
    let deadline = started + START_TIMEOUT;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let mut last: String;
    loop {
        etcd.check()?;
        apiserver.check()?;
        let request = axum::http::Request::get("/readyz")
            .body(Vec::new())
            .expect("a request");
        match tokio::time::timeout(Duration::from_secs(5), client.request_text(request)).await {
            Ok(Ok(text)) if text.trim() == "ok" => {
                let mut missing = Vec::new();
                for ns in ["default", "kube-system", "kube-node-lease"] {
                    if !matches!(namespaces.get_opt(ns).await, Ok(Some(_))) {
                        missing.push(ns);
                    }
                }
                if !missing.is_empty() {
                    last = format!("ready, but no namespace {}", missing.join(", "));
                } else if !matches!(services.get_opt("kubernetes").await, Ok(Some(_))) {
                    last = "ready, but no service default/kubernetes".into();
                } else {
                    return Ok(());
                }
            }
            Ok(Ok(text)) => last = text,
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = "no answer within 5 s".into(),
        }
        if Instant::now() > deadline {
            return Err(apiserver.not_ready(START_TIMEOUT, last));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Creates `object`; one that exists already is fine.
pub async fn create_or_keep<K>(api: &Api<K>, object: &K, what: &str)
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.create(&PostParams::default(), object).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("creating {what}: {e}"),
    }
}
