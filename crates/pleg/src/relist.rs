//! The relist PLEG: the kubelet's generic PLEG (`pkg/kubelet/pleg/generic.go`).
//!
//! Every period it lists the runtime's sandboxes and containers, diffs each
//! container's state against the previous relist, inspects only the pods that
//! changed, writes their status into the [`PodStatusCache`] and sends the
//! kubelet's lifecycle events. Faithful to the kubelet:
//!
//! * the list's timestamp is taken *before* listing, and each pod's cache entry is
//!   stamped with the time taken just before *its* inspection (`updateCache`);
//! * a pod whose inspection fails gets the error in the cache (its worker does not
//!   sync on it) and is re-inspected next time; its events wait for success;
//! * a snapshot older than what the cache holds (a kernel death observed after the
//!   list began) is not stored and its events are not sent: the change is found
//!   again, here within [`CONFIRM_RETRY`] rather than at the next period;
//! * the state-to-event table of [`events_for`]; a change to Created or Unknown
//!   inspects the pod (the kubelet's ContainerChanged) but sends nothing;
//! * a re-inspection without other events sends PodSync;
//! * after all pods are written the cache's global time advances to the list's
//!   timestamp, releasing waiters of unchanged pods;
//! * the event channel never blocks: a full channel drops the event and counts it
//!   (`pleg_discard_events`);
//! * health: "pleg has yet to be successful" before the first relist, then
//!   unhealthy when the last relist is older than a threshold;
//! * on demand, one pod alone is relisted (the kubelet's PLEGOnDemandRelist);
//!   here the pods due at once share one listing of the runtime, each then
//!   processed as if relisted alone ([`RelistPleg::relist_pod`]);
//! * the pods a relist inspects are inspected together, at most
//!   [`INSPECTIONS_AT_ONCE`] at a time, where the kubelet inspects them one
//!   after another; each keeps its own stamp, taken just before its
//!   inspection.
//!
//! Where it differs (docs/pleg.md, "The contract"): in `ebpf` mode the period is
//! slow and the kernel's certain exits are merged in: one the runtime does not
//! report yet is kept as an overlay (the runtime lags by tens of milliseconds) and
//! the pod re-checked every [`CONFIRM_RETRY`]; one the runtime still contradicts
//! after [`CONFIRM_BOUND`] is forgotten, counted, logged, and the worker woken
//! with the runtime's view; the pod is then re-checked for
//! [`CONTRADICTION_WATCH`], in case the runtime only lagged. Transitions the kernel delivered are not sent again.
//! A kernel hint (something it cannot vouch for) re-checks its pod for
//! [`DOUBT_WATCH`], a certain event of a container the snapshot did not hold
//! yet until the confirmation bound ([`super::on_demand::Watch`]).
//! A dropped event is not lost: the pod is re-checked and a PodSync delivered.
//! A full relist that fails is retried after [`GENERIC_PERIOD`], whatever the
//! period. Every relist hands the runtime's view to the kernel tracker
//! ([`Reconciler`]).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::mpsc::{self, error::TrySendError};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::kernel::{RuntimeContainer, RuntimeView};
use super::on_demand::{PodRelistQueue, Watch};
use super::stages::{self, Stage};
use evpleg_core::cache::{CacheEntry, KernelExit, PodStatusCache};
use evpleg_core::clock::SharedClock;
use evpleg_core::clock::monotonic_to_unix_ns;
use evpleg_core::container::{ContainerState, PodStatus, SandboxState};
use evpleg_core::ids::{ContainerId, PodUid};
use evpleg_core::lifecycle::{EventKind, EventSource, PodLifecycleEvent, RelistSignal};
use evpleg_core::runtime::{PlegState, PodRuntime, RuntimeEntry, RuntimeError};

/// The kubelet's relist period, for `generic` mode, and the fallback period.
pub const GENERIC_PERIOD: Duration = Duration::from_secs(1);
/// The reconciling relist period in `ebpf` mode.
pub const EBPF_PERIOD: Duration = Duration::from_secs(300);
/// The kubelet's relist threshold: unhealthy when the last relist is older.
pub const RELIST_THRESHOLD: Duration = Duration::from_secs(180);
/// How long a kernel-observed exit may disagree with the runtime before the
/// runtime's view wins. containerd reports exits 40-630 ms after the kernel
/// on a quiet node, but up to 3.5 s later (p90 2.5 s) with the whole fidelity
/// corpus at once on 2 cores (issue #31: at 2 s, 14 certain deaths of one run
/// were forgotten and the runtime's stale `running` won). A longer bound does
/// not let a wrong kernel death do more: the worker acts on a certain death at
/// once; the bound only decides when an unconfirmed one is dropped.
pub const CONFIRM_BOUND: Duration = Duration::from_secs(5);
/// How soon a pod is looked at again: a kernel exit the runtime does not confirm
/// yet (the first re-check; then [`next_confirm_wait`]), a snapshot older than
/// the cache, an event the channel could not take.
pub const CONFIRM_RETRY: Duration = Duration::from_millis(20);
/// The longest wait between re-checks of a pod whose kernel view the runtime
/// has not confirmed yet: the wait doubles from [`CONFIRM_RETRY`] up to this
/// (issue #29: a fixed 20 ms poll made some 30 pod relists of each death
/// containerd took 600 ms to report, on the CPU the shim needed to report
/// it). The kernel's view is held meanwhile; the runtime's is taken at most
/// this long after it reports.
pub const CONFIRM_RETRY_MAX: Duration = Duration::from_millis(160);
/// At most this many pods of one relist are inspected at once (issue #31:
/// one after another, the 42 pods due together when the whole fidelity corpus
/// started took 2 s, each inspection's calls waiting their turn in a busy
/// containerd, and a container that ran 1 s was never seen running).
pub const INSPECTIONS_AT_ONCE: usize = 8;
/// The longest wait before a failed pod relist is tried again.
pub const RETRY_MAX: Duration = Duration::from_secs(1);
/// How long a pod whose kernel exit the runtime contradicted is re-checked (every
/// [`RETRY_MAX`] at most), so that a runtime that only lagged past the bound is
/// heard as soon as it reports the exit.
pub const CONTRADICTION_WATCH: Duration = Duration::from_secs(30);
/// How long a pod is re-checked (every [`RETRY_MAX`] at most) after a kernel
/// hint, something the kernel cannot vouch for (an uncertain main process's
/// exit, a cgroup removed before its main process was seen to exit): a death
/// the runtime reports up to this long after the hint is reported by the
/// relist within [`RETRY_MAX`] of the runtime's report. As long as the watch
/// after a contradiction: the runtime may lag as much for an uncertain death as
/// for a certain one (containerd here: 40-630 ms, seconds under load).
pub const DOUBT_WATCH: Duration = CONTRADICTION_WATCH;

/// The wait before the next re-check of a pod whose kernel view the runtime
/// has not confirmed: [`CONFIRM_RETRY`] first, then doubling up to
/// [`CONFIRM_RETRY_MAX`].
pub fn next_confirm_wait(last: Option<Duration>) -> Duration {
    last.map_or(CONFIRM_RETRY, |w| (w * 2).min(CONFIRM_RETRY_MAX))
}

/// The kubelet's state-to-event table (`generateEvents`), without ContainerChanged
/// (never sent; the change still inspects the pod). `sandbox` picks the sandbox
/// variants.
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

/// Hands the runtime's view to the kernel tracker after each relist.
pub type Reconciler = Box<dyn Fn(RuntimeView) + Send + Sync>;

/// Transitions delivered to the pod workers, by the kernel merge or by the relist,
/// so that neither sends one a second time (a container's start and death are
/// each delivered once). A transition counts only once its event was taken by
/// the channel (contract clause 4); the check, the send and the record happen
/// under one lock, so the two senders cannot both deliver it.
#[derive(Debug, Default)]
pub struct KernelReports(Mutex<HashMap<ContainerId, (PlegState, u64)>>);

/// What became of an event offered through [`KernelReports::deliver`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    Sent,
    /// The transition was delivered before: not sent again.
    AlreadyDelivered,
    /// The channel did not take it: nothing recorded.
    Dropped,
}

impl KernelReports {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ContainerId, (PlegState, u64)>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records that the transition of `id` to `state` at `at_ns` was delivered.
    pub fn record(&self, id: &ContainerId, state: PlegState, at_ns: u64) {
        self.lock().insert(id.clone(), (state, at_ns));
    }

    /// The last transition of `id` delivered, and when.
    pub fn get(&self, id: &ContainerId) -> Option<(PlegState, u64)> {
        self.lock().get(id).copied()
    }

    /// Offers the event of `kind` for `id`: unless that transition was delivered
    /// already, `send` is called (it must not block) and, if it delivered, the
    /// transition is recorded.
    pub fn deliver(
        &self,
        id: &ContainerId,
        kind: EventKind,
        at_ns: u64,
        send: impl FnOnce() -> bool,
    ) -> Delivery {
        Self::deliver_locked(&mut self.lock(), id, kind, at_ns, send)
    }

    /// [`KernelReports::deliver`] only if the lock is free now (the kernel
    /// PLEG's real-time reader never waits for it): `None` when it is not
    /// (nothing sent, nothing recorded).
    pub fn try_deliver(
        &self,
        id: &ContainerId,
        kind: EventKind,
        at_ns: u64,
        send: impl FnOnce() -> bool,
    ) -> Option<Delivery> {
        let mut map = match self.0.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(Self::deliver_locked(&mut map, id, kind, at_ns, send))
    }

    fn deliver_locked(
        map: &mut HashMap<ContainerId, (PlegState, u64)>,
        id: &ContainerId,
        kind: EventKind,
        at_ns: u64,
        send: impl FnOnce() -> bool,
    ) -> Delivery {
        let state = map.get(id).map(|(s, _)| *s);
        use EventKind::*;
        let (already, new) = match kind {
            ContainerStarted | SandboxStarted => (state.is_some(), Some(PlegState::Running)),
            ContainerDied | SandboxDied => {
                (state == Some(PlegState::Exited), Some(PlegState::Exited))
            }
            ContainerRemoved | SandboxRemoved | PodSync => (false, None),
        };
        if already {
            return Delivery::AlreadyDelivered;
        }
        if !send() {
            return Delivery::Dropped;
        }
        match new {
            Some(state) => {
                map.insert(id.clone(), (state, at_ns));
            }
            None if kind != PodSync => {
                map.remove(id);
            }
            None => {}
        }
        Delivery::Sent
    }

    pub fn forget(&self, id: &ContainerId) {
        self.lock().remove(id);
    }

    /// Forgets transitions of containers a listing that began at `listed_at_ns`
    /// did not show (`listed` is false), unless delivered after it began.
    pub fn prune(&self, listed_at_ns: u64, listed: impl Fn(&ContainerId) -> bool) {
        self.lock()
            .retain(|id, (_, at)| listed(id) || *at >= listed_at_ns);
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why a full relist ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FullRelistCause {
    /// Its period passed (the kubelet's only cause).
    Period,
    /// Something asked for it: a loss on the kernel path, a CRI event stream
    /// that failed, a kernel event that named no pod.
    Requested,
    /// One of [`LOSS_FOLLOW_UPS`] after a request.
    FollowUp,
    /// The last one failed to list the runtime.
    Retry,
}

impl FullRelistCause {
    pub const ALL: [Self; 4] = [Self::Period, Self::Requested, Self::FollowUp, Self::Retry];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Period => "period",
            Self::Requested => "requested",
            Self::FollowUp => "follow-up",
            Self::Retry => "retry",
        }
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
    /// Full relists started, by [`FullRelistCause`] (failed ones included).
    pub by_cause: [AtomicU64; FullRelistCause::ALL.len()],
    /// Loss follow-ups still to run (the last request's).
    pub follow_ups_due: AtomicU64,
    pub pod_relists: AtomicU64,
    /// On-demand requests a full relist that began after them had served.
    pub pod_relists_skipped: AtomicU64,
    pub failed_relists: AtomicU64,
    pub failed_pod_relists: AtomicU64,
    /// Events dropped because the channel was full (`pleg_discard_events`).
    pub discarded: AtomicU64,
    /// Duration of the last full relist, ns.
    pub last_duration_ns: AtomicU64,
    /// Interval between the last two full relists, ns.
    pub last_interval_ns: AtomicU64,
    /// Kernel exits the runtime confirmed (once each).
    pub confirmed: AtomicU64,
    /// Kernel exits the runtime contradicted past the bound.
    pub contradictions: AtomicU64,
    /// The current full relist period, ns.
    pub period_ns: AtomicU64,
}

impl Default for RelistStats {
    fn default() -> Self {
        // The kubelet's buckets (DefBuckets).
        let buckets = evpleg_core::metrics::def_histogram;
        Self {
            duration_seconds: buckets(),
            interval_seconds: buckets(),
            last_relist_ns: AtomicU64::new(0),
            relists: AtomicU64::new(0),
            by_cause: Default::default(),
            follow_ups_due: AtomicU64::new(0),
            pod_relists: AtomicU64::new(0),
            pod_relists_skipped: AtomicU64::new(0),
            failed_relists: AtomicU64::new(0),
            failed_pod_relists: AtomicU64::new(0),
            discarded: AtomicU64::new(0),
            last_duration_ns: AtomicU64::new(0),
            last_interval_ns: AtomicU64::new(0),
            confirmed: AtomicU64::new(0),
            contradictions: AtomicU64::new(0),
            period_ns: AtomicU64::new(0),
        }
    }
}

impl RelistStats {
    /// The kubelet's PLEG health check (`Healthy`).
    pub fn healthy(&self, now_ns: u64, threshold: Duration) -> Result<(), String> {
        let last = self.last_relist_ns.load(Ordering::Relaxed);
        if last == 0 {
            return Err("pleg has yet to be successful".into());
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
    /// Inspected only when a container changed (a full relist; a pod relist
    /// then raises the unchanged snapshot's time to the listing's).
    OnChange,
    /// Failed last time, or an event was not delivered: inspected, PodSync when
    /// nothing else changed.
    Reinspect,
    /// Asked for on demand: inspected, no PodSync.
    Always,
}

/// A pod whose kernel view (an exit, a start) the runtime does not report yet.
#[derive(Debug, Clone, Copy)]
struct Confirming {
    /// The wait before the next re-check (doubling up to [`CONFIRM_RETRY_MAX`]).
    wait: Duration,
    /// When the kernel saw the oldest transition the runtime does not report:
    /// the confirmation bound runs from here.
    since_ns: u64,
}

#[derive(Debug, Default)]
struct PodRecord {
    old: Option<Vec<RuntimeEntry>>,
    current: Option<Vec<RuntimeEntry>>,
}

impl PodRecord {
    /// Whether a sandbox or container changed state since the last look (the
    /// kubelet's relist then inspects the pod).
    fn changed(&self) -> bool {
        [&self.old, &self.current]
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| state_of(&self.old, &e.id).0 != state_of(&self.current, &e.id).0)
    }
}

/// A pod's inspection: the time taken just before it (its cache stamp), and
/// what the runtime said.
type Inspection = (u64, Result<PodStatus, RuntimeError>);

/// One pod's part of a listing, recorded, and how the pod is looked at.
struct Listed {
    inspect: Inspect,
    /// When the kernel saw what the runtime does not report yet, while the
    /// listing is unchanged ([`RelistPleg::lagging_since`]).
    lagging: Option<u64>,
    entries: Vec<RuntimeEntry>,
}

/// Inspects `pods`, at most [`INSPECTIONS_AT_ONCE`] at a time (the kubelet
/// inspects them one after another), each stamped with the time taken just
/// before its own inspection, as the kubelet's `updateCache` does.
async fn inspect_all<R: PodRuntime>(
    runtime: &R,
    clock: &SharedClock,
    pods: Vec<PodUid>,
) -> HashMap<PodUid, Inspection> {
    use futures::StreamExt;
    let mut pods = pods.into_iter();
    let mut running = futures::stream::FuturesUnordered::new();
    for uid in pods.by_ref().take(INSPECTIONS_AT_ONCE) {
        running.push(inspect_one(runtime, clock, uid));
    }
    let mut done = HashMap::new();
    while let Some((uid, inspection)) = running.next().await {
        done.insert(uid, inspection);
        if let Some(uid) = pods.next() {
            running.push(inspect_one(runtime, clock, uid));
        }
    }
    done
}

/// One pod's inspection, stamped just before it.
async fn inspect_one<R: PodRuntime>(
    runtime: &R,
    clock: &SharedClock,
    uid: PodUid,
) -> (PodUid, Inspection) {
    let at = clock.now_ns();
    let status = runtime.pod_status(&uid).await;
    (uid, (at, status))
}

fn state_of(entries: &Option<Vec<RuntimeEntry>>, id: &ContainerId) -> (PlegState, Option<bool>) {
    entries
        .as_ref()
        .and_then(|v| v.iter().find(|e| e.id == *id))
        .map(|e| (e.state, Some(e.sandbox)))
        .unwrap_or((PlegState::NonExistent, None))
}

/// A pod to look at again, and when.
#[derive(Clone, Copy, Debug)]
struct Recheck {
    due: Instant,
    /// Consecutive failed relists of the pod (for the back-off).
    failures: u32,
    /// An event could not be delivered: send a PodSync.
    redeliver: bool,
    /// A kernel hint: keep looking, at doubling intervals, until then (the
    /// runtime may learn of what the kernel saw only later).
    until: Option<Instant>,
    interval: Duration,
}

impl Recheck {
    fn at(due: Instant) -> Self {
        Self {
            due,
            failures: 0,
            redeliver: false,
            until: None,
            interval: CONFIRM_RETRY,
        }
    }
}

/// After a full relist that a loss asked for, full relists follow at these
/// delays: the runtime may learn of the lost transition only later (containerd
/// reported exits 40-630 ms after the kernel here), and a lost record does not
/// name its pod. The last one is past [`CONFIRM_BOUND`].
pub const LOSS_FOLLOW_UPS: [Duration; 4] = [
    Duration::from_millis(250),
    Duration::from_secs(1),
    Duration::from_millis(2500),
    Duration::from_millis(5500),
];

/// A test hook called with a pod before its snapshot is stored.
#[cfg(test)]
pub(crate) type StoreHook = Box<dyn FnMut(&PodUid) + Send>;

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
    recheck: HashMap<PodUid, Recheck>,
    /// Main pids the runtime reported at the last inspection, for the tracker.
    pids: HashMap<ContainerId, u32>,
    /// Containers whose kernel death the runtime contradicted, told to the
    /// tracker with the next view.
    contradicted: HashSet<ContainerId>,
    reconciler: Option<Reconciler>,
    /// Pods whose kernel view the runtime does not confirm yet.
    confirming: HashMap<PodUid, Confirming>,
    /// Test hook: called with the pod between the kernel exits' merge into a
    /// snapshot and its store, where the reader thread's merge can land in
    /// a real run (the model test lays deaths there, clause 4).
    #[cfg(test)]
    pub(crate) before_store: Option<StoreHook>,
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
            recheck: HashMap::new(),
            pids: HashMap::new(),
            contradicted: HashSet::new(),
            reconciler: None,
            confirming: HashMap::new(),
            #[cfg(test)]
            before_store: None,
        }
    }

    /// Hands every relist's view of the runtime to `reconciler` (the kernel
    /// tracker's [`crate::kernel::KernelPleg::reconcile`]).
    pub fn with_reconciler(mut self, reconciler: Reconciler) -> Self {
        self.reconciler = Some(reconciler);
        self
    }

    pub fn stats(&self) -> Arc<RelistStats> {
        self.stats.clone()
    }

    /// Pods that failed inspection and will be re-inspected.
    pub fn pods_to_reinspect(&self) -> &HashSet<PodUid> {
        &self.reinspect
    }

    /// Whether some pod is due to be looked at again (a kernel exit awaiting
    /// confirmation, a failed pod relist, an undelivered event).
    pub fn has_rechecks(&self) -> bool {
        !self.recheck.is_empty()
    }

    /// One full relist.
    pub async fn relist(&mut self) -> Result<(), RuntimeError> {
        let timestamp = self.clock.now_ns();
        let entries = match self.runtime.list(None).await {
            Ok(e) => e,
            Err(e) => {
                self.stats.failed_relists.fetch_add(1, Ordering::Relaxed);
                warn!(error = %e, "relist: listing the runtime failed; retried within 1s");
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
        for e in &entries {
            by_pod.entry(e.pod.clone()).or_default().push(e.clone());
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
        let pods: Vec<(PodUid, Inspect)> = pods
            .into_iter()
            .map(|uid| {
                let inspect = if self.reinspect.remove(&uid) {
                    Inspect::Reinspect
                } else {
                    Inspect::OnChange
                };
                (uid, inspect)
            })
            .collect();
        let wanted = self.to_inspect(pods.iter().map(|(uid, inspect)| (uid, *inspect)));
        let mut inspections = inspect_all(&self.runtime, &self.clock, wanted).await;
        let mut needs_reinspection = HashSet::new();
        for (uid, inspect) in &pods {
            let inspection = inspections.remove(uid);
            self.process_pod(
                uid,
                timestamp,
                &mut needs_reinspection,
                *inspect,
                inspection,
            )
            .await;
        }
        self.cache.update_time(timestamp);
        // Failed inspections are retried soon, not a period later.
        for uid in &needs_reinspection {
            self.schedule_retry(uid);
        }
        self.reinspect = needs_reinspection;
        self.records
            .retain(|_, r| r.old.is_some() || r.current.is_some());
        let records = &self.records;
        self.confirming.retain(|uid, _| records.contains_key(uid));
        let listed: HashSet<&ContainerId> = entries.iter().map(|e| &e.id).collect();
        self.pids.retain(|id, _| listed.contains(id));
        // Nothing is kept about containers the runtime no longer has.
        self.cache
            .prune_exits(None, timestamp, |id| listed.contains(id));
        self.kernel.prune(timestamp, |id| listed.contains(id));
        self.reconcile(None, timestamp, &entries);
        // What the view did not list is gone.
        self.contradicted.clear();
        self.stats.relists.fetch_add(1, Ordering::Relaxed);
        let duration = self.clock.now_ns().saturating_sub(timestamp);
        self.stats
            .last_duration_ns
            .store(duration, Ordering::Relaxed);
        self.stats.duration_seconds.observe(duration as f64 / 1e9);
        Ok(())
    }

    /// Relists one pod alone (on demand: after a kernel event, after a sync that
    /// called the runtime, or a re-check). Does not advance the cache's global
    /// time. A failure is written to the cache as the pod's error and the pod is
    /// tried again with back-off (at most [`RETRY_MAX`]).
    pub async fn relist_pod(&mut self, uid: &PodUid) -> Result<(), RuntimeError> {
        let mut results = self
            .relist_pods(vec![(uid.clone(), Inspect::Always)], "pod relist")
            .await;
        results.pop().map_or(Ok(()), |(_, result)| result)
    }

    /// Relists each of `pods` as [`Self::relist_pod`] does, under one listing
    /// of the runtime when there are several (the pod's own listing when it is
    /// alone): the pods due at once share its cost. Under load they are many
    /// (issue #31: with the whole fidelity corpus at once, one listing per pod
    /// queued the workers' relists for seconds). Each pod keeps the listing's
    /// timestamp, taken before it, and its own inspection and its own stamp.
    /// `what` names the batch in the debug line that times it.
    async fn relist_pods(
        &mut self,
        pods: Vec<(PodUid, Inspect)>,
        what: &'static str,
    ) -> Vec<(PodUid, Result<(), RuntimeError>)> {
        let timestamp = self.clock.now_ns();
        let listed = match pods.as_slice() {
            [] => return Vec::new(),
            [(uid, _)] => self.runtime.list(Some(uid)).await,
            _ => self.runtime.list(None).await,
        };
        let mut results = Vec::with_capacity(pods.len());
        let entries = match listed {
            Ok(entries) => entries,
            Err(e) => {
                for (uid, _) in pods {
                    self.stats.pod_relists.fetch_add(1, Ordering::Relaxed);
                    self.pod_relist_failed(&uid, &e, timestamp);
                    results.push((uid, Err(RuntimeError(e.0.clone()))));
                }
                return results;
            }
        };
        let listed: Vec<(PodUid, Listed)> = pods
            .into_iter()
            .map(|(uid, inspect)| {
                let mine = entries.iter().filter(|e| e.pod == uid).cloned().collect();
                let listed = self.record_listed(&uid, inspect, mine);
                (uid, listed)
            })
            .collect();
        let wanted = self.to_inspect(listed.iter().map(|(uid, l)| (uid, l.inspect)));
        let mut inspections = inspect_all(&self.runtime, &self.clock, wanted).await;
        for (uid, l) in listed {
            let inspection = inspections.remove(&uid);
            let result = self.finish_listed(&uid, l, timestamp, inspection).await;
            results.push((uid, result));
        }
        self.records
            .retain(|_, r| r.old.is_some() || r.current.is_some());
        debug!(
            pods = results.len(),
            took_ms = self.clock.now_ns().saturating_sub(timestamp) / 1_000_000,
            "{what}"
        );
        results
    }

    /// Those of `pods` that [`Self::process_pod`] will inspect: a listing
    /// that changed, or asked regardless; not a pod the runtime no longer has.
    fn to_inspect<'a>(&self, pods: impl IntoIterator<Item = (&'a PodUid, Inspect)>) -> Vec<PodUid> {
        pods.into_iter()
            .filter(|(uid, inspect)| {
                self.records.get(uid).is_some_and(|r| {
                    r.current.is_some() && (*inspect != Inspect::OnChange || r.changed())
                })
            })
            .map(|(uid, _)| uid.clone())
            .collect()
    }

    /// The first half of one pod's relist: `entries`, its part of the
    /// listing, recorded, and how the pod is to be looked at decided.
    fn record_listed(
        &mut self,
        uid: &PodUid,
        inspect: Inspect,
        entries: Vec<RuntimeEntry>,
    ) -> Listed {
        self.stats.pod_relists.fetch_add(1, Ordering::Relaxed);
        // This relist serves any re-check that was due for the pod, except a
        // hint's, which goes on until its bound.
        let mut inspect = inspect;
        if let Some(r) = self.recheck.get(uid).copied() {
            if r.redeliver {
                // An event for this pod was dropped: this relist delivers a PodSync.
                inspect = Inspect::Reinspect;
            }
            if r.until.is_none() {
                self.recheck.remove(uid);
            } else if let Some(r) = self.recheck.get_mut(uid) {
                r.redeliver = false;
            }
        }
        self.records.entry(uid.clone()).or_default().current =
            (!entries.is_empty()).then(|| entries.clone());
        // A pod whose listing shows what its cached snapshot was taken from is
        // not inspected again: the snapshot holds as of this listing (its time
        // raised, which releases a worker waiting for a newer view). The
        // kubelet's on-demand relist always inspects; under load (the whole
        // fidelity corpus at once) those inspections kept the relist task 90 %
        // busy and the workers waited seconds for their own relists. Inspected
        // still: a pod that failed or owes a wake-up, one not cached or cached
        // with an error, and one whose kernel view awaits the runtime past
        // the confirmation bound (to be confirmed or contradicted). Within
        // the bound, a lagging runtime's unchanged listing is not inspected
        // either ([`Self::lagging_since`]; issue #29: each death's
        // re-checks inspected the pod, every container's verbose status,
        // five times, three times generic's load on containerd).
        let failed_before = self.reinspect.remove(uid);
        let cached = (!failed_before)
            .then(|| self.cache.get(uid))
            .flatten()
            .filter(|e| e.error.is_none());
        let unconfirmed = self.unconfirmed_exits(uid);
        let awaited = !unconfirmed.is_empty() || self.confirming.contains_key(uid);
        let lagging = cached
            .as_ref()
            .and_then(|c| self.lagging_since(uid, c, &unconfirmed));
        let inspect = match inspect {
            Inspect::Always if cached.is_some() && (lagging.is_some() || !awaited) => {
                Inspect::OnChange
            }
            other => other,
        };
        Listed {
            inspect,
            lagging,
            entries,
        }
    }

    /// The second half of one pod's relist, from a listing made at
    /// `timestamp`: the pod processed with its inspection (if it was
    /// inspected), then the kernel told what the runtime listed.
    async fn finish_listed(
        &mut self,
        uid: &PodUid,
        listed: Listed,
        timestamp: u64,
        inspection: Option<Inspection>,
    ) -> Result<(), RuntimeError> {
        let Listed {
            inspect,
            lagging,
            entries,
        } = listed;
        let mut needs = HashSet::new();
        let inspected = self
            .process_pod(uid, timestamp, &mut needs, inspect, inspection)
            .await;
        if !inspected {
            self.cache.touch(uid, timestamp);
            if let Some(since_ns) = lagging {
                self.recheck_while_lagging(uid, since_ns);
            }
        }
        let failed = !needs.is_empty();
        self.reinspect.extend(needs);
        self.cache.prune_exits(Some(uid), timestamp, |id| {
            entries.iter().any(|e| e.id == *id)
        });
        self.reconcile(Some(uid), timestamp, &entries);
        if failed {
            let e = RuntimeError(format!("inspection of pod {uid} failed"));
            self.schedule_retry(uid);
            return Err(e);
        }
        Ok(())
    }

    fn pod_relist_failed(&mut self, uid: &PodUid, e: &RuntimeError, timestamp: u64) {
        self.stats
            .failed_pod_relists
            .fetch_add(1, Ordering::Relaxed);
        self.cache.set_error(uid, e.0.clone(), timestamp);
        self.schedule_retry(uid);
    }

    fn schedule_retry(&mut self, uid: &PodUid) {
        let entry = self
            .recheck
            .entry(uid.clone())
            .or_insert(Recheck::at(Instant::now()));
        entry.failures = entry.failures.saturating_add(1);
        let backoff = CONFIRM_RETRY
            .saturating_mul(1 << entry.failures.min(8))
            .min(RETRY_MAX);
        entry.due = Instant::now() + backoff;
    }

    fn recheck_soon(&mut self, uid: &PodUid, redeliver: bool) {
        self.recheck_after(uid, CONFIRM_RETRY, redeliver);
    }

    fn recheck_after(&mut self, uid: &PodUid, wait: Duration, redeliver: bool) {
        let due = Instant::now() + wait;
        let entry = self.recheck.entry(uid.clone()).or_insert(Recheck::at(due));
        entry.due = entry.due.min(due);
        entry.redeliver |= redeliver;
    }

    /// Re-checks `uid` at doubling intervals (from [`CONFIRM_RETRY`] to
    /// [`RETRY_MAX`]) for `window`: after a kernel hint (the runtime may learn of
    /// it only later) and after a contradiction (a runtime that only lagged is
    /// caught up with when it reports the exit).
    /// A watch already running for the pod is extended, its back-off kept: a
    /// busy uncertain container hints at every exit of its processes, and
    /// restarting at 20 ms each time relisted it every 20 ms for as long as it
    /// ran (issue #25); a re-check is still at most [`RETRY_MAX`] away.
    fn recheck_for(&mut self, uid: &PodUid, window: Duration) {
        let now = Instant::now();
        let entry = self
            .recheck
            .entry(uid.clone())
            .or_insert(Recheck::at(now + CONFIRM_RETRY));
        let watching = entry.until.is_some_and(|u| u > now);
        if !watching {
            entry.due = entry.due.min(now + CONFIRM_RETRY);
            entry.interval = CONFIRM_RETRY;
        }
        entry.until = entry.until.max(Some(now + window));
    }

    fn reconcile(&mut self, scope: Option<&PodUid>, listed_at_ns: u64, entries: &[RuntimeEntry]) {
        let Some(reconciler) = &self.reconciler else {
            return;
        };
        let contradicted = &mut self.contradicted;
        reconciler(RuntimeView {
            listed_at_ns,
            scope: scope.cloned(),
            containers: entries
                .iter()
                .map(|e| RuntimeContainer {
                    id: e.id.clone(),
                    pod: e.pod.clone(),
                    sandbox: e.sandbox,
                    running: e.state == PlegState::Running,
                    pid: self.pids.get(&e.id).copied(),
                    contradicted: contradicted.remove(&e.id),
                })
                .collect(),
        });
    }

    async fn process_pod(
        &mut self,
        uid: &PodUid,
        timestamp: u64,
        needs: &mut HashSet<PodUid>,
        inspect: Inspect,
        inspection: Option<Inspection>,
    ) -> bool {
        let Some(record) = self.records.get(uid) else {
            return false;
        };
        let mut ids: Vec<ContainerId> = Vec::new();
        for list in [&record.old, &record.current].into_iter().flatten() {
            for e in list {
                if !ids.contains(&e.id) {
                    ids.push(e.id.clone());
                }
            }
        }
        let changed = record.changed();
        let mut events = Vec::new();
        for id in &ids {
            let (old, old_sandbox) = state_of(&record.old, id);
            let (new, new_sandbox) = state_of(&record.current, id);
            let sandbox = new_sandbox.or(old_sandbox).unwrap_or(false);
            for kind in events_for(old, new, sandbox) {
                events.push((kind, id.clone()));
            }
        }
        if !changed && inspect == Inspect::OnChange {
            if let Some(r) = self.records.get_mut(uid) {
                r.old = r.current.clone();
            }
            return false;
        }
        let owed = match self.update_cache(uid, inspection).await {
            Err(e) => {
                debug!(pod = %uid, error = %e, "pod inspection failed; re-inspected");
                needs.insert(uid.clone());
                return true;
            }
            Ok(None) => {
                // The cache holds a newer observation (a kernel death seen after
                // this list began): as the kubelet, leave the record so the change
                // is found again, and look again shortly.
                self.recheck_soon(uid, inspect == Inspect::Reinspect);
                return true;
            }
            Ok(Some(owed)) => owed,
        };
        if let Some(r) = self.records.get_mut(uid) {
            r.old = r.current.clone();
        }
        let mut to_send: Vec<PodLifecycleEvent> = Vec::new();
        for (kind, id) in events {
            if matches!(
                kind,
                EventKind::ContainerRemoved | EventKind::SandboxRemoved
            ) {
                // Gone from the runtime: nothing about it is kept any longer.
                self.cache.forget_exit(uid, &id);
                self.pids.remove(&id);
            }
            let exit = self.cache.kernel_exit(uid, &id).map(|k| k.status);
            to_send.push(PodLifecycleEvent {
                pod_uid: Some(uid.clone()),
                kind,
                container_id: Some(id),
                at_ns: timestamp,
                source: EventSource::Relist,
                exit,
                pid: None,
            });
        }
        // A re-inspection owes the workers a wake-up (an event of this pod was
        // dropped before, the kernel was contradicted, or its code corrected):
        // if none of the events above reaches them (none, or all delivered
        // already by the kernel), a PodSync does.
        let owes_wake_up = inspect == Inspect::Reinspect || owed;
        let mut woken = false;
        for event in to_send {
            // The stage log's `delivered` (benchmarks; off otherwise).
            let stage = stages::log().and_then(|_| event.died().cloned());
            let delivery = match event.container_id.clone() {
                Some(id) => {
                    let (kind, at) = (event.kind, event.at_ns);
                    self.kernel.deliver(&id, kind, at, || self.send(event))
                }
                None if self.send(event) => Delivery::Sent,
                None => Delivery::Dropped,
            };
            match delivery {
                Delivery::Sent => {
                    if let Some(id) = &stage {
                        stages::record_now(Stage::Delivered, id);
                    }
                    woken = true;
                }
                Delivery::Dropped => {
                    // Redelivered by the re-check.
                    woken = true;
                    self.recheck_soon(uid, true);
                }
                Delivery::AlreadyDelivered => {}
            }
        }
        if owes_wake_up && !woken {
            let sync = PodLifecycleEvent {
                pod_uid: Some(uid.clone()),
                kind: EventKind::PodSync,
                container_id: None,
                at_ns: timestamp,
                source: EventSource::Relist,
                exit: None,
                pid: None,
            };
            if !self.send(sync) {
                self.recheck_soon(uid, true);
            }
        }
        true
    }

    /// Inspects a pod and writes its status, with the kernel's exits merged in.
    /// `Ok(None)`: the cache holds a newer observation and kept it. `Ok(Some(c))`:
    /// stored; `c` tells whether the workers are owed a wake-up (a kernel exit
    /// contradicted, or its code corrected by the runtime's).
    /// `inspection`: the pod's, made by [`inspect_all`] (inspected
    /// here if it was not).
    async fn update_cache(
        &mut self,
        uid: &PodUid,
        inspection: Option<Inspection>,
    ) -> Result<Option<bool>, RuntimeError> {
        let gone = self.records.get(uid).is_none_or(|r| r.current.is_none());
        let (timestamp, inspected) = if gone {
            // No sandbox or container left: an empty status.
            let empty = PodStatus {
                uid: Some(uid.clone()),
                ..PodStatus::default()
            };
            (self.clock.now_ns(), Ok(empty))
        } else {
            match inspection {
                Some(i) => i,
                None => (self.clock.now_ns(), self.runtime.pod_status(uid).await),
            }
        };
        let mut status = match inspected {
            Ok(s) => s,
            Err(e) => {
                self.cache.set_error(uid, e.0.clone(), timestamp);
                return Err(e);
            }
        };
        for c in &status.containers {
            match c.pid {
                Some(pid) => self.pids.insert(c.id.clone(), pid),
                None => self.pids.remove(&c.id),
            };
        }
        for s in &status.sandboxes {
            match s.pid {
                Some(pid) => self.pids.insert(s.id.clone(), pid),
                None => self.pids.remove(&s.id),
            };
        }
        let contradicted = self.merge_kernel_exits(uid, &mut status);
        #[cfg(test)]
        if let Some(hook) = &mut self.before_store {
            hook(uid);
        }
        Ok(self
            .cache
            .set(uid, status, timestamp)
            .then_some(contradicted))
    }

    /// Overlays the kernel's certain exits that the runtime does not report yet;
    /// confirms (once) those it does; forgets those it still contradicts after
    /// [`CONFIRM_BOUND`]. Returns whether the workers are owed a wake-up:
    /// something was contradicted, or the runtime confirmed a death with
    /// another code than the kernel's (the workers were told the kernel's, and
    /// no transition of the relist tells them again: issue #25, found by the
    /// lying-kernel model).
    fn merge_kernel_exits(&mut self, uid: &PodUid, status: &mut PodStatus) -> bool {
        let now = self.clock.now_ns();
        // When the kernel saw the oldest transition still pending.
        let mut pending: Option<u64> = None;
        let mut contradicted = false;
        let mut recoded = false;
        for (id, exit, _) in self.cache.kernel_exits(uid) {
            let runtime_exited = if let Some(c) = status.container(&id) {
                (c.state == ContainerState::Exited).then_some(c.exit_code)
            } else if let Some(s) = status.sandboxes.iter().find(|s| s.id == id) {
                (s.state == SandboxState::NotReady).then_some(None)
            } else {
                // The runtime forgot it: the exit stays for its code until the
                // relist sees the removal.
                continue;
            };
            if let Some(runtime_code) = runtime_exited {
                // The runtime lost the exit (containerd 2 after a restart:
                // 255 `Unknown`): the kernel's certain one is kept, at every
                // relist, where the kubelet would show 255.
                let lost = match status.container_mut(&id) {
                    Some(c) if c.exit_unknown() => {
                        c.apply_exit(&exit.status, monotonic_to_unix_ns(exit.at_ns));
                        true
                    }
                    _ => false,
                };
                if self.cache.confirm_exit(uid, &id) {
                    self.stats.confirmed.fetch_add(1, Ordering::Relaxed);
                    if lost {
                        info!(container = %id, kernel = exit.status.code,
                              "the runtime lost the exit (255 Unknown); the kernel's is kept");
                    } else if runtime_code.is_some_and(|c| c != exit.status.code) {
                        recoded = true;
                        warn!(container = %id, kernel = exit.status.code, runtime = ?runtime_code,
                              "runtime and kernel disagree on the exit code; the runtime's is kept");
                    }
                }
                continue;
            }
            let age = Duration::from_nanos(now.saturating_sub(exit.at_ns));
            if age < CONFIRM_BOUND {
                // The runtime lags the kernel: keep the kernel's view, re-check
                // (backing off while it still lags).
                if let Some(c) = status.container_mut(&id) {
                    c.apply_exit(&exit.status, monotonic_to_unix_ns(exit.at_ns));
                } else if let Some(s) = status.sandboxes.iter_mut().find(|s| s.id == id) {
                    s.state = SandboxState::NotReady;
                }
                pending = Some(pending.map_or(exit.at_ns, |p| p.min(exit.at_ns)));
            } else {
                self.stats.contradictions.fetch_add(1, Ordering::Relaxed);
                warn!(container = %id, pod = %uid, age_ms = age.as_millis() as u64,
                      "the runtime still reports running a container whose death the kernel \
                       reported; the runtime's view wins and the kernel's exit is forgotten");
                self.cache.forget_exit(uid, &id);
                self.kernel.forget(&id);
                // The tracker is told with this relist's view: the main process
                // is unknown again, so the real death is a death (or a hint).
                if self.reconciler.is_some() {
                    self.contradicted.insert(id.clone());
                }
                contradicted = true;
            }
        }
        // Starts too: the kernel saw the entrypoint exec, the runtime may still say
        // Created for a few milliseconds; re-check within the same bound.
        for c in &status.containers {
            if let Some((PlegState::Running, at)) = self.kernel.get(&c.id)
                && matches!(c.state, ContainerState::Created | ContainerState::Unknown)
                && Duration::from_nanos(now.saturating_sub(at)) < CONFIRM_BOUND
            {
                pending = Some(pending.map_or(at, |p| p.min(at)));
            }
        }
        match pending {
            Some(since_ns) => self.recheck_while_lagging(uid, since_ns),
            None => {
                self.confirming.remove(uid);
            }
        }
        if contradicted {
            self.recheck_for(uid, CONTRADICTION_WATCH);
        }
        contradicted || recoded
    }

    /// Sends without blocking; returns false when the event was dropped.
    fn send(&self, event: PodLifecycleEvent) -> bool {
        match self.events.try_send(event) {
            Ok(()) => true,
            Err(TrySendError::Full(e)) => {
                self.stats.discarded.fetch_add(1, Ordering::Relaxed);
                warn!(kind = ?e.kind, pod = ?e.pod_uid, "pleg event channel full: event discarded; the pod is re-checked");
                false
            }
            Err(TrySendError::Closed(_)) => true,
        }
    }

    pub(crate) async fn run_rechecks(&mut self) {
        let now = Instant::now();
        let due: Vec<(PodUid, Recheck)> = self
            .recheck
            .iter()
            .filter(|(_, r)| r.due <= now)
            .map(|(u, r)| (u.clone(), *r))
            .collect();
        let mut batch = Vec::with_capacity(due.len());
        for (uid, r) in &due {
            self.recheck.remove(uid);
            let inspect = if r.redeliver {
                Inspect::Reinspect
            } else {
                Inspect::Always
            };
            batch.push((uid.clone(), inspect));
        }
        let results = self.relist_pods(batch, "pod re-checks").await;
        for ((uid, result), (_, r)) in results.into_iter().zip(due) {
            if let Some(next) = self.recheck.get_mut(&uid) {
                // Keep the back-off counting and the hint's bound across re-checks.
                if result.is_err() {
                    next.failures = next.failures.max(r.failures.saturating_add(1));
                    next.redeliver |= r.redeliver;
                }
                next.until = next.until.max(r.until);
            } else if let Some(until) = r.until.filter(|u| *u > now) {
                let interval = (r.interval * 2).min(RETRY_MAX);
                self.recheck.insert(
                    uid.clone(),
                    Recheck {
                        due: (now + interval).min(until),
                        until: Some(until),
                        interval,
                        ..Recheck::at(now)
                    },
                );
            }
            if let Err(e) = result {
                warn!(pod = %uid, error = %e, "pod relist failed; retrying");
            }
        }
    }

    pub(crate) async fn run_requests(&mut self, queue: &PodRelistQueue) {
        let served_until = self.stats.last_relist_ns.load(Ordering::Relaxed);
        let mut batch = Vec::new();
        for (uid, request) in queue.take() {
            // A hint for a pod already watched waits for the watch's next
            // re-check (at most RETRY_MAX away): a busy uncertain container
            // hints at every exit of its processes.
            let watched = request.watch == Watch::Doubt
                && !request.prompt
                && !request.redeliver
                && self
                    .recheck
                    .get(&uid)
                    .is_some_and(|r| r.until.is_some_and(|u| u > Instant::now()));
            match request.watch {
                Watch::Doubt => self.recheck_for(&uid, DOUBT_WATCH),
                Watch::Deferred => self.recheck_for(&uid, CONFIRM_BOUND + CONFIRM_RETRY),
                Watch::Once => {}
            }
            if request.redeliver {
                // A kernel event of this pod was dropped: its relist wakes the
                // workers, and no full relist serves it.
                self.recheck_soon(&uid, true);
            }
            if watched {
                self.stats
                    .pod_relists_skipped
                    .fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if request.watch == Watch::Once
                && !request.redeliver
                && served_until > request.at_ns
                && !self.awaits_confirmation(&uid)
            {
                // A full relist that began after the request has looked already.
                self.stats
                    .pod_relists_skipped
                    .fetch_add(1, Ordering::Relaxed);
                continue;
            }
            batch.push((uid, Inspect::Always));
        }
        for (uid, result) in self.relist_pods(batch, "on-demand pod relists").await {
            if let Err(e) = result {
                warn!(pod = %uid, error = %e, "on-demand relist failed; retrying");
            }
        }
    }

    /// The kernel exits of the pod the runtime has not confirmed yet.
    fn unconfirmed_exits(&self, uid: &PodUid) -> Vec<(ContainerId, KernelExit)> {
        self.cache
            .kernel_exits(uid)
            .into_iter()
            .filter(|(_, _, confirmed)| !confirmed)
            .map(|(id, exit, _)| (id, exit))
            .collect()
    }

    /// Whether the runtime lags the kernel's view of the pod within the
    /// confirmation bound, that view already in the `cached` snapshot: every
    /// kernel exit it has not confirmed (`unconfirmed`) is laid on the
    /// snapshot and younger than [`CONFIRM_BOUND`], and so is any start it
    /// did not report at the last inspection. While the pod's listing is
    /// unchanged, an inspection would only find the same (the runtime's
    /// listing and its statuses come from one store); past the bound it is
    /// inspected, to be contradicted. `Some`: when the kernel saw the oldest
    /// of these transitions.
    fn lagging_since(
        &self,
        uid: &PodUid,
        cached: &CacheEntry,
        unconfirmed: &[(ContainerId, KernelExit)],
    ) -> Option<u64> {
        let oldest_start = self.confirming.get(uid).map(|c| c.since_ns);
        let oldest = unconfirmed
            .iter()
            .map(|(_, exit)| exit.at_ns)
            .chain(oldest_start)
            .min()?;
        let now = self.clock.now_ns();
        let young = Duration::from_nanos(now.saturating_sub(oldest)) < CONFIRM_BOUND;
        let laid = |id: &ContainerId| match cached.status.container(id) {
            Some(c) => c.state == ContainerState::Exited,
            None => cached
                .status
                .sandboxes
                .iter()
                .any(|s| s.id == *id && s.state == SandboxState::NotReady),
        };
        (young && unconfirmed.iter().all(|(id, _)| laid(id))).then_some(oldest)
    }

    /// Schedules the next re-check of a pod whose runtime lags the kernel
    /// since `since_ns` (from [`CONFIRM_RETRY`], doubling to
    /// [`CONFIRM_RETRY_MAX`]).
    fn recheck_while_lagging(&mut self, uid: &PodUid, since_ns: u64) {
        let wait = next_confirm_wait(self.confirming.get(uid).map(|c| c.wait));
        self.confirming
            .insert(uid.clone(), Confirming { wait, since_ns });
        self.recheck_after(uid, wait, false);
    }

    /// Whether a kernel exit of the pod waits for the runtime: a full relist
    /// does not serve its request, as it inspects only the pods whose listing
    /// changed, and a runtime that lags, or contradicts the kernel, shows no
    /// change (issue #25: a session taken for the main process stood past
    /// the confirmation bound when a full relist came between the death and
    /// its pod relist).
    fn awaits_confirmation(&self, uid: &PodUid) -> bool {
        !self.unconfirmed_exits(uid).is_empty()
    }

    /// Runs until `shutdown`: a full relist `period` after the last periodic
    /// one ended (`wait.Until`; the period may change: the fallback to
    /// [`GENERIC_PERIOD`]), whenever `signal` asks (a kernel drop, a
    /// full channel), one pod whenever `queue` names it, and re-checks when due.
    /// A full relist has priority over pod relists.
    pub async fn run(
        mut self,
        mut period: watch::Receiver<Duration>,
        signal: Arc<RelistSignal>,
        queue: Arc<PodRelistQueue>,
        shutdown: CancellationToken,
    ) {
        let mut current = *period.borrow_and_update();
        let mut tick = interval(current);
        self.stats
            .period_ns
            .store(current.as_nanos() as u64, Ordering::Relaxed);
        info!(period_s = current.as_secs_f64(), "relist pleg started");
        let mut retry_full: Option<Instant> = None;
        let mut follow_ups: Vec<Instant> = Vec::new();
        let mut period_open = true;
        loop {
            let next_recheck = self.recheck.values().map(|r| r.due).min();
            let next_follow_up = follow_ups.iter().min().copied();
            let mut why = FullRelistCause::Period;
            let full = tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                () = signal.requested() => {
                    let now = Instant::now();
                    follow_ups = LOSS_FOLLOW_UPS.iter().map(|d| now + *d).collect();
                    why = FullRelistCause::Requested;
                    true
                }
                _ = tick.tick() => true,
                () = sleep_until_opt(retry_full) => { why = FullRelistCause::Retry; true }
                () = sleep_until_opt(next_follow_up) => {
                    let now = Instant::now();
                    follow_ups.retain(|t| *t > now);
                    why = FullRelistCause::FollowUp;
                    true
                }
                changed = period.changed(), if period_open => {
                    if changed.is_err() {
                        // The sender is gone: keep the current period.
                        period_open = false;
                        continue;
                    }
                    let new = *period.borrow_and_update();
                    if new != current {
                        info!(from_s = current.as_secs_f64(), to_s = new.as_secs_f64(), "relist period changed");
                        current = new;
                        tick = interval(current);
                        self.stats.period_ns.store(current.as_nanos() as u64, Ordering::Relaxed);
                    }
                    false
                }
                () = queue.ready() => { self.run_requests(&queue).await; false }
                () = sleep_until_opt(next_recheck) => { self.run_rechecks().await; false }
            };
            if full {
                debug!(why = why.as_str(), "full relist");
                self.stats.by_cause[why as usize].fetch_add(1, Ordering::Relaxed);
                self.stats
                    .follow_ups_due
                    .store(follow_ups.len() as u64, Ordering::Relaxed);
                retry_full = match self.relist().await {
                    Ok(()) => None,
                    Err(_) => Some(Instant::now() + GENERIC_PERIOD.min(current)),
                };
                if why == FullRelistCause::Period {
                    // The kubelet's `wait.Until`: the next periodic relist is
                    // a whole period after this one *ended*, not on a
                    // fixed-rate tick (a slow relist does not shorten the
                    // pause after it).
                    tick.reset();
                }
            }
        }
    }
}

fn interval(period: Duration) -> tokio::time::Interval {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests;
