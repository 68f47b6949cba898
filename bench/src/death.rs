//! Death latency: containers on the real containerd that exit by themselves at
//! random times, or are killed from the host at random times, measured from the
//! kernel's exit timestamp to the ring-buffer reader and to the PLEG's
//! ContainerDied event.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use evpleg_core::clock::monotonic_ns;
use evpleg_core::lifecycle::{EventKind, PodLifecycleEvent};
use evpleg_cri::CriClient;
use evpleg_pleg::kernel::KernelPlegConfig;
use evpleg_pleg::stages::{Stage, StageRecord};
use evpleg_pleg::{Pleg, PlegMode};
use evpleg_tests::containerd::Containerd;
use evpleg_tests::cri_pod::{ExitClock, TestPod, run_container, run_sandbox, verbose_pid};
use tokio::sync::mpsc;

use crate::floor::{BareReader, ExitRead};

/// How deaths are caused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    /// The container's shell exits once its signal file appears.
    SelfExit,
    /// SIGKILL to the container's main process from the host.
    Killed,
}

impl Workload {
    pub fn name(self) -> &'static str {
        match self {
            Self::SelfExit => "self-exit",
            Self::Killed => "killed",
        }
    }
}

/// The report's name of the kubelet 1.37 Evented PLEG ("events are hints":
/// `PlegMode::EventedCri`).
pub const EVENTED_137: &str = "evented-1.37";
/// The report's name of the Evented PLEG of kubelets 1.26-1.36 (each event's
/// payload is the pod's status, a 300 s relist: `PlegMode::EventedCriPayload`).
pub const EVENTED_126: &str = "evented-1.26";

/// What observes the deaths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Observer {
    Pleg(PlegMode),
    /// The bare reader alone.
    Floor,
}

impl Observer {
    pub fn name(self) -> &'static str {
        match self {
            Self::Pleg(PlegMode::Ebpf) => "ebpf",
            Self::Pleg(PlegMode::Generic) => "generic",
            Self::Pleg(PlegMode::EventedCri) => EVENTED_137,
            Self::Pleg(PlegMode::EventedCriPayload) => EVENTED_126,
            Self::Floor => "floor",
        }
    }
}

/// One repetition's samples, in microseconds.
#[derive(Debug, Default)]
pub struct RepSamples {
    pub reader_us: Vec<f64>,
    pub event_us: Vec<f64>,
    /// The runtime's own view: from the kernel's exit to the exit time the
    /// runtime reports (`finished_at`: when containerd's shim reaped the
    /// process with waitpid), read from ContainerStatus after the repetition.
    pub shim_reaped_us: Vec<f64>,
    /// Deaths with no event within the bound.
    pub lost_events: usize,
    pub lost_reader: usize,
    /// Per-stage samples from the agent's stage log (`ebpf` mode), after the
    /// ring-buffer read (which `reader_us` holds).
    pub stages: Vec<(Stage, Vec<f64>)>,
}

/// One started container.
struct Target {
    name: String,
    id: String,
    pid: u32,
}

/// The observer running for the repetitions of one mode.
pub struct Running {
    observer: Observer,
    pleg: Option<Pleg>,
    events: Option<mpsc::Receiver<PodLifecycleEvent>>,
    clock: Option<ExitClock>,
    floor: Option<BareReader>,
    /// The pids the bare reader hands on.
    floor_rx: Option<mpsc::Receiver<u32>>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("observer", &self.observer)
            .finish()
    }
}

impl Running {
    /// Starts the observer (inside a tokio runtime).
    pub fn start(observer: Observer, client: &CriClient) -> anyhow::Result<Self> {
        let mut this = Self {
            observer,
            pleg: None,
            events: None,
            clock: None,
            floor: None,
            floor_rx: None,
        };
        match observer {
            // Started by each repetition, once its sandbox made /kubepods.
            Observer::Floor => {}
            Observer::Pleg(mode) => {
                // No record tap in `ebpf` mode: the PLEG's own stage log
                // times its reads ([`exit_read`]), so nothing of the
                // benchmark runs in the path it measures.
                let kernel = KernelPlegConfig::default();
                if mode != PlegMode::Ebpf {
                    this.clock = Some(ExitClock::start());
                }
                let (tx, rx) = mpsc::channel(1000);
                this.pleg = Some(start_pleg(mode, client, kernel, tx)?);
                this.events = Some(rx);
            }
        }
        Ok(this)
    }

    pub async fn stop(mut self) {
        if let Some(p) = self.pleg.take() {
            p.stop().await;
        }
        if let Some(f) = self.floor.take() {
            // Its reads are taken by the repetition that stops it.
            drop(f.stop());
        }
    }

    /// Ends a repetition: its sandbox removed.
    async fn end_repetition(&self, client: &CriClient, sandbox: &str) {
        let _ = client.stop_pod_sandbox(sandbox).await;
        let _ = client.remove_pod_sandbox(sandbox).await;
    }

    /// The PLEG's stage log in `ebpf` mode (it times the reads there).
    fn stage_log(&self) -> Option<Vec<StageRecord>> {
        (self.observer == Observer::Pleg(PlegMode::Ebpf)).then(crate::stages::snapshot)
    }
}

/// PLEG `mode` in process on `client`, the way every part of the benchmark
/// runs one: the monotonic clock, its mode's default relist period.
pub fn start_pleg(
    mode: PlegMode,
    client: &CriClient,
    kernel: KernelPlegConfig,
    events: mpsc::Sender<PodLifecycleEvent>,
) -> Result<Pleg, evpleg_pleg::PlegError> {
    Pleg::start(
        mode,
        evpleg_cri::runtime::CriRuntime::new(client.clone()),
        kernel,
        events,
        Arc::new(evpleg_core::clock::MonotonicClock),
        None,
    )
}

/// A random duration below `max`.
fn random_below(max: Duration) -> Duration {
    let us = max.as_micros().max(1) as u64;
    Duration::from_micros(evpleg_tests::unique_u64() % us)
}

/// One repetition: `n` containers in a fresh pod, their deaths at random times
/// over `window`, then the pod removed.
pub async fn repetition(
    containerd: &Containerd,
    client: &CriClient,
    running: &mut Running,
    workload: Workload,
    n: usize,
    window: Duration,
    rep: usize,
) -> RepSamples {
    let pod = TestPod::new(
        containerd,
        &format!(
            "bench-{}-{}-{rep}",
            running.observer.name(),
            workload.name()
        ),
    );
    let sandbox = run_sandbox(client, &pod).await;
    crate::stages::start();
    if running.observer == Observer::Floor && running.floor.is_none() {
        let (tx, rx) = mpsc::channel(1000);
        running.floor =
            Some(BareReader::start(tx).unwrap_or_else(|e| panic!("floor reader: {e:#}")));
        running.floor_rx = Some(rx);
    }
    let mut targets = Vec::new();
    for i in 0..n {
        let name = format!("c{i}");
        let id = run_container(client, &pod, &sandbox, &pod.waiting_container(&name)).await;
        let status = client
            .container_status(&id, true)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let pid = verbose_pid(&status.info).unwrap_or_else(|| panic!("no pid for {id}"));
        targets.push(Target { name, id, pid });
    }
    let mut seen: HashMap<String, u64> = HashMap::new();
    let mut pending: Vec<PodLifecycleEvent> = Vec::new();
    // Every container known to be running by the PLEG before it dies.
    if let Some(rx) = running.events.as_mut() {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut started: Vec<&str> = Vec::new();
        while started.len() < targets.len() {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(e)) => {
                    if e.kind == EventKind::ContainerStarted
                        && let Some(c) = &e.container_id
                        && let Some(t) = targets.iter().find(|t| t.id == c.as_str())
                        && !started.contains(&t.id.as_str())
                    {
                        started.push(t.id.as_str());
                    } else {
                        pending.push(e);
                    }
                }
                _ => break,
            }
        }
    }
    // The deaths, at random times.
    let start = tokio::time::Instant::now();
    let mut killers = Vec::new();
    for t in &targets {
        let at = start + random_below(window);
        let signal_file = pod.signal_dir.join(&t.name);
        let pid = t.pid;
        killers.push(tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            match workload {
                Workload::SelfExit => {
                    let _ = std::fs::write(signal_file, b"");
                }
                // SAFETY: kill has no memory preconditions; the pid is the
                // container's main process, alive until this signal.
                Workload::Killed => unsafe {
                    libc::kill(pid as i32, libc::SIGKILL);
                },
            }
        }));
    }
    // Deaths as the PLEG reports them.
    let bound = start + window + Duration::from_secs(5);
    for e in pending.drain(..) {
        note_death(&e, &targets, &mut seen, monotonic_ns());
    }
    if let Some(rx) = running.events.as_mut() {
        while seen.len() < targets.len() {
            match tokio::time::timeout_at(bound, rx.recv()).await {
                Ok(Some(e)) => {
                    let now = monotonic_ns();
                    note_death(&e, &targets, &mut seen, now);
                }
                _ => break,
            }
        }
    } else if let Some(rx) = running.floor_rx.as_mut() {
        // The bare reader's hand-off, taken as the PLEG's events are.
        while seen.len() < targets.len() {
            match tokio::time::timeout_at(bound, rx.recv()).await {
                Ok(Some(pid)) => {
                    let now = monotonic_ns();
                    if let Some(t) = targets.iter().find(|t| t.pid == pid) {
                        seen.entry(t.id.clone()).or_insert(now);
                    }
                }
                _ => break,
            }
        }
    }
    for k in killers {
        let _ = k.await;
    }
    // The kernel's side.
    let mut out = RepSamples::default();
    // The bare reader keeps its records on its thread until it stops: it is
    // started again by the next repetition.
    let floor_reads = running
        .floor
        .take()
        .map(BareReader::stop)
        .unwrap_or_default();
    let handed_on = running.floor_rx.take().is_some();
    let log = running.stage_log();
    let mut handed_us = Vec::new();
    for t in &targets {
        let read = exit_read(&floor_reads, log.as_deref(), t);
        let kernel_ns = match (&mut running.clock, read) {
            (Some(clock), _) => Some(clock.exit_ns(&t.id).await),
            (None, Some(r)) => Some(r.kernel_ns),
            (None, None) => None,
        };
        if let Some(r) = read {
            out.reader_us
                .push(r.read_ns.saturating_sub(r.kernel_ns) as f64 / 1000.0);
            if let Some(h) = r.handed_ns {
                handed_us.push(h.saturating_sub(r.kernel_ns) as f64 / 1000.0);
            }
        } else if running.clock.is_none() {
            out.lost_reader += 1;
        }
        if let Some(k) = kernel_ns
            && let Some(reaped) = finished_at_ns(client, &t.id).await
        {
            let k = evpleg_core::clock::monotonic_to_unix_ns(k);
            out.shim_reaped_us.push((reaped - k) as f64 / 1000.0);
        }
        if running.events.is_some() || handed_on {
            match (kernel_ns, seen.get(&t.id)) {
                (Some(k), Some(&at)) => out.event_us.push(at.saturating_sub(k) as f64 / 1000.0),
                _ => out.lost_events += 1,
            }
        }
    }
    if running.observer == Observer::Pleg(PlegMode::Ebpf) {
        let ids: Vec<&str> = targets.iter().map(|t| t.id.as_str()).collect();
        let (mut stages, _) = crate::stages::samples(&ids, &crate::stages::snapshot());
        stages.retain(|(s, _)| *s != Stage::Read);
        out.stages = stages;
    }
    if handed_on {
        out.stages = vec![(Stage::Delivered, handed_us)];
    }
    running.end_repetition(client, &sandbox).await;
    out
}

/// When the kernel saw `t` exit and the reader read the record (ns): from the
/// bare reader's records (by pid) or, given the `ebpf` PLEG's stage log, from
/// its `kernel` and `read` records (by container id).
fn exit_read(reads: &[ExitRead], log: Option<&[StageRecord]>, t: &Target) -> Option<ExitRead> {
    match log {
        Some(log) => crate::stages::exit_read(&t.id, log).map(|(kernel_ns, read_ns)| ExitRead {
            pid: t.pid,
            kernel_ns,
            read_ns,
            handed_ns: None,
        }),
        None => reads.iter().rev().find(|r| r.pid == t.pid).copied(),
    }
}

/// When the runtime says container `id` exited (Unix ns: the shim's time), once
/// it says so (it may not yet when a fast PLEG reported the death; waited for
/// at most 5 s).
async fn finished_at_ns(client: &CriClient, id: &str) -> Option<i64> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let status = client.container_status(id, false).await.ok()?.status?;
        if status.finished_at > 0 {
            return Some(status.finished_at);
        }
        if tokio::time::Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn note_death(
    e: &PodLifecycleEvent,
    targets: &[Target],
    seen: &mut HashMap<String, u64>,
    now: u64,
) {
    if e.kind != EventKind::ContainerDied {
        return;
    }
    if let Some(c) = &e.container_id
        && targets.iter().any(|t| t.id == c.as_str())
    {
        seen.entry(c.as_str().to_owned()).or_insert(now);
    }
}

/// Churn: for `duration`, a container started every `1 / rate` s in one pod,
/// each exiting by itself `lifetime` after it starts. Samples from the kernel's
/// exit to the reader and to the PLEG's event; a death without an event within
/// the bound is lost.
pub async fn churn(
    containerd: &Containerd,
    client: &CriClient,
    running: &mut Running,
    rate: f64,
    duration: Duration,
    lifetime: Duration,
    tail: Duration,
) -> RepSamples {
    let pod = TestPod::new(
        containerd,
        &format!("bench-churn-{}", running.observer.name()),
    );
    let sandbox = run_sandbox(client, &pod).await;
    let starter = {
        let client = client.clone();
        let sandbox = sandbox.clone();
        let script = format!("sleep {}; exit 3", lifetime.as_secs_f64());
        tokio::spawn(async move {
            let mut targets = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let end = tokio::time::Instant::now() + duration;
            let mut i = 0;
            while tokio::time::Instant::now() < end {
                tick.tick().await;
                let name = format!("churn{i}");
                i += 1;
                let config = pod.container(&name, &["sh", "-c", &script]);
                let id = run_container(&client, &pod, &sandbox, &config).await;
                let pid = client
                    .container_status(&id, true)
                    .await
                    .ok()
                    .and_then(|s| verbose_pid(&s.info))
                    .unwrap_or(0);
                targets.push(Target { name, id, pid });
            }
            (pod, targets)
        })
    };
    let mut seen: HashMap<String, u64> = HashMap::new();
    let rx = running.events.as_mut().expect("churn runs a pleg");
    let bound = tokio::time::Instant::now() + duration + lifetime + tail;
    while let Ok(Some(e)) = tokio::time::timeout_at(bound, rx.recv()).await {
        if e.kind == EventKind::ContainerDied
            && let Some(c) = &e.container_id
        {
            seen.entry(c.as_str().to_owned()).or_insert(monotonic_ns());
        }
    }
    let (_pod, targets) = starter.await.expect("the starter task");
    // A pleg runs the churn: no bare reader's records.
    let log = running.stage_log();
    let mut out = RepSamples::default();
    for t in &targets {
        let read = exit_read(&[], log.as_deref(), t);
        if let Some(r) = read {
            out.reader_us
                .push(r.read_ns.saturating_sub(r.kernel_ns) as f64 / 1000.0);
        }
        let kernel_ns = match (&mut running.clock, read) {
            (Some(clock), _) => Some(clock.exit_ns(&t.id).await),
            (None, Some(r)) => Some(r.kernel_ns),
            (None, None) => None,
        };
        match (kernel_ns, seen.get(&t.id)) {
            (Some(k), Some(&at)) => out.event_us.push(at.saturating_sub(k) as f64 / 1000.0),
            _ => out.lost_events += 1,
        }
    }
    running.end_repetition(client, &sandbox).await;
    out
}
