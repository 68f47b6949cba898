//! Idle cost: N containers running and nothing happening, each PLEG mode in
//! turn: CPU of the process running the PLEG (the benchmark only sleeps
//! meanwhile) and of containerd, from `/proc/<pid>/task/*/schedstat`; resident memory from
//! `/proc/self/status`; relists per second (each is a ListPodSandbox and a
//! ListContainers, plus a status per changed pod).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use evpleg_cri::CriClient;
use evpleg_pleg::kernel::KernelPlegConfig;
use evpleg_pleg::{Pleg, PlegMode};
use evpleg_tests::containerd::Containerd;
use evpleg_tests::cri_pod::{TestPod, run_container, run_sandbox};
use tokio::sync::mpsc;

/// CPU time of `pid`'s live threads in seconds: the sum of their
/// `/proc/<pid>/task/*/schedstat` run times (ns; `stat`'s ticks are too coarse
/// for a few seconds of an idle process). Threads that ended are not counted,
/// nor the calling thread: the benchmark measures from its main thread
/// (`block_on`), which runs nothing else, and reading a hundred shims'
/// threads is the benchmark's work, not the measured agent's (it was a tenth
/// of the agent's figure at 100 idle pods).
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    // SAFETY: gettid has no preconditions.
    let me = unsafe { libc::gettid() }.to_string();
    let mut ns = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let Ok(task) = task else { continue };
        if task.file_name().to_str() == Some(me.as_str()) {
            continue;
        }
        if let Ok(s) = std::fs::read_to_string(task.path().join("schedstat"))
            && let Some(run) = s
                .split_whitespace()
                .next()
                .and_then(|f| f.parse::<u64>().ok())
        {
            ns += run;
        }
    }
    Some(ns as f64 / 1e9)
}

/// The resident memory of process `pid` in MiB.
pub fn rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// Idle containers kept running across modes.
#[derive(Debug)]
pub struct IdlePods {
    pods: Vec<(TestPod, String)>,
    pub containers: usize,
}

impl IdlePods {
    pub fn new() -> Self {
        Self {
            pods: Vec::new(),
            containers: 0,
        }
    }

    /// Adds containers (10 per pod, `sleep`) until `n` run.
    pub async fn grow_to(&mut self, containerd: &Containerd, client: &CriClient, n: usize) {
        while self.containers < n {
            let per_pod = 10;
            if self.containers.is_multiple_of(per_pod) {
                let pod = TestPod::new(containerd, &format!("idle{}", self.pods.len()));
                let sandbox = run_sandbox(client, &pod).await;
                self.pods.push((pod, sandbox));
            }
            let (pod, sandbox) = self.pods.last().expect("a pod");
            let name = format!("s{}", self.containers);
            let config = pod.container(&name, &["sleep", "1000000"]);
            run_container(client, pod, sandbox, &config).await;
            self.containers += 1;
        }
    }

    pub async fn remove(self, client: &CriClient) {
        for (_, sandbox) in self.pods {
            let _ = client.stop_pod_sandbox(&sandbox).await;
            let _ = client.remove_pod_sandbox(&sandbox).await;
        }
    }
}

/// One window's measurement.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    pub agent_cpu_pct: f64,
    pub containerd_cpu_pct: f64,
    pub rss_mib: f64,
    pub relists_per_s: f64,
}

/// Runs `mode` (or no PLEG at all: the baseline of the benchmark's own process)
/// for `windows` windows of `each` after a settling period.
pub async fn measure(
    mode: Option<PlegMode>,
    client: &CriClient,
    containerd_pid: u32,
    windows: usize,
    each: Duration,
) -> anyhow::Result<Vec<Window>> {
    let (tx, mut rx) = mpsc::channel(10_000);
    let pleg = match mode {
        Some(mode) => Some(crate::death::start_pleg(
            mode,
            client,
            KernelPlegConfig::default(),
            tx,
        )?),
        None => None,
    };
    let relists = |p: &Option<Pleg>| {
        p.as_ref()
            .map_or(0, |p| p.relist_stats.relists.load(Ordering::Relaxed))
    };
    // The events are drained (as the sync loop would) by a task of their own.
    let drain = tokio::spawn(async move { while rx.recv().await.is_some() {} });
    // Settle: the first relist and the start-up scan are not idle cost.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let me = std::process::id();
    let mut out = Vec::new();
    for _ in 0..windows {
        let started = Instant::now();
        let (a0, c0) = (cpu_seconds(me), cpu_seconds(containerd_pid));
        let r0 = relists(&pleg);
        tokio::time::sleep(each).await;
        let secs = started.elapsed().as_secs_f64();
        let (a1, c1) = (cpu_seconds(me), cpu_seconds(containerd_pid));
        let r1 = relists(&pleg);
        let pct = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => 100.0 * (b - a) / secs,
            _ => f64::NAN,
        };
        out.push(Window {
            agent_cpu_pct: pct(a0, a1),
            containerd_cpu_pct: pct(c0, c1),
            rss_mib: rss_mib(me).unwrap_or(f64::NAN),
            relists_per_s: (r1 - r0) as f64 / secs,
        });
    }
    if let Some(pleg) = pleg {
        pleg.stop().await;
    }
    drain.abort();
    Ok(out)
}
