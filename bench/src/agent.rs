//! The full agent (`evpleg::agent::Agent`, the code the binary runs: file
//! source, sync loop, pod workers, status manager) in each PLEG mode against the
//! same containerd: static pods written to its manifest directory one at a time
//! (start latency), then their main processes killed from the host at random
//! times (death latency through every stage, from the agent's stage log). In
//! the `generic` and `evented-cri` modes a kernel PLEG beside the agent is the
//! stopwatch (its exit timestamps only: its own reader's stages are not the
//! agent's and are left out). In `cri-proxy` mode (issue #15) the agent runs
//! in `evented-cri` mode, as a stock kubelet with the EventedPLEG gate, its
//! CRI endpoint an `evpleg cri-proxy` in front of the same containerd; the
//! proxy's kernel PLEG is the stopwatch, and only the agent's own
//! `worker-sync` and `status-held` are kept (the proxy's PLEG records a
//! `delivered` of its own for the same containers).

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

use crate::results::{Latency, Start};
use crate::stats::{Percentiles, Summary};

const NODE: &str = "bench";
/// How often `/pods` is looked at while waiting (the figures come from the
/// stage log, not from this polling).
const POLL: Duration = Duration::from_millis(10);
/// The CRI calls that start a pod (the rest are inspection).
const START_OPS: [&str; 5] = [
    "run_podsandbox",
    "create_container",
    "start_container",
    "pull_image",
    "image_status",
];

/// The agent's own stages in the modes whose kernel records are the
/// stopwatch's.
const AGENT_STAGES: [Stage; 3] = [Stage::Delivered, Stage::WorkerSync, Stage::StatusHeld];

/// How the agent meets the runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgentMode {
    /// Directly, with its PLEG in this mode.
    Pleg(PlegMode),
    /// In `evented-cri` mode through `evpleg cri-proxy`.
    CriProxy,
}

impl AgentMode {
    pub const ALL: [AgentMode; 4] = [
        AgentMode::Pleg(PlegMode::Ebpf),
        AgentMode::Pleg(PlegMode::EventedCri),
        AgentMode::Pleg(PlegMode::Generic),
        AgentMode::CriProxy,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Pleg(m) => crate::death::Observer::Pleg(m).name(),
            Self::CriProxy => "cri-proxy",
        }
    }

    /// The agent's `--pleg`.
    fn pleg(self) -> PlegMode {
        match self {
            Self::Pleg(m) => m,
            Self::CriProxy => PlegMode::EventedCri,
        }
    }

    /// The stages of the agent's own that are kept (`None`: every stage).
    fn kept(self) -> Option<&'static [Stage]> {
        match self {
            Self::Pleg(PlegMode::Ebpf) => None,
            Self::Pleg(_) => Some(&AGENT_STAGES),
            Self::CriProxy => Some(&AGENT_STAGES[1..]),
        }
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

/// Runs the workload; the agent is stopped and every pod removed also when it
/// fails.
pub async fn run(
    containerd: &Containerd,
    mode: AgentMode,
    reps: usize,
    n: usize,
    window: Duration,
) -> Result<AgentRun> {
    let base = containerd.base().join("bench-agent");
    let manifests = base.join("manifests");
    let logs = base.join("pod-logs");
    std::fs::create_dir_all(&manifests)?;
    std::fs::create_dir_all(&logs)?;
    let proxy = match mode {
        AgentMode::CriProxy => Some(evpleg_tests::cri_proxy::proxy(containerd, &[]).await.0),
        AgentMode::Pleg(_) => None,
    };
    let endpoint = match mode {
        AgentMode::CriProxy => format!("unix://{}", containerd.base().join("proxy.sock").display()),
        AgentMode::Pleg(_) => containerd.endpoint(),
    };
    let pleg = crate::death::Observer::Pleg(mode.pleg()).name();
    let args = RunArgs::try_parse_from([
        "evpleg",
        "--pleg",
        pleg,
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
    ])?;
    crate::stages::start();
    // The proxy's own kernel PLEG records the exits in cri-proxy mode.
    let _stopwatch = matches!(mode, AgentMode::Pleg(m) if m != PlegMode::Ebpf)
        .then(evpleg_tests::cri_pod::ExitClock::start);
    let agent = Agent::start(&args).await.context("starting the agent")?;
    let mut uids = Vec::new();
    let mut outcome = measure(&agent, mode, &manifests, reps, n, window, &mut uids).await;
    // Clean-up, whatever happened: the pods removed through the agent, then
    // the agent stopped and the pod cgroups runc leaves removed.
    for f in std::fs::read_dir(&manifests)
        .into_iter()
        .flatten()
        .flatten()
    {
        let _ = std::fs::remove_file(f.path());
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while pod_items(&agent).next().is_some() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(POLL).await;
    }
    agent.stop().await;
    if let Some(p) = proxy {
        p.stop().await;
        if let Ok(out) = &mut outcome {
            out.notes.push(
                "cri-proxy: the full agent in `evented-cri` mode (as a stock kubelet with the \
                 EventedPLEG gate), its CRI endpoint `evpleg cri-proxy` in front of the same \
                 containerd: every call forwarded, GetContainerEvents served from the proxy's \
                 kernel PLEG, the overlay on. The proxy's kernel PLEG is the stopwatch; its own \
                 `delivered` (to the proxy's event task) is left out, so the agent's stages shown \
                 are `worker-sync` and `status-held`."
                    .into(),
            );
        }
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
    outcome
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
fn app(pod: &Value) -> Option<&Value> {
    pod["status"]["containerStatuses"].as_array()?.first()
}

/// Sums of the CRI calls' durations by operation, in seconds, from `/metrics`.
async fn cri_sums(agent: &Agent) -> BTreeMap<String, f64> {
    let text = evpleg_tests::e2e::http_get(agent.addr, "/metrics").await;
    let prefix = "evpleg_runtime_operations_duration_seconds_sum{operation_type=\"";
    text.lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .filter_map(|rest| {
            let (op, value) = rest.split_once("\"} ")?;
            Some((op.to_owned(), value.trim().parse().ok()?))
        })
        .collect()
}

/// (start calls, other calls) between two scrapes, in ms.
fn cri_delta(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>) -> (f64, f64) {
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

fn write_manifest(dir: &std::path::Path, name: &str) -> Result<()> {
    let yaml = evpleg_tests::e2e::manifest(name, "Never", "sleep 1000000", "");
    let tmp = dir.join(format!(".{name}.yaml.tmp"));
    std::fs::write(&tmp, yaml)?;
    std::fs::rename(&tmp, dir.join(format!("{name}.yaml")))?;
    Ok(())
}

async fn measure(
    agent: &Agent,
    agent_mode: AgentMode,
    manifests: &std::path::Path,
    reps: usize,
    n: usize,
    window: Duration,
    uids: &mut Vec<String>,
) -> Result<AgentRun> {
    let mut out = AgentRun::default();
    let mode = agent_mode.name();
    let mut deaths: BTreeMap<&'static str, (Vec<Percentiles>, Vec<f64>)> = BTreeMap::new();
    let mut order: Vec<&'static str> = Vec::new();
    let mut lost = 0;
    let (mut total, mut runtime, mut inspection, mut own) = (vec![], vec![], vec![], vec![]);
    for rep in 0..reps {
        // Starts, one pod at a time: the CRI time of each is its own.
        let mut pods = Vec::new();
        let (mut t_rep, mut r_rep, mut i_rep, mut a_rep) = (vec![], vec![], vec![], vec![]);
        for i in 0..n {
            let name = format!("r{rep}c{i}");
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
                    bail!("pod {name}: not running within 60 s");
                }
                tokio::time::sleep(POLL).await;
            };
            uids.push(pod.uid.clone());
            let after = cri_sums(agent).await;
            let running = stage_at(Stage::StatusRunning, &pod.id)
                .with_context(|| format!("no status-running record for {name}"))?;
            let ms = running.saturating_sub(written) as f64 / 1e6;
            let (start_ms, other_ms) = cri_delta(&before, &after);
            t_rep.push(ms);
            r_rep.push(start_ms);
            i_rep.push(other_ms);
            a_rep.push((ms - start_ms).max(0.0));
            pods.push(pod);
        }
        total.extend(Percentiles::of(&t_rep));
        runtime.extend(Percentiles::of(&r_rep));
        inspection.extend(Percentiles::of(&i_rep));
        own.extend(Percentiles::of(&a_rep));
        // Deaths at random times over the window.
        let start = tokio::time::Instant::now();
        let mut killers = Vec::new();
        for p in &pods {
            let pid = evpleg_tests::e2e::find_container_pid(&p.id)
                .with_context(|| format!("no main process for {}", p.name))?;
            let at = start
                + Duration::from_micros(
                    evpleg_tests::unique_u64() % window.as_micros().max(1) as u64,
                );
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
        let (mut stages, missing) = crate::stages::samples(&ids, &records);
        if let Some(kept) = agent_mode.kept() {
            stages.retain(|(s, _)| kept.contains(s));
        }
        lost += missing;
        let mut line = String::new();
        for (stage, samples) in stages {
            let name = crate::stages::name(stage);
            if !order.contains(&name) {
                order.push(name);
            }
            let e = deaths.entry(name).or_default();
            if let Some(p) = Percentiles::of(&samples) {
                line.push_str(&format!("; {name} p50 {:.0} us", p.p50));
                e.0.push(p);
            }
            e.1.extend(samples);
        }
        crate::progress(&format!(
            "  repetition {}: start p50 {:.0} ms{line}",
            rep + 1,
            Percentiles::of(&t_rep).map_or(f64::NAN, |p| p.p50)
        ));
        for p in &pods {
            let _ = std::fs::remove_file(manifests.join(format!("{}.yaml", p.name)));
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while pods.iter().any(|p| find_pod(agent, &p.name).is_some()) {
            if tokio::time::Instant::now() > deadline {
                bail!("pods of repetition {} not removed within 60 s", rep + 1);
            }
            tokio::time::sleep(POLL).await;
        }
    }
    for name in order {
        let (reps, samples) = deaths.remove(name).unwrap_or_default();
        out.latencies.push(Latency {
            mode: mode.into(),
            workload: "agent-killed".into(),
            stage: name.into(),
            summary: Summary::of(&reps),
            lost: if name == "status-held" { lost } else { 0 },
            samples_us: samples,
        });
    }
    out.starts.push(Start {
        mode: mode.into(),
        pods: reps * n,
        total_ms: Summary::of(&total),
        runtime_ms: Summary::of(&runtime),
        inspection_ms: Summary::of(&inspection),
        agent_ms: Summary::of(&own),
    });
    out.notes.push(format!(
        "Full agent: the `evpleg` agent in-process (file source, sync loop, pod workers, \
         status manager, its own HTTP port), static pods (busybox `sleep`, restartPolicy \
         Never, host network) written to its manifest directory one at a time; start \
         latency from the manifest's rename into the directory to the status manager \
         holding the container Running (its stage log), the CRI time from the agent's \
         `evpleg_runtime_operations_duration_seconds` sums scraped before the write and \
         after Running (start calls: {}; the others are inspection). Then each pod's \
         main process killed with SIGKILL at a random time over the window.",
        START_OPS.join(", ")
    ));
    Ok(out)
}
