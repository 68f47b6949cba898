//! What a run measured, as written to `bench/results/*.json` and read by the
//! report.

use serde::{Deserialize, Serialize};

use crate::stats::{Pooled, Spread, Summary};

/// The machine the run was made on.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    pub cores: usize,
    pub kernel: String,
    pub cpu_model: String,
    /// UTC, RFC 3339.
    pub date: String,
}

impl Machine {
    /// Reads `/proc` (and the clock) of this machine.
    pub fn here() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, m)| m.trim().to_owned())
            .unwrap_or_else(|| "unknown".to_owned());
        let cores = cpuinfo
            .lines()
            .filter(|l| l.starts_with("processor"))
            .count();
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_owned())
            .unwrap_or_default();
        let date = std::process::Command::new("date")
            .args(["-u", "+%Y-%m-%dT%H:%M:%SZ"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default();
        Self {
            cores,
            kernel,
            cpu_model,
            date,
        }
    }
}

/// Latencies of one mode, workload and stage, in microseconds from the kernel's
/// exit timestamp.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    /// `ebpf`, `generic`, `evented-cri`, or `floor` (the bare reader).
    pub mode: String,
    /// `self-exit` or `killed`.
    pub workload: String,
    /// `reader` (the record read from the ring buffer) or `event` (the
    /// lifecycle event taken from the PLEG's channel).
    pub stage: String,
    /// The spread across repetitions (each repetition's own percentiles).
    pub summary: Option<Summary>,
    /// Deaths never seen at this stage within the bound.
    pub lost: usize,
    /// Every sample of every counted repetition (the warm-up's are not): the
    /// tails and the CDF are taken from these.
    pub samples_us: Vec<f64>,
}

impl Latency {
    /// The tails over the pooled samples.
    pub fn pooled(&self) -> Option<Pooled> {
        Pooled::of(&self.samples_us)
    }
}

/// CPU and memory with `containers` running and nothing happening.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Idle {
    pub mode: String,
    pub containers: usize,
    pub seconds: f64,
    /// CPU seconds per second of the process running the PLEG (the benchmark
    /// itself idles meanwhile), as a percentage of one core.
    pub agent_cpu_pct: Spread,
    pub containerd_cpu_pct: Spread,
    pub agent_rss_mib: Spread,
    /// Full relists per second (each a ListPodSandbox and a ListContainers).
    pub relists_per_s: Spread,
}

/// A whole run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Results {
    pub machine: Machine,
    pub command: String,
    pub quick: bool,
    pub containerd: String,
    /// Counted repetitions.
    pub repetitions: usize,
    pub containers_per_repetition: usize,
    /// A warm-up repetition ran first (not counted) and the modes were
    /// interleaved repetition by repetition (false in results written before
    /// issue #29).
    #[serde(default)]
    pub warm_up: bool,
    pub latency: Vec<Latency>,
    pub idle: Vec<Idle>,
    /// The whole node agent (evpleg's or the stock kubelet) idle by pod
    /// count (absent from results written before it).
    #[serde(default)]
    pub node_idle: Vec<crate::node_idle::NodeIdle>,
    /// Start latency of static pods through the full agent.
    #[serde(default)]
    pub starts: Vec<Start>,
    /// The scale workload (cgroups and plain processes, a fake runtime).
    #[serde(default)]
    pub scale: Option<crate::scale::ScaleResults>,
    /// What an operator asks first: the node tax, the runtime's load, the
    /// PLEG's memory (issue #29).
    #[serde(default)]
    pub operator: crate::operator::OperatorResults,
    pub notes: Vec<String>,
}

/// Start latency of one kind of pod through the full agent: from the manifest
/// written to the status manager holding the container Running, in ms.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Start {
    pub mode: String,
    pub pods: usize,
    /// Manifest written to the status Running.
    pub total_ms: Option<Summary>,
    /// The CRI calls that start a pod (RunPodSandbox, CreateContainer,
    /// StartContainer, image calls), summed per pod.
    pub runtime_ms: Option<Summary>,
    /// Other CRI calls meanwhile (inspection: lists and statuses), summed.
    pub inspection_ms: Option<Summary>,
    /// `total - runtime`: the agent's own time (sources, admission, workers,
    /// waits for the cache, the status manager) and the inspection calls.
    pub agent_ms: Option<Summary>,
    /// Every pod's figures, for the pooled percentiles (absent from results
    /// written before issue #29: the report then shows the spread only).
    #[serde(default)]
    pub samples: StartSamples,
}

/// Every counted pod's start figures, in ms.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StartSamples {
    pub total_ms: Vec<f64>,
    pub runtime_ms: Vec<f64>,
    pub inspection_ms: Vec<f64>,
    pub agent_ms: Vec<f64>,
}

impl StartSamples {
    /// One pod's start: `total_ms` from its manifest to Running, with the
    /// CRI time of its start calls and of the others meanwhile
    /// ([`crate::agent::cri_delta`]); the rest is the agent's (or the
    /// kubelet's) own.
    pub fn push(&mut self, total_ms: f64, (start_ms, other_ms): (f64, f64)) {
        self.total_ms.push(total_ms);
        self.runtime_ms.push(start_ms);
        self.inspection_ms.push(other_ms);
        self.agent_ms.push((total_ms - start_ms).max(0.0));
    }

    pub fn extend(&mut self, other: &StartSamples) {
        self.total_ms.extend(&other.total_ms);
        self.runtime_ms.extend(&other.runtime_ms);
        self.inspection_ms.extend(&other.inspection_ms);
        self.agent_ms.extend(&other.agent_ms);
    }
}

/// Results files written before issue #29 named the kubelet 1.37 design's
/// comparator `evented-cri` (it also relisted a pod on every event, not only
/// on CONTAINER_STOPPED: the same for deaths and idle cost), and the agent
/// behind the proxy in that design `cri-proxy`.
const RENAMED: [(&str, &str); 2] = [
    ("evented-cri", crate::death::EVENTED_137),
    ("cri-proxy", crate::agent::CRI_PROXY_137),
];

impl Results {
    /// Brings a results file of an older run to today's names.
    pub fn migrate(&mut self) {
        let rename = |m: &mut String| {
            if let Some((_, new)) = RENAMED.iter().find(|(old, _)| m == old) {
                *m = (*new).to_owned();
            }
        };
        self.latency.iter_mut().for_each(|l| rename(&mut l.mode));
        self.idle.iter_mut().for_each(|i| rename(&mut i.mode));
        self.starts.iter_mut().for_each(|s| rename(&mut s.mode));
    }

    pub fn latency(&self, mode: &str, workload: &str, stage: &str) -> Option<&Latency> {
        self.latency
            .iter()
            .find(|l| l.mode == mode && l.workload == workload && l.stage == stage)
    }
}
