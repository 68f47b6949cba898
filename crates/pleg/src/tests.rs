//! A model-based test of the PLEG contract (docs/pleg.md, "The contract").
//!
//! A simulated runtime (which learns of deaths late, as containerd does) and a
//! simulated kernel stream (certain deaths and starts, hints for uncertain ones)
//! drive the `ebpf`-mode PLEG (the kernel merge and the reconciling relist) with
//! random interleavings of: starts, deaths, sandbox deaths, the runtime catching
//! up, removals, kernel records delivered, reordered, duplicated or lost (the
//! reader then asks for a relist), a pod worker channel left full, full relists,
//! on-demand relists and the passing of time. After every step it checks that no
//! pod status a worker can read is one that no complete snapshot plus certain
//! kernel death could produce; at quiescence that every death reached the
//! workers with its exit code, without a full periodic relist, and that the
//! cache agrees with a generic relist of the same runtime.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proptest::prelude::*;
use tokio::sync::mpsc;

use super::merge::{KernelMerge, MergeStats};
use super::on_demand::PodRelistQueue;
use super::relist::{CONFIRM_BOUND, CONFIRM_RETRY, KernelReports, LOSS_FOLLOW_UPS, RelistPleg};
use evpleg_core::cache::PodStatusCache;
use evpleg_core::clock::{Clock, ManualClock};
use evpleg_core::container::{
    ContainerState, ContainerStatus, PodStatus, SandboxState, SandboxStatus,
};
use evpleg_core::ids::{ContainerId, PodUid};
use evpleg_core::lifecycle::{EventKind, EventSource, ExitStatus, PodLifecycleEvent, RelistSignal};
use evpleg_core::runtime::{PlegState, PodRuntime, RuntimeEntry, RuntimeError};

mod kernel_model;

const PODS: u8 = 3;
/// The slowest the simulated runtime is to learn of a death (containerd took
/// 40-630 ms here): past the confirmation bound, so that contradictions happen,
/// and within the last follow-up relist after a loss, the lag the contract
/// covers for a lost record.
const RUNTIME_LAG: Duration = Duration::from_millis(5200);
/// Room in the pod workers' channel: small, so that it fills.
const CHANNEL: usize = 4;

#[derive(Clone, Debug)]
struct SimContainer {
    id: ContainerId,
    pod: u8,
    name: String,
    sandbox: bool,
    /// The truth: `Some(code)` once its main process died.
    died: Option<i32>,
    /// When it died (the clock's ns).
    died_at: u64,
    /// What the runtime reports: it learns of a death at `catch_up`.
    runtime_exited: bool,
    removed: bool,
    pid: u32,
}

#[derive(Debug, Default)]
struct World {
    containers: Vec<SimContainer>,
    next: u32,
}

/// The simulated runtime, shared with the test.
#[derive(Clone, Debug, Default)]
struct SimRuntime(Arc<Mutex<World>>);

fn uid(pod: u8) -> PodUid {
    PodUid::parse(&format!("{:02x}", pod + 1).repeat(16)).unwrap()
}

impl PodRuntime for SimRuntime {
    async fn list(&self, pod: Option<&PodUid>) -> Result<Vec<RuntimeEntry>, RuntimeError> {
        let w = self.0.lock().unwrap();
        Ok(w.containers
            .iter()
            .filter(|c| !c.removed && pod.is_none_or(|p| *p == uid(c.pod)))
            .map(|c| RuntimeEntry {
                pod: uid(c.pod),
                id: c.id.clone(),
                sandbox: c.sandbox,
                state: if c.runtime_exited {
                    PlegState::Exited
                } else {
                    PlegState::Running
                },
            })
            .collect())
    }

    async fn pod_status(&self, pod: &PodUid) -> Result<PodStatus, RuntimeError> {
        let w = self.0.lock().unwrap();
        let mut status = PodStatus {
            uid: Some(pod.clone()),
            name: format!("pod-{pod}"),
            ..PodStatus::default()
        };
        for c in w
            .containers
            .iter()
            .filter(|c| !c.removed && uid(c.pod) == *pod)
        {
            if c.sandbox {
                status.sandboxes.push(SandboxStatus {
                    id: c.id.clone(),
                    state: if c.runtime_exited {
                        SandboxState::NotReady
                    } else {
                        SandboxState::Ready
                    },
                    attempt: 0,
                    created_at: None,
                    ip: None,
                    pid: (!c.runtime_exited).then_some(c.pid),
                });
                continue;
            }
            let state = if c.runtime_exited {
                ContainerState::Exited
            } else {
                ContainerState::Running
            };
            let mut s = ContainerStatus::new(c.id.clone(), &c.name, state, EventSource::Relist);
            if c.runtime_exited {
                s.exit_code = c.died;
            } else {
                s.pid = Some(c.pid);
            }
            status.containers.push(s);
        }
        Ok(status)
    }
}

/// One step of a scenario.
#[derive(Clone, Debug)]
enum Step {
    /// A new container (and, first, the pod's sandbox) starts.
    Start {
        pod: u8,
    },
    /// The main process of the n-th live container dies; the kernel is certain
    /// of it or only hints.
    Die {
        n: usize,
        code: i32,
        certain: bool,
    },
    /// The runtime learns of every death.
    CatchUp,
    /// The runtime removes the n-th exited container.
    Remove {
        n: usize,
    },
    /// The kernel's records reach the merge.
    Deliver {
        count: usize,
    },
    Reorder,
    Duplicate,
    /// A record is lost (ring buffer full): the reader asks for a relist.
    Lose,
    /// The pod workers read their channel.
    Drain,
    FullRelist,
    /// The relist task serves on-demand requests, re-checks and signals.
    Serve,
    Advance {
        ms: u64,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0..PODS).prop_map(|pod| Step::Start { pod }),
        3 => (0usize..8, 0i32..3, proptest::bool::weighted(0.7))
            .prop_map(|(n, code, certain)| Step::Die { n, code, certain }),
        2 => Just(Step::CatchUp),
        1 => (0usize..8).prop_map(|n| Step::Remove { n }),
        4 => (1usize..4).prop_map(|count| Step::Deliver { count }),
        1 => Just(Step::Reorder),
        1 => Just(Step::Duplicate),
        1 => Just(Step::Lose),
        3 => Just(Step::Drain),
        1 => Just(Step::FullRelist),
        3 => Just(Step::Serve),
        2 => prop_oneof![Just(5u64), Just(30), Just(300), Just(2500)]
            .prop_map(|ms| Step::Advance { ms }),
    ]
}

struct Model {
    runtime: SimRuntime,
    clock: ManualClock,
    cache: Arc<PodStatusCache>,
    merge: KernelMerge,
    relist: RelistPleg<SimRuntime>,
    queue: Arc<PodRelistQueue>,
    signal: Arc<RelistSignal>,
    signals_served: u64,
    follow_ups: Vec<u64>,
    workers: mpsc::Receiver<PodLifecycleEvent>,
    /// The kernel's records not yet delivered to the merge.
    kernel: Vec<PodLifecycleEvent>,
    /// What each pod's worker last read from the cache, when woken.
    views: HashMap<PodUid, Arc<PodStatus>>,
}

impl Model {
    fn new() -> Self {
        let clock = ManualClock::new(1_000_000_000);
        let shared: evpleg_core::clock::SharedClock = Arc::new(clock.clone());
        let runtime = SimRuntime::default();
        let cache = Arc::new(PodStatusCache::new());
        let reports = Arc::new(KernelReports::default());
        let queue = Arc::new(PodRelistQueue::new(shared.clone()));
        let signal = Arc::new(RelistSignal::new());
        let (tx, workers) = mpsc::channel(CHANNEL);
        let merge = KernelMerge {
            cache: cache.clone(),
            reports: reports.clone(),
            out: tx.clone(),
            pod_relist: queue.clone(),
            relist: signal.clone(),
            stats: Arc::new(MergeStats::default()),
        };
        let relist = RelistPleg::new(runtime.clone(), cache.clone(), tx, shared, reports);
        Self {
            runtime,
            clock,
            cache,
            merge,
            relist,
            queue,
            signal,
            signals_served: 0,
            follow_ups: Vec::new(),
            workers,
            kernel: Vec::new(),
            views: HashMap::new(),
        }
    }

    fn kernel_event(
        &self,
        c: &SimContainer,
        kind: EventKind,
        exit: Option<ExitStatus>,
    ) -> PodLifecycleEvent {
        PodLifecycleEvent {
            pod_uid: Some(uid(c.pod)),
            kind,
            container_id: Some(c.id.clone()),
            at_ns: self.clock.now_ns(),
            source: EventSource::Kernel,
            exit,
            pid: Some(c.pid),
        }
    }

    fn new_container(&self, pod: u8, sandbox: bool) -> SimContainer {
        let mut w = self.runtime.0.lock().unwrap();
        w.next += 1;
        let n = w.next;
        let c = SimContainer {
            id: ContainerId::parse(&format!("{n:064x}")).unwrap(),
            pod,
            name: if sandbox {
                String::new()
            } else {
                format!("c{n}")
            },
            sandbox,
            died: None,
            died_at: 0,
            runtime_exited: false,
            removed: false,
            pid: 1000 + n,
        };
        w.containers.push(c.clone());
        c
    }

    async fn apply(&mut self, step: &Step) {
        match step {
            Step::Start { pod } => {
                let has_sandbox = self
                    .runtime
                    .0
                    .lock()
                    .unwrap()
                    .containers
                    .iter()
                    .any(|c| c.pod == *pod && c.sandbox && c.died.is_none());
                if !has_sandbox {
                    let sb = self.new_container(*pod, true);
                    self.kernel
                        .push(self.kernel_event(&sb, EventKind::ContainerStarted, None));
                }
                let c = self.new_container(*pod, false);
                self.kernel
                    .push(self.kernel_event(&c, EventKind::ContainerStarted, None));
            }
            Step::Die { n, code, certain } => {
                let live: Vec<usize> = {
                    let w = self.runtime.0.lock().unwrap();
                    (0..w.containers.len())
                        .filter(|i| w.containers[*i].died.is_none() && !w.containers[*i].removed)
                        .collect()
                };
                if live.is_empty() {
                    return;
                }
                let i = live[n % live.len()];
                let c = {
                    let mut w = self.runtime.0.lock().unwrap();
                    let code = if w.containers[i].sandbox { 137 } else { *code };
                    w.containers[i].died = Some(code);
                    w.containers[i].died_at = self.clock.now_ns();
                    w.containers[i].clone()
                };
                let died = c.died.unwrap();
                let status = if died == 137 {
                    ExitStatus::from_wait_status(9, false)
                } else {
                    ExitStatus::from_wait_status((died as u32) << 8, false)
                };
                let ev = if *certain {
                    let kind = if c.sandbox {
                        EventKind::SandboxDied
                    } else {
                        EventKind::ContainerDied
                    };
                    self.kernel_event(&c, kind, Some(status))
                } else {
                    self.kernel_event(&c, EventKind::PodSync, None)
                };
                self.kernel.push(ev);
            }
            Step::CatchUp => {
                for c in &mut self.runtime.0.lock().unwrap().containers {
                    c.runtime_exited |= c.died.is_some();
                }
            }
            Step::Remove { n } => {
                let mut w = self.runtime.0.lock().unwrap();
                let exited: Vec<usize> = (0..w.containers.len())
                    .filter(|i| w.containers[*i].runtime_exited && !w.containers[*i].removed)
                    .collect();
                if !exited.is_empty() {
                    let i = exited[n % exited.len()];
                    w.containers[i].removed = true;
                }
            }
            Step::Deliver { count } => {
                for _ in 0..*count {
                    if self.kernel.is_empty() {
                        break;
                    }
                    let ev = self.kernel.remove(0);
                    self.merge.handle(ev);
                }
            }
            Step::Reorder => {
                if self.kernel.len() >= 2 {
                    self.kernel.swap(0, 1);
                }
            }
            Step::Duplicate => {
                if let Some(ev) = self.kernel.first().cloned() {
                    self.kernel.insert(0, ev);
                }
            }
            Step::Lose => {
                if !self.kernel.is_empty() {
                    self.kernel.remove(0);
                    self.signal.request("model: a kernel record was lost");
                }
            }
            Step::Drain => self.drain(),
            Step::FullRelist => {
                let _ = self.relist.relist().await;
            }
            Step::Serve => self.serve().await,
            Step::Advance { ms } => {
                self.pass(*ms).await;
                self.serve().await;
            }
        }
    }

    /// `ms` pass, and the runtime learns of the deaths that are due: however
    /// slow, it learns of a death within RUNTIME_LAG.
    async fn pass(&mut self, ms: u64) {
        let d = Duration::from_millis(ms);
        self.clock.advance(d.as_nanos() as u64);
        tokio::time::advance(d).await;
        let now = self.clock.now_ns();
        for c in &mut self.runtime.0.lock().unwrap().containers {
            if c.died.is_some() && now - c.died_at >= RUNTIME_LAG.as_nanos() as u64 {
                c.runtime_exited = true;
            }
        }
    }

    /// What the relist task's loop does when it runs: a full relist (and its
    /// follow-ups) for every signal, on-demand requests, due re-checks.
    async fn serve(&mut self) {
        let now = self.clock.now_ns();
        if self.signal.count() > self.signals_served {
            self.signals_served = self.signal.count();
            self.follow_ups = LOSS_FOLLOW_UPS
                .iter()
                .map(|d| now + d.as_nanos() as u64)
                .collect();
            let _ = self.relist.relist().await;
        }
        if self.follow_ups.iter().any(|t| *t <= now) {
            self.follow_ups.retain(|t| *t > now);
            let _ = self.relist.relist().await;
        }
        self.relist.run_requests(&self.queue).await;
        self.relist.run_rechecks().await;
    }

    fn drain(&mut self) {
        while let Ok(ev) = self.workers.try_recv() {
            if std::env::var_os("MODEL_TRACE").is_some() {
                eprintln!(
                    "  worker <- {:?} {:?} {:?} {:?}",
                    ev.kind,
                    ev.source,
                    ev.container_id.as_ref().map(|c| &c.as_str()[60..]),
                    ev.pod_uid.as_ref().map(|u| &u.as_str()[..2])
                );
            }
            let uid = ev.pod_uid.clone().expect("every event names its pod");
            if let Some(e) = self.cache.get(&uid) {
                if std::env::var_os("MODEL_TRACE").is_some() {
                    eprintln!(
                        "    view of {}: {:?}",
                        &uid.as_str()[..2],
                        e.status
                            .containers
                            .iter()
                            .map(|c| (&c.id.as_str()[60..], c.state, c.exit_code))
                            .collect::<Vec<_>>()
                    );
                }
                self.views.insert(uid, e.status.clone());
            }
        }
    }

    /// Contract clauses 1, 2, 6: every cached status is a complete snapshot of
    /// the runtime, plus certain deaths.
    fn check_cache(&self) -> Result<(), TestCaseError> {
        self.check_cache_allowing(&std::collections::HashSet::new())
    }

    /// As [`Self::check_cache`], except that the containers in `lied` may show
    /// a death that did not happen: a lie the kernel model tells on purpose,
    /// which no rule can tell from a death (clause 3 repairs it, checked at
    /// quiescence).
    fn check_cache_allowing(
        &self,
        lied: &std::collections::HashSet<ContainerId>,
    ) -> Result<(), TestCaseError> {
        let w = self.runtime.0.lock().unwrap();
        for pod in 0..PODS {
            let Some(entry) = self.cache.get(&uid(pod)) else {
                continue;
            };
            for c in &entry.status.containers {
                let truth = w.containers.iter().find(|t| t.id == c.id);
                let Some(truth) = truth else {
                    return Err(TestCaseError::fail(format!("phantom container {c:?}")));
                };
                prop_assert!(!truth.sandbox, "a sandbox in the containers: {c:?}");
                prop_assert_eq!(&c.name, &truth.name, "a container without its name");
                prop_assert_eq!(truth.pod, pod);
                if c.state == ContainerState::Exited && !lied.contains(&c.id) {
                    prop_assert_eq!(
                        Some(c.exit_code.unwrap_or(-1)),
                        truth.died,
                        "exited in the cache but not dead, or the wrong code: {:?}",
                        c
                    );
                }
            }
        }
        Ok(())
    }

    /// Quiescence without any periodic relist: the kernel's records all
    /// delivered, the runtime caught up, the relist task serving for longer than
    /// the bound.
    async fn settle(&mut self) {
        self.apply(&Step::Deliver { count: usize::MAX }).await;
        self.apply(&Step::CatchUp).await;
        let steps = (CONFIRM_BOUND + LOSS_FOLLOW_UPS[LOSS_FOLLOW_UPS.len() - 1]).as_millis() as u64
            / 20
            + 20;
        for _ in 0..steps {
            self.drain();
            self.apply(&Step::Advance {
                ms: CONFIRM_RETRY.as_millis() as u64,
            })
            .await;
        }
        self.drain();
    }

    /// At quiescence (clause 4): every death the runtime still lists reached
    /// the workers with its code, no living container died in their view, the
    /// cache agrees with a generic relist of the same runtime, and no kernel
    /// exit of a removed container is kept.
    async fn check_deaths_reached_the_workers(&mut self) -> Result<(), TestCaseError> {
        // Every death the runtime still lists reached the workers with its code
        // (clause 4): the worker's last view of the pod shows it.
        let truth = self.runtime.0.lock().unwrap().containers.clone();
        for c in truth.iter().filter(|c| !c.removed && !c.sandbox) {
            let view = self.views.get(&uid(c.pod));
            let seen = view.and_then(|v| v.container(&c.id)).cloned();
            match c.died {
                Some(code) => {
                    let seen = seen.ok_or_else(|| {
                        TestCaseError::fail(format!("the workers never saw {c:?}"))
                    })?;
                    prop_assert_eq!(
                        (seen.state, seen.exit_code),
                        (ContainerState::Exited, Some(code)),
                        "the workers' last view of a dead container: {:?}",
                        c
                    );
                }
                None => {
                    if let Some(seen) = seen {
                        prop_assert_eq!(
                            seen.state,
                            ContainerState::Running,
                            "a living container died"
                        );
                    }
                }
            }
        }
        // The cache agrees with a generic relist of the same runtime.
        let generic_cache = Arc::new(PodStatusCache::new());
        let (tx, _rx) = mpsc::channel(10_000);
        let mut generic = RelistPleg::new(
            self.runtime.clone(),
            generic_cache.clone(),
            tx,
            Arc::new(self.clock.clone()),
            Arc::new(KernelReports::default()),
        );
        generic.relist().await.unwrap();
        self.relist.relist().await.unwrap();
        for pod in 0..PODS {
            let key = |s: &PodStatus| {
                let mut v: Vec<_> = s
                    .containers
                    .iter()
                    .map(|c| (c.id.clone(), c.state, c.exit_code))
                    .collect();
                v.sort_by(|a, b| a.0.cmp(&b.0));
                let mut sb: Vec<_> = s
                    .sandboxes
                    .iter()
                    .map(|s| (s.id.clone(), s.state))
                    .collect();
                sb.sort_by(|a, b| a.0.cmp(&b.0));
                (v, sb)
            };
            // A pod with nothing left is an empty status here (so that waiters
            // are released), no entry in a cache that never saw it.
            let seen = |c: &PodStatusCache| {
                c.get(&uid(pod))
                    .map(|e| key(&e.status))
                    .filter(|(c, s)| !c.is_empty() || !s.is_empty())
            };
            let (ours, theirs) = (seen(&self.cache), seen(&generic_cache));
            prop_assert_eq!(
                ours,
                theirs,
                "the ebpf and generic caches disagree on pod {}",
                pod
            );
        }
        prop_assert!(
            self.cache.kernel_exit_count() <= truth.iter().filter(|c| !c.removed).count(),
            "kernel exits of removed containers are kept"
        );
        Ok(())
    }
}

fn run(steps: &[Step]) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let mut m = Model::new();
        let _ = m.relist.relist().await;
        for s in steps {
            if std::env::var_os("MODEL_TRACE").is_some() {
                eprintln!(
                    "step {s:?}; kernel queue {:?}",
                    m.kernel
                        .iter()
                        .map(|e| (e.kind, &e.container_id.as_ref().unwrap().as_str()[60..]))
                        .collect::<Vec<_>>()
                );
            }
            m.apply(s).await;
            m.check_cache()?;
        }
        m.settle().await;
        m.check_cache()?;
        m.check_deaths_reached_the_workers().await
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn the_pleg_contract_holds_over_random_interleavings(
        steps in proptest::collection::vec(step(), 1..60)
    ) {
        run(&steps)?;
    }
}

/// The scenario that a PLEG recording a kernel transition as reported before
/// delivering it gets wrong: the worker channel is full when the kernel's
/// death arrives, so only the relist can tell the worker, and it must not think
/// the kernel already did.
#[test]
fn a_death_dropped_on_a_full_channel_still_reaches_the_worker() {
    let mut steps = vec![
        Step::Start { pod: 0 },
        Step::Deliver { count: 2 },
        Step::Serve,
        Step::Drain,
    ];
    steps.extend((0..CHANNEL).map(|_| Step::Start { pod: 1 }));
    steps.push(Step::Deliver { count: CHANNEL + 1 });
    steps.push(Step::Die {
        n: 1,
        code: 2,
        certain: true,
    });
    steps.push(Step::Deliver { count: 1 });
    run(&steps).unwrap();
}

/// Found by the model (session 4): a pod whose dropped event was owed a
/// re-inspection, where the only change then found (its sandbox's death) had
/// been delivered by the kernel already, woke no worker, so the death of its
/// container, which the runtime meanwhile reported, never reached the workers.
/// A re-inspection now always wakes them (a PodSync if nothing else did).
#[test]
fn a_reinspection_whose_events_the_kernel_delivered_still_wakes_the_workers() {
    use Step::*;
    let steps = [
        Start { pod: 1 },
        Deliver { count: 2 },
        FullRelist,
        Die {
            n: 1,
            code: 0,
            certain: false,
        },
        CatchUp,
        Die {
            n: 0,
            code: 0,
            certain: true,
        },
        Start { pod: 0 },
        Deliver { count: 3 },
        Die {
            n: 6,
            code: 0,
            certain: false,
        },
        Drain,
        Start { pod: 0 },
        Serve,
    ];
    run(&steps).unwrap();
}

/// Clause 4's bound, measured (issue #25 item 5): a certain death the workers'
/// channel drops reaches the pod's worker within `CONFIRM_RETRY` (20 ms) of
/// the channel having room again, in every interleaving tried: the workers
/// reading at any time from 0 to 300 ms after the drop, with or without a
/// full relist asked for at the same time (which skipped a plain pod relist
/// before issue #25), through the relist task's own loop. The worker is woken
/// by a PodSync (or the death itself) and reads the death from the cache.
#[test]
fn a_dropped_death_reaches_the_worker_within_20_ms_of_room() {
    let mut worst = Duration::ZERO;
    for read_after_ms in [0u64, 1, 5, 19, 20, 21, 37, 100, 300] {
        for full_relist in [false, true] {
            let latency = dropped_death_latency(read_after_ms, full_relist);
            assert!(
                latency <= CONFIRM_RETRY,
                "read {read_after_ms} ms after the drop (full relist: {full_relist}): \
                 woken {latency:?} after the channel had room"
            );
            worst = worst.max(latency);
        }
    }
    eprintln!("worst wake-up after the channel had room: {worst:?}");
}

/// How long after the workers make room in their full channel they are woken
/// for a death it dropped, when they make room `read_after_ms` after the drop.
fn dropped_death_latency(read_after_ms: u64, full_relist: bool) -> Duration {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let mut m = Model::new();
        m.apply(&Step::Start { pod: 0 }).await;
        let _ = m.relist.relist().await;
        m.drain();
        let c = m.runtime.0.lock().unwrap().containers[1].clone();
        // The workers' channel is full.
        let filler = m.kernel_event(&c, EventKind::PodSync, None);
        while m.merge.out.try_send(filler.clone()).is_ok() {}
        let relist = std::mem::replace(
            &mut m.relist,
            RelistPleg::new(
                m.runtime.clone(),
                m.cache.clone(),
                mpsc::channel(1).0,
                Arc::new(m.clock.clone()),
                m.merge.reports.clone(),
            ),
        );
        let (_period_tx, period) = tokio::sync::watch::channel(Duration::from_secs(300));
        let shutdown = tokio_util::sync::CancellationToken::new();
        let task =
            tokio::spawn(relist.run(period, m.signal.clone(), m.queue.clone(), shutdown.clone()));
        tokio::task::yield_now().await;
        // The death, certain, dropped by the full channel.
        m.runtime.0.lock().unwrap().containers[1].died = Some(2);
        let died = m.kernel_event(
            &c,
            EventKind::ContainerDied,
            Some(ExitStatus::from_wait_status(2 << 8, false)),
        );
        m.merge.handle(died);
        if full_relist {
            m.signal.request("test: a full relist at the same time");
        }
        tokio::time::sleep(Duration::from_millis(read_after_ms)).await;
        while let Ok(ev) = m.workers.try_recv() {
            assert_eq!(ev.kind, EventKind::PodSync, "only the fillers so far");
        }
        let room = tokio::time::Instant::now();
        let woken = tokio::time::timeout(Duration::from_secs(5), m.workers.recv())
            .await
            .expect("the worker is woken within 5 s")
            .expect("the channel is open");
        let latency = room.elapsed();
        assert_eq!(woken.pod_uid, Some(uid(0)));
        let view = m.cache.get(&uid(0)).expect("the pod is cached");
        let seen = view.status.container(&c.id).expect("the container");
        assert_eq!(
            (seen.state, seen.exit_code),
            (ContainerState::Exited, Some(2)),
            "the woken worker reads the death"
        );
        shutdown.cancel();
        task.await.unwrap();
        latency
    })
}
