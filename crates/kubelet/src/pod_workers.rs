//! Pod workers: one task per pod UID that serialises everything done to that pod,
//! the kubelet's `pod_workers.go`.
//!
//! A worker moves through `Sync` -> `Terminating` -> `Terminated` -> done:
//! * updates that arrive while it is busy are coalesced: the latest pod wins;
//! * a kill moves it to `Terminating`, and a terminating pod never goes back to
//!   sync; the shortest grace period asked for wins;
//! * a pod whose sync finds it terminal (restartPolicy Never/OnFailure, done)
//!   terminates by itself;
//! * once terminated, its UID is never started again, unless the sync loop
//!   forgets it ([`PodWorkers::forget_finished`], the kubelet's restart of a
//!   pod re-added with the same UID);
//! * no worker syncs before the PLEG's first complete relist has filled the
//!   cache (the kubelet's workers block on the cache's global time);
//! * before each sync the worker waits for a pod status cache entry newer than
//!   the end of its last sync that called the runtime or failed (the kubelet's
//!   `GetNewerThan`), and never syncs on an older one; an entry holding an
//!   inspection error is a failed sync ("error determining status"), retried
//!   with back-off;
//! * after such a sync it asks the PLEG to relist the pod at once (the
//!   kubelet's PLEGOnDemandRelist), so that wait ends in milliseconds;
//! * errors back off as the kubelet's `completeWork`: 10 to 15 s after any
//!   failed sync, 1 to 1.5 s when the network is not ready ([`retry`]); a
//!   sync whose container waits in CrashLoopBackOff is requeued at the
//!   back-off's expiry plus up to half of the wait at random (the kubelet's
//!   back-off error, `MinBackoffExpiration` and `wait.Jitter` 0.5), one
//!   waiting for a deadline at it, and every worker resyncs periodically;
//! * a kill's grace period is never below 1 s (`calculateEffectiveGracePeriod`:
//!   a pod deleted with grace 0 still gives its preStop hooks 1 s);
//! * static pods with the same full name start one at a time, a new version
//!   once the old one's worker finished ([`static_pods`], the kubelet's
//!   `allowStaticPodStart`); one asked to terminate before it started is
//!   finished without a sync (`cleanupUnstartedPod`);
//! * after a failed sync, a PLEG event brings the retry forward no sooner than
//!   the kubelet's relist period after the failure ([`retry`]); a new spec or
//!   a kill syncs at once.
//!
//! Differences: no separate "terminating runtime pods" without a spec (orphans are
//! the sync loop's housekeeping). The kubelet's wait is released by its next 1 s
//! relist; here the worker asks for a pod relist whenever the cache has nothing
//! newer, and again every `cache_wait` while it still waits ([`WorkerConfig`]).
//! The kubelet's `lastSyncTime` is the end of every sync, and its `postSync`
//! asks a relist only after a successful sync with `SyncResults`; here a sync
//! that called nothing (a steady pod's resync, a wait in CrashLoopBackOff)
//! moves neither, so the next one may act on the same view: it is still newer
//! than the worker's own last runtime calls, and with the kernel PLEG no
//! periodic relist would otherwise renew it (a steady node makes no CRI call
//! per pod per resync).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use evpleg_core::cache::{CacheEntry, PodStatusCache};
use evpleg_core::clock::SharedClock;
use evpleg_core::ids::PodUid;
use evpleg_pleg::on_demand::PodRelistQueue;

pub mod retry;
pub mod static_pods;

use retry::{Retry, Wake};
use static_pods::StaticPods;

/// What a sync asks of its worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncResult {
    /// The pod reached a terminal phase: terminate it.
    pub terminal: bool,
    /// Sync again after this (the pod's active deadline).
    pub requeue_after: Option<Duration>,
    /// The earliest CrashLoopBackOff expiry of a container waiting in it (the
    /// kubelet's `MinBackoffExpiration`): the worker syncs again then, plus
    /// the kubelet's jitter.
    pub backoff: Option<Duration>,
    /// The sync changed the runtime: relist the pod now.
    pub did_runtime_work: bool,
}

/// What a worker keeps of a successful sync.
struct Synced {
    /// Sync again after this (`None`: at the periodic resync).
    after: Option<Duration>,
    /// The sync called the runtime (a terminating or terminated pod's always
    /// may): its end is the worker's new floor, and the pod is relisted.
    called_runtime: bool,
}

/// A failed sync; the worker retries with back-off.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SyncError(pub String);

/// The kubelet's `SyncPod`, `SyncTerminatingPod` and `SyncTerminatedPod`.
pub trait PodSyncer: Send + Sync + 'static {
    fn sync_pod(
        &self,
        pod: Arc<Pod>,
        status: CacheEntry,
    ) -> impl Future<Output = Result<SyncResult, SyncError>> + Send;
    fn sync_terminating_pod(
        &self,
        pod: Arc<Pod>,
        status: CacheEntry,
        grace_seconds: i64,
    ) -> impl Future<Output = Result<(), SyncError>> + Send;
    fn sync_terminated_pod(
        &self,
        pod: Arc<Pod>,
        status: CacheEntry,
    ) -> impl Future<Output = Result<(), SyncError>> + Send;
}

/// What the sync loop asks of a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpdateType {
    Create,
    Update,
    /// A PLEG event or a resync.
    Sync,
    /// Terminate, with an optional grace period override (seconds).
    Kill {
        grace_seconds: Option<i64>,
    },
}

/// A worker's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum WorkerState {
    Sync,
    Terminating,
    Terminated,
    Done,
}

/// Timings of the workers.
#[derive(Clone, Copy, Debug)]
pub struct WorkerConfig {
    /// Every worker syncs again after this without other reason.
    pub resync: Duration,
    /// How long a worker waits for a cache entry newer than its last sync before
    /// it asks for a pod relist again (it never syncs on an older entry).
    pub cache_wait: Duration,
    /// The back-off after a failed sync, before its jitter (the kubelet's
    /// `backOffPeriod`, [`retry::BACK_OFF_PERIOD`]).
    pub error_backoff: Duration,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            resync: Duration::from_secs(10),
            cache_wait: Duration::from_secs(2),
            error_backoff: retry::BACK_OFF_PERIOD,
        }
    }
}

/// The `operation_type` label of `pod_worker_duration_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct Operation {
    pub operation_type: &'static str,
}

type DurationFamily = prometheus_client::metrics::family::Family<
    Operation,
    prometheus_client::metrics::histogram::Histogram,
    fn() -> prometheus_client::metrics::histogram::Histogram,
>;

/// The kubelet's `pod_worker_duration_seconds` (DefBuckets): how long each
/// sync took, by the kind of update that led to it: `create` (the pod's first
/// sync), `update` (a new spec), `sync` (a PLEG event, a resync) or `kill`
/// (termination).
#[derive(Debug)]
pub struct WorkerMetrics {
    pub duration: DurationFamily,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        Self {
            duration: DurationFamily::new_with_constructor(evpleg_core::metrics::def_histogram),
        }
    }
}

impl WorkerMetrics {
    /// Registers `pod_worker_duration_seconds` (the kubelet's name; the
    /// registry adds the `evpleg_` prefix).
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "pod_worker_duration_seconds",
            "Duration in seconds to sync a single pod. Broken down by operation type: create, update, sync or kill",
            self.duration.clone(),
        );
    }
}

impl UpdateType {
    /// The kubelet's `SyncPodType` name.
    fn label(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Update => "update",
            Self::Sync => "sync",
            Self::Kill { .. } => "kill",
        }
    }
}

#[derive(Debug)]
struct Shared {
    pod: Arc<Pod>,
    state: WorkerState,
    /// The kind of the updates since the last sync: the latest, except that a
    /// pod's first sync stays `create`.
    update: &'static str,
    grace_seconds: i64,
    /// An update arrived since the worker last looked.
    pending: bool,
    /// A new pod, spec or kill arrived since the worker last looked (not only
    /// PLEG events or probe results).
    urgent: bool,
}

#[derive(Debug)]
struct Worker {
    shared: Arc<Mutex<Shared>>,
    notify: Arc<Notify>,
    task: JoinHandle<()>,
}

/// The pod workers.
pub struct PodWorkers<S> {
    syncer: Arc<S>,
    cache: Arc<PodStatusCache>,
    clock: SharedClock,
    pod_relist: Option<Arc<PodRelistQueue>>,
    config: WorkerConfig,
    workers: Arc<Mutex<HashMap<PodUid, Worker>>>,
    finished: Arc<Mutex<HashSet<PodUid>>>,
    static_pods: Arc<Mutex<StaticPods>>,
    done: mpsc::UnboundedSender<PodUid>,
    metrics: Arc<WorkerMetrics>,
}

impl<S> std::fmt::Debug for PodWorkers<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodWorkers")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The least grace period a kill gives (`calculateEffectiveGracePeriod`:
/// "no matter what, we always supply a grace period of 1").
pub const MIN_KILL_GRACE_SECONDS: i64 = 1;

/// The grace period of a kill: the override asked for, else the pod's own,
/// never below [`MIN_KILL_GRACE_SECONDS`].
fn kill_grace(override_seconds: Option<i64>, pod: &Pod) -> i64 {
    override_seconds
        .unwrap_or_else(|| spec_grace_seconds(pod))
        .max(MIN_KILL_GRACE_SECONDS)
}

/// The pod's own grace period (`terminationGracePeriodSeconds`, 30 by default).
pub fn spec_grace_seconds(pod: &Pod) -> i64 {
    pod.spec
        .as_ref()
        .and_then(|s| s.termination_grace_period_seconds)
        .unwrap_or(30)
        .max(0)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<S: PodSyncer> PodWorkers<S> {
    /// `done` receives the UID of every worker that finished (terminated).
    pub fn new(
        syncer: Arc<S>,
        cache: Arc<PodStatusCache>,
        clock: SharedClock,
        pod_relist: Option<Arc<PodRelistQueue>>,
        config: WorkerConfig,
        done: mpsc::UnboundedSender<PodUid>,
    ) -> Self {
        Self {
            syncer,
            cache,
            clock,
            pod_relist,
            config,
            workers: Arc::new(Mutex::new(HashMap::new())),
            finished: Arc::new(Mutex::new(HashSet::new())),
            static_pods: Arc::new(Mutex::new(StaticPods::default())),
            done,
            metrics: Arc::default(),
        }
    }

    /// `pod_worker_duration_seconds`.
    pub fn metrics(&self) -> &WorkerMetrics {
        &self.metrics
    }

    /// Hands an update to the pod's worker, starting it if needed.
    pub fn update_pod(&self, uid: &PodUid, pod: Arc<Pod>, kind: UpdateType) {
        if lock(&self.finished).contains(uid) {
            debug!(pod = %uid, ?kind, "update for a terminated pod ignored: its UID never restarts");
            return;
        }
        let mut workers = lock(&self.workers);
        if let Some(w) = workers.get(uid) {
            let mut s = lock(&w.shared);
            s.pod = pod;
            if s.update != "create" {
                s.update = kind.label();
            }
            if let UpdateType::Kill { grace_seconds } = kind {
                let grace = kill_grace(grace_seconds, &s.pod);
                if s.state == WorkerState::Sync {
                    s.state = WorkerState::Terminating;
                    s.grace_seconds = grace;
                } else {
                    s.grace_seconds = s.grace_seconds.min(grace);
                }
            }
            s.pending = true;
            s.urgent |= kind != UpdateType::Sync;
            drop(s);
            w.notify.notify_one();
            return;
        }
        let (state, grace_seconds) = match kind {
            UpdateType::Kill { grace_seconds } => {
                (WorkerState::Terminating, kill_grace(grace_seconds, &pod))
            }
            _ => (WorkerState::Sync, spec_grace_seconds(&pod)),
        };
        // Static pods start in the order their workers were created.
        let static_name = crate::status::api::is_static(&pod).then(|| {
            let name = crate::status::api::full_name(&pod);
            lock(&self.static_pods).enqueue(&name, uid);
            name
        });
        let shared = Arc::new(Mutex::new(Shared {
            pod,
            state,
            update: UpdateType::Create.label(),
            grace_seconds,
            pending: true,
            urgent: true,
        }));
        let notify = Arc::new(Notify::new());
        let task = tokio::spawn(
            WorkerLoop {
                uid: uid.clone(),
                shared: shared.clone(),
                notify: notify.clone(),
                syncer: self.syncer.clone(),
                cache: self.cache.clone(),
                clock: self.clock.clone(),
                pod_relist: self.pod_relist.clone(),
                config: self.config,
                finished: self.finished.clone(),
                done: self.done.clone(),
                metrics: self.metrics.clone(),
                workers: self.workers.clone(),
                static_pods: self.static_pods.clone(),
                static_name,
            }
            .run(),
        );
        notify.notify_one();
        workers.insert(
            uid.clone(),
            Worker {
                shared,
                notify,
                task,
            },
        );
    }

    /// The state of a pod's worker.
    pub fn state(&self, uid: &PodUid) -> Option<WorkerState> {
        if lock(&self.finished).contains(uid) {
            return Some(WorkerState::Done);
        }
        lock(&self.workers).get(uid).map(|w| lock(&w.shared).state)
    }

    /// Whether the static pod started under `full_name` is terminating and
    /// has not stopped yet (the kubelet's
    /// `IsPodForMirrorPodTerminatingByFullName`): its mirror pod is not an
    /// orphan yet.
    pub fn is_static_pod_terminating(&self, full_name: &str) -> bool {
        let workers = lock(&self.workers);
        let Some(uid) = lock(&self.static_pods).started(full_name).cloned() else {
            return false;
        };
        workers
            .get(&uid)
            .is_some_and(|w| lock(&w.shared).state == WorkerState::Terminating)
    }

    /// UIDs with a live worker.
    pub fn known(&self) -> Vec<PodUid> {
        lock(&self.workers).keys().cloned().collect()
    }

    /// Whether a worker of this UID is registered (running, or finished but not
    /// yet reaped).
    pub fn is_live(&self, uid: &PodUid) -> bool {
        lock(&self.workers).contains_key(uid)
    }

    /// Forgets that a UID finished, so that it can start again (the kubelet's
    /// purge of a finished worker before a restart-requested pod is created
    /// again). Does nothing while a worker of that UID is registered; returns
    /// whether the UID can now start.
    pub fn forget_finished(&self, uid: &PodUid) -> bool {
        if self.is_live(uid) {
            return false;
        }
        lock(&self.finished).remove(uid);
        true
    }

    /// Drops the bookkeeping of a finished worker.
    pub fn reap(&self, uid: &PodUid) {
        if let Some(w) = lock(&self.workers).remove(uid) {
            w.task.abort();
        }
    }

    /// Stops every worker (shutdown).
    pub fn shutdown(&self) {
        for (_, w) in lock(&self.workers).drain() {
            w.task.abort();
        }
    }
}

impl<S> Drop for PodWorkers<S> {
    /// Workers never outlive the agent that started them (a stopped agent's
    /// worker acting next to a new agent's would break every rule).
    fn drop(&mut self) {
        for (_, w) in lock(&self.workers).drain() {
            w.task.abort();
        }
    }
}

struct WorkerLoop<S> {
    uid: PodUid,
    shared: Arc<Mutex<Shared>>,
    notify: Arc<Notify>,
    syncer: Arc<S>,
    cache: Arc<PodStatusCache>,
    clock: SharedClock,
    pod_relist: Option<Arc<PodRelistQueue>>,
    config: WorkerConfig,
    finished: Arc<Mutex<HashSet<PodUid>>>,
    done: mpsc::UnboundedSender<PodUid>,
    metrics: Arc<WorkerMetrics>,
    workers: Arc<Mutex<HashMap<PodUid, Worker>>>,
    static_pods: Arc<Mutex<StaticPods>>,
    /// The full name of a static pod (it waits for its turn to start).
    static_name: Option<String>,
}

/// Whether a worker may start its pod (`allowPodStart`).
enum Start {
    Now,
    Later,
    /// Asked to terminate before it started.
    Never,
}

impl<S: PodSyncer> WorkerLoop<S> {
    async fn run(self) {
        self.cache.first_relist().await;
        let mut last_sync_ns = 0u64;
        let mut retry = Retry::Clear;
        let mut requeue = tokio::time::Instant::now() + self.config.resync;
        let mut started = self.static_name.is_none();
        loop {
            let wake = tokio::select! {
                () = self.notify.notified() => if lock(&self.shared).urgent { Wake::Update } else { Wake::Event },
                () = tokio::time::sleep_until(requeue) => Wake::Timer,
            };
            if let Some(until) = retry.hold(wake, tokio::time::Instant::now()) {
                self.hold_until(until).await;
            }
            if !started {
                match self.may_start() {
                    Start::Now => started = true,
                    Start::Later => {
                        // The kubelet requeues it after its back-off period;
                        // the release of the name wakes it sooner.
                        debug!(pod = %self.uid, "static pod waits for its older version to finish");
                        requeue = tokio::time::Instant::now()
                            + retry::go_jitter(
                                self.config.error_backoff,
                                retry::BACK_OFF_JITTER,
                                retry::random_unit(),
                            );
                        continue;
                    }
                    Start::Never => {
                        self.finish_unstarted();
                        return;
                    }
                }
            }
            let (pod, state, grace, update) = {
                let mut s = lock(&self.shared);
                s.pending = false;
                s.urgent = false;
                let update = std::mem::replace(&mut s.update, UpdateType::Sync.label());
                (s.pod.clone(), s.state, s.grace_seconds, update)
            };
            let entry = self.newer_than(last_sync_ns).await;
            evpleg_pleg::stages::worker_sync(&entry);
            let started = tokio::time::Instant::now();
            let outcome: Result<Synced, SyncError> = match &entry.error {
                // The kubelet refuses to sync on a status it could not determine.
                Some(e) => Err(SyncError(format!("error determining status: {e}"))),
                None => self.sync(state, pod, entry, grace).await,
            };
            let operation_type = match state {
                WorkerState::Sync => update,
                _ => "kill",
            };
            self.metrics
                .duration
                .get_or_create(&Operation { operation_type })
                .observe(started.elapsed().as_secs_f64());
            if matches!(lock(&self.shared).state, WorkerState::Done) {
                return;
            }
            // The kubelet's lastSyncTime: the *end* of this sync, taken before the
            // relist is asked for, so that the relist's observation is newer. The
            // next sync waits for it: it never acts on a view from before its own
            // runtime calls. A sync that called nothing (a resync of a steady
            // pod, a wait in CrashLoopBackOff) leaves both alone, as the
            // kubelet's `postSync` asks no relist without `SyncResults`.
            if outcome.as_ref().map_or(true, |s| s.called_runtime) {
                last_sync_ns = self.clock.now_ns();
                self.relist_now();
            }
            let delay = match outcome {
                Ok(Synced { after, .. }) => {
                    retry = retry.succeeded();
                    after.unwrap_or(self.config.resync).min(self.config.resync)
                }
                Err(e) => {
                    let backoff =
                        retry::backoff_after(&e.0, self.config.error_backoff, retry::random_unit());
                    retry = retry.failed(tokio::time::Instant::now(), backoff);
                    warn!(pod = %self.uid, ?state, error = %e, retry_in_ms = backoff.as_millis() as u64, "pod sync failed");
                    backoff
                }
            };
            requeue = tokio::time::Instant::now() + delay;
            if delay.is_zero() {
                self.notify.notify_one();
            }
        }
    }

    /// `allowPodStart` for a static pod that has not started yet.
    fn may_start(&self) -> Start {
        let Some(name) = &self.static_name else {
            return Start::Now;
        };
        if lock(&self.shared).state != WorkerState::Sync {
            return Start::Never;
        }
        let workers = lock(&self.workers);
        let finished = lock(&self.finished).clone();
        let gone = |u: &PodUid| {
            finished.contains(u)
                || workers
                    .get(u)
                    .is_none_or(|w| lock(&w.shared).state != WorkerState::Sync)
        };
        if lock(&self.static_pods).allow_start(name, &self.uid, &gone) {
            Start::Now
        } else {
            Start::Later
        }
    }

    /// A static pod's worker is done: its full name is released and the
    /// pods waiting for it are woken.
    fn release_static_name(&self) {
        let Some(name) = &self.static_name else {
            return;
        };
        let workers = lock(&self.workers);
        let waiting = lock(&self.static_pods).release(name, &self.uid);
        for uid in waiting {
            if let Some(w) = workers.get(&uid) {
                w.notify.notify_one();
            }
        }
    }

    /// `cleanupUnstartedPod`: a pod asked to terminate before it was allowed
    /// to start has nothing to stop; it is finished without a sync.
    fn finish_unstarted(&self) {
        debug!(pod = %self.uid, "static pod terminated before it started: finished without a sync");
        lock(&self.shared).state = WorkerState::Done;
        lock(&self.finished).insert(self.uid.clone());
        self.release_static_name();
        let _ = self.done.send(self.uid.clone());
    }

    /// Waits until `until`, or until a new spec or a kill arrives; PLEG
    /// events meanwhile are taken in by the sync that follows.
    async fn hold_until(&self, until: tokio::time::Instant) {
        debug!(pod = %self.uid, "PLEG event after a failed sync: retrying at the kubelet's relist period");
        loop {
            tokio::select! {
                () = self.notify.notified() => {
                    if lock(&self.shared).urgent {
                        return;
                    }
                }
                () = tokio::time::sleep_until(until) => return,
            }
        }
    }

    /// One sync in the worker's current state.
    async fn sync(
        &self,
        state: WorkerState,
        pod: Arc<Pod>,
        entry: CacheEntry,
        grace: i64,
    ) -> Result<Synced, SyncError> {
        let synced = |after| Synced {
            after,
            called_runtime: true,
        };
        match state {
            WorkerState::Sync => {
                let r = self.syncer.sync_pod(pod, entry).await?;
                let after = if r.terminal {
                    let mut s = lock(&self.shared);
                    if s.state == WorkerState::Sync {
                        s.state = WorkerState::Terminating;
                    }
                    Some(Duration::ZERO)
                } else {
                    // `completeWork` after a back-off error: the expiry (at
                    // most a resync) plus up to half of it at random.
                    let backoff = r.backoff.map(|b| {
                        retry::go_jitter(
                            b.min(self.config.resync),
                            retry::BACK_OFF_JITTER,
                            retry::random_unit(),
                        )
                    });
                    r.requeue_after.into_iter().chain(backoff).min()
                };
                Ok(Synced {
                    after,
                    called_runtime: r.did_runtime_work,
                })
            }
            WorkerState::Terminating => {
                self.syncer.sync_terminating_pod(pod, entry, grace).await?;
                lock(&self.shared).state = WorkerState::Terminated;
                Ok(synced(Some(Duration::ZERO)))
            }
            WorkerState::Terminated => {
                self.syncer.sync_terminated_pod(pod, entry).await?;
                lock(&self.shared).state = WorkerState::Done;
                lock(&self.finished).insert(self.uid.clone());
                self.release_static_name();
                let _ = self.done.send(self.uid.clone());
                Ok(synced(None))
            }
            WorkerState::Done => Ok(synced(None)),
        }
    }

    /// The pod's cache entry observed after `min_ns` (the kubelet's
    /// `GetNewerThan`). Asks for a pod relist when there is none yet, and again
    /// every `cache_wait` while waiting.
    async fn newer_than(&self, min_ns: u64) -> CacheEntry {
        if let Some(e) = self.cache.newer_than_now(&self.uid, min_ns) {
            return e;
        }
        let started = tokio::time::Instant::now();
        loop {
            self.relist_now();
            match tokio::time::timeout(
                self.config.cache_wait,
                self.cache.get_newer_than(&self.uid, min_ns),
            )
            .await
            {
                Ok(e) => {
                    debug!(pod = %self.uid, waited_ms = started.elapsed().as_millis() as u64,
                           "pod status newer than the last sync");
                    return e;
                }
                Err(_) => {
                    warn!(pod = %self.uid, wait_ms = self.config.cache_wait.as_millis() as u64,
                          "no pod status newer than the last sync yet; asking for a pod relist again");
                }
            }
        }
    }

    fn relist_now(&self) {
        if let Some(q) = &self.pod_relist {
            q.request(self.uid.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;
    use evpleg_core::clock::{Clock, ManualClock};

    #[derive(Debug, Default)]
    struct Recorder {
        calls: Mutex<Vec<(String, String)>>,
        terminal_after: AtomicU32,
        fail_next: AtomicU32,
        /// Its syncs call no runtime (a steady pod).
        idle: std::sync::atomic::AtomicBool,
        /// Its syncs find a container waiting this long in CrashLoopBackOff.
        backoff: Mutex<Option<Duration>>,
        notify: Notify,
    }

    impl Recorder {
        fn record(&self, what: &str, pod: &Pod) {
            // A static pod's version (its label `v`), else its name.
            let name = pod
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("v").cloned())
                .or_else(|| pod.metadata.name.clone())
                .unwrap_or_default();
            lock(&self.calls).push((what.into(), name));
            self.notify.notify_waiters();
        }

        fn calls(&self) -> Vec<(String, String)> {
            lock(&self.calls).clone()
        }
    }

    impl PodSyncer for Recorder {
        async fn sync_pod(
            &self,
            pod: Arc<Pod>,
            _status: CacheEntry,
        ) -> Result<SyncResult, SyncError> {
            self.record("sync", &pod);
            if self.fail_next.load(Ordering::SeqCst) > 0 {
                self.fail_next.fetch_sub(1, Ordering::SeqCst);
                return Err(SyncError("runtime unavailable".into()));
            }
            let n = self.terminal_after.load(Ordering::SeqCst);
            let terminal = n == 1;
            if n > 0 {
                self.terminal_after.fetch_sub(1, Ordering::SeqCst);
            }
            Ok(SyncResult {
                terminal,
                requeue_after: None,
                backoff: *lock(&self.backoff),
                did_runtime_work: !self.idle.load(Ordering::SeqCst),
            })
        }

        async fn sync_terminating_pod(
            &self,
            pod: Arc<Pod>,
            _s: CacheEntry,
            grace: i64,
        ) -> Result<(), SyncError> {
            self.record(&format!("terminating({grace})"), &pod);
            Ok(())
        }

        async fn sync_terminated_pod(
            &self,
            pod: Arc<Pod>,
            _s: CacheEntry,
        ) -> Result<(), SyncError> {
            self.record("terminated", &pod);
            Ok(())
        }
    }

    fn pod(name: &str, grace: Option<i64>) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name},
                "spec": {"containers": [], "terminationGracePeriodSeconds": grace}
            }))
            .unwrap(),
        )
    }

    fn uid() -> PodUid {
        PodUid::parse(&"a".repeat(32)).unwrap()
    }

    /// A stand-in for the PLEG: the first full relist, then every on-demand pod
    /// relist answered with a fresh observation while `answer` is set.
    struct FakePleg {
        cache: Arc<PodStatusCache>,
        clock: ManualClock,
        queue: Arc<PodRelistQueue>,
        answer: Arc<std::sync::atomic::AtomicBool>,
        error: Arc<Mutex<Option<String>>>,
        requests: Arc<AtomicU32>,
    }

    impl FakePleg {
        fn new() -> Self {
            let clock = ManualClock::new(1);
            Self {
                cache: Arc::new(PodStatusCache::new()),
                queue: Arc::new(PodRelistQueue::new(Arc::new(clock.clone()))),
                clock,
                answer: Arc::new(std::sync::atomic::AtomicBool::new(true)),
                error: Arc::new(Mutex::new(None)),
                requests: Arc::new(AtomicU32::new(0)),
            }
        }

        fn spawn(&self, first_relist: bool) {
            if first_relist {
                self.cache.update_time(1);
            }
            let (cache, clock, queue, answer, error, requests) = (
                self.cache.clone(),
                self.clock.clone(),
                self.queue.clone(),
                self.answer.clone(),
                self.error.clone(),
                self.requests.clone(),
            );
            tokio::spawn(async move {
                loop {
                    queue.ready().await;
                    for (uid, _) in queue.take() {
                        requests.fetch_add(1, Ordering::SeqCst);
                        if !answer.load(Ordering::SeqCst) {
                            continue;
                        }
                        clock.advance(1_000);
                        match lock(&error).clone() {
                            Some(e) => cache.set_error(&uid, e, clock.now_ns()),
                            None => cache.set(
                                &uid,
                                evpleg_core::container::PodStatus::default(),
                                clock.now_ns(),
                            ),
                        };
                    }
                }
            });
        }
    }

    fn workers_with(
        rec: Arc<Recorder>,
        pleg: &FakePleg,
    ) -> (PodWorkers<Recorder>, mpsc::UnboundedReceiver<PodUid>) {
        workers_configured(rec, pleg, WorkerConfig::default().resync)
    }

    /// Workers on `pleg` that wait at most 100 ms for the cache and resync
    /// every `resync`.
    fn workers_configured(
        rec: Arc<Recorder>,
        pleg: &FakePleg,
        resync: Duration,
    ) -> (PodWorkers<Recorder>, mpsc::UnboundedReceiver<PodUid>) {
        let (done, done_rx) = mpsc::unbounded_channel();
        let w = PodWorkers::new(
            rec,
            pleg.cache.clone(),
            Arc::new(pleg.clock.clone()),
            Some(pleg.queue.clone()),
            WorkerConfig {
                cache_wait: Duration::from_millis(100),
                resync,
                ..WorkerConfig::default()
            },
            done,
        );
        (w, done_rx)
    }

    fn workers(rec: Arc<Recorder>) -> (PodWorkers<Recorder>, mpsc::UnboundedReceiver<PodUid>) {
        let pleg = FakePleg::new();
        pleg.spawn(true);
        workers_with(rec, &pleg)
    }

    fn workers_with_resync(
        rec: Arc<Recorder>,
        resync: Duration,
    ) -> (PodWorkers<Recorder>, mpsc::UnboundedReceiver<PodUid>) {
        let pleg = FakePleg::new();
        pleg.spawn(true);
        workers_configured(rec, &pleg, resync)
    }

    /// A static pod (source `file`) named `web`, version `v` (its label).
    fn static_pod(v: &str) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "web", "namespace": "kube-system", "labels": {"v": v},
                             "annotations": {"kubernetes.io/config.source": "file"}},
                "spec": {"containers": [], "terminationGracePeriodSeconds": 2}
            }))
            .unwrap(),
        )
    }

    fn uid_n(n: u8) -> PodUid {
        PodUid::parse(&format!("{n:02x}").repeat(16)).unwrap()
    }

    /// `allowStaticPodStart`: a static pod's new version (new UID, same full
    /// name) does not sync while the old one's worker runs; it starts once
    /// that worker finished. One removed before it started finishes without
    /// any sync.
    #[tokio::test(start_paused = true)]
    async fn a_static_pod_s_new_version_starts_after_the_old_one_finished() {
        let rec = Arc::new(Recorder::default());
        let (w, mut done) = workers(rec.clone());
        let (old, new, newer) = (uid_n(1), uid_n(2), uid_n(3));
        w.update_pod(&old, static_pod("v1"), UpdateType::Create);
        tokio::time::timeout(Duration::from_secs(5), rec.notify.notified())
            .await
            .unwrap();
        // The manifest changed: the source removes v1 and adds v2.
        w.update_pod(&new, static_pod("v2"), UpdateType::Create);
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert!(
            !rec.calls().iter().any(|(_, v)| v == "v2"),
            "v2 synced while v1 runs: {:?}",
            rec.calls()
        );
        // v3 comes and goes before it could start.
        w.update_pod(&newer, static_pod("v3"), UpdateType::Create);
        w.update_pod(
            &newer,
            static_pod("v3"),
            UpdateType::Kill {
                grace_seconds: None,
            },
        );
        w.update_pod(
            &old,
            static_pod("v1"),
            UpdateType::Kill {
                grace_seconds: None,
            },
        );
        let mut finished = Vec::new();
        for _ in 0..2 {
            finished.push(
                tokio::time::timeout(Duration::from_secs(5), done.recv())
                    .await
                    .unwrap()
                    .unwrap(),
            );
        }
        finished.sort_by_key(|u| u.to_string());
        assert_eq!(finished, [old.clone(), newer.clone()]);
        while !rec.calls().iter().any(|(_, v)| v == "v2") {
            tokio::time::timeout(Duration::from_secs(5), rec.notify.notified())
                .await
                .unwrap();
        }
        let calls: Vec<String> = rec
            .calls()
            .into_iter()
            .map(|(c, v)| format!("{c} {v}"))
            .collect();
        let v1_done = calls.iter().position(|c| c == "terminated v1").unwrap();
        let v2_first = calls.iter().position(|c| c.ends_with(" v2")).unwrap();
        assert!(v1_done < v2_first, "{calls:?}");
        assert!(!calls.iter().any(|c| c.ends_with(" v3")), "{calls:?}");
        assert_eq!(w.state(&newer), Some(WorkerState::Done));
        w.shutdown();
    }

    /// `calculateEffectiveGracePeriod`: a kill with grace 0 (a force
    /// deletion, a pod whose spec says 0) gives 1 s.
    #[tokio::test(start_paused = true)]
    async fn a_kill_never_gives_less_than_one_second() {
        for (spec, kill, want) in [
            (Some(0), None, "terminating(1)"),
            (Some(30), Some(0), "terminating(1)"),
            (Some(30), Some(5), "terminating(5)"),
        ] {
            let rec = Arc::new(Recorder::default());
            let (w, mut done) = workers(rec.clone());
            w.update_pod(&uid(), pod("p", spec), UpdateType::Create);
            w.update_pod(
                &uid(),
                pod("p", spec),
                UpdateType::Kill {
                    grace_seconds: kill,
                },
            );
            tokio::time::timeout(Duration::from_secs(5), done.recv())
                .await
                .unwrap()
                .unwrap();
            let calls: Vec<String> = rec.calls().into_iter().map(|(c, _)| c).collect();
            assert!(
                calls.iter().any(|c| c == want),
                "spec {spec:?}, kill {kill:?}: {calls:?}"
            );
        }
    }

    async fn settle() {
        // Let spawned workers run (paused time auto-advances when all are idle).
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn updates_are_coalesced_latest_wins() {
        let rec = Arc::new(Recorder::default());
        let (w, _done) = workers(rec.clone());
        w.update_pod(&uid(), pod("v1", None), UpdateType::Create);
        w.update_pod(&uid(), pod("v2", None), UpdateType::Update);
        w.update_pod(&uid(), pod("v3", None), UpdateType::Update);
        settle().await;
        let calls = rec.calls();
        assert!(!calls.is_empty());
        assert_eq!(calls.last().unwrap(), &("sync".to_owned(), "v3".to_owned()));
        assert!(
            calls.len() <= 2,
            "three updates coalesced into at most two syncs: {calls:?}"
        );
        w.shutdown();
    }

    #[tokio::test(start_paused = true)]
    async fn kill_terminates_and_never_goes_back_to_sync() {
        let rec = Arc::new(Recorder::default());
        let (w, mut done) = workers(rec.clone());
        w.update_pod(&uid(), pod("v1", Some(30)), UpdateType::Create);
        settle().await;
        w.update_pod(
            &uid(),
            pod("v1", Some(30)),
            UpdateType::Kill {
                grace_seconds: Some(5),
            },
        );
        w.update_pod(&uid(), pod("v2", Some(30)), UpdateType::Update);
        let finished = tokio::time::timeout(Duration::from_secs(5), done.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(finished, uid());
        let calls: Vec<String> = rec.calls().into_iter().map(|(c, _)| c).collect();
        let first_term = calls
            .iter()
            .position(|c| c.starts_with("terminating"))
            .unwrap();
        assert_eq!(calls[first_term], "terminating(5)");
        assert!(calls[first_term..].iter().all(|c| c != "sync"), "{calls:?}");
        assert_eq!(calls.last().unwrap(), "terminated");
        // pod_worker_duration_seconds: the first sync is `create`, the two
        // termination steps are `kill` (the update that came with the kill too).
        let mut registry = prometheus_client::registry::Registry::with_prefix("evpleg");
        w.metrics().register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for (op, n) in [("create", 1), ("kill", 2)] {
            let line = format!(
                "evpleg_pod_worker_duration_seconds_count{{operation_type=\"{op}\"}} {n}\n"
            );
            assert!(text.contains(&line), "{line} in {text}");
        }
        assert!(!text.contains("operation_type=\"update\""), "{text}");
        // A terminated UID never restarts.
        w.update_pod(&uid(), pod("v3", None), UpdateType::Create);
        settle().await;
        assert_eq!(w.state(&uid()), Some(WorkerState::Done));
        assert!(!rec.calls().iter().any(|(_, n)| n == "v3"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_terminal_pod_terminates_by_itself_with_its_own_grace() {
        let rec = Arc::new(Recorder::default());
        rec.terminal_after.store(1, Ordering::SeqCst);
        let (w, mut done) = workers(rec.clone());
        w.update_pod(&uid(), pod("job", Some(7)), UpdateType::Create);
        tokio::time::timeout(Duration::from_secs(5), done.recv())
            .await
            .unwrap()
            .unwrap();
        let calls: Vec<String> = rec.calls().into_iter().map(|(c, _)| c).collect();
        assert_eq!(calls, ["sync", "terminating(7)", "terminated"]);
    }

    #[tokio::test(start_paused = true)]
    async fn errors_back_off_and_resync_happens() {
        let rec = Arc::new(Recorder::default());
        rec.fail_next.store(2, Ordering::SeqCst);
        let (w, _done) = workers_with_resync(rec.clone(), Duration::from_secs(60));
        let start = tokio::time::Instant::now();
        w.update_pod(&uid(), pod("v1", None), UpdateType::Create);
        // Three syncs: two failures, each followed by the kubelet's 10 s
        // back-off with up to 50 % jitter, then success.
        let mut at = Vec::new();
        while rec.calls().len() < 3 {
            tokio::time::timeout(Duration::from_secs(20), rec.notify.notified())
                .await
                .unwrap();
            at.push(start.elapsed());
        }
        for pair in at.windows(2) {
            let gap = pair[1] - pair[0];
            assert!(
                gap >= Duration::from_secs(10) && gap < Duration::from_secs(15),
                "retry {gap:?} after a failure: {at:?}"
            );
        }
        // Then the periodic resync (60 s here).
        let before = rec.calls().len();
        let synced = tokio::time::Instant::now();
        tokio::time::timeout(Duration::from_secs(61), rec.notify.notified())
            .await
            .unwrap();
        assert_eq!(rec.calls().len(), before + 1);
        assert!(
            synced.elapsed() >= Duration::from_secs(59),
            "{:?}",
            synced.elapsed()
        );
        w.shutdown();
    }

    /// A pod whose every sync fails and whose every failure makes a PLEG event
    /// (a refused sandbox the relist then lists): retries come at the
    /// kubelet's cadence, not at the events' rate; a new spec still syncs at
    /// once.
    #[tokio::test(start_paused = true)]
    async fn events_after_a_failed_sync_retry_at_the_relist_period_not_at_once() {
        let rec = Arc::new(Recorder::default());
        rec.fail_next.store(u32::MAX, Ordering::SeqCst);
        let (w, _done) = workers(rec.clone());
        let start = tokio::time::Instant::now();
        w.update_pod(&uid(), pod("v1", None), UpdateType::Create);
        // A PLEG event every 20 ms for 4.5 s.
        while start.elapsed() < Duration::from_millis(4_500) {
            w.update_pod(&uid(), pod("v1", None), UpdateType::Sync);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Failures at 0 s, then one a second (the relist period, before the
        // back-off's 10 s timer): 1, 2, 3, 4 s; the last event waits for 5 s.
        let syncs = rec.calls().len();
        assert!((5..=6).contains(&syncs), "{syncs} syncs in 4.5 s");
        // A new spec does not wait for the floor.
        let before = rec.calls().len();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(rec.calls().len(), before, "held meanwhile");
        let asked = tokio::time::Instant::now();
        w.update_pod(&uid(), pod("v2", None), UpdateType::Update);
        tokio::time::timeout(Duration::from_secs(5), rec.notify.notified())
            .await
            .unwrap();
        assert!(
            asked.elapsed() < Duration::from_millis(100),
            "{:?}",
            asked.elapsed()
        );
        assert_eq!(rec.calls().last().unwrap().1, "v2");
        w.shutdown();
    }

    #[tokio::test(start_paused = true)]
    async fn no_sync_before_the_first_full_relist() {
        let rec = Arc::new(Recorder::default());
        let pleg = FakePleg::new();
        pleg.spawn(false);
        let (w, _done) = workers_with(rec.clone(), &pleg);
        w.update_pod(&uid(), pod("v1", None), UpdateType::Create);
        // A pod relist alone does not release it: the node's first relist does.
        pleg.queue.request(uid());
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert!(rec.calls().is_empty(), "{:?}", rec.calls());
        pleg.cache.update_time(pleg.clock.now_ns() + 1);
        tokio::time::timeout(Duration::from_secs(5), rec.notify.notified())
            .await
            .unwrap();
        assert_eq!(rec.calls(), [("sync".to_owned(), "v1".to_owned())]);
        w.shutdown();
    }

    #[tokio::test(start_paused = true)]
    async fn never_syncs_on_a_view_older_than_its_last_sync() {
        let rec = Arc::new(Recorder::default());
        let pleg = FakePleg::new();
        pleg.spawn(true);
        // The PLEG answers no pod relist: the first sync runs on the first full
        // relist's view; an update after it must wait, asking again and again.
        pleg.answer.store(false, Ordering::SeqCst);
        let (w, _done) = workers_with(rec.clone(), &pleg);
        w.update_pod(&uid(), pod("v1", None), UpdateType::Create);
        tokio::time::timeout(Duration::from_secs(5), rec.notify.notified())
            .await
            .unwrap();
        let asked = pleg.requests.load(Ordering::SeqCst);
        w.update_pod(&uid(), pod("v2", None), UpdateType::Update);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(rec.calls().len(), 1, "{:?}", rec.calls());
        assert!(
            pleg.requests.load(Ordering::SeqCst) >= asked + 10,
            "the worker keeps asking for a pod relist"
        );
        pleg.answer.store(true, Ordering::SeqCst);
        tokio::time::timeout(Duration::from_secs(5), rec.notify.notified())
            .await
            .unwrap();
        assert_eq!(rec.calls().last().unwrap().1, "v2");
        w.shutdown();
    }

    /// Workers on `pleg` (its first relist done, a resync a minute) whose
    /// pod `v1` has synced once.
    async fn synced_once(
        rec: &Arc<Recorder>,
        pleg: &FakePleg,
    ) -> (PodWorkers<Recorder>, mpsc::UnboundedReceiver<PodUid>) {
        pleg.spawn(true);
        let (w, done) = workers_configured(rec.clone(), pleg, Duration::from_secs(60));
        w.update_pod(&uid(), pod("v1", None), UpdateType::Create);
        tokio::time::timeout(Duration::from_secs(5), rec.notify.notified())
            .await
            .unwrap();
        (w, done)
    }

    /// The floor moves with the runtime calls: a sync that called the runtime
    /// is followed by one pod relist and the next sync waits for it; a steady
    /// pod's resyncs call nothing, ask nothing of the PLEG, and act on the
    /// view taken after the last calls.
    #[tokio::test(start_paused = true)]
    async fn only_a_sync_that_called_the_runtime_asks_for_a_relist() {
        for (idle, relists_per_resync) in [(false, 1), (true, 0)] {
            let rec = Arc::new(Recorder::default());
            let pleg = FakePleg::new();
            let (w, _done) = synced_once(&rec, &pleg).await;
            rec.idle.store(idle, Ordering::SeqCst);
            settle().await;
            let asked = pleg.requests.load(Ordering::SeqCst);
            // Three resyncs.
            for _ in 0..3 {
                tokio::time::timeout(Duration::from_secs(61), rec.notify.notified())
                    .await
                    .unwrap();
                settle().await;
            }
            assert_eq!(rec.calls().len(), 4, "idle {idle}: {:?}", rec.calls());
            assert_eq!(
                pleg.requests.load(Ordering::SeqCst) - asked,
                3 * relists_per_resync,
                "pod relists asked over three resyncs, idle {idle}"
            );
            w.shutdown();
        }
    }

    /// A container waiting in CrashLoopBackOff: the worker syncs again at the
    /// back-off's expiry plus up to half of it at random, as the kubelet's
    /// `completeWork` requeues a back-off error (`wait.Jitter` 0.5). Without
    /// the jitter every wait is exactly the back-off.
    #[tokio::test(start_paused = true)]
    async fn a_crash_loop_back_off_requeues_at_its_expiry_with_the_kubelets_jitter() {
        let rec = Arc::new(Recorder::default());
        rec.idle.store(true, Ordering::SeqCst);
        *lock(&rec.backoff) = Some(Duration::from_secs(1));
        let pleg = FakePleg::new();
        let (w, _done) = synced_once(&rec, &pleg).await;
        let mut last = tokio::time::Instant::now();
        let mut waits = Vec::new();
        for _ in 0..20 {
            tokio::time::timeout(Duration::from_secs(5), rec.notify.notified())
                .await
                .unwrap();
            let now = tokio::time::Instant::now();
            waits.push(now - last);
            last = now;
        }
        let (shortest, longest) = (waits.iter().min().unwrap(), waits.iter().max().unwrap());
        assert!(*shortest >= Duration::from_secs(1), "{waits:?}");
        assert!(*longest <= Duration::from_millis(1500), "{waits:?}");
        // Twenty draws all under 1.05 s: one chance in 10^20.
        assert!(
            *longest > Duration::from_millis(1050),
            "no jitter: {waits:?}"
        );
        w.shutdown();
    }

    #[tokio::test(start_paused = true)]
    async fn an_inspection_error_is_a_failed_sync() {
        let rec = Arc::new(Recorder::default());
        let pleg = FakePleg::new();
        pleg.spawn(true);
        // Every pod relist fails from the start: the first sync runs on the
        // first full relist's view; the next sees the error.
        *lock(&pleg.error) = Some("ListContainers: unavailable".into());
        let (w, _done) = workers_with(rec.clone(), &pleg);
        w.update_pod(&uid(), pod("v1", None), UpdateType::Create);
        tokio::time::timeout(Duration::from_secs(5), rec.notify.notified())
            .await
            .unwrap();
        w.update_pod(&uid(), pod("v2", None), UpdateType::Update);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(rec.calls().len(), 1, "the syncer is not called on an error");
        *lock(&pleg.error) = None;
        // Retried with back-off, then synced on the good status.
        tokio::time::timeout(Duration::from_secs(60), rec.notify.notified())
            .await
            .unwrap();
        assert_eq!(rec.calls().last().unwrap().1, "v2");
        w.shutdown();
    }
}
