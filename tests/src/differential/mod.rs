//! The differential harness (issue #31): the same static pod manifests (the
//! corpus, `tests/fidelity/*.yaml`) run once under the stock kubelet 1.37
//! ([`crate::stock_kubelet`]) and once under `evpleg run` (the agent in
//! process, as [`crate::e2e`] runs it), each standalone on its own private
//! containerd of the same version (1.7), with the same CrashLoopBackOff (1 s
//! initial and maximum: the kubelet's `maxContainerRestartPeriod`, the agent's
//! `--crashloop-backoff-initial`/`-max`) and the same node name; what is
//! recorded of each pod ([`record`]) is then compared field by field
//! ([`report`]), and each difference is matched against the table of known
//! ones ([`known`]): deliberate (with the reason) or an open bug.
//!
//! Where it differs from what a user sees: the kubelet's standalone statuses
//! come from its read-only `/pods` (the status manager's), the agent's from its
//! local store (the same JSON); a pod's status after its manifest is removed is
//! not served by the kubelet, so deletion is compared through the runtime (when
//! each container ended, with which exit code). Events are not compared (a
//! standalone kubelet writes them nowhere readable).

pub mod act;
pub mod api;
pub mod known;
mod node;
pub mod record;
pub mod report;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use evpleg_cri_api::v1;
use serde_json::Value;

use crate::containerd::Containerd;
use crate::control_plane::ControlPlane;
use node::Node;
use record::{Attempt, Record};

/// The node name on both sides: static pods are `<name>-<node>`.
pub const NODE: &str = "fidelity";
/// How often statuses are polled.
pub const STATUS_POLL: Duration = Duration::from_millis(50);
/// How often the runtime's containers are polled.
pub const CRI_POLL: Duration = Duration::from_millis(200);
/// How long a case may take to reach its `until` (and its deletion to end).
pub const CASE_DEADLINE: Duration = Duration::from_secs(120);
/// How long a status keeps being recorded once `until` holds.
pub const SETTLE: Duration = Duration::from_secs(2);

/// The most cases a side runs at once (on one containerd and node). The
/// whole corpus at once, 48 pods starting together on this machine's two
/// cores, made either side's syncs take 0.9 to 2.5 s and its relists queue:
/// the comparison then measured which side that contention slowed more in a
/// given run (the intermittent timing rows it left in the known table), not
/// what each does. How evpleg behaves under load is the benchmark's to
/// measure (docs/benchmarks.md).
pub const AT_ONCE: usize = 12;

/// The port of the gRPC health service the harness serves while a side runs
/// (the corpus's busybox has none): `SERVING` for the whole server (service
/// `""`), for the gRPC probe that passes. The pods share the host's network.
pub const GRPC_HEALTH_PORT: u16 = 18436;

#[derive(Debug, thiserror::Error)]
pub enum DifferentialError {
    #[error("fidelity corpus: {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("fidelity corpus: {path}: {why}")]
    Manifest { path: PathBuf, why: String },
    #[error("fidelity: containerd: {0}")]
    Containerd(String),
    #[error("fidelity: {0}")]
    Kubelet(#[from] crate::stock_kubelet::KubeletError),
    #[error("fidelity: the agent: {0}")]
    Agent(String),
    #[error("fidelity: the API server: {0}")]
    Api(String),
    #[error("fidelity: the CSI driver: {0}")]
    CsiDriver(String),
    #[error("fidelity: the gRPC health service on port {port}: {source}")]
    Health { port: u16, source: std::io::Error },
}

/// Where the pods come from and where their statuses are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Standalone, static pods from a manifest directory.
    Static,
    /// API pods on the real API server (the sides' Nodes distinct).
    Api,
}

/// When a case's status is final for the comparison.
#[derive(Debug, Clone, PartialEq)]
pub enum Until {
    /// The phase is Succeeded or Failed and the pod's sandbox is stopped
    /// (no `PodReadyToStartContainers` True): the final status is in. The
    /// phase alone came as much as 3 s before the sandbox's stop on evpleg's
    /// side (the kernel PLEG reports the last death at once, and
    /// containerd's StopPodSandbox waits for its own lagging exit handling),
    /// so a case ended with a status not yet final on one side or the other.
    Terminal,
    /// Some container restarted at least this many times.
    Restarts(u64),
    /// Every container is ready.
    Ready,
    /// Every container is running.
    Running,
    /// This long after the pod was first seen.
    For(Duration),
}

impl Until {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "terminal" => Self::Terminal,
            "ready" => Self::Ready,
            "running" => Self::Running,
            _ => {
                if let Some(n) = s.strip_prefix("restarts:") {
                    Self::Restarts(n.parse().ok()?)
                } else {
                    let secs = s.strip_prefix("for:")?.strip_suffix('s')?;
                    Self::For(Duration::from_secs(secs.parse().ok()?))
                }
            }
        })
    }

    /// A restart count as compared: exact for a pod that ends, else capped
    /// where the case stops waiting (how far past it a side got is timing).
    pub fn restart_count(&self, count: u64) -> u64 {
        match self {
            Self::Terminal => count,
            Self::Restarts(n) => count.min(*n),
            Self::Ready | Self::Running | Self::For(_) => count.min(1),
        }
    }

    fn holds(&self, pod: &Value, seen_for: Duration) -> bool {
        let status = &pod["status"];
        match self {
            Self::Terminal => {
                let sandbox_ready = status["conditions"].as_array().is_some_and(|l| {
                    l.iter()
                        .any(|c| c["type"] == "PodReadyToStartContainers" && c["status"] == "True")
                });
                matches!(status["phase"].as_str(), Some("Succeeded" | "Failed")) && !sandbox_ready
            }
            Self::Restarts(n) => ["initContainerStatuses", "containerStatuses"]
                .iter()
                .flat_map(|k| status[k].as_array().into_iter().flatten())
                .any(|c| c["restartCount"].as_u64().unwrap_or(0) >= *n),
            Self::Ready => {
                let list = status["containerStatuses"].as_array();
                list.is_some_and(|l| !l.is_empty() && l.iter().all(|c| c["ready"] == true))
            }
            Self::Running => {
                let list = status["containerStatuses"].as_array();
                list.is_some_and(|l| {
                    !l.is_empty() && l.iter().all(|c| c["state"]["running"].is_object())
                })
            }
            Self::For(d) => seen_for >= *d,
        }
    }
}

/// One manifest of the corpus.
#[derive(Debug, Clone)]
pub struct Case {
    /// The file's stem, also the pod's name.
    pub name: String,
    /// What it exercises (its first comment line).
    pub about: String,
    pub yaml: String,
    pub until: Until,
    /// In the `--quick` subset.
    pub quick: bool,
    /// Its manifest is removed once `until` holds.
    pub delete: bool,
    /// In the `--quick` subset of the API mode.
    pub api_quick: bool,
    /// The modes it runs in (a static pod updated in place is static only;
    /// a readiness gate set by a controller needs the API server).
    pub modes: Vec<Mode>,
    /// What is done to it mid-run, and when ([`act`]).
    pub act: Option<(act::Act, Duration)>,
    /// The case whose pod must have been taken up by the node before this
    /// one's is written (a host port held by a running pod): both run in one
    /// batch.
    pub after: Option<String>,
    /// The manifest's other documents, the API objects its pod refers to
    /// (ConfigMaps, Secrets, a claim and its volume), created before the
    /// pod (API mode only).
    pub objects: Vec<String>,
    /// Its node runs the test CSI driver (`evpleg-csi-driver`, registered
    /// before the pods are written; in API mode with its CSIDriver object).
    pub csi_driver: bool,
}

impl Case {
    /// Whether it runs in `mode`.
    pub fn runs_in(&self, mode: Mode) -> bool {
        self.modes.contains(&mode)
    }
}

/// Reads the corpus: every `*.yaml` of `dir`, sorted by name. Each opens with
/// `# <what it exercises>` and `# fidelity: until=<terminal|ready|running|restarts:N|for:Ns> [quick] [api-quick] [delete] [static-only|api-only] [act=<kill-sandbox|update|gate|restart-node>:<N>s] [after=<case>] [csi-driver]`,
/// and its pod's name is the file's stem. The pod is the first document;
/// those after it (`---`) are the API objects it refers to, which only an
/// `api-only` case may have.
pub fn corpus(dir: &Path) -> Result<Vec<Case>, DifferentialError> {
    let io = |what, path: &Path| {
        let path = path.to_path_buf();
        move |source| DifferentialError::Io { what, path, source }
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io("read", dir))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let mut cases = Vec::new();
    for path in files {
        let bad = |why: String| DifferentialError::Manifest {
            path: path.clone(),
            why,
        };
        let yaml = std::fs::read_to_string(&path).map_err(io("read", &path))?;
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .ok_or_else(|| bad("no utf-8 file name".into()))?
            .to_owned();
        if !yaml.contains(&format!("\n  name: {name}\n")) {
            return Err(bad(format!(
                "the pod is not named {name:?} (its file's stem)"
            )));
        }
        let mut lines = yaml.lines();
        let about = lines
            .next()
            .and_then(|l| l.strip_prefix("# "))
            .ok_or_else(|| bad("no `# <what it exercises>` first line".into()))?
            .to_owned();
        let header = lines
            .next()
            .and_then(|l| l.strip_prefix("# fidelity:"))
            .ok_or_else(|| bad("no `# fidelity: until=...` second line".into()))?;
        let (mut until, mut quick, mut delete, mut api_quick) = (None, false, false, false);
        let mut csi_driver = false;
        let mut modes = vec![Mode::Static, Mode::Api];
        let (mut act, mut after) = (None, None);
        for word in header.split_whitespace() {
            match word {
                "quick" => quick = true,
                "api-quick" => api_quick = true,
                "delete" => delete = true,
                "csi-driver" => csi_driver = true,
                "static-only" => modes = vec![Mode::Static],
                "api-only" => modes = vec![Mode::Api],
                w if w.starts_with("act=") => match act::parse(&w[4..]) {
                    Some(a) => act = Some(a),
                    None => return Err(bad(format!("unknown act {w:?}"))),
                },
                w if w.starts_with("after=") => after = Some(w[6..].to_owned()),
                w => match w.strip_prefix("until=").and_then(Until::parse) {
                    Some(u) => until = Some(u),
                    None => return Err(bad(format!("unknown fidelity word {w:?}"))),
                },
            }
        }
        let until = until.ok_or_else(|| bad("no until=".into()))?;
        let mut documents = yaml.split("\n---\n");
        let pod = format!("{}\n", documents.next().unwrap_or_default().trim_end());
        let objects: Vec<String> = documents.map(str::to_owned).collect();
        if !objects.is_empty() && modes != [Mode::Api] {
            return Err(bad(
                "API objects (documents after the pod) need `api-only`".into()
            ));
        }
        cases.push(Case {
            name,
            about,
            yaml: pod,
            until,
            quick,
            delete,
            api_quick,
            modes,
            act,
            after,
            objects,
            csi_driver,
        });
    }
    for case in &cases {
        if let Some(first) = &case.after
            && !cases
                .iter()
                .any(|c| &c.name == first && c.modes == case.modes)
        {
            return Err(DifferentialError::Manifest {
                path: dir.join(format!("{}.yaml", case.name)),
                why: format!("after={first}: no case of that name runs in the same modes"),
            });
        }
    }
    Ok(cases)
}

/// The corpus's directory in this repository.
pub fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fidelity")
}

/// The programs a side runs besides its node.
#[derive(Debug, Clone, Copy)]
pub struct Programs<'a> {
    /// containerd 1.7: each batch starts its own.
    pub containerd: &'a Path,
    /// The test CSI driver (`CARGO_BIN_EXE_evpleg-csi-driver`), started for
    /// a batch with a [`Case::csi_driver`] case.
    pub csi_driver: &'static str,
}

/// Which node runs the pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The stock kubelet on containerd directly (its generic PLEG).
    Kubelet,
    /// `evpleg run`, in a process of its own: `program` is the
    /// `evpleg-killable` build of the binary's `main`
    /// (`CARGO_BIN_EXE_evpleg-killable`, which only this package's tests
    /// can name).
    Evpleg { program: &'static str },
    /// The stock kubelet with its CRI endpoint at `evpleg cri-proxy` in front
    /// of containerd, with or without the `EventedPLEG` gate (issue #30).
    KubeletBehindProxy { evented: bool },
}

/// Runs `cases` on one side, [`AT_ONCE`] at a time: for each batch a fresh
/// containerd (`programs.containerd`, a binary of 1.7) and node (against
/// `cp`'s API server in [`Mode::Api`]; with the test CSI driver when a case
/// asks for it), its pods started at once, each pod's status polled every
/// [`STATUS_POLL`] by a task of its own (so that the runtime's polling does
/// not slow it) until its `until` has held for [`SETTLE`]; then, for a
/// deletion case, its pod is deleted (its status record stops there) and the
/// runtime is followed until every container ended; at most
/// [`CASE_DEADLINE`] in all. In API mode the pods' events are then read until
/// they stop changing ([`EVENTS_QUIET`]).
/// Cases that restart their node ([`act::Act::RestartNode`]) run after the
/// others, on a containerd and node of their own. A case written after
/// another's pod was taken up ([`Case::after`]) joins that one's batch.
pub async fn run_side(
    side: Side,
    programs: Programs<'_>,
    cases: &[Case],
    cp: Option<&ControlPlane>,
) -> Result<BTreeMap<String, Record>, DifferentialError> {
    let (later, first): (Vec<Case>, Vec<Case>) =
        cases.iter().cloned().partition(|c| c.after.is_some());
    if let Some(lost) = later
        .iter()
        .find(|c| !first.iter().any(|d| Some(&d.name) == c.after.as_ref()))
    {
        return Err(DifferentialError::Manifest {
            path: format!("{}.yaml", lost.name).into(),
            why: format!(
                "it runs after {}, which is not among the cases run (or runs after another)",
                lost.after.as_deref().unwrap_or_default()
            ),
        });
    }
    let (restarting, others): (Vec<Case>, Vec<Case>) = first
        .into_iter()
        .partition(|c| matches!(c.act, Some((act::Act::RestartNode, _))));
    let mut batches = Vec::new();
    for chunk in others.chunks(AT_ONCE).chain(restarting.chunks(AT_ONCE)) {
        let mut batch = chunk.to_vec();
        let of_chunk = |c: &&Case| chunk.iter().any(|d| Some(&d.name) == c.after.as_ref());
        batch.extend(later.iter().filter(of_chunk).cloned());
        batches.push(batch);
    }
    let health = serve_grpc_health().await?;
    let (mut records, mut failed) = (BTreeMap::new(), None);
    for batch in &batches {
        match run_batch(side, programs, batch, cp).await {
            Ok(batch) => records.extend(batch),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    // Its port free again when this returns.
    health.abort();
    let _ = health.await;
    failed.map_or(Ok(records), Err)
}

/// Serves the gRPC health protocol on [`GRPC_HEALTH_PORT`], every address,
/// until the task returned is aborted.
async fn serve_grpc_health() -> Result<tokio::task::JoinHandle<()>, DifferentialError> {
    let port = GRPC_HEALTH_PORT;
    let listener = tokio::net::TcpListener::bind(("0.0.0.0", port))
        .await
        .map_err(|source| DifferentialError::Health { port, source })?;
    let (_reporter, service) = tonic_health::server::health_reporter();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    Ok(tokio::spawn(async move {
        let served = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(incoming)
            .await;
        if let Err(e) = served {
            tracing::error!(port, "the gRPC health service stopped: {e}");
        }
    }))
}

/// [`run_side`] for `cases` on one containerd and node.
async fn run_batch(
    side: Side,
    programs: Programs<'_>,
    cases: &[Case],
    cp: Option<&ControlPlane>,
) -> Result<BTreeMap<String, Record>, DifferentialError> {
    crate::containerd::init_test_logging();
    let cri = Containerd::start_with(programs.containerd)
        .map_err(|e| DifferentialError::Containerd(e.to_string()))?;
    let csi_driver = cases
        .iter()
        .any(|c| c.csi_driver)
        .then_some(programs.csi_driver);
    let node = Arc::new(Node::start(side, &cri, cp, csi_driver).await?);
    let client = cri.client().await;
    let records: Arc<Mutex<BTreeMap<String, Record>>> = Arc::default();
    let mut names = BTreeMap::new();
    for case in cases {
        names.insert(node.pod_name(&case.name), case.name.clone());
        lock(&records).insert(case.name.clone(), Record::default());
    }
    // Polling before the first pod is written: polling after the last, a
    // side that had already run a fast pod to its end (a postStart hook
    // failing) was first seen Failed, its Pending never seen.
    let polling = Arc::new(AtomicBool::new(true));
    let poller = tokio::spawn(poll_statuses(
        node.clone(),
        names,
        records.clone(),
        polling.clone(),
    ));
    for case in cases {
        node.create_objects(case).await?;
    }
    // The cases whose manifest is not written yet: those that wait for
    // another's pod.
    let mut unwritten: Vec<&Case> = Vec::new();
    for case in cases {
        match case.after {
            Some(_) => unwritten.push(case),
            None => node.write(&case.name, &case.yaml).await?,
        }
    }
    // Per case: when `until` first held, whether finished (and how).
    let mut held: BTreeMap<String, Instant> = BTreeMap::new();
    let mut finished: BTreeMap<String, String> = BTreeMap::new();
    let mut attempts: BTreeMap<String, BTreeMap<String, Attempt>> = BTreeMap::new();
    // The cases whose act is done (or that have none).
    let mut acted: BTreeMap<String, bool> = cases
        .iter()
        .map(|c| (c.name.clone(), c.act.is_none()))
        .collect();
    let started = Instant::now();
    while finished.len() < cases.len() {
        let taken_up: Vec<&Case> = {
            let records = lock(&records);
            let first_seen = |name: &str| records.get(name).is_some_and(|r| r.first_seen.is_some());
            unwritten
                .iter()
                .copied()
                .filter(|c| c.after.as_deref().is_some_and(first_seen))
                .collect()
        };
        for case in taken_up {
            node.write(&case.name, &case.yaml).await?;
            unwritten.retain(|c| c.name != case.name);
        }
        let containers = client.list_containers(None).await.unwrap_or_default();
        for case in cases {
            if finished.contains_key(&case.name) {
                continue;
            }
            let full = node.pod_name(&case.name);
            let seen = attempts.entry(case.name.clone()).or_default();
            update_attempts(&client, seen, &containers, &full).await;
            let ended = seen.values().all(|a| a.state == 2 || a.state == 3);
            let now = Instant::now();
            let (remove, act_now) = {
                let mut records = lock(&records);
                let rec = records.get_mut(&case.name).expect("inserted");
                let mut remove = false;
                let done = acted[&case.name];
                let act_now = match (case.act, rec.first_seen) {
                    (Some((a, after)), Some(first)) if !done && now - first >= after => Some(a),
                    _ => None,
                };
                if rec.removed_ns.is_some() {
                    if ended {
                        finished.insert(case.name.clone(), "done".into());
                    }
                } else if let Some(first) = rec.first_seen
                    && done
                    && case.until.holds(&rec.last, now - first)
                {
                    let since = *held.entry(case.name.clone()).or_insert(now);
                    if now - since >= SETTLE {
                        rec.frozen = true;
                        if case.delete {
                            rec.removed_ns = Some(now_ns());
                            remove = true;
                        } else {
                            finished.insert(case.name.clone(), "done".into());
                        }
                    }
                }
                if !finished.contains_key(&case.name) && now - started > CASE_DEADLINE {
                    rec.frozen = true;
                    let why = if rec.first_seen.is_some() {
                        "timeout"
                    } else {
                        "never seen"
                    };
                    finished.insert(case.name.clone(), why.into());
                }
                (remove, act_now)
            };
            if remove {
                node.remove(&case.name).await?;
            }
            if let Some(a) = act_now {
                let done = node.act(a, case, &client).await?;
                acted.insert(case.name.clone(), done);
            }
        }
        tokio::time::sleep(CRI_POLL).await;
    }
    polling.store(false, Ordering::Relaxed);
    let _ = poller.await;
    let mut records = std::mem::take(&mut *lock(&records));
    let mut uids = Vec::new();
    let mut uid_of = BTreeMap::new();
    for (name, rec) in records.iter_mut() {
        rec.outcome = finished.remove(name).unwrap_or_default();
        rec.attempts = attempts.remove(name).unwrap_or_default();
        if let Some(uid) = rec.last["metadata"]["uid"].as_str() {
            uids.push(uid.to_owned());
            uid_of.insert(name.clone(), uid.to_owned());
        }
    }
    if let Some(api) = &node.api {
        let mut events = quiet_events(api, &uid_of).await;
        for (name, rec) in records.iter_mut() {
            rec.events = Some(events.remove(name).unwrap_or_default());
        }
        api.delete_all().await?;
    }
    let node = Arc::into_inner(node).expect("the poller has ended");
    let kubelet_root = node.stop().await;
    drop(client);
    drop(cri);
    match kubelet_root {
        Some(root) => crate::stock_kubelet::remove_cgroups(&root),
        None => crate::e2e::remove_pod_cgroups(&uids),
    }
    Ok(records)
}

/// How long the pods' events must stay the same before they are taken.
pub const EVENTS_QUIET: Duration = Duration::from_secs(3);
/// Bound of the wait for them to stay the same.
const EVENTS_DEADLINE: Duration = Duration::from_secs(20);

/// The pods' events once they stopped changing for [`EVENTS_QUIET`] (a
/// kubelet's recorder writes them asynchronously), or at
/// [`EVENTS_DEADLINE`].
async fn quiet_events(
    api: &api::ApiSide,
    uids: &BTreeMap<String, String>,
) -> BTreeMap<String, Vec<api::Seen>> {
    let end = Instant::now() + EVENTS_DEADLINE;
    let mut last = api.events(uids).await;
    let mut since = Instant::now();
    while Instant::now() < end && since.elapsed() < EVENTS_QUIET {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = api.events(uids).await;
        if now != last {
            last = now;
            since = Instant::now();
        }
    }
    last
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Polls the node's statuses into the records until `polling` is false.
/// `names`: each case by its pod's name.
async fn poll_statuses(
    node: Arc<Node>,
    names: BTreeMap<String, String>,
    records: Arc<Mutex<BTreeMap<String, Record>>>,
    polling: Arc<AtomicBool>,
) {
    while polling.load(Ordering::Relaxed) {
        let pods = node.pods().await;
        let (now, at_ns) = (Instant::now(), now_ns());
        {
            let mut records = lock(&records);
            for (pod_name, pod) in &pods {
                if let Some(rec) = names.get(pod_name).and_then(|n| records.get_mut(n)) {
                    if !written_by_the_node(pod) {
                        continue;
                    }
                    rec.first_seen.get_or_insert(now);
                    rec.observe(pod, at_ns);
                }
            }
        }
        tokio::time::sleep(STATUS_POLL).await;
    }
}

/// Whether the node has taken the pod up: a terminal phase (a pod rejected
/// at admission has no containers), or a container past its creation (not
/// waiting `ContainerCreating` or `PodInitializing`). An API pod is listed
/// from its creation on, and on a loaded machine with the whole corpus at
/// once a node may take seconds to create its containers: a case's clock
/// (`until=for:`, `act=`) starts only here, on both sides alike.
fn written_by_the_node(pod: &Value) -> bool {
    let status = &pod["status"];
    if matches!(status["phase"].as_str(), Some("Succeeded" | "Failed")) {
        return true;
    }
    ["initContainerStatuses", "containerStatuses"]
        .iter()
        .flat_map(|k| status[k].as_array().into_iter().flatten())
        .any(|c| {
            let waiting = c["state"]["waiting"]["reason"].as_str();
            c["state"].is_object()
                && !matches!(waiting, Some("ContainerCreating" | "PodInitializing"))
        })
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// Records the runtime's containers of pod `full` (its name): a new
/// one, or one whose state changed, is asked for its status.
async fn update_attempts(
    client: &evpleg_cri::CriClient,
    attempts: &mut BTreeMap<String, Attempt>,
    containers: &[v1::Container],
    full: &str,
) {
    use evpleg_core::labels;
    for c in containers {
        if c.labels.get(labels::POD_NAME).map(String::as_str) != Some(full) {
            continue;
        }
        if attempts.get(&c.id).is_some_and(|a| a.state == c.state) {
            continue;
        }
        let Ok(resp) = client.container_status(&c.id, false).await else {
            continue;
        };
        let Some(s) = resp.status else { continue };
        let meta = s.metadata.clone().unwrap_or_default();
        attempts.insert(
            c.id.clone(),
            Attempt {
                name: meta.name,
                attempt: meta.attempt,
                created_ns: s.created_at,
                started_ns: s.started_at,
                finished_ns: s.finished_at,
                exit_code: s.exit_code,
                state: s.state,
            },
        );
    }
}
