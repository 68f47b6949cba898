//! The relist PLEG: the kubelet's generic PLEG (`pkg/kubelet/pleg/generic.go`).
//!
//! Every period it lists the runtime's sandboxes and containers, diffs each
//! container's state against the previous relist, inspects only the pods that
//! changed, writes their status into the [`PodStatusCache`] and sends the
//! kubelet's lifecycle events. Faithful to the kubelet:
//!
//! * the timestamp is taken *before* listing, so a container that changes during
//!   the list is seen again next time rather than missed;
//! * a pod whose inspection fails keeps its old record and is re-inspected next
//!   time; its events are not sent until it succeeds;
//! * the state-to-event table of [`events_for`] (ContainerChanged is never sent);
//! * a re-inspection without other events sends PodSync;
//! * after all pods are written the cache's global time advances, releasing
//!   waiters of unchanged pods;
//! * the event channel never blocks: a full channel drops the event and counts it
//!   (`pleg_discard_events`);
//! * health: unhealthy when the last relist is older than a threshold ("pleg was
//!   last seen active ... ago; threshold is ...");
//! * on demand, one pod alone is relisted (the kubelet's PLEGOnDemandRelist).
//!
//! Where it differs: in `ebpf` mode the period is slow (it only reconciles) and
//! the kernel's exits are merged in: a kernel-observed exit that the runtime does
//! not report yet is kept (the runtime lags by tens of milliseconds) and the pod is
//! re-checked shortly; a disagreement that outlives [`CONFIRM_BOUND`] is logged and
//! counted, and the runtime wins. Transitions the kernel already reported are not
//! sent a second time.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use tokio::sync::mpsc::{self, error::TrySendError};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::cache::PodStatusCache;
use super::{ContainerId, EventKind, EventSource, PodLifecycleEvent, PodUid, RelistSignal};
use crate::clock::SharedClock;
use crate::container::{ContainerState, PodStatus, monotonic_to_unix_ns};

/// The kubelet's relist period, for `generic` mode.
pub const GENERIC_PERIOD: Duration = Duration::from_secs(1);
/// The reconciling relist period in `ebpf` mode.
pub const EBPF_PERIOD: Duration = Duration::from_secs(300);
/// The kubelet's relist threshold: unhealthy when the last relist is older.
pub const RELIST_THRESHOLD: Duration = Duration::from_secs(180);
/// How long a kernel-observed exit may disagree with the runtime before the
/// runtime's view wins.
pub const CONFIRM_BOUND: Duration = Duration::from_secs(2);
/// How soon a pod whose kernel exit the runtime does not confirm yet is re-checked.
pub const CONFIRM_RETRY: Duration = Duration::from_millis(20);

/// A container's state as the PLEG compares it (`plegContainerState`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PlegState {
    Running,
    Exited,
    /// Created or unknown: the kubelet does not act on it.
    Unknown,
    NonExistent,
}

impl From<ContainerState> for PlegState {
    fn from(s: ContainerState) -> Self {
        match s {
            ContainerState::Running => Self::Running,
            ContainerState::Exited => Self::Exited,
            ContainerState::Created | ContainerState::Unknown => Self::Unknown,
        }
    }
}

/// The kubelet's state-to-event table (`generateEvents`), without ContainerChanged
/// (which is never sent). `sandbox` picks the sandbox variants.
pub fn events_for(old: PlegState, new: PlegState, sandbox: bool) -> Vec<EventKind> {
    use EventKind::*;
    let (started, died, removed) = if sandbox {
        (SandboxStarted, SandboxDied, SandboxRemoved)
    } else {
        (ContainerStarted, ContainerDied, ContainerRemoved)
    };
    if old == new {
        return Vec::new();
    }
    match new {
        PlegState::Running => vec![started],
        PlegState::Exited => vec![died],
        PlegState::Unknown => Vec::new(),
        PlegState::NonExistent => match old {
            PlegState::Exited => vec![removed],
            _ => vec![died, removed],
        },
    }
}

/// One sandbox or container as the runtime lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuntimeEntry {
    pub pod: PodUid,
    pub id: ContainerId,
    pub sandbox: bool,
    pub state: PlegState,
}

/// A failed runtime call, as the relist sees it.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RuntimeError(pub String);

/// The runtime, as the relist uses it (the kubelet's `GetPods` and
/// `GetPodStatus`). The CRI implementation is `runtime::CriRuntime`; tests use
/// in-memory values.
pub trait PodRuntime: Send + Sync {
    /// Every sandbox and container, or those of one pod.
    fn list(
        &self,
        pod: Option<&PodUid>,
    ) -> impl Future<Output = Result<Vec<RuntimeEntry>, RuntimeError>> + Send;
    /// A pod's full status.
    fn pod_status(
        &self,
        pod: &PodUid,
    ) -> impl Future<Output = Result<PodStatus, RuntimeError>> + Send;
}

/// Transitions the kernel PLEG already reported, so the relist does not send
/// them again.
#[derive(Debug, Default)]
pub struct KernelReports(Mutex<HashMap<ContainerId, (PlegState, u64)>>);

impl KernelReports {
    /// Records that the kernel saw `id` reach `state` at `at_ns`.
    pub fn record(&self, id: &ContainerId, state: PlegState, at_ns: u64) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.clone(), (state, at_ns));
    }

    /// What the kernel last saw of `id`, and when.
    pub fn get(&self, id: &ContainerId) -> Option<(PlegState, u64)> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .copied()
    }

    /// Whether `kind` for `id` was already reported by the kernel.
    fn already_reported(&self, id: &ContainerId, kind: EventKind) -> bool {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let Some((state, _)) = map.get(id) else {
            return false;
        };
        use EventKind::*;
        match kind {
            ContainerStarted | SandboxStarted => true,
            ContainerDied | SandboxDied => {
                matches!(state, PlegState::Exited | PlegState::NonExistent)
            }
            ContainerRemoved | SandboxRemoved => *state == PlegState::NonExistent,
            PodSync => false,
        }
    }

    fn forget(&self, id: &ContainerId) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
    }
}

/// Counters and health of the relist PLEG (Prometheus names in `metrics`).
#[derive(Debug)]
pub struct RelistStats {
    /// `pleg_relist_duration_seconds`.
    pub duration_seconds: Histogram,
    /// `pleg_relist_interval_seconds`.
    pub interval_seconds: Histogram,
    /// Monotonic ns of the start of the last successful full relist (0: none yet).
    pub last_relist_ns: AtomicU64,
    pub relists: AtomicU64,
    pub pod_relists: AtomicU64,
    pub failed_relists: AtomicU64,
    /// Events dropped because the channel was full (`pleg_discard_events`).
    pub discarded: AtomicU64,
    /// Duration of the last full relist, ns.
    pub last_duration_ns: AtomicU64,
    /// Interval between the last two full relists, ns.
    pub last_interval_ns: AtomicU64,
    /// Kernel exits the runtime confirmed / contradicted past the bound.
    pub confirmed: AtomicU64,
    pub disagreements: AtomicU64,
}

impl Default for RelistStats {
    fn default() -> Self {
        // The kubelet's buckets: 5 ms doubling twelve times (about 20 s).
        let buckets = || Histogram::new(exponential_buckets(0.005, 2.0, 12));
        Self {
            duration_seconds: buckets(),
            interval_seconds: buckets(),
            last_relist_ns: AtomicU64::new(0),
            relists: AtomicU64::new(0),
            pod_relists: AtomicU64::new(0),
            failed_relists: AtomicU64::new(0),
            discarded: AtomicU64::new(0),
            last_duration_ns: AtomicU64::new(0),
            last_interval_ns: AtomicU64::new(0),
            confirmed: AtomicU64::new(0),
            disagreements: AtomicU64::new(0),
        }
    }
}

impl RelistStats {
    /// The kubelet's PLEG health check.
    pub fn healthy(&self, now_ns: u64, threshold: Duration) -> Result<(), String> {
        let last = self.last_relist_ns.load(Ordering::Relaxed);
        if last == 0 {
            return Ok(());
        }
        let ago = Duration::from_nanos(now_ns.saturating_sub(last));
        if ago > threshold {
            return Err(format!(
                "pleg was last seen active {:.1}s ago; threshold is {:.1}s",
                ago.as_secs_f64(),
                threshold.as_secs_f64()
            ));
        }
        Ok(())
    }
}

/// Why a pod is processed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Inspect {
    /// Inspected only when a container changed.
    OnChange,
    /// Failed last time: inspected, PodSync when nothing else changed.
    Reinspect,
    /// Asked for on demand: inspected, no PodSync.
    Always,
}

#[derive(Debug, Default)]
struct PodRecord {
    old: Option<Vec<RuntimeEntry>>,
    current: Option<Vec<RuntimeEntry>>,
}

fn state_of(entries: &Option<Vec<RuntimeEntry>>, id: &ContainerId) -> (PlegState, Option<bool>) {
    entries
        .as_ref()
        .and_then(|v| v.iter().find(|e| e.id == *id))
        .map(|e| (e.state, Some(e.sandbox)))
        .unwrap_or((PlegState::NonExistent, None))
}

/// The relist PLEG.
pub struct RelistPleg<R> {
    runtime: R,
    cache: Arc<PodStatusCache>,
    events: mpsc::Sender<PodLifecycleEvent>,
    clock: SharedClock,
    kernel: Arc<KernelReports>,
    stats: Arc<RelistStats>,
    records: HashMap<PodUid, PodRecord>,
    reinspect: HashSet<PodUid>,
    /// Pods whose kernel exit awaits the runtime's confirmation.
    unconfirmed: HashSet<PodUid>,
}

impl<R> std::fmt::Debug for RelistPleg<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelistPleg")
            .field("pods", &self.records.len())
            .field("reinspect", &self.reinspect)
            .finish_non_exhaustive()
    }
}

impl<R: PodRuntime> RelistPleg<R> {
    pub fn new(
        runtime: R,
        cache: Arc<PodStatusCache>,
        events: mpsc::Sender<PodLifecycleEvent>,
        clock: SharedClock,
        kernel: Arc<KernelReports>,
    ) -> Self {
        Self {
            runtime,
            cache,
            events,
            clock,
            kernel,
            stats: Arc::new(RelistStats::default()),
            records: HashMap::new(),
            reinspect: HashSet::new(),
            unconfirmed: HashSet::new(),
        }
    }

    pub fn stats(&self) -> Arc<RelistStats> {
        self.stats.clone()
    }

    /// Pods that failed inspection and will be re-inspected.
    pub fn pods_to_reinspect(&self) -> &HashSet<PodUid> {
        &self.reinspect
    }

    /// Whether some kernel exit still waits for the runtime to confirm it.
    pub fn has_unconfirmed(&self) -> bool {
        !self.unconfirmed.is_empty()
    }

    /// One full relist.
    pub async fn relist(&mut self) -> Result<(), RuntimeError> {
        let timestamp = self.clock.now_ns();
        let entries = match self.runtime.list(None).await {
            Ok(e) => e,
            Err(e) => {
                self.stats.failed_relists.fetch_add(1, Ordering::Relaxed);
                warn!(error = %e, "relist: listing the runtime failed");
                return Err(e);
            }
        };
        let previous = self.stats.last_relist_ns.swap(timestamp, Ordering::Relaxed);
        if previous != 0 {
            let interval = timestamp.saturating_sub(previous);
            self.stats
                .last_interval_ns
                .store(interval, Ordering::Relaxed);
            self.stats.interval_seconds.observe(interval as f64 / 1e9);
        }
        let mut by_pod: HashMap<PodUid, Vec<RuntimeEntry>> = HashMap::new();
        for e in entries {
            by_pod.entry(e.pod.clone()).or_default().push(e);
        }
        let mut pods: Vec<PodUid> = self.records.keys().cloned().collect();
        pods.extend(
            by_pod
                .keys()
                .filter(|p| !self.records.contains_key(*p))
                .cloned(),
        );
        for uid in &pods {
            self.records.entry(uid.clone()).or_default().current = by_pod.remove(uid);
        }
        let mut needs_reinspection = HashSet::new();
        for uid in &pods {
            let inspect = if self.reinspect.remove(uid) {
                Inspect::Reinspect
            } else {
                Inspect::OnChange
            };
            self.process_pod(uid, timestamp, &mut needs_reinspection, inspect)
                .await;
        }
        self.cache.update_time(timestamp);
        self.reinspect = needs_reinspection;
        self.records
            .retain(|_, r| r.old.is_some() || r.current.is_some());
        self.stats.relists.fetch_add(1, Ordering::Relaxed);
        let duration = self.clock.now_ns().saturating_sub(timestamp);
        self.stats
            .last_duration_ns
            .store(duration, Ordering::Relaxed);
        self.stats.duration_seconds.observe(duration as f64 / 1e9);
        Ok(())
    }

    /// Relists one pod alone (on demand: after a kernel event, or after a sync that
    /// did runtime work). Does not advance the cache's global time.
    pub async fn relist_pod(&mut self, uid: &PodUid) -> Result<(), RuntimeError> {
        let timestamp = self.clock.now_ns();
        let entries = self.runtime.list(Some(uid)).await?;
        self.stats.pod_relists.fetch_add(1, Ordering::Relaxed);
        let entries: Vec<RuntimeEntry> = entries.into_iter().filter(|e| e.pod == *uid).collect();
        self.records.entry(uid.clone()).or_default().current =
            (!entries.is_empty()).then_some(entries);
        let mut needs = HashSet::new();
        // A pod relisted on demand is always inspected (that is why it was asked),
        // without a PodSync when nothing changed.
        self.reinspect.remove(uid);
        self.process_pod(uid, timestamp, &mut needs, Inspect::Always)
            .await;
        self.reinspect.extend(needs);
        self.records
            .retain(|_, r| r.old.is_some() || r.current.is_some());
        Ok(())
    }

    async fn process_pod(
        &mut self,
        uid: &PodUid,
        timestamp: u64,
        needs: &mut HashSet<PodUid>,
        inspect: Inspect,
    ) {
        let Some(record) = self.records.get(uid) else {
            return;
        };
        let mut ids: Vec<ContainerId> = Vec::new();
        for list in [&record.old, &record.current].into_iter().flatten() {
            for e in list {
                if !ids.contains(&e.id) {
                    ids.push(e.id.clone());
                }
            }
        }
        let mut events = Vec::new();
        for id in &ids {
            let (old, old_sandbox) = state_of(&record.old, id);
            let (new, new_sandbox) = state_of(&record.current, id);
            let sandbox = new_sandbox.or(old_sandbox).unwrap_or(false);
            for kind in events_for(old, new, sandbox) {
                events.push((kind, Some(id.clone()), new));
            }
        }
        if events.is_empty() && inspect == Inspect::OnChange {
            if let Some(r) = self.records.get_mut(uid) {
                r.old = r.current.clone();
            }
            return;
        }
        if let Err(e) = self.update_cache(uid, timestamp).await {
            debug!(pod = %uid, error = %e, "pod inspection failed; re-inspected next relist");
            needs.insert(uid.clone());
            return;
        }
        if let Some(r) = self.records.get_mut(uid) {
            r.old = r.current.clone();
        }
        if events.is_empty() && inspect == Inspect::Reinspect {
            events.push((EventKind::PodSync, None, PlegState::Unknown));
        }
        for (kind, id, new) in events {
            let Some(id) = id else {
                self.send(PodLifecycleEvent {
                    pod_uid: Some(uid.clone()),
                    kind,
                    container_id: None,
                    at_ns: timestamp,
                    source: EventSource::Relist,
                    exit: None,
                    pid: None,
                });
                continue;
            };
            let already = self.kernel.already_reported(&id, kind);
            if new == PlegState::NonExistent
                && matches!(
                    kind,
                    EventKind::ContainerRemoved | EventKind::SandboxRemoved
                )
            {
                self.kernel.forget(&id);
            }
            if already {
                continue;
            }
            let exit = self.cache.kernel_exit(&id).map(|k| k.status);
            self.send(PodLifecycleEvent {
                pod_uid: Some(uid.clone()),
                kind,
                container_id: Some(id),
                at_ns: timestamp,
                source: EventSource::Relist,
                exit,
                pid: None,
            });
        }
    }

    /// Inspects a pod and writes its status, with the kernel's exits merged in.
    async fn update_cache(&mut self, uid: &PodUid, timestamp: u64) -> Result<(), RuntimeError> {
        let gone = self.records.get(uid).is_none_or(|r| r.current.is_none());
        let mut status = if gone {
            // No sandbox or container left: an empty status (the kernel's exits of
            // its containers stay in the cache).
            PodStatus {
                uid: Some(uid.clone()),
                ..PodStatus::default()
            }
        } else {
            self.runtime.pod_status(uid).await?
        };
        self.merge_kernel_exits(uid, &mut status);
        self.cache.set(uid, status, timestamp);
        Ok(())
    }

    fn merge_kernel_exits(&mut self, uid: &PodUid, status: &mut PodStatus) {
        let now = self.clock.now_ns();
        let mut pending = false;
        for (id, exit) in self.cache.kernel_exits(uid) {
            let Some(c) = status.container_mut(&id) else {
                continue;
            };
            if c.state == ContainerState::Exited {
                if c.source != EventSource::Kernel && c.exit_code != Some(exit.status.code) {
                    warn!(container = %id, kernel = exit.status.code, runtime = ?c.exit_code,
                          "runtime and kernel disagree on the exit code; the runtime's is kept");
                }
                self.stats.confirmed.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let age = Duration::from_nanos(now.saturating_sub(exit.at_ns));
            if age < CONFIRM_BOUND {
                // The runtime lags the kernel: keep the kernel's view, re-check soon.
                c.apply_exit(&exit.status, monotonic_to_unix_ns(exit.at_ns));
                pending = true;
            } else {
                self.stats.disagreements.fetch_add(1, Ordering::Relaxed);
                warn!(container = %id, pod = %uid, runtime_state = ?c.state, age_ms = age.as_millis() as u64,
                      "the runtime still disagrees with the kernel's exit; the runtime's view wins");
            }
        }
        // Starts too: the kernel saw the entrypoint exec, the runtime may still say
        // Created for a few milliseconds; re-check within the same bound.
        for c in &status.containers {
            if let Some((PlegState::Running, at)) = self.kernel.get(&c.id)
                && matches!(c.state, ContainerState::Created | ContainerState::Unknown)
                && Duration::from_nanos(now.saturating_sub(at)) < CONFIRM_BOUND
            {
                pending = true;
            }
        }
        if pending {
            self.unconfirmed.insert(uid.clone());
        } else {
            self.unconfirmed.remove(uid);
        }
    }

    fn send(&self, event: PodLifecycleEvent) {
        match self.events.try_send(event) {
            Ok(()) => {}
            Err(TrySendError::Full(e)) => {
                self.stats.discarded.fetch_add(1, Ordering::Relaxed);
                warn!(kind = ?e.kind, pod = ?e.pod_uid, "pleg event channel full: event discarded");
            }
            Err(TrySendError::Closed(_)) => {}
        }
    }

    /// Runs until `shutdown`: a full relist every `period`, whenever `signal` asks
    /// (a kernel drop, a full channel), one pod whenever `pod_requests` names it,
    /// and unconfirmed kernel exits re-checked every [`CONFIRM_RETRY`].
    pub async fn run(
        mut self,
        period: Duration,
        signal: Arc<RelistSignal>,
        mut pod_requests: mpsc::UnboundedReceiver<PodUid>,
        shutdown: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        info!(period_s = period.as_secs_f64(), "relist pleg started");
        loop {
            let confirm = async {
                if self.unconfirmed.is_empty() {
                    std::future::pending::<()>().await
                } else {
                    tokio::time::sleep(CONFIRM_RETRY).await
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => break,
                _ = tick.tick() => { let _ = self.relist().await; }
                () = signal.requested() => { let _ = self.relist().await; }
                Some(uid) = pod_requests.recv() => {
                    if let Err(e) = self.relist_pod(&uid).await {
                        warn!(pod = %uid, error = %e, "on-demand relist failed");
                    }
                }
                () = confirm => {
                    for uid in self.unconfirmed.clone() {
                        if let Err(e) = self.relist_pod(&uid).await {
                            warn!(pod = %uid, error = %e, "confirmation relist failed");
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex as StdMutex;

    use proptest::prelude::*;

    use super::*;
    use crate::clock::{Clock, ManualClock};
    use crate::container::ContainerStatus;
    use crate::pleg::ExitStatus;
    use crate::pleg::cache::KernelExit;

    /// The runtime as in-memory values: what it lists and what inspection says.
    #[derive(Debug, Default)]
    struct MemRuntime {
        entries: StdMutex<Vec<RuntimeEntry>>,
        fail_status: StdMutex<bool>,
        status_calls: AtomicU64,
    }

    impl MemRuntime {
        fn set(&self, entries: Vec<RuntimeEntry>) {
            *self.entries.lock().unwrap() = entries;
        }
    }

    impl PodRuntime for Arc<MemRuntime> {
        async fn list(&self, pod: Option<&PodUid>) -> Result<Vec<RuntimeEntry>, RuntimeError> {
            let all = self.entries.lock().unwrap().clone();
            Ok(all
                .into_iter()
                .filter(|e| pod.is_none_or(|p| *p == e.pod))
                .collect())
        }

        async fn pod_status(&self, pod: &PodUid) -> Result<PodStatus, RuntimeError> {
            self.status_calls.fetch_add(1, Ordering::Relaxed);
            if *self.fail_status.lock().unwrap() {
                return Err(RuntimeError(format!(
                    "PodSandboxStatus of pod {pod}: unavailable"
                )));
            }
            let entries = self.entries.lock().unwrap().clone();
            let containers = entries
                .iter()
                .filter(|e| e.pod == *pod && !e.sandbox)
                .map(|e| {
                    let state = match e.state {
                        PlegState::Running => ContainerState::Running,
                        PlegState::Exited => ContainerState::Exited,
                        _ => ContainerState::Unknown,
                    };
                    let mut c =
                        ContainerStatus::new(e.id.clone(), "app", state, EventSource::Relist);
                    if state == ContainerState::Exited {
                        c.exit_code = Some(7);
                    }
                    c
                })
                .collect();
            Ok(PodStatus {
                uid: Some(pod.clone()),
                containers,
                ..PodStatus::default()
            })
        }
    }

    fn uid(n: u8) -> PodUid {
        PodUid::parse(&format!("{n:02x}").repeat(16)).unwrap()
    }

    fn cid(n: u8) -> ContainerId {
        ContainerId::parse(&format!("{n:02x}").repeat(32)).unwrap()
    }

    fn entry(pod: u8, c: u8, state: PlegState) -> RuntimeEntry {
        RuntimeEntry {
            pod: uid(pod),
            id: cid(c),
            sandbox: false,
            state,
        }
    }

    struct Fixture {
        runtime: Arc<MemRuntime>,
        cache: Arc<PodStatusCache>,
        clock: ManualClock,
        kernel: Arc<KernelReports>,
        pleg: RelistPleg<Arc<MemRuntime>>,
        rx: mpsc::Receiver<PodLifecycleEvent>,
    }

    fn fixture(capacity: usize) -> Fixture {
        let runtime = Arc::new(MemRuntime::default());
        let cache = Arc::new(PodStatusCache::new());
        let clock = ManualClock::new(1_000);
        let kernel = Arc::new(KernelReports::default());
        let (tx, rx) = mpsc::channel(capacity);
        let pleg = RelistPleg::new(
            runtime.clone(),
            cache.clone(),
            tx,
            Arc::new(clock.clone()),
            kernel.clone(),
        );
        Fixture {
            runtime,
            cache,
            clock,
            kernel,
            pleg,
            rx,
        }
    }

    impl Fixture {
        async fn relist(&mut self) -> Vec<(EventKind, Option<ContainerId>)> {
            self.clock.advance(1_000_000);
            self.pleg.relist().await.unwrap();
            self.drain()
        }

        fn drain(&mut self) -> Vec<(EventKind, Option<ContainerId>)> {
            let mut out = Vec::new();
            while let Ok(e) = self.rx.try_recv() {
                out.push((e.kind, e.container_id));
            }
            out
        }
    }

    #[test]
    fn the_kubelet_state_to_event_table() {
        use EventKind::*;
        use PlegState::*;
        let table = [
            (NonExistent, Running, vec![ContainerStarted]),
            (NonExistent, Exited, vec![ContainerDied]),
            (NonExistent, Unknown, vec![]),
            (Running, Exited, vec![ContainerDied]),
            (Running, NonExistent, vec![ContainerDied, ContainerRemoved]),
            (Exited, NonExistent, vec![ContainerRemoved]),
            (Unknown, NonExistent, vec![ContainerDied, ContainerRemoved]),
            (Unknown, Running, vec![ContainerStarted]),
            (Exited, Running, vec![ContainerStarted]),
            (Running, Unknown, vec![]),
            (Running, Running, vec![]),
            (Exited, Exited, vec![]),
        ];
        for (old, new, expected) in table {
            assert_eq!(events_for(old, new, false), expected, "{old:?} -> {new:?}");
        }
        assert_eq!(
            events_for(Running, NonExistent, true),
            vec![SandboxDied, SandboxRemoved]
        );
    }

    #[tokio::test]
    async fn lifecycle_of_a_container_across_relists() {
        let mut f = fixture(100);
        f.runtime.set(vec![entry(1, 1, PlegState::Running)]);
        assert_eq!(
            f.relist().await,
            vec![(EventKind::ContainerStarted, Some(cid(1)))]
        );
        assert_eq!(f.relist().await, vec![], "nothing changed");
        f.runtime.set(vec![entry(1, 1, PlegState::Exited)]);
        assert_eq!(
            f.relist().await,
            vec![(EventKind::ContainerDied, Some(cid(1)))]
        );
        let cached = f.cache.get(&uid(1)).unwrap();
        assert_eq!(cached.status.container(&cid(1)).unwrap().exit_code, Some(7));
        f.runtime.set(vec![]);
        assert_eq!(
            f.relist().await,
            vec![(EventKind::ContainerRemoved, Some(cid(1)))]
        );
        // Gone while running: Died then Removed.
        f.runtime.set(vec![entry(2, 2, PlegState::Running)]);
        f.relist().await;
        f.runtime.set(vec![]);
        assert_eq!(
            f.relist().await,
            vec![
                (EventKind::ContainerDied, Some(cid(2))),
                (EventKind::ContainerRemoved, Some(cid(2)))
            ]
        );
    }

    #[tokio::test]
    async fn only_changed_pods_are_inspected_and_the_timestamp_precedes_the_list() {
        let mut f = fixture(100);
        f.runtime.set(vec![
            entry(1, 1, PlegState::Running),
            entry(2, 2, PlegState::Running),
        ]);
        f.relist().await;
        assert_eq!(f.runtime.status_calls.load(Ordering::Relaxed), 2);
        f.runtime.set(vec![
            entry(1, 1, PlegState::Exited),
            entry(2, 2, PlegState::Running),
        ]);
        let before = f.clock.now_ns() + 1_000_000;
        f.relist().await;
        assert_eq!(
            f.runtime.status_calls.load(Ordering::Relaxed),
            3,
            "only pod 1 inspected"
        );
        assert_eq!(f.cache.get(&uid(1)).unwrap().observed_ns, before);
        assert_eq!(f.cache.global_ns(), before);
    }

    #[tokio::test]
    async fn failed_inspection_is_retried_and_then_sends_its_events() {
        let mut f = fixture(100);
        f.runtime.set(vec![entry(1, 1, PlegState::Running)]);
        f.relist().await;
        f.runtime.set(vec![entry(1, 1, PlegState::Exited)]);
        *f.runtime.fail_status.lock().unwrap() = true;
        assert_eq!(
            f.relist().await,
            vec![],
            "events wait for a successful inspection"
        );
        assert!(f.pleg.pods_to_reinspect().contains(&uid(1)));
        *f.runtime.fail_status.lock().unwrap() = false;
        assert_eq!(
            f.relist().await,
            vec![(EventKind::ContainerDied, Some(cid(1)))]
        );
        assert!(f.pleg.pods_to_reinspect().is_empty());
    }

    #[tokio::test]
    async fn reinspection_without_events_is_a_pod_sync() {
        let mut f = fixture(100);
        f.runtime.set(vec![entry(1, 1, PlegState::Running)]);
        f.relist().await;
        f.runtime.set(vec![entry(1, 1, PlegState::Exited)]);
        *f.runtime.fail_status.lock().unwrap() = true;
        f.relist().await;
        // Back to running before the retry: no container event, but a PodSync.
        f.runtime.set(vec![entry(1, 1, PlegState::Running)]);
        *f.runtime.fail_status.lock().unwrap() = false;
        assert_eq!(f.relist().await, vec![(EventKind::PodSync, None)]);
    }

    #[tokio::test]
    async fn full_channel_drops_and_counts() {
        let mut f = fixture(1);
        f.runtime.set(vec![
            entry(1, 1, PlegState::Running),
            entry(1, 2, PlegState::Running),
        ]);
        f.relist().await;
        assert_eq!(f.pleg.stats().discarded.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn kernel_exit_is_kept_until_the_runtime_confirms_it_and_not_sent_twice() {
        let mut f = fixture(100);
        f.runtime.set(vec![entry(1, 1, PlegState::Running)]);
        f.relist().await;
        // The kernel saw the exit (code 3); the runtime still says running.
        let exit = ExitStatus::from_wait_status(0x300, false);
        let at = f.clock.now_ns();
        f.cache.record_exit(
            &uid(1),
            &cid(1),
            KernelExit {
                status: exit,
                at_ns: at,
            },
        );
        f.kernel.record(&cid(1), PlegState::Exited, at);
        f.clock.advance(1_000_000);
        f.pleg.relist_pod(&uid(1)).await.unwrap();
        let c = f
            .cache
            .get(&uid(1))
            .unwrap()
            .status
            .container(&cid(1))
            .unwrap()
            .clone();
        assert_eq!(
            (c.state, c.exit_code),
            (ContainerState::Exited, Some(3)),
            "the kernel's view is kept"
        );
        assert!(f.pleg.has_unconfirmed());
        // The runtime catches up: confirmed, and its Died is not sent again.
        f.runtime.set(vec![entry(1, 1, PlegState::Exited)]);
        f.clock.advance(1_000_000);
        f.pleg.relist_pod(&uid(1)).await.unwrap();
        assert!(!f.pleg.has_unconfirmed());
        assert_eq!(f.pleg.stats().confirmed.load(Ordering::Relaxed), 1);
        assert_eq!(f.drain(), vec![]);
        // Removed after the kernel reported only the death: sent.
        f.runtime.set(vec![]);
        assert_eq!(
            f.relist().await,
            vec![(EventKind::ContainerRemoved, Some(cid(1)))]
        );
        // The exit code is still known after the runtime forgot the container.
        assert_eq!(f.cache.kernel_exit(&cid(1)).unwrap().status.code, 3);
    }

    #[tokio::test]
    async fn a_disagreement_past_the_bound_lets_the_runtime_win() {
        let mut f = fixture(100);
        f.runtime.set(vec![entry(1, 1, PlegState::Running)]);
        f.relist().await;
        let exit = ExitStatus::from_wait_status(9, false);
        f.cache.record_exit(
            &uid(1),
            &cid(1),
            KernelExit {
                status: exit,
                at_ns: f.clock.now_ns(),
            },
        );
        f.clock.advance(CONFIRM_BOUND.as_nanos() as u64 + 1);
        f.pleg.relist_pod(&uid(1)).await.unwrap();
        let c = f
            .cache
            .get(&uid(1))
            .unwrap()
            .status
            .container(&cid(1))
            .unwrap()
            .clone();
        assert_eq!(c.state, ContainerState::Running);
        assert_eq!(f.pleg.stats().disagreements.load(Ordering::Relaxed), 1);
        assert!(!f.pleg.has_unconfirmed());
    }

    #[test]
    fn health_threshold() {
        let stats = RelistStats::default();
        assert!(
            stats.healthy(10, RELIST_THRESHOLD).is_ok(),
            "healthy before the first relist"
        );
        stats.last_relist_ns.store(1, Ordering::Relaxed);
        let late = 1 + RELIST_THRESHOLD.as_nanos() as u64 + 1_000_000_000;
        let err = stats.healthy(late, RELIST_THRESHOLD).unwrap_err();
        assert!(
            err.starts_with("pleg was last seen active 181.0s ago; threshold is 180.0s"),
            "{err}"
        );
        assert!(stats.healthy(2, RELIST_THRESHOLD).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn run_relists_on_its_period_and_on_request() {
        let f = fixture(100);
        f.runtime.set(vec![entry(1, 1, PlegState::Running)]);
        let stats = f.pleg.stats();
        let signal = Arc::new(RelistSignal::new());
        let (pod_tx, pod_rx) = mpsc::unbounded_channel();
        let shutdown = CancellationToken::new();
        let mut rx = f.rx;
        let task = tokio::spawn(f.pleg.run(
            Duration::from_secs(300),
            signal.clone(),
            pod_rx,
            shutdown.clone(),
        ));
        let first = tokio::time::timeout(Duration::from_secs(1), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            first.kind,
            EventKind::ContainerStarted,
            "the first relist runs at once"
        );
        f.runtime.set(vec![entry(1, 1, PlegState::Exited)]);
        signal.request("test");
        let died = tokio::time::timeout(Duration::from_secs(1), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(died.kind, EventKind::ContainerDied);
        pod_tx.send(uid(1)).unwrap();
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(stats.pod_relists.load(Ordering::Relaxed), 1);
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .unwrap()
            .unwrap();
    }

    fn arb_state() -> impl Strategy<Value = PlegState> {
        prop_oneof![
            Just(PlegState::Running),
            Just(PlegState::Exited),
            Just(PlegState::Unknown),
            Just(PlegState::NonExistent)
        ]
    }

    proptest! {
        /// Over any sequence of runtime states, the relist sends exactly what the
        /// kubelet's table gives for each consecutive pair, per container.
        #[test]
        fn relist_events_follow_the_table(steps in proptest::collection::vec(proptest::collection::vec(arb_state(), 3), 1..12)) {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            rt.block_on(async {
                let mut f = fixture(10_000);
                let mut previous = [PlegState::NonExistent; 3];
                for states in &steps {
                    let entries = states
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| **s != PlegState::NonExistent)
                        .map(|(i, s)| entry(1, i as u8, *s))
                        .collect();
                    f.runtime.set(entries);
                    let got = f.relist().await;
                    for (i, s) in states.iter().enumerate() {
                        let expected: Vec<_> = events_for(previous[i], *s, false)
                            .into_iter()
                            .map(|k| (k, Some(cid(i as u8))))
                            .collect();
                        let mine: Vec<_> = got.iter().filter(|(_, c)| *c == Some(cid(i as u8))).cloned().collect();
                        prop_assert_eq!(mine, expected);
                    }
                    prop_assert!(got.iter().all(|(k, _)| *k != EventKind::PodSync));
                    previous = [states[0], states[1], states[2]];
                }
                Ok(())
            })?;
        }
    }
}
