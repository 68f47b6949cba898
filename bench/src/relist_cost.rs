//! The relist's cost by pod count against real pods (issue #29), beside the
//! kernel path's per-event cost. The kubelet's generic relist
//! (`GenericPLEG.Relist`, `pkg/kubelet/pleg/generic.go`) lists every sandbox
//! and container each second, whatever happened; its duration grows with the
//! pods (kubernetes/kubernetes#96448 reports about 5.7 ms at 100 pods, 10.8 ms
//! at 300 and 17.1 ms at 900 on containerd 1.4). evpleg's `ebpf` mode instead
//! pays per event: a death is read from the ring buffer and its pod alone is
//! relisted.
//!
//! At each count of real pods (one sandbox and one `sleep` container each,
//! against the run's containerd): `generic` mode on a CRI client of its own,
//! its first relist and the median of its steady relists
//! (`relist_stats.last_duration_ns`); then `ebpf` mode with the same pods,
//! a few of their containers killed from the host one at a time, each death's
//! stages from the stage log, and the process's CPU per death over the
//! killing window, which starts once its first full relist and that relist's
//! loss follow-ups have run and no relist ran for a second ([`settle`]), the
//! victims' pids already asked. The fake runtime's figures to 10 000 pods are the scale
//! part's (`RelistCost`).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use evpleg_cri::CriClient;
use evpleg_pleg::kernel::KernelPlegConfig;
use evpleg_pleg::{Pleg, PlegMode};
use evpleg_tests::containerd::Containerd;
use evpleg_tests::cri_pod::{TestPod, run_container, run_sandbox, verbose_pid};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::stats::{Percentiles, Spread};

/// Errors of the relist-cost measurement.
#[derive(Debug, thiserror::Error)]
pub enum RelistCostError {
    #[error(transparent)]
    Interrupted(#[from] crate::interrupt::Interrupted),
    #[error("connecting a cri client to {endpoint}: {message}")]
    Connect { endpoint: String, message: String },
    #[error("starting the {mode} pleg: {message}")]
    Start { mode: &'static str, message: String },
    #[error("no relist by the {mode} pleg within {secs} s at {pods} pods")]
    NoRelist {
        mode: &'static str,
        secs: u64,
        pods: usize,
    },
}

/// One count of real pods.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RealRelist {
    pub pods: usize,
    /// The first relist (every pod inspected), ms.
    pub first_ms: f64,
    /// Each steady relist seen over the window, ms.
    pub steady_ms: Vec<f64>,
    /// The ebpf deaths at this count: container kills from the host.
    pub deaths: usize,
    /// Per stage (`reader` .. `delivered`): each death's latency, us.
    pub stages: Vec<(String, Vec<f64>)>,
    /// The whole process's CPU over the killing window, s.
    pub ebpf_cpu_s: f64,
    /// The whole process's CPU over a window as long without a death, just
    /// before it, s (`None`: a run from before it was measured): what the
    /// process costs anyway (its threads, the PLEG idle).
    #[serde(default)]
    pub ebpf_idle_cpu_s: Option<f64>,
    /// The PLEG's CRI calls over the killing window (`None`: a run from
    /// before they were counted).
    #[serde(default)]
    pub ebpf_cri_calls: Option<u64>,
}

impl RealRelist {
    /// The median steady relist, ms.
    pub fn steady_median_ms(&self) -> Option<f64> {
        Spread::of(&self.steady_ms).map(|s| s.median)
    }

    /// The process's CPU per death above its CPU without deaths, us (the
    /// whole window's per death for a run that did not measure the latter).
    pub fn cpu_us_per_death(&self) -> Option<f64> {
        let above = self.ebpf_cpu_s - self.ebpf_idle_cpu_s.unwrap_or(0.0);
        (self.deaths > 0).then(|| above.max(0.0) * 1e6 / self.deaths as f64)
    }

    /// The process's CPU without deaths, per death of the killing window, us.
    pub fn idle_cpu_us_per_death(&self) -> Option<f64> {
        let idle = self.ebpf_idle_cpu_s?;
        (self.deaths > 0).then(|| idle * 1e6 / self.deaths as f64)
    }

    /// The PLEG's CRI calls per death.
    pub fn calls_per_death(&self) -> Option<f64> {
        let calls = self.ebpf_cri_calls?;
        (self.deaths > 0).then(|| calls as f64 / self.deaths as f64)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RelistCostResults {
    pub real: Vec<RealRelist>,
}

/// Real pods kept across counts: (pod, sandbox, container id).
struct RealPods(Vec<(TestPod, String, String)>);

impl RealPods {
    async fn grow_to(&mut self, containerd: &Containerd, client: &CriClient, n: usize) {
        while self.0.len() < n {
            let pod = TestPod::new(containerd, &format!("relist{}", self.0.len()));
            let sandbox = run_sandbox(client, &pod).await;
            let config = pod.container("app", &["sleep", "1000000"]);
            let id = run_container(client, &pod, &sandbox, &config).await;
            self.0.push((pod, sandbox, id));
        }
    }

    async fn remove(self, client: &CriClient) {
        for (_, sandbox, _) in self.0 {
            let _ = client.stop_pod_sandbox(&sandbox).await;
            let _ = client.remove_pod_sandbox(&sandbox).await;
        }
    }
}

type Events = mpsc::Receiver<evpleg_core::lifecycle::PodLifecycleEvent>;

/// The PLEG on `client`, its events drained by a task of their own.
fn start(
    mode: PlegMode,
    client: &CriClient,
) -> Result<(Pleg, tokio::task::JoinHandle<()>), RelistCostError> {
    let (tx, rx) = mpsc::channel(10_000);
    let pleg =
        crate::death::start_pleg(mode, client, KernelPlegConfig::default(), tx).map_err(|e| {
            RelistCostError::Start {
                mode: crate::death::Observer::Pleg(mode).name(),
                message: e.to_string(),
            }
        })?;
    let mut rx: Events = rx;
    let drain = tokio::spawn(async move { while rx.recv().await.is_some() {} });
    Ok((pleg, drain))
}

/// `generic` mode's relists at the pods there are: (first, steady).
async fn generic(
    client: &CriClient,
    pods: usize,
    window: Duration,
) -> Result<(f64, Vec<f64>), RelistCostError> {
    let (pleg, drain) = start(PlegMode::Generic, client)?;
    let stats = pleg.relist_stats.clone();
    let bound = Duration::from_secs(120);
    let deadline = Instant::now() + bound;
    while stats.relists.load(Ordering::Relaxed) < 1 {
        if Instant::now() > deadline {
            pleg.stop().await;
            drain.abort();
            return Err(RelistCostError::NoRelist {
                mode: "generic",
                secs: bound.as_secs(),
                pods,
            });
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let first_ms = stats.last_duration_ns.load(Ordering::Relaxed) as f64 / 1e6;
    let mut steady = Vec::new();
    let mut last = stats.relists.load(Ordering::Relaxed);
    let t0 = Instant::now();
    while t0.elapsed() < window {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = stats.relists.load(Ordering::Relaxed);
        if now != last {
            last = now;
            steady.push(stats.last_duration_ns.load(Ordering::Relaxed) as f64 / 1e6);
        }
    }
    pleg.stop().await;
    drain.abort();
    Ok((first_ms, steady))
}

/// Waits (at most 120 s) for `pleg`'s first full relist and its loss
/// follow-ups, then for a second without any relist.
async fn settle(pleg: &Pleg, pods: usize) -> Result<(), RelistCostError> {
    let stats = &pleg.relist_stats;
    let relists =
        || stats.relists.load(Ordering::Relaxed) + stats.pod_relists.load(Ordering::Relaxed);
    let bound = Duration::from_secs(120);
    let deadline = Instant::now() + bound;
    let late = || RelistCostError::NoRelist {
        mode: "ebpf",
        secs: bound.as_secs(),
        pods,
    };
    while stats.relists.load(Ordering::Relaxed) < 1
        || stats.follow_ups_due.load(Ordering::Relaxed) > 0
    {
        if Instant::now() > deadline {
            return Err(late());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    loop {
        let before = relists();
        tokio::time::sleep(Duration::from_secs(1)).await;
        if relists() == before {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(late());
        }
    }
}

/// What `ebpf` mode's killing window measured.
struct Killed {
    stages: Vec<(String, Vec<f64>)>,
    cpu_s: f64,
    idle_cpu_s: f64,
    cri_calls: u64,
    deaths: usize,
}

/// Every CRI call `client` made so far.
fn cri_calls(client: &CriClient) -> u64 {
    crate::runtime_load::calls(&client.metrics()).values().sum()
}

/// How long the killing window waits after each kill.
const KILL_SPACING: Duration = Duration::from_millis(200);

/// `ebpf` mode: `kills` containers killed from the host one at a time.
async fn ebpf(
    client: &CriClient,
    real: &mut RealPods,
    containerd: &Containerd,
    kills: usize,
) -> Result<Killed, RelistCostError> {
    let (pleg, drain) = start(PlegMode::Ebpf, client)?;
    // Past the start-up scan, the first full relist (every pod inspected:
    // 2 to 3 s at 900 pods, which a fixed 2 s let into the window, 37 ms of
    // CPU a death) and its loss follow-ups, until no relist ran for a second.
    if let Err(e) = settle(&pleg, real.0.len()).await {
        pleg.stop().await;
        drain.abort();
        return Err(e);
    }
    // The victims' pids are asked before the window: the verbose status is
    // the benchmark's call, not the PLEG's cost.
    let victims: Vec<usize> = (real.0.len().saturating_sub(kills)..real.0.len()).collect();
    let mut targets = Vec::new();
    for i in &victims {
        let id = real.0[*i].2.clone();
        let pid = client
            .container_status(&id, true)
            .await
            .ok()
            .and_then(|s| verbose_pid(&s.info));
        if let Some(pid) = pid {
            targets.push((id, pid));
        }
    }
    let me = std::process::id();
    // The same length without a death: what the process costs anyway.
    let idle0 = crate::idle::cpu_seconds(me).unwrap_or(0.0);
    tokio::time::sleep(KILL_SPACING * targets.len() as u32).await;
    let idle_cpu_s = crate::idle::cpu_seconds(me).unwrap_or(0.0) - idle0;
    crate::stages::start();
    let calls0 = cri_calls(client);
    let cpu0 = crate::idle::cpu_seconds(me).unwrap_or(0.0);
    let mut ids = Vec::new();
    for (id, pid) in targets {
        // SAFETY: kill has no memory preconditions.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        ids.push(id);
        tokio::time::sleep(KILL_SPACING).await;
    }
    let cpu1 = crate::idle::cpu_seconds(me).unwrap_or(0.0);
    let cri_calls = cri_calls(client).saturating_sub(calls0);
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let (stages, _) = crate::stages::samples(&refs, &crate::stages::snapshot());
    pleg.stop().await;
    drain.abort();
    // The killed pods are replaced by new ones for the next count.
    for i in victims.into_iter().rev() {
        let (_, sandbox, _) = real.0.remove(i);
        let _ = client.stop_pod_sandbox(&sandbox).await;
        let _ = client.remove_pod_sandbox(&sandbox).await;
    }
    let n = real.0.len() + ids.len();
    real.grow_to(containerd, client, n).await;
    let stages = stages
        .into_iter()
        .filter(|(s, _)| {
            !matches!(
                s,
                evpleg_pleg::stages::Stage::WorkerSync | evpleg_pleg::stages::Stage::StatusHeld
            )
        })
        .map(|(s, v)| (crate::stages::name(s).to_owned(), v))
        .collect();
    Ok(Killed {
        stages,
        cpu_s: cpu1 - cpu0,
        idle_cpu_s,
        cri_calls,
        deaths: ids.len(),
    })
}

/// `MemAvailable` of `/proc/meminfo`, KiB.
fn mem_available_kib() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// The share of the memory still available that more pods may take.
const MEMORY_SHARE: f64 = 0.6;

/// How many pods to run when `want` are asked for and `have` run, each
/// having taken `per_pod_kib` (measured so far) of the memory, `available_kib`
/// left: at most what fits in [`MEMORY_SHARE`] of it, never fewer than run.
pub fn pods_that_fit(want: usize, have: usize, per_pod_kib: f64, available_kib: u64) -> usize {
    if want <= have || per_pod_kib <= 0.0 {
        return want.max(have);
    }
    let more = (MEMORY_SHARE * available_kib as f64 / per_pod_kib).floor() as usize;
    want.min(have + more)
}

/// Every count of real pods (a count that does not fit in this machine's
/// memory is cut to what does, and the cut is said in the progress line;
/// the count run is the one recorded).
pub async fn run(
    containerd: &Containerd,
    counts: &[usize],
    kills: usize,
    window: Duration,
) -> Result<RelistCostResults, RelistCostError> {
    let endpoint = containerd.endpoint();
    let client = CriClient::connect(&endpoint, Default::default())
        .await
        .map_err(|e| RelistCostError::Connect {
            endpoint: endpoint.clone(),
            message: e.to_string(),
        })?;
    let mut real = RealPods(Vec::new());
    let mut out = RelistCostResults::default();
    let before = mem_available_kib().unwrap_or(0);
    let result = async {
        for &want in counts {
            crate::interrupt::check()?;
            let have = real.0.len();
            let now = mem_available_kib().unwrap_or(0);
            let per_pod = if have > 0 {
                before.saturating_sub(now) as f64 / have as f64
            } else {
                0.0
            };
            let n = pods_that_fit(want, have, per_pod, now);
            if n < want {
                crate::progress(&format!(
                    "relist cost: {want} pods asked, {n} fit ({:.0} KiB a pod, {} MiB available)",
                    per_pod,
                    now / 1024
                ));
            }
            if out.real.last().is_some_and(|r| r.pods >= n) {
                continue;
            }
            crate::progress(&format!("relist cost: starting real pods up to {n}"));
            let made = Instant::now();
            real.grow_to(containerd, &client, n).await;
            crate::progress(&format!(
                "  {n} pods running ({:.0} s)",
                made.elapsed().as_secs_f64()
            ));
            let (first_ms, steady_ms) = generic(&client, n, window).await?;
            let k = ebpf(&client, &mut real, containerd, kills).await?;
            let r = RealRelist {
                pods: n,
                first_ms,
                steady_ms,
                deaths: k.deaths,
                stages: k.stages,
                ebpf_cpu_s: k.cpu_s,
                ebpf_idle_cpu_s: Some(k.idle_cpu_s),
                ebpf_cri_calls: Some(k.cri_calls),
            };
            crate::progress(&format!(
                "  generic: first relist {:.1} ms, steady {:.1} ms; ebpf: {} deaths, {:.0} us CPU a death above {:.0} us without ({:.1} CRI calls a death)",
                r.first_ms,
                r.steady_median_ms().unwrap_or(f64::NAN),
                r.deaths,
                r.cpu_us_per_death().unwrap_or(f64::NAN),
                r.idle_cpu_us_per_death().unwrap_or(f64::NAN),
                r.calls_per_death().unwrap_or(f64::NAN)
            ));
            out.real.push(r);
        }
        Ok(())
    }
    .await;
    real.remove(&client).await;
    result.map(|()| out)
}

/// The report's section (`fake`: the scale part's relist figures, if run).
pub fn render(r: &RelistCostResults, fake: Option<&crate::scale::ScaleResults>) -> String {
    let mut s = String::from("## The relist's cost by pod count\n\n");
    s.push_str(
        "Real pods (one sandbox and one `sleep` container each) against the run's \
         containerd: `generic` mode's first relist (every pod inspected) and its steady \
         relists (median over the window), beside `ebpf` mode's per-death cost at the same \
         count (containers killed from the host one at a time, 200 ms apart: each death's latency to \
         the PLEG's event; the process's CPU over the killing window per death, above its CPU \
         over a window as long without a death just before it, the windows opening once the \
         PLEG's first full relist and its loss follow-ups have run and no relist ran for a second; \
         and the PLEG's CRI calls over the killing window per death, its pod relists and their \
         re-checks until the runtime shows the death). For \
         reference, kubernetes/kubernetes#96448 reports the kubelet's relist at about 5.7 ms \
         at 100 pods, 10.8 ms at 300 and 17.1 ms at 900 (containerd 1.4, another machine).\n\n\
         | pods | generic first relist (ms) | generic steady relist (ms) | relists seen | ebpf deaths | ebpf `delivered` p50 (us) | ebpf CPU a death (us) | ebpf CPU without deaths (us a death) | ebpf CRI calls a death |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for x in &r.real {
        let delivered = x
            .stages
            .iter()
            .find(|(s, _)| s == "delivered")
            .and_then(|(_, v)| Percentiles::of(v))
            .map_or_else(|| "-".into(), |p| format!("{:.0}", p.p50));
        s.push_str(&format!(
            "| {} | {:.1} | {} | {} | {} | {delivered} | {} | {} | {} |\n",
            x.pods,
            x.first_ms,
            x.steady_median_ms()
                .map_or_else(|| "-".into(), |m| format!("{m:.1}")),
            x.steady_ms.len(),
            x.deaths,
            x.cpu_us_per_death()
                .map_or_else(|| "-".into(), |c| format!("{c:.0}")),
            x.idle_cpu_us_per_death()
                .map_or_else(|| "-".into(), |c| format!("{c:.0}")),
            x.calls_per_death()
                .map_or_else(|| "-".into(), |c| format!("{c:.1}")),
        ));
    }
    if let Some(f) = fake.filter(|f| !f.relist.is_empty()) {
        s.push_str("\nThe in-process fake runtime (the scale part):\n\n| pods | generic first relist (ms) | generic steady relist (ms) |\n|---:|---:|---:|\n");
        for c in &f.relist {
            let v = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.1}"));
            s.push_str(&format!(
                "| {} | {} | {} |\n",
                c.cgroups,
                v(c.first_ms),
                v(c.steady_ms)
            ));
        }
    }
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn real(steady_ms: Vec<f64>, deaths: usize, cpu_s: f64) -> RealRelist {
        RealRelist {
            pods: 100,
            first_ms: 10.0,
            steady_ms,
            deaths,
            stages: vec![("delivered".into(), vec![30.0, 10.0, 20.0])],
            ebpf_cpu_s: cpu_s,
            ebpf_idle_cpu_s: None,
            ebpf_cri_calls: None,
        }
    }

    #[test]
    fn steady_relist_and_cost_per_death() {
        // (steady relists, deaths, cpu s, median, us a death)
        let table = [
            (vec![5.0, 7.0, 6.0], 10, 0.01, Some(6.0), Some(1000.0)),
            (vec![5.0, 9.0], 4, 0.002, Some(5.0), Some(500.0)),
            (vec![], 0, 0.5, None, None),
        ];
        for (steady, deaths, cpu, median, per_death) in table {
            let r = real(steady.clone(), deaths, cpu);
            assert_eq!(r.steady_median_ms(), median, "{steady:?}");
            match (r.cpu_us_per_death(), per_death) {
                (Some(g), Some(w)) => assert!((g - w).abs() < 1e-6, "{g} vs {w}"),
                (g, w) => assert_eq!(g, w),
            }
        }
        // The CPU without deaths is taken off; the calls are per death.
        let mut r = real(vec![5.0], 10, 0.01);
        r.ebpf_idle_cpu_s = Some(0.004);
        r.ebpf_cri_calls = Some(45);
        assert!((r.cpu_us_per_death().unwrap() - 600.0).abs() < 1e-6);
        assert_eq!(r.calls_per_death(), Some(4.5));
        // Never below zero: a window without deaths that cost more.
        r.ebpf_idle_cpu_s = Some(0.02);
        assert_eq!(r.cpu_us_per_death(), Some(0.0));
    }

    #[test]
    fn a_count_is_cut_to_what_fits() {
        // (want, have, KiB a pod, KiB available, run)
        let table = [
            (300, 100, 10_000.0, 20_000_000, 300),
            (900, 300, 10_000.0, 5_000_000, 600),
            (900, 300, 0.0, 5_000_000, 900),
            (100, 300, 10_000.0, 0, 300),
            (900, 300, 10_000.0, 0, 300),
        ];
        for (want, have, per_pod, available, run) in table {
            assert_eq!(
                pods_that_fit(want, have, per_pod, available),
                run,
                "{want} asked, {have} run, {per_pod} KiB a pod, {available} KiB"
            );
        }
    }

    #[test]
    fn the_section_shows_each_count_and_the_delivered_median() {
        let md = render(
            &RelistCostResults {
                real: vec![real(vec![5.0, 7.0, 6.0], 10, 0.01)],
            },
            None,
        );
        assert!(
            md.contains("| 100 | 10.0 | 6.0 | 3 | 10 | 20 | 1000 | - | - |"),
            "{md}"
        );
        let mut r = real(vec![6.0], 10, 0.01);
        (r.ebpf_idle_cpu_s, r.ebpf_cri_calls) = (Some(0.004), Some(45));
        let md = render(&RelistCostResults { real: vec![r] }, None);
        assert!(
            md.contains("| 100 | 10.0 | 6.0 | 1 | 10 | 20 | 600 | 400 | 4.5 |"),
            "{md}"
        );
    }
}
