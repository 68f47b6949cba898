//! The full agent (`evpleg::agent::Agent`, the code the binary runs: file
//! source, sync loop, pod workers, status manager) in each PLEG mode against the
//! same containerd: static pods written to its manifest directory one at a time
//! (start latency), then their main processes killed from the host at random
//! times (death latency through every stage, from the agent's stage log). In
//! the `generic` and Evented PLEG modes a kernel PLEG beside the agent is the
//! stopwatch (its exit timestamps only: its own reader's stages are not the
//! agent's and are left out). In the `cri-proxy` modes (issue #15) the agent
//! runs in one of the kubelet's Evented PLEG designs, its CRI endpoint an
//! `evpleg cri-proxy` in front of the same containerd; the proxy's kernel
//! PLEG is the stopwatch, and only the agent's own `worker-sync` and
//! `status-held` are kept (the proxy's PLEG records a `delivered` of its own
//! for the same containers).
//!
//! Each repetition of each mode runs a fresh agent with a manifest directory
//! of its own ([`repetition`]), so that the modes can be interleaved
//! repetition by repetition. The stock kubelet's rows run among them, the
//! same way ([`crate::kubelet`]).

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use evpleg::agent::Agent;
use evpleg::config::RunArgs;
use evpleg_core::clock::monotonic_ns;
use evpleg_pleg::PlegMode;
use evpleg_pleg::stages;
use evpleg_pleg::stages::Stage;
use evpleg_tests::containerd::Containerd;
use serde_json::Value;

use crate::results::{Latency, Start, StartSamples};
use crate::stats::{Percentiles, Summary};

pub(crate) const NODE: &str = "bench";
/// How often `/pods` is looked at while waiting (the figures come from the
/// stage log, not from this polling).
pub(crate) const POLL: Duration = Duration::from_millis(10);
/// The CRI calls that start a pod (the rest are inspection).
pub(crate) const START_OPS: [&str; 5] = [
    "run_podsandbox",
    "create_container",
    "start_container",
    "pull_image",
    "image_status",
];

/// The agent's own stages in the modes whose kernel records are the
/// stopwatch's.
const AGENT_STAGES: [Stage; 4] = [
    Stage::Delivered,
    Stage::Taken,
    Stage::WorkerSync,
    Stage::StatusHeld,
];

/// The `cri-proxy` mode with the agent in the 1.26-1.36 Evented PLEG design.
pub const CRI_PROXY_126: &str = "cri-proxy-1.26";
/// The `cri-proxy` mode with the agent in the 1.37 Evented PLEG design.
pub const CRI_PROXY_137: &str = "cri-proxy-1.37";

/// How the agent meets the runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgentMode {
    /// Directly, with its PLEG in this mode.
    Pleg(PlegMode),
    /// Through `evpleg cri-proxy`, its PLEG in this Evented PLEG design, as a
    /// stock kubelet with the EventedPLEG gate runs it: 1.26-1.36 (the gate's
    /// released design: the events' payloads, a 300 s relist) or 1.37 (hints,
    /// the 1 s relist).
    CriProxy(PlegMode),
    /// Not the agent: the stock kubelet 1.37 itself ([`crate::kubelet`]).
    Kubelet(crate::kubelet::KubeletMode),
}

impl AgentMode {
    pub const ALL: [AgentMode; 9] = [
        AgentMode::Pleg(PlegMode::Ebpf),
        AgentMode::Pleg(PlegMode::EventedCri),
        AgentMode::Pleg(PlegMode::EventedCriPayload),
        AgentMode::Pleg(PlegMode::Generic),
        AgentMode::CriProxy(PlegMode::EventedCriPayload),
        AgentMode::CriProxy(PlegMode::EventedCri),
        AgentMode::Kubelet(crate::kubelet::KubeletMode::Generic),
        AgentMode::Kubelet(crate::kubelet::KubeletMode::Evented),
        AgentMode::Kubelet(crate::kubelet::KubeletMode::ProxyEvented),
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Pleg(m) => crate::death::Observer::Pleg(m).name(),
            Self::CriProxy(PlegMode::EventedCriPayload) => CRI_PROXY_126,
            Self::CriProxy(_) => CRI_PROXY_137,
            Self::Kubelet(k) => k.name(),
        }
    }

    /// The stages of the agent's own that are kept (`None`: every stage).
    fn kept(self) -> Option<&'static [Stage]> {
        match self {
            Self::Pleg(PlegMode::Ebpf) => None,
            Self::Pleg(_) => Some(&AGENT_STAGES),
            Self::CriProxy(_) => Some(&AGENT_STAGES[1..]),
            // Its /pods showing the death (`crate::kubelet`).
            Self::Kubelet(_) => Some(&AGENT_STAGES[3..]),
        }
    }

    /// The agent's `--pleg` value (`None`: not the agent).
    fn flag(self) -> Option<&'static str> {
        let (Self::Pleg(m) | Self::CriProxy(m)) = self else {
            return None;
        };
        Some(match m {
            PlegMode::Ebpf => "ebpf",
            PlegMode::Generic => "generic",
            PlegMode::EventedCri => "evented-cri",
            PlegMode::EventedCriPayload => "evented-cri-1.26",
        })
    }
}

/// What the full-agent run measured.
#[derive(Debug, Default)]
pub struct AgentRun {
    pub latencies: Vec<Latency>,
    pub starts: Vec<Start>,
    pub notes: Vec<String>,
}

/// One running static pod.
struct Pod {
    name: String,
    uid: String,
    id: String,
}

/// What one mode's counted repetitions gathered.
#[derive(Debug)]
pub struct AgentSeries {
    pub mode: AgentMode,
    /// By stage: each repetition's percentiles, every sample.
    deaths: BTreeMap<&'static str, (Vec<Percentiles>, Vec<f64>)>,
    order: Vec<&'static str>,
    lost: usize,
    /// Each repetition's percentiles of total, runtime, inspection, agent.
    starts: [Vec<Percentiles>; 4],
    samples: StartSamples,
    pods: usize,
}

impl AgentSeries {
    pub fn new(mode: AgentMode) -> Self {
        Self {
            mode,
            deaths: BTreeMap::new(),
            order: Vec::new(),
            lost: 0,
            starts: Default::default(),
            samples: StartSamples::default(),
            pods: 0,
        }
    }

    /// The latencies, start figures and notes of the counted repetitions.
    pub fn finish(mut self) -> AgentRun {
        let mode = self.mode.name();
        let mut out = AgentRun::default();
        for name in self.order {
            let (reps, samples) = self.deaths.remove(name).unwrap_or_default();
            out.latencies.push(Latency {
                mode: mode.into(),
                workload: "agent-killed".into(),
                stage: name.into(),
                summary: Summary::of(&reps),
                lost: if name == "status-held" { self.lost } else { 0 },
                samples_us: samples,
            });
        }
        let [total, runtime, inspection, own] = self.starts;
        out.starts.push(Start {
            mode: mode.into(),
            pods: self.pods,
            total_ms: Summary::of(&total),
            runtime_ms: Summary::of(&runtime),
            inspection_ms: Summary::of(&inspection),
            agent_ms: Summary::of(&own),
            samples: self.samples,
        });
        if let AgentMode::Kubelet(_) = self.mode {
            out.notes.push(crate::kubelet::NOTE.to_owned());
            return out;
        }
        out.notes.push(format!(
            "Full agent: the `evpleg` agent in-process (file source, sync loop, pod workers, \
             status manager, its own HTTP port), a fresh one for each mode's repetition, \
             static pods (busybox `sleep`, restartPolicy Never, host network) written to its \
             manifest directory one at a time; start latency from the manifest's rename into \
             the directory to the status manager holding the container Running (its stage \
             log), the CRI time from the agent's `evpleg_runtime_operations_duration_seconds` \
             sums scraped before the write and after Running (start calls: {}; the others are \
             inspection). Then each pod's main process killed with SIGKILL at a random time \
             over the window.",
            START_OPS.join(", ")
        ));
        if let AgentMode::CriProxy(design) = self.mode {
            out.notes.push(format!(
                "{mode}: the full agent with `--pleg {}` (the kubelet's Evented PLEG of {}, as a \
                 stock kubelet with the EventedPLEG gate runs it), its CRI endpoint `evpleg \
                 cri-proxy` in front of the same containerd: every call forwarded, \
                 GetContainerEvents served from the proxy's kernel PLEG, the overlay on. The \
                 proxy's kernel PLEG is the stopwatch; its own `delivered` (to the proxy's event \
                 task) is left out, so the agent's stages shown are `worker-sync` and \
                 `status-held`.",
                self.mode.flag().unwrap_or_default(),
                if design == PlegMode::EventedCriPayload {
                    "1.26-1.36"
                } else {
                    "1.37"
                }
            ));
        }
        out
    }
}

/// One repetition of `series`' mode (`rep` 0 is the warm-up: run, not
/// counted): a fresh agent ([`Running`]), `n` static pods started one at a
/// time and killed over `window`, then the pods removed and the agent
/// stopped, also when the repetition fails. Returns its progress line.
pub async fn repetition(
    containerd: &Containerd,
    series: &mut AgentSeries,
    rep: usize,
    n: usize,
    window: Duration,
) -> Result<String> {
    let mode = series.mode;
    if let AgentMode::Kubelet(kubelet) = mode {
        return crate::kubelet::repetition(containerd, series, kubelet, rep, n, window).await;
    }
    crate::stages::start();
    // The proxy's own kernel PLEG records the exits in the cri-proxy modes.
    let _stopwatch = matches!(mode, AgentMode::Pleg(m) if m != PlegMode::Ebpf)
        .then(evpleg_tests::cri_pod::ExitClock::start);
    let running = Running::start(containerd, mode, &rep.to_string()).await?;
    let mut uids = Vec::new();
    let outcome = measure(&running, series, rep, n, window, &mut uids).await;
    running.finish(containerd, &uids).await;
    outcome
}

/// A fresh agent in one mode (behind a fresh proxy in the cri-proxy modes)
/// with a manifest directory of its own.
pub(crate) struct Running {
    pub agent: Agent,
    pub proxy: Option<evpleg::cri_proxy::CriProxy>,
    pub manifests: std::path::PathBuf,
}

impl Running {
    /// Starts the agent in `mode`; `tag` names its directory among the
    /// run's (a repetition's number, a part's name).
    pub async fn start(containerd: &Containerd, mode: AgentMode, tag: &str) -> Result<Self> {
        Self::start_against(containerd, mode, tag, None).await
    }

    /// As [`Self::start`], with `kubeconfig` (when given) the API server it
    /// registers its Node with and takes its pods from.
    pub async fn start_against(
        containerd: &Containerd,
        mode: AgentMode,
        tag: &str,
        kubeconfig: Option<&std::path::Path>,
    ) -> Result<Self> {
        let flag = mode.flag().context("not an agent mode")?;
        let manifests = manifest_dir(containerd.base(), mode, tag);
        let base = manifests.parent().context("manifest dir")?.to_owned();
        let logs = base.join("pod-logs");
        std::fs::create_dir_all(&manifests)?;
        std::fs::create_dir_all(&logs)?;
        let proxy = match mode {
            AgentMode::CriProxy(_) => Some(evpleg_tests::cri_proxy::proxy(containerd, &[]).await.0),
            AgentMode::Pleg(_) | AgentMode::Kubelet(_) => None,
        };
        let endpoint = match mode {
            AgentMode::CriProxy(_) => {
                format!("unix://{}", containerd.base().join("proxy.sock").display())
            }
            AgentMode::Pleg(_) | AgentMode::Kubelet(_) => containerd.endpoint(),
        };
        let mut argv = vec![
            "evpleg",
            "--pleg",
            flag,
            "--cri-endpoint",
            &endpoint,
            "--manifest-dir",
            manifests.to_str().context("utf-8 path")?,
            "--node-name",
            NODE,
            "--listen",
            "127.0.0.1:0",
            "--pod-log-dir",
            logs.to_str().context("utf-8 path")?,
        ];
        if let Some(k) = kubeconfig {
            argv.extend(["--kubeconfig", k.to_str().context("utf-8 path")?]);
        }
        let args = RunArgs::try_parse_from(argv)?;
        let agent = match Agent::start(&args).await {
            Ok(agent) => agent,
            Err(e) => {
                if let Some(p) = proxy {
                    p.stop().await;
                }
                return Err(e).context("starting the agent");
            }
        };
        Ok(Self {
            agent,
            proxy,
            manifests,
        })
    }

    /// Clean-up, whatever happened: the pods removed through the agent (its
    /// manifests deleted), then the agent stopped, what it left of the pods
    /// `uids` removed from the runtime, the proxy stopped and the pod
    /// cgroups runc leaves removed.
    pub async fn finish(self, containerd: &Containerd, uids: &[String]) {
        for f in std::fs::read_dir(&self.manifests)
            .into_iter()
            .flatten()
            .flatten()
        {
            let _ = std::fs::remove_file(f.path());
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while pod_items(&self.agent).next().is_some() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(POLL).await;
        }
        self.agent.stop().await;
        // Its deleted pods' sandboxes and dead containers wait for its
        // container GC (a minute, as the kubelet's): removed here, so that
        // no agent after it meets them.
        let client = containerd.client().await;
        for s in runtime_clean(&client, uids, Duration::ZERO).await {
            let _ = client.stop_pod_sandbox(&s).await;
            let _ = client.remove_pod_sandbox(&s).await;
        }
        if let Some(p) = self.proxy {
            p.stop().await;
        }
        // Under every hierarchy (hybrid hosts mount cgroup2 at /sys/fs/cgroup/unified).
        let mut roots = vec![std::path::PathBuf::from("/sys/fs/cgroup")];
        roots.extend(
            std::fs::read_dir("/sys/fs/cgroup")
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path()),
        );
        for uid in uids {
            for root in &roots {
                for qos in ["kubepods/besteffort", "kubepods/burstable", "kubepods"] {
                    let _ = std::fs::remove_dir(root.join(qos).join(format!("pod{uid}")));
                }
            }
        }
    }

    /// Its pods as its `/pods` serves them.
    pub fn pods(&self) -> Value {
        self.agent.local.pod_list()
    }
}

/// The manifest directory of one repetition of one mode. A static pod's UID
/// is a hash over its manifest's path and content (`file.rs`'s `static_uid`),
/// so a directory of its own gives every repetition of every mode pods of
/// their own: with one directory for all, `r1c0` of a mode had the UID of
/// `r1c0` of the mode before, whose exited sandbox and container that agent
/// had left in containerd, and the new agent (as the kubelet) took the
/// restartPolicy Never pod for one that had run and never started it (the
/// quick run's `pod r1c0: not running within 60 s`, issue #29).
fn manifest_dir(base: &std::path::Path, mode: AgentMode, tag: &str) -> std::path::PathBuf {
    base.join(format!("bench-agent-{}-{tag}", mode.name()))
        .join("manifests")
}

/// The name of pod `i` of repetition `rep`.
pub(crate) fn pod_name(rep: usize, i: usize) -> String {
    format!("r{rep}c{i}")
}

/// Waits until the runtime holds no sandbox of the pods `uids`, for at most
/// `bound`; returns those still there then.
pub(crate) async fn runtime_clean(
    client: &evpleg_cri::CriClient,
    uids: &[String],
    bound: Duration,
) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        let left: Vec<String> = client
            .list_pod_sandboxes(None)
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|s| {
                s.labels
                    .get(evpleg_core::labels::POD_UID)
                    .is_some_and(|u| uids.contains(u))
            })
            .map(|s| s.id)
            .collect();
        if left.is_empty() || tokio::time::Instant::now() > deadline {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn pod_items(agent: &Agent) -> impl Iterator<Item = Value> {
    let list = agent.local.pod_list();
    list["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
}

fn find_pod(agent: &Agent, name: &str) -> Option<Value> {
    let full = format!("{name}-{NODE}");
    pod_items(agent).find(|p| p["metadata"]["name"] == full.as_str())
}

/// The app container's status in a `/pods` item.
pub(crate) fn app(pod: &Value) -> Option<&Value> {
    pod["status"]["containerStatuses"].as_array()?.first()
}

/// Sums of the CRI calls' durations by operation, in seconds, from the
/// agent's `/metrics`.
async fn cri_sums(agent: &Agent) -> BTreeMap<String, f64> {
    let text = evpleg_tests::e2e::http_get(agent.addr, "/metrics").await;
    cri_sums_in(&text, "evpleg_runtime_operations_duration_seconds")
}

/// Sums of the CRI calls' durations by operation, in seconds, from the
/// Prometheus text `metrics` whose histogram of them is `name` (the agent's
/// `evpleg_...`, the kubelet's `kubelet_runtime_operations_duration_seconds`).
pub(crate) fn cri_sums_in(metrics: &str, name: &str) -> BTreeMap<String, f64> {
    by_operation(metrics, &format!("{name}_sum"))
        .map(|(op, v)| (op.to_owned(), v))
        .collect()
}

/// The `series{operation_type="<op>"} <value>` lines of `metrics`, as
/// `(op, value)`.
fn by_operation<'a>(metrics: &'a str, series: &str) -> impl Iterator<Item = (&'a str, f64)> {
    let prefix = format!("{series}{{operation_type=\"");
    metrics.lines().filter_map(move |l| {
        let (op, value) = l.strip_prefix(prefix.as_str())?.split_once("\"} ")?;
        Some((op, value.trim().parse().ok()?))
    })
}

/// The number of CRI calls so far, every operation, from the Prometheus text
/// `metrics` whose histogram of their durations is `name` (its `_count`s).
pub(crate) fn cri_calls_in(metrics: &str, name: &str) -> f64 {
    by_operation(metrics, &format!("{name}_count"))
        .map(|(_, v)| v)
        .sum()
}

/// (start calls, other calls) between two scrapes, in ms.
pub(crate) fn cri_delta(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
) -> (f64, f64) {
    let (mut start, mut other) = (0.0, 0.0);
    for (op, v) in after {
        let d = (v - before.get(op).copied().unwrap_or(0.0)) * 1000.0;
        if START_OPS.contains(&op.as_str()) {
            start += d;
        } else {
            other += d;
        }
    }
    (start, other)
}

fn stage_at(stage: Stage, id: &str) -> Option<u64> {
    let key = stages::key_of(id)?;
    crate::stages::snapshot()
        .into_iter()
        .filter(|r| r.stage == stage && r.key == key)
        .map(|r| r.at_ns)
        .min()
}

pub(crate) fn write_manifest(dir: &std::path::Path, name: &str) -> Result<()> {
    let yaml = evpleg_tests::e2e::manifest(name, "Never", "sleep 1000000", "");
    let tmp = dir.join(format!(".{name}.yaml.tmp"));
    std::fs::write(&tmp, yaml)?;
    std::fs::rename(&tmp, dir.join(format!("{name}.yaml")))?;
    Ok(())
}

async fn measure(
    running: &Running,
    series: &mut AgentSeries,
    rep: usize,
    n: usize,
    window: Duration,
    uids: &mut Vec<String>,
) -> Result<String> {
    let (agent, manifests) = (&running.agent, running.manifests.as_path());
    // Starts, one pod at a time: the CRI time of each is its own.
    let mut pods = Vec::new();
    let mut starts = StartSamples::default();
    for i in 0..n {
        let name = pod_name(rep, i);
        let before = cri_sums(agent).await;
        let written = monotonic_ns();
        write_manifest(manifests, &name)?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let pod = loop {
            if let Some(p) = find_pod(agent, &name)
                && let Some(c) = app(&p)
                && !c["state"]["running"].is_null()
                && let Some(id) = c["containerID"].as_str()
            {
                break Pod {
                    name: name.clone(),
                    uid: p["metadata"]["uid"].as_str().unwrap_or_default().to_owned(),
                    id: id.rsplit("://").next().unwrap_or(id).to_owned(),
                };
            }
            if tokio::time::Instant::now() > deadline {
                // What the agent shows of it, for the diagnosis.
                let seen = find_pod(agent, &name)
                    .map_or_else(|| "not in /pods".to_owned(), |p| p["status"].to_string());
                bail!("pod {name}: not running within 60 s; its status: {seen}");
            }
            tokio::time::sleep(POLL).await;
        };
        uids.push(pod.uid.clone());
        let after = cri_sums(agent).await;
        let running = stage_at(Stage::StatusRunning, &pod.id)
            .with_context(|| format!("no status-running record for {name}"))?;
        let ms = running.saturating_sub(written) as f64 / 1e6;
        starts.push(ms, cri_delta(&before, &after));
        pods.push(pod);
    }
    // Deaths at random times over the window.
    let mut pids = Vec::new();
    for p in &pods {
        let pid = evpleg_tests::e2e::find_container_pid(&p.id)
            .with_context(|| format!("no main process for {}", p.name))?;
        pids.push(pid);
    }
    kill_over(&pids, window).await;
    let deadline = tokio::time::Instant::now() + window + Duration::from_secs(10);
    let ids: Vec<&str> = pods.iter().map(|p| p.id.as_str()).collect();
    while tokio::time::Instant::now() < deadline
        && ids
            .iter()
            .any(|id| stage_at(Stage::StatusHeld, id).is_none())
    {
        tokio::time::sleep(POLL).await;
    }
    let records = crate::stages::snapshot();
    let (stages, missing) = crate::stages::samples(&ids, &records);
    Ok(series.record(rep, n, &starts, stages, missing))
}

/// SIGKILLs each of `pids` at a random time over `window`; returns once all
/// are sent.
pub async fn kill_over(pids: &[i32], window: Duration) {
    let start = tokio::time::Instant::now();
    let mut killers = Vec::new();
    for &pid in pids {
        let at = start
            + Duration::from_micros(evpleg_tests::unique_u64() % window.as_micros().max(1) as u64);
        killers.push(tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            // SAFETY: kill has no memory preconditions; the pid is the
            // container's main process, alive until this signal.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }));
    }
    for k in killers {
        let _ = k.await;
    }
}

impl AgentSeries {
    /// Adds one repetition's starts and death stages (those of the mode's
    /// own; nothing for the warm-up, `rep` 0); returns its progress line.
    pub fn record(
        &mut self,
        rep: usize,
        n: usize,
        starts: &StartSamples,
        mut stages: Vec<(Stage, Vec<f64>)>,
        missing: usize,
    ) -> String {
        if let Some(kept) = self.mode.kept() {
            stages.retain(|(s, _)| kept.contains(s));
        }
        let mut line = format!(
            "start p50 {:.0} ms",
            Percentiles::of(&starts.total_ms).map_or(f64::NAN, |p| p.p50)
        );
        for (stage, samples) in &stages {
            if let Some(p) = Percentiles::of(samples) {
                line.push_str(&format!(
                    "; {} p50 {:.0} us",
                    crate::stages::name(*stage),
                    p.p50
                ));
            }
        }
        if rep == 0 {
            return line;
        }
        self.lost += missing;
        for (stage, samples) in stages {
            let name = crate::stages::name(stage);
            if !self.order.contains(&name) {
                self.order.push(name);
            }
            let e = self.deaths.entry(name).or_default();
            e.0.extend(Percentiles::of(&samples));
            e.1.extend(samples);
        }
        let parts = [
            &starts.total_ms,
            &starts.runtime_ms,
            &starts.inspection_ms,
            &starts.agent_ms,
        ];
        for (acc, part) in self.starts.iter_mut().zip(parts) {
            acc.extend(Percentiles::of(part));
        }
        self.samples.extend(starts);
        self.pods += n;
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pod of every repetition of every mode has a manifest path of its
    /// own, hence a static pod UID of its own: no agent meets a pod of the
    /// agent before it under its UID (the quick run's failure).
    #[test]
    fn every_mode_and_repetition_has_pods_of_its_own() {
        let base = std::path::Path::new("/run/evpleg-bench");
        let mut seen = std::collections::HashSet::new();
        for mode in AgentMode::ALL {
            for rep in 0..3 {
                for i in 0..3 {
                    let path = manifest_dir(base, mode, &rep.to_string())
                        .join(format!("{}.yaml", pod_name(rep, i)));
                    assert!(seen.insert(path.clone()), "{} reused", path.display());
                }
            }
        }
        assert_eq!(seen.len(), AgentMode::ALL.len() * 9);
    }

    /// The CRI time by operation from the agent's and the kubelet's
    /// histograms, each read under its own name only.
    #[test]
    fn cri_sums_are_read_by_histogram_name() {
        let text = "# TYPE kubelet_runtime_operations_duration_seconds histogram\n\
            kubelet_runtime_operations_duration_seconds_bucket{operation_type=\"start_container\",le=\"0.005\"} 1\n\
            kubelet_runtime_operations_duration_seconds_sum{operation_type=\"start_container\"} 0.25\n\
            kubelet_runtime_operations_duration_seconds_sum{operation_type=\"list_containers\"} 1.5\n\
            evpleg_runtime_operations_duration_seconds_sum{operation_type=\"start_container\"} 9\n";
        let kubelet = cri_sums_in(text, "kubelet_runtime_operations_duration_seconds");
        assert_eq!(
            kubelet,
            BTreeMap::from([
                ("list_containers".to_owned(), 1.5),
                ("start_container".to_owned(), 0.25)
            ])
        );
        let (start, other) = cri_delta(&BTreeMap::new(), &kubelet);
        assert_eq!((start, other), (250.0, 1500.0));
        let agent = cri_sums_in(text, "evpleg_runtime_operations_duration_seconds");
        assert_eq!(agent, BTreeMap::from([("start_container".to_owned(), 9.0)]));
    }

    #[test]
    fn cri_calls_are_counted_over_every_operation() {
        let text = "# TYPE x histogram\n\
            kubelet_runtime_operations_duration_seconds_count{operation_type=\"list_podsandbox\"} 12\n\
            kubelet_runtime_operations_duration_seconds_count{operation_type=\"container_status\"} 30\n\
            kubelet_runtime_operations_duration_seconds_sum{operation_type=\"container_status\"} 0.5\n\
            evpleg_runtime_operations_duration_seconds_count{operation_type=\"list_containers\"} 7\n";
        assert_eq!(
            cri_calls_in(text, "kubelet_runtime_operations_duration_seconds"),
            42.0
        );
        assert_eq!(
            cri_calls_in(text, "evpleg_runtime_operations_duration_seconds"),
            7.0
        );
        assert_eq!(
            cri_calls_in("", "evpleg_runtime_operations_duration_seconds"),
            0.0
        );
    }
}
