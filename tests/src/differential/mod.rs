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

pub mod known;
pub mod record;
pub mod report;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use evpleg_cri_api::v1;
use serde_json::Value;

use crate::containerd::Containerd;
use crate::stock_kubelet::{KubeletOptions, StockKubelet};
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
}

/// When a case's status is final for the comparison.
#[derive(Debug, Clone, PartialEq)]
pub enum Until {
    /// The phase is Succeeded or Failed.
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
            Self::Terminal => matches!(status["phase"].as_str(), Some("Succeeded" | "Failed")),
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
}

/// Reads the corpus: every `*.yaml` of `dir`, sorted by name. Each opens with
/// `# <what it exercises>` and `# fidelity: until=<terminal|ready|running|restarts:N|for:Ns> [quick] [delete]`,
/// and its pod's name is the file's stem.
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
        let (mut until, mut quick, mut delete) = (None, false, false);
        for word in header.split_whitespace() {
            match word {
                "quick" => quick = true,
                "delete" => delete = true,
                w => match w.strip_prefix("until=").and_then(Until::parse) {
                    Some(u) => until = Some(u),
                    None => return Err(bad(format!("unknown fidelity word {w:?}"))),
                },
            }
        }
        let until = until.ok_or_else(|| bad("no until=".into()))?;
        cases.push(Case {
            name,
            about,
            yaml,
            until,
            quick,
            delete,
        });
    }
    Ok(cases)
}

/// The corpus's directory in this repository.
pub fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fidelity")
}

/// Which node runs the pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Kubelet,
    Evpleg,
}

/// A running node of one side on its own containerd.
enum Node {
    Kubelet(StockKubelet),
    Evpleg(evpleg::agent::Agent, PathBuf),
}

impl Node {
    async fn start(side: Side, containerd: &Containerd) -> Result<Self, DifferentialError> {
        match side {
            Side::Kubelet => {
                let opts = KubeletOptions {
                    endpoint: containerd.endpoint(),
                    node: NODE.into(),
                    evented_pleg: false,
                    cgroups: crate::stock_kubelet::KubeletCgroups::PrivateRoot,
                };
                Ok(Self::Kubelet(
                    StockKubelet::start(containerd.base(), &opts).await?,
                ))
            }
            Side::Evpleg => {
                let base = containerd.base();
                let manifests = base.join("agent-manifests");
                std::fs::create_dir_all(&manifests).map_err(|source| DifferentialError::Io {
                    what: "create",
                    path: manifests.clone(),
                    source,
                })?;
                let s = |p: PathBuf| p.display().to_string();
                let argv = [
                    "evpleg".to_owned(),
                    "--manifest-dir".into(),
                    s(manifests.clone()),
                    "--node-name".into(),
                    NODE.into(),
                    "--listen".into(),
                    "127.0.0.1:0".into(),
                    "--pod-log-dir".into(),
                    s(base.join("agent-pod-logs")),
                    "--root-dir".into(),
                    s(base.join("agent-root")),
                    "--cri-endpoint".into(),
                    containerd.endpoint(),
                    "--crashloop-backoff-initial".into(),
                    "1s".into(),
                    "--crashloop-backoff-max".into(),
                    "1s".into(),
                ];
                let args = evpleg::config::RunArgs::try_parse_from(argv)
                    .map_err(|e| DifferentialError::Agent(e.to_string()))?;
                let agent = evpleg::agent::Agent::start(&args)
                    .await
                    .map_err(|e| DifferentialError::Agent(e.to_string()))?;
                Ok(Self::Evpleg(agent, manifests))
            }
        }
    }

    fn write(&self, file: &str, yaml: &str) {
        match self {
            Self::Kubelet(k) => k.write(file, yaml),
            Self::Evpleg(_, dir) => {
                let tmp = dir.join(format!(".{file}.tmp"));
                std::fs::write(&tmp, yaml).expect("write manifest");
                std::fs::rename(&tmp, dir.join(file)).expect("rename manifest");
            }
        }
    }

    fn remove(&self, file: &str) {
        match self {
            Self::Kubelet(k) => k.remove(file),
            Self::Evpleg(_, dir) => std::fs::remove_file(dir.join(file)).expect("remove manifest"),
        }
    }

    /// The pods served now, by name.
    async fn pods(&self) -> BTreeMap<String, Value> {
        let list = match self {
            Self::Kubelet(k) => k.pods().await.unwrap_or(Value::Null),
            Self::Evpleg(a, _) => a.local.pod_list(),
        };
        list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| Some((p["metadata"]["name"].as_str()?.to_owned(), p.clone())))
            .collect()
    }

    /// Stops the node; returns the kubelet's cgroup root, to remove once
    /// containerd has removed the containers.
    async fn stop(self) -> Option<String> {
        match self {
            Self::Kubelet(mut k) => {
                k.stop();
                let root = k.private_cgroup_root().map(str::to_owned);
                drop(k);
                root
            }
            Self::Evpleg(a, _) => {
                a.stop().await;
                None
            }
        }
    }
}

/// Runs `cases` on one side: a fresh containerd (`containerd`, a binary of
/// 1.7) and node, every manifest written at once, each pod's status polled
/// every [`STATUS_POLL`] by a task of its own (so that the runtime's polling
/// does not slow it) until its `until` has held for [`SETTLE`]; then, for a
/// deletion case, its manifest is removed (its status record stops there) and
/// the runtime is followed until every container ended; at most
/// [`CASE_DEADLINE`] in all.
pub async fn run_side(
    side: Side,
    containerd: &Path,
    cases: &[Case],
) -> Result<BTreeMap<String, Record>, DifferentialError> {
    crate::containerd::init_test_logging();
    let cri = Containerd::start_with(containerd)
        .map_err(|e| DifferentialError::Containerd(e.to_string()))?;
    let node = Arc::new(Node::start(side, &cri).await?);
    let client = cri.client().await;
    let records: Arc<Mutex<BTreeMap<String, Record>>> = Arc::default();
    for case in cases {
        node.write(&format!("{}.yaml", case.name), &case.yaml);
        lock(&records).insert(case.name.clone(), Record::default());
    }
    let polling = Arc::new(AtomicBool::new(true));
    let poller = tokio::spawn(poll_statuses(
        node.clone(),
        records.clone(),
        polling.clone(),
    ));
    // Per case: when `until` first held, whether finished (and how).
    let mut held: BTreeMap<String, Instant> = BTreeMap::new();
    let mut finished: BTreeMap<String, String> = BTreeMap::new();
    let mut attempts: BTreeMap<String, BTreeMap<String, Attempt>> = BTreeMap::new();
    let started = Instant::now();
    while finished.len() < cases.len() {
        let containers = client.list_containers(None).await.unwrap_or_default();
        for case in cases {
            if finished.contains_key(&case.name) {
                continue;
            }
            let full = format!("{}-{NODE}", case.name);
            let seen = attempts.entry(case.name.clone()).or_default();
            update_attempts(&client, seen, &containers, &full).await;
            let ended = seen.values().all(|a| a.state == 2 || a.state == 3);
            let now = Instant::now();
            let mut records = lock(&records);
            let rec = records.get_mut(&case.name).expect("inserted");
            if rec.removed_ns.is_some() {
                if ended {
                    finished.insert(case.name.clone(), "done".into());
                }
            } else if let Some(first) = rec.first_seen
                && case.until.holds(&rec.last, now - first)
            {
                let since = *held.entry(case.name.clone()).or_insert(now);
                if now - since >= SETTLE {
                    rec.frozen = true;
                    if case.delete {
                        node.remove(&format!("{}.yaml", case.name));
                        rec.removed_ns = Some(now_ns());
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
        }
        tokio::time::sleep(CRI_POLL).await;
    }
    polling.store(false, Ordering::Relaxed);
    let _ = poller.await;
    let mut records = std::mem::take(&mut *lock(&records));
    let mut uids = Vec::new();
    for (name, rec) in records.iter_mut() {
        rec.outcome = finished.remove(name).unwrap_or_default();
        rec.attempts = attempts.remove(name).unwrap_or_default();
        if let Some(uid) = rec.last["metadata"]["uid"].as_str() {
            uids.push(uid.to_owned());
        }
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Polls the node's statuses into the records until `polling` is false.
async fn poll_statuses(
    node: Arc<Node>,
    records: Arc<Mutex<BTreeMap<String, Record>>>,
    polling: Arc<AtomicBool>,
) {
    while polling.load(Ordering::Relaxed) {
        let pods = node.pods().await;
        let now = Instant::now();
        for (name, rec) in lock(&records).iter_mut() {
            if let Some(pod) = pods.get(&format!("{name}-{NODE}")) {
                rec.first_seen.get_or_insert(now);
                rec.observe(pod);
            }
        }
        tokio::time::sleep(STATUS_POLL).await;
    }
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// Records the runtime's containers of pod `full` (`<name>-<node>`): a new
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
