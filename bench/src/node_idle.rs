//! Node idle (issues #29 and #30): static pods running and nothing happening,
//! under the full agent in each PLEG mode and under the stock kubelet 1.37 in
//! each of its ways, each a fresh one against the benchmark's containerd,
//! its pods added up to each count asked for (10, 50 and 100 in a full run;
//! busybox `sleep`, restartPolicy Never, host network: a sandbox and one
//! container each). Once all run and a settling period has passed, the CPU
//! over each window of:
//!
//! * the node agent: the `evpleg` agent (in the benchmark's process, which
//!   only sleeps meanwhile) or the kubelet's process, all threads;
//! * the proxy in `kubelet-1.37-cri-proxy` (`evpleg cri-proxy`, in the
//!   benchmark's process);
//! * the runtime: containerd and its shims (the `containerd-shim` processes
//!   serving this containerd's socket);
//!
//! from `/proc/<pid>/task/*/schedstat` ([`crate::idle::cpu_seconds`]), and
//! the agent's or kubelet's resident memory. The kubelet's whole process is
//! counted, as an operator's `top` shows it: at idle it also runs cadvisor's
//! stats housekeeping and its managers' loops, which the agent has not.
//! Unlike [`crate::idle`] (the PLEG alone over containers in a few pods),
//! this is the cost of the whole node agent by pod count.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use evpleg_tests::containerd::Containerd;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::agent::{AgentMode, app};
use crate::idle::{cpu_seconds, rss_mib};
use crate::kubelet::KubeletMode;

/// The modes measured: the agent's own PLEG and the 1.37 and 1.0 designs it
/// models, and the stock kubelet's three ways.
pub const MODES: [AgentMode; 6] = [
    AgentMode::Pleg(evpleg_pleg::PlegMode::Ebpf),
    AgentMode::Pleg(evpleg_pleg::PlegMode::EventedCri),
    AgentMode::Pleg(evpleg_pleg::PlegMode::Generic),
    AgentMode::Kubelet(KubeletMode::Generic),
    AgentMode::Kubelet(KubeletMode::Evented),
    AgentMode::Kubelet(KubeletMode::ProxyEvented),
];

/// How long the pods of one step may take to run.
const START_BOUND: Duration = Duration::from_secs(300);

/// The report's note on this part.
pub const NOTE: &str = "Node idle: a fresh agent (in the benchmark's process, which only \
     sleeps meanwhile) or stock kubelet 1.37 for each mode, on the same containerd, its static \
     pods (busybox `sleep`, restartPolicy Never, host network; a sandbox and one container \
     each) added up to each count; once all run and a settling period has passed, CPU over \
     each window from `/proc/<pid>/task/*/schedstat`: the agent or the kubelet's whole \
     process, the proxy (`evpleg cri-proxy`, in the benchmark's process) in \
     `kubelet-1.37-cri-proxy`, containerd, and its shims; the agent's or the kubelet's CRI \
     calls a second, from its `runtime_operations_duration_seconds` counts scraped just before \
     the first window and after the last. The kubelet runs with \
     `cgroupsPerQOS: false` (its containers in containerd's `/k8s.io/<id>`, as in its other \
     rows) and does at idle what the agent does not (cadvisor's stats housekeeping among \
     them): its whole process is counted, as an operator's `top` shows it. The shims are \
     shown apart and left out of the target: containerd 1.7's shim forces a garbage collection \
     and returns its memory to the system every 30 s (`debug.FreeOSMemory` on a 30 s ticker in \
     `runtime/v2/shim`'s `setRuntime`, the whole of the shims' idle profile here), the same \
     cost under any node agent, so the windows last 30 s, each holding one such round of \
     every shim.";

/// How long and how often to measure.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Pod counts, growing.
    pub counts: Vec<usize>,
    /// After the pods run, before the first window.
    pub settle: Duration,
    pub windows: usize,
    pub each: Duration,
}

/// A figure over the windows: its mean, the figure over all the counted
/// time (the windows are of equal length), and the lowest and highest window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Windows {
    pub mean: f64,
    pub min: f64,
    pub max: f64,
}

impl Windows {
    /// `None` for no window.
    pub fn of(values: &[f64]) -> Option<Self> {
        let first = *values.first()?;
        Some(Self {
            mean: values.iter().sum::<f64>() / values.len() as f64,
            min: values.iter().copied().fold(first, f64::min),
            max: values.iter().copied().fold(first, f64::max),
        })
    }
}

/// One mode at one pod count: each figure over the windows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeIdle {
    pub mode: String,
    pub pods: usize,
    /// Counted seconds (every window).
    pub seconds: f64,
    /// The agent or the kubelet, % of a core.
    pub agent_cpu_pct: Windows,
    /// The proxy in front of the runtime, when one runs.
    pub proxy_cpu_pct: Option<Windows>,
    pub containerd_cpu_pct: Windows,
    pub shims_cpu_pct: Windows,
    /// The agent's (the benchmark process's) or the kubelet's resident memory.
    pub agent_rss_mib: Windows,
    /// The agent's or the kubelet's CRI calls a second over the windows (its
    /// `runtime_operations_duration_seconds` counts, scraped before the first
    /// window and after the last); `None` in results from before it was kept.
    #[serde(default)]
    pub cri_calls_per_s: Option<f64>,
}

impl NodeIdle {
    /// Agent (or kubelet), proxy and containerd: the sum of the means,
    /// what the node agent costs with the runtime daemon it drives.
    pub fn agent_and_daemon_cpu_pct(&self) -> f64 {
        self.agent_cpu_pct.mean
            + self.proxy_cpu_pct.as_ref().map_or(0.0, |p| p.mean)
            + self.containerd_cpu_pct.mean
    }

    /// Whether the node agent ran in the benchmark's process (evpleg's
    /// modes), whose resident memory then holds the benchmark's too: only
    /// the kubelet's rows give the node agent's own.
    pub fn agent_in_benchmark_process(&self) -> bool {
        !self.mode.starts_with("kubelet-")
    }

    /// Every process counted, the shims too: the sum of the means.
    pub fn total_cpu_pct(&self) -> f64 {
        self.agent_and_daemon_cpu_pct() + self.shims_cpu_pct.mean
    }
}

/// The node agent under measurement.
enum Node {
    Agent(crate::agent::Running),
    Kubelet(crate::kubelet::Running),
}

impl Node {
    async fn start(containerd: &Containerd, mode: AgentMode) -> Result<Self> {
        Ok(match mode {
            AgentMode::Kubelet(k) => {
                Self::Kubelet(crate::kubelet::Running::start(containerd, k, "idle").await?)
            }
            _ => Self::Agent(crate::agent::Running::start(containerd, mode, "idle").await?),
        })
    }

    fn add_pod(&mut self, name: &str) -> Result<()> {
        match self {
            Self::Agent(a) => crate::agent::write_manifest(&a.manifests, name),
            Self::Kubelet(k) => {
                k.write_pod(name);
                Ok(())
            }
        }
    }

    /// The node agent's CRI calls so far, every operation.
    async fn cri_calls(&self) -> Option<f64> {
        Some(match self {
            Self::Agent(a) => crate::agent::cri_calls_in(
                &evpleg_tests::e2e::http_get(a.agent.addr, "/metrics").await,
                "evpleg_runtime_operations_duration_seconds",
            ),
            Self::Kubelet(k) => crate::agent::cri_calls_in(
                &k.kubelet.metrics().await?,
                "kubelet_runtime_operations_duration_seconds",
            ),
        })
    }

    async fn pods(&self) -> Value {
        match self {
            Self::Agent(a) => a.pods(),
            Self::Kubelet(k) => k.pods().await,
        }
    }

    /// The process of the node agent, and of the proxy when one runs.
    fn pids(&self) -> Result<(u32, Option<u32>)> {
        let me = std::process::id();
        Ok(match self {
            Self::Agent(_) => (me, None),
            Self::Kubelet(k) => (
                k.kubelet
                    .pid()
                    .context("the stock kubelet is not running")?,
                k.proxy.as_ref().map(|_| me),
            ),
        })
    }

    async fn finish(self, containerd: &Containerd, uids: &[String]) {
        match self {
            Self::Agent(a) => a.finish(containerd, uids).await,
            Self::Kubelet(k) => k.finish(containerd, uids).await,
        }
    }
}

/// Measures `modes` one after another; returns the rows and a note for
/// each mode that failed (its rows up to the failure are kept).
pub async fn run(
    containerd: &Containerd,
    modes: &[AgentMode],
    plan: &Plan,
) -> (Vec<NodeIdle>, Vec<String>) {
    let (mut rows, mut failures) = (Vec::new(), Vec::new());
    for &mode in modes {
        if crate::interrupt::check().is_err() {
            // The caller checks again and stops the run.
            break;
        }
        if let Err(e) = one_mode(containerd, mode, plan, &mut rows).await {
            let note = format!("Node idle, {}: failed: {e:#}", mode.name());
            crate::progress(&note);
            failures.push(note);
        }
    }
    (rows, failures)
}

async fn one_mode(
    containerd: &Containerd,
    mode: AgentMode,
    plan: &Plan,
    rows: &mut Vec<NodeIdle>,
) -> Result<()> {
    let mut node = Node::start(containerd, mode).await?;
    let outcome = grow_and_measure(containerd, &mut node, mode, plan, rows).await;
    let uids = uids(&node.pods().await);
    node.finish(containerd, &uids).await;
    outcome
}

async fn grow_and_measure(
    containerd: &Containerd,
    node: &mut Node,
    mode: AgentMode,
    plan: &Plan,
    rows: &mut Vec<NodeIdle>,
) -> Result<()> {
    let containerd_pid = containerd.pid().context("containerd's pid")?;
    let socket = containerd.socket().display().to_string();
    let mut added = 0;
    for &n in &plan.counts {
        crate::interrupt::check()?;
        crate::progress(&format!("node idle: {} with {n} pods", mode.name()));
        while added < n {
            node.add_pod(&format!("idle{added}"))?;
            added += 1;
        }
        wait_running(node, n).await?;
        tokio::time::sleep(plan.settle).await;
        let (agent, proxy) = node.pids()?;
        let shims = shims_of(&socket);
        // Scraped outside the windows, so that serving them is not counted.
        let calls_before = node.cri_calls().await;
        let counted = Instant::now();
        let mut windows = Vec::new();
        for _ in 0..plan.windows {
            crate::interrupt::check()?;
            windows.push(window(agent, proxy, containerd_pid, &shims, plan.each).await);
        }
        let counted = counted.elapsed().as_secs_f64();
        let cri_calls_per_s = calls_before
            .zip(node.cri_calls().await)
            .map(|(before, after)| (after - before) / counted);
        let over = |f: fn(&Window) -> f64| {
            Windows::of(&windows.iter().map(f).collect::<Vec<_>>()).context("no window")
        };
        let row = NodeIdle {
            mode: mode.name().into(),
            pods: n,
            seconds: (plan.each * plan.windows as u32).as_secs_f64(),
            agent_cpu_pct: over(|w| w.agent)?,
            proxy_cpu_pct: proxy.map(|_| over(|w| w.proxy)).transpose()?,
            containerd_cpu_pct: over(|w| w.containerd)?,
            shims_cpu_pct: over(|w| w.shims)?,
            agent_rss_mib: over(|w| w.rss_mib)?,
            cri_calls_per_s,
        };
        crate::progress(&format!(
            "  agent {:.3} %, proxy {:.3} %, containerd {:.3} %, {} shims {:.3} % of a core; RSS {:.1} MiB; {:.1} CRI calls/s",
            row.agent_cpu_pct.mean,
            row.proxy_cpu_pct.as_ref().map_or(0.0, |p| p.mean),
            row.containerd_cpu_pct.mean,
            shims.len(),
            row.shims_cpu_pct.mean,
            row.agent_rss_mib.mean,
            row.cri_calls_per_s.unwrap_or(f64::NAN)
        ));
        rows.push(row);
    }
    Ok(())
}

/// The pods in a `/pods` list whose (one) container runs.
fn running(list: &Value) -> usize {
    list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| app(p).is_some_and(|c| !c["state"]["running"].is_null()))
        .count()
}

/// The UIDs of the pods in a `/pods` list.
fn uids(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["metadata"]["uid"].as_str().map(str::to_owned))
        .collect()
}

async fn wait_running(node: &Node, n: usize) -> Result<()> {
    let deadline = Instant::now() + START_BOUND;
    loop {
        let list = node.pods().await;
        let count = running(&list);
        if count >= n {
            return Ok(());
        }
        if Instant::now() > deadline {
            let waiting = list["items"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| app(p).is_none_or(|c| c["state"]["running"].is_null()))
                .map_or_else(|| "none listed".to_owned(), |p| p["status"].to_string());
            bail!("{count} of {n} pods running after {START_BOUND:?}; one that is not: {waiting}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The shims serving the containerd at `socket` (their command line names
/// it after `-address`).
fn shims_of(socket: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|cmdline| is_shim_of(&cmdline, socket))
        })
        .collect()
}

/// Whether the NUL-separated command line `cmdline` is a containerd shim's
/// whose `-address` is `socket`.
fn is_shim_of(cmdline: &[u8], socket: &str) -> bool {
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    let is_shim = args
        .first()
        .is_some_and(|a| String::from_utf8_lossy(a).contains("containerd-shim"));
    is_shim
        && args
            .windows(2)
            .any(|w| w[0] == b"-address" && w[1] == socket.as_bytes())
}

/// One window's figures, % of a core (and MiB).
struct Window {
    agent: f64,
    proxy: f64,
    containerd: f64,
    shims: f64,
    rss_mib: f64,
}

async fn window(
    agent: u32,
    proxy: Option<u32>,
    containerd: u32,
    shims: &[u32],
    each: Duration,
) -> Window {
    let cpu = |pids: &[u32]| -> f64 { pids.iter().filter_map(|p| cpu_seconds(*p)).sum() };
    let proxy: Vec<u32> = proxy.into_iter().collect();
    let sample = || [cpu(&[agent]), cpu(&proxy), cpu(&[containerd]), cpu(shims)];
    let started = Instant::now();
    let before = sample();
    tokio::time::sleep(each).await;
    let after = sample();
    let secs = started.elapsed().as_secs_f64();
    let pct = |i: usize| 100.0 * (after[i] - before[i]) / secs;
    Window {
        agent: pct(0),
        proxy: pct(1),
        containerd: pct(2),
        shims: pct(3),
        rss_mib: rss_mib(agent).unwrap_or(f64::NAN),
    }
}

/// The report's section.
pub fn render(rows: &[NodeIdle]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    if rows.is_empty() {
        return out;
    }
    let _ = writeln!(out, "## Node idle: the whole node agent by pod count\n");
    let _ = writeln!(
        out,
        "Means over the windows, that is over all the counted time (the lowest and highest window), % of a core; see the note on node idle for the \
         method. RSS: the kubelet's process; in evpleg's modes the agent runs in the benchmark's process, whose RSS (in brackets) \
         holds the benchmark's own data too and is not the agent's: the PLEG's own memory is measured in a process of its own (The PLEG's memory).\n"
    );
    let _ = writeln!(
        out,
        "| mode | pods | seconds | agent or kubelet | proxy | containerd | agent, proxy and containerd | shims | total | kubelet RSS (MiB) | its CRI calls/s |\n|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let f = |s: &Windows| format!("{:.3} ({:.3}-{:.3})", s.mean, s.min, s.max);
    for r in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {} | {} | {} | {:.3} | {} | {:.3} | {} | {} |",
            r.mode,
            r.pods,
            r.seconds,
            f(&r.agent_cpu_pct),
            r.proxy_cpu_pct.as_ref().map_or_else(|| "-".to_owned(), f),
            f(&r.containerd_cpu_pct),
            r.agent_and_daemon_cpu_pct(),
            f(&r.shims_cpu_pct),
            r.total_cpu_pct(),
            if r.agent_in_benchmark_process() {
                format!("({:.1})", r.agent_rss_mib.mean)
            } else {
                format!("{:.1}", r.agent_rss_mib.mean)
            },
            r.cri_calls_per_s
                .map_or_else(|| "-".to_owned(), |c| format!("{c:.1}"))
        );
    }
    let _ = writeln!(out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(mean: f64) -> Windows {
        Windows {
            mean,
            min: mean / 2.0,
            max: mean * 2.0,
        }
    }

    #[test]
    fn a_figure_over_the_windows_is_their_mean_not_the_lower_middle() {
        let w = Windows::of(&[0.63, 0.415]).unwrap();
        assert!((w.mean - 0.5225).abs() < 1e-12, "{w:?}");
        assert_eq!((w.min, w.max), (0.415, 0.63));
        assert_eq!(Windows::of(&[]), None);
    }

    #[test]
    fn the_total_sums_the_means_of_every_process_counted() {
        let mut row = NodeIdle {
            mode: "kubelet-1.37-cri-proxy".into(),
            pods: 100,
            seconds: 30.0,
            agent_cpu_pct: s(2.0),
            proxy_cpu_pct: Some(s(0.25)),
            containerd_cpu_pct: s(1.0),
            shims_cpu_pct: s(0.5),
            agent_rss_mib: s(80.0),
            cri_calls_per_s: Some(2.5),
        };
        assert_eq!(row.total_cpu_pct(), 3.75);
        assert_eq!(row.agent_and_daemon_cpu_pct(), 3.25);
        row.proxy_cpu_pct = None;
        assert_eq!(row.total_cpu_pct(), 3.5);
        assert_eq!(row.agent_and_daemon_cpu_pct(), 3.0);
        let agent = NodeIdle {
            mode: "ebpf".into(),
            ..row.clone()
        };
        let table = render(&[row, agent]);
        assert!(
            table.contains("| kubelet-1.37-cri-proxy | 100 | 30 | 2.000 (1.000-4.000) | - | 1.000 (0.500-2.000) | 3.000 | 0.500 (0.250-1.000) | 3.500 | 80.0 | 2.5 |"),
            "{table}"
        );
        // The agent's row gives the benchmark process's RSS, marked so.
        assert!(
            table.contains("| ebpf | 100 | 30 | 2.000 (1.000-4.000) | - | 1.000 (0.500-2.000) | 3.000 | 0.500 (0.250-1.000) | 3.500 | (80.0) | 2.5 |"),
            "{table}"
        );
    }

    #[test]
    fn running_pods_and_their_uids_are_read_from_pods() {
        let list = serde_json::json!({"items": [
            {"metadata": {"uid": "a"}, "status": {"containerStatuses": [{"state": {"running": {}}}]}},
            {"metadata": {"uid": "b"}, "status": {"containerStatuses": [{"state": {"waiting": {}}}]}},
            {"metadata": {"uid": "c"}, "status": {}},
        ]});
        assert_eq!(running(&list), 1);
        assert_eq!(uids(&list), ["a", "b", "c"]);
        assert_eq!(running(&Value::Null), 0);
    }

    #[test]
    fn a_shim_is_known_by_its_address() {
        let ours = "/run/evpleg-test/c1/containerd.sock";
        let shim = |address: &str| {
            format!(
                "/usr/bin/containerd-shim-runc-v2\0-namespace\0k8s.io\0-id\0abc\0-address\0{address}\0"
            )
        };
        assert!(is_shim_of(shim(ours).as_bytes(), ours));
        // Another containerd's shim, and a process naming the socket.
        assert!(!is_shim_of(
            shim("/run/containerd/containerd.sock").as_bytes(),
            ours
        ));
        let ctr = format!("/usr/bin/ctr\0-address\0{ours}\0");
        assert!(!is_shim_of(ctr.as_bytes(), ours));
    }
}
