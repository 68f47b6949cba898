//! The runtime's extra load (issue #29): what each PLEG mode asks of
//! containerd while containers come and go. The kubelet's PLEG inspects the
//! runtime by relisting (`GenericPLEG.Relist`,
//! `pkg/kubelet/pleg/generic.go`: ListPodSandbox and ListContainers every
//! second, a status per changed pod); evpleg's `ebpf` mode relists a pod on
//! each kernel event and re-checks it until the runtime confirms the exit
//! (`relist::CONFIRM_RETRY`), which is runtime load the kubelet does not make.
//!
//! Per mode, the same churn (one pod, a container started at a steady rate,
//! each exiting by itself after a fixed lifetime): the PLEG on a CRI client of
//! its own, so that its calls are counted apart from the workload's (the
//! client's `runtime_operations_total`, the kubelet's metric); containerd's
//! and the pod's shim's CPU over the loaded window only (first start to the
//! last container's death), from `/proc/<pid>/task/*/schedstat`; the PLEG's
//! full and pod relists over the same window. Derived figures
//! ([`ModeLoad::calls_per_s`], [`ModeLoad::cpu_pct`]) are computed from the
//! raw counts kept.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use evpleg_core::lifecycle::{EventKind, PodLifecycleEvent};
use evpleg_cri::CriClient;
use evpleg_cri::metrics::{CriMetrics, Operation, operation_type};
use evpleg_pleg::kernel::KernelPlegConfig;
use evpleg_pleg::{Pleg, PlegMode};
use evpleg_tests::containerd::Containerd;
use evpleg_tests::cri_pod::{TestPod, run_container, run_sandbox};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

/// The CRI methods counted (every method the client has).
const CALLS: [&str; 20] = [
    "Version",
    "Status",
    "RuntimeConfig",
    "ListPodSandbox",
    "PodSandboxStatus",
    "RunPodSandbox",
    "StopPodSandbox",
    "RemovePodSandbox",
    "ListContainers",
    "ContainerStatus",
    "CreateContainer",
    "StartContainer",
    "ExecSync",
    "StopContainer",
    "RemoveContainer",
    "GetContainerEvents",
    "ListImages",
    "ImageStatus",
    "PullImage",
    "Exec",
];

/// Errors of the runtime-load measurement.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeLoadError {
    #[error(transparent)]
    Interrupted(#[from] crate::interrupt::Interrupted),
    #[error("connecting the pleg's own cri client to {endpoint}: {message}")]
    Connect { endpoint: String, message: String },
    #[error("starting the {mode} pleg: {message}")]
    Start { mode: String, message: String },
    #[error("containerd has no pid")]
    NoContainerd,
}

/// One mode's churn.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModeLoad {
    pub mode: String,
    /// The loaded window (first start to the last container's death), s.
    pub seconds: f64,
    pub containers: usize,
    /// Deaths whose ContainerDied came within the bound.
    pub deaths_seen: usize,
    /// containerd's and the pod's shim's CPU over the window, s.
    pub containerd_cpu_s: f64,
    pub shim_cpu_s: f64,
    /// The PLEG's CRI calls over the window, by the kubelet's operation name.
    pub pleg_calls: Vec<(String, u64)>,
    pub relists: u64,
    pub pod_relists: u64,
}

impl ModeLoad {
    pub fn total_calls(&self) -> u64 {
        self.pleg_calls.iter().map(|(_, n)| n).sum()
    }

    /// The PLEG's CRI calls per second of the window.
    pub fn calls_per_s(&self) -> f64 {
        per_s(self.total_calls() as f64, self.seconds)
    }

    /// CPU seconds over the window as % of a core.
    pub fn cpu_pct(&self, cpu_s: f64) -> f64 {
        100.0 * per_s(cpu_s, self.seconds)
    }

    /// Pod relists per container that came and went.
    pub fn pod_relists_per_container(&self) -> f64 {
        self.pod_relists as f64 / self.containers.max(1) as f64
    }
}

fn per_s(v: f64, seconds: f64) -> f64 {
    if seconds > 0.0 { v / seconds } else { f64::NAN }
}

/// The whole measurement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RuntimeLoad {
    /// Containers started per second, and each one's lifetime, ms.
    pub rate: f64,
    pub lifetime_ms: u64,
    pub modes: Vec<ModeLoad>,
}

/// Every counted call's total so far.
pub(crate) fn calls(metrics: &CriMetrics) -> HashMap<String, u64> {
    CALLS
        .iter()
        .map(|c| {
            let op = operation_type(c);
            let n = metrics
                .operations
                .get_or_create(&Operation {
                    operation_type: op.clone(),
                })
                .get();
            (op, n)
        })
        .collect()
}

/// One mode under the churn.
async fn one(
    containerd: &Containerd,
    client: &CriClient,
    mode: PlegMode,
    rate: f64,
    duration: Duration,
    lifetime: Duration,
) -> Result<ModeLoad, RuntimeLoadError> {
    let name = crate::death::Observer::Pleg(mode).name();
    let endpoint = containerd.endpoint();
    let own = CriClient::connect(&endpoint, evpleg_cri::CriClientConfig::default())
        .await
        .map_err(|e| RuntimeLoadError::Connect {
            endpoint: endpoint.clone(),
            message: e.to_string(),
        })?;
    let metrics = own.metrics();
    let (tx, mut rx) = mpsc::channel::<PodLifecycleEvent>(10_000);
    let pleg =
        crate::death::start_pleg(mode, &own, KernelPlegConfig::default(), tx).map_err(|e| {
            RuntimeLoadError::Start {
                mode: name.into(),
                message: e.to_string(),
            }
        })?;
    let pod = TestPod::new(containerd, &format!("bench-load-{name}"));
    let sandbox = run_sandbox(client, &pod).await;
    // Settle: the sandbox's start and the first relist are not churn.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let containerd_pid = containerd.pid().ok_or(RuntimeLoadError::NoContainerd)?;
    let cpu = || {
        (
            crate::idle::cpu_seconds(containerd_pid).unwrap_or(0.0),
            containerd
                .shims()
                .iter()
                .map(|(pid, _)| crate::idle::cpu_seconds(*pid).unwrap_or(0.0))
                .sum::<f64>(),
        )
    };
    let counts = |p: &Pleg| {
        (
            p.relist_stats.relists.load(Ordering::Relaxed),
            p.relist_stats.pod_relists.load(Ordering::Relaxed),
        )
    };
    let (c0, s0) = cpu();
    let calls0 = calls(&metrics);
    let (r0, pr0) = counts(&pleg);
    let t0 = Instant::now();
    let mut ids = Vec::new();
    let script = format!("sleep {}; exit 3", lifetime.as_secs_f64());
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seen = std::collections::HashSet::new();
    while t0.elapsed() < duration {
        tick.tick().await;
        let config = pod.container(&format!("load{}", ids.len()), &["sh", "-c", &script]);
        ids.push(run_container(client, &pod, &sandbox, &config).await);
        while let Ok(e) = rx.try_recv() {
            note_death(&mut seen, &e);
        }
    }
    // The last container's death ends the window (its lifetime after its
    // start; its event is waited for below, outside the window).
    tokio::time::sleep(lifetime).await;
    let seconds = t0.elapsed().as_secs_f64();
    let (c1, s1) = cpu();
    let calls1 = calls(&metrics);
    let (r1, pr1) = counts(&pleg);
    let bound = tokio::time::Instant::now() + Duration::from_secs(5);
    while seen.len() < ids.len() {
        match tokio::time::timeout_at(bound, rx.recv()).await {
            Ok(Some(e)) => note_death(&mut seen, &e),
            _ => break,
        }
    }
    pleg.stop().await;
    let _ = client.stop_pod_sandbox(&sandbox).await;
    let _ = client.remove_pod_sandbox(&sandbox).await;
    let mut pleg_calls: Vec<(String, u64)> = calls1
        .iter()
        .map(|(op, n)| (op.clone(), n - calls0.get(op).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect();
    pleg_calls.sort();
    Ok(ModeLoad {
        mode: name.into(),
        seconds,
        containers: ids.len(),
        deaths_seen: ids.iter().filter(|id| seen.contains(id.as_str())).count(),
        containerd_cpu_s: c1 - c0,
        shim_cpu_s: s1 - s0,
        pleg_calls,
        relists: r1 - r0,
        pod_relists: pr1 - pr0,
    })
}

fn note_death(seen: &mut std::collections::HashSet<String>, e: &PodLifecycleEvent) {
    if e.kind == EventKind::ContainerDied
        && let Some(c) = &e.container_id
    {
        seen.insert(c.as_str().to_owned());
    }
}

/// Every mode under the same churn.
pub async fn run(
    containerd: &Containerd,
    client: &CriClient,
    rate: f64,
    duration: Duration,
    lifetime: Duration,
) -> Result<RuntimeLoad, RuntimeLoadError> {
    let mut out = RuntimeLoad {
        rate,
        lifetime_ms: lifetime.as_millis() as u64,
        modes: Vec::new(),
    };
    for mode in [PlegMode::Ebpf, PlegMode::EventedCri, PlegMode::Generic] {
        crate::interrupt::check()?;
        crate::progress(&format!(
            "runtime load: {} under churn, {rate} containers/s for {} s",
            crate::death::Observer::Pleg(mode).name(),
            duration.as_secs()
        ));
        let m = one(containerd, client, mode, rate, duration, lifetime).await?;
        crate::progress(&format!(
            "  {:.1} CRI calls/s, containerd {:.2} % and shim {:.2} % of a core, {:.1} pod relists a container, {}/{} deaths seen",
            m.calls_per_s(),
            m.cpu_pct(m.containerd_cpu_s),
            m.cpu_pct(m.shim_cpu_s),
            m.pod_relists_per_container(),
            m.deaths_seen,
            m.containers
        ));
        out.modes.push(m);
    }
    Ok(out)
}

/// The report's section.
pub fn render(l: &RuntimeLoad) -> String {
    let mut s = String::from("## The runtime's extra load\n\n");
    s.push_str(&format!(
        "One pod, a container started every {:.0} ms, each exiting by itself {} ms after \
         its start; each mode's PLEG on a CRI client of its own (its calls counted apart \
         from the workload's). CPU over the loaded window only (first start to the last \
         death).\n\n",
        1000.0 / l.rate,
        l.lifetime_ms
    ));
    s.push_str(
        "| mode | window (s) | containers | deaths seen | PLEG CRI calls/s | containerd CPU (% of a core) | shim CPU (% of a core) | full relists | pod relists a container | calls |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n",
    );
    for m in &l.modes {
        let calls: Vec<String> = m
            .pleg_calls
            .iter()
            .map(|(op, n)| format!("{op} {n}"))
            .collect();
        s.push_str(&format!(
            "| {} | {:.1} | {} | {} | {:.1} | {:.2} | {:.2} | {} | {:.1} | {} |\n",
            m.mode,
            m.seconds,
            m.containers,
            m.deaths_seen,
            m.calls_per_s(),
            m.cpu_pct(m.containerd_cpu_s),
            m.cpu_pct(m.shim_cpu_s),
            m.relists,
            m.pod_relists_per_container(),
            calls.join(", ")
        ));
    }
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(seconds: f64, containers: usize, calls: &[(&str, u64)], pod_relists: u64) -> ModeLoad {
        ModeLoad {
            mode: "ebpf".into(),
            seconds,
            containers,
            deaths_seen: containers,
            containerd_cpu_s: 0.5,
            shim_cpu_s: 0.25,
            pleg_calls: calls.iter().map(|(o, n)| ((*o).to_owned(), *n)).collect(),
            relists: 0,
            pod_relists,
        }
    }

    #[test]
    fn rates_come_from_the_window() {
        // (seconds, calls, calls/s, containerd %, shim %, pod relists a container)
        let table = [
            (
                10.0,
                vec![("list_containers", 30), ("container_status", 20)],
                5.0,
                5.0,
                2.5,
                2.0,
            ),
            (2.0, vec![("list_podsandbox", 1)], 0.5, 25.0, 12.5, 2.0),
            (50.0, vec![], 0.0, 1.0, 0.5, 2.0),
        ];
        for (seconds, calls, per_s, containerd, shim, per_container) in table {
            let m = load(seconds, 10, &calls, 20);
            assert!(
                (m.calls_per_s() - per_s).abs() < 1e-9,
                "{seconds} s: {}",
                m.calls_per_s()
            );
            assert!(
                (m.cpu_pct(m.containerd_cpu_s) - containerd).abs() < 1e-9,
                "{seconds} s"
            );
            assert!((m.cpu_pct(m.shim_cpu_s) - shim).abs() < 1e-9, "{seconds} s");
            assert!((m.pod_relists_per_container() - per_container).abs() < 1e-9);
        }
    }

    #[test]
    fn an_empty_window_has_no_rate() {
        let m = load(0.0, 0, &[("version", 1)], 0);
        assert!(m.calls_per_s().is_nan());
        assert!(m.cpu_pct(1.0).is_nan());
        assert_eq!(m.pod_relists_per_container(), 0.0);
    }

    #[test]
    fn every_counted_call_has_a_distinct_operation() {
        let ops: std::collections::HashSet<String> =
            CALLS.iter().map(|c| operation_type(c)).collect();
        assert_eq!(ops.len(), CALLS.len());
        assert!(ops.contains("list_podsandbox") && ops.contains("container_status"));
    }
}
