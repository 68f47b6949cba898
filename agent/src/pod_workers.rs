//! Pod workers: one task per pod UID that serialises everything done to that pod,
//! the kubelet's `pod_workers.go`.
//!
//! A worker moves through `Sync` -> `Terminating` -> `Terminated` -> done:
//! * updates that arrive while it is busy are coalesced: the latest pod wins;
//! * a kill moves it to `Terminating`, and a terminating pod never goes back to
//!   sync; the shortest grace period asked for wins;
//! * a pod whose sync finds it terminal (restartPolicy Never/OnFailure, done)
//!   terminates by itself;
//! * once terminated, its UID is never started again;
//! * before each sync the worker waits (bounded) for a pod status cache entry
//!   newer than the end of its previous sync (the kubelet's `GetNewerThan`);
//!   after a sync that did runtime work it asks the PLEG to relist the pod at
//!   once (the kubelet's on-demand relist), so that wait ends in milliseconds;
//! * errors back off (doubling, capped); a sync may ask to be requeued (a
//!   container in CrashLoopBackOff) and every worker resyncs periodically.
//!
//! Differences: no separate "terminating runtime pods" without a spec (orphans are
//! the sync loop's housekeeping); the cache wait is bounded ([`WorkerConfig`]).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::clock::SharedClock;
use crate::pleg::PodUid;
use crate::pleg::cache::{CacheEntry, PodStatusCache};

/// What a sync asks of its worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncResult {
    /// The pod reached a terminal phase: terminate it.
    pub terminal: bool,
    /// Sync again after this (a container waiting in CrashLoopBackOff).
    pub requeue_after: Option<Duration>,
    /// The sync changed the runtime: relist the pod now.
    pub did_runtime_work: bool,
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
    /// The longest wait for a cache entry newer than the last sync.
    pub cache_wait: Duration,
    pub error_backoff_initial: Duration,
    pub error_backoff_max: Duration,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            resync: Duration::from_secs(10),
            cache_wait: Duration::from_secs(2),
            error_backoff_initial: Duration::from_millis(500),
            error_backoff_max: Duration::from_secs(30),
        }
    }
}

#[derive(Debug)]
struct Shared {
    pod: Arc<Pod>,
    state: WorkerState,
    grace_seconds: i64,
    /// An update arrived since the worker last looked.
    pending: bool,
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
    pod_relist: Option<mpsc::UnboundedSender<PodUid>>,
    config: WorkerConfig,
    workers: Mutex<HashMap<PodUid, Worker>>,
    finished: Arc<Mutex<HashSet<PodUid>>>,
    done: mpsc::UnboundedSender<PodUid>,
}

impl<S> std::fmt::Debug for PodWorkers<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodWorkers")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
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
        pod_relist: Option<mpsc::UnboundedSender<PodUid>>,
        config: WorkerConfig,
        done: mpsc::UnboundedSender<PodUid>,
    ) -> Self {
        Self {
            syncer,
            cache,
            clock,
            pod_relist,
            config,
            workers: Mutex::new(HashMap::new()),
            finished: Arc::new(Mutex::new(HashSet::new())),
            done,
        }
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
            if let UpdateType::Kill { grace_seconds } = kind {
                let grace = grace_seconds.unwrap_or_else(|| spec_grace_seconds(&s.pod));
                if s.state == WorkerState::Sync {
                    s.state = WorkerState::Terminating;
                    s.grace_seconds = grace;
                } else {
                    s.grace_seconds = s.grace_seconds.min(grace);
                }
            }
            s.pending = true;
            drop(s);
            w.notify.notify_one();
            return;
        }
        let (state, grace_seconds) = match kind {
            UpdateType::Kill { grace_seconds } => (
                WorkerState::Terminating,
                grace_seconds.unwrap_or_else(|| spec_grace_seconds(&pod)),
            ),
            _ => (WorkerState::Sync, spec_grace_seconds(&pod)),
        };
        let shared = Arc::new(Mutex::new(Shared {
            pod,
            state,
            grace_seconds,
            pending: true,
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

    /// UIDs with a live worker.
    pub fn known(&self) -> Vec<PodUid> {
        lock(&self.workers).keys().cloned().collect()
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

struct WorkerLoop<S> {
    uid: PodUid,
    shared: Arc<Mutex<Shared>>,
    notify: Arc<Notify>,
    syncer: Arc<S>,
    cache: Arc<PodStatusCache>,
    clock: SharedClock,
    pod_relist: Option<mpsc::UnboundedSender<PodUid>>,
    config: WorkerConfig,
    finished: Arc<Mutex<HashSet<PodUid>>>,
    done: mpsc::UnboundedSender<PodUid>,
}

impl<S: PodSyncer> WorkerLoop<S> {
    async fn run(self) {
        let mut last_sync_ns = 0u64;
        let mut errors = 0u32;
        let mut requeue = tokio::time::Instant::now() + self.config.resync;
        loop {
            let woken_by_update = tokio::select! {
                () = self.notify.notified() => true,
                () = tokio::time::sleep_until(requeue) => false,
            };
            let (pod, state, grace) = {
                let mut s = lock(&self.shared);
                s.pending = false;
                (s.pod.clone(), s.state, s.grace_seconds)
            };
            // A status newer than our last sync, unless only the timer woke us.
            let entry = if woken_by_update && last_sync_ns > 0 {
                match tokio::time::timeout(
                    self.config.cache_wait,
                    self.cache.get_newer_than(&self.uid, last_sync_ns),
                )
                .await
                {
                    Ok(e) => e,
                    Err(_) => {
                        debug!(pod = %self.uid, "no newer pod status within the cache wait; syncing with the cached one");
                        self.cached()
                    }
                }
            } else {
                self.cached()
            };
            let outcome: Result<Option<Duration>, SyncError> = match state {
                WorkerState::Sync => match self.syncer.sync_pod(pod, entry).await {
                    Ok(r) => {
                        if r.did_runtime_work {
                            self.relist_now();
                        }
                        if r.terminal {
                            let mut s = lock(&self.shared);
                            if s.state == WorkerState::Sync {
                                s.state = WorkerState::Terminating;
                            }
                            Ok(Some(Duration::ZERO))
                        } else {
                            Ok(r.requeue_after)
                        }
                    }
                    Err(e) => Err(e),
                },
                WorkerState::Terminating => {
                    match self.syncer.sync_terminating_pod(pod, entry, grace).await {
                        Ok(()) => {
                            self.relist_now();
                            lock(&self.shared).state = WorkerState::Terminated;
                            Ok(Some(Duration::ZERO))
                        }
                        Err(e) => Err(e),
                    }
                }
                WorkerState::Terminated => {
                    match self.syncer.sync_terminated_pod(pod, entry).await {
                        Ok(()) => {
                            lock(&self.shared).state = WorkerState::Done;
                            lock(&self.finished).insert(self.uid.clone());
                            let _ = self.done.send(self.uid.clone());
                            return;
                        }
                        Err(e) => Err(e),
                    }
                }
                WorkerState::Done => return,
            };
            // The kubelet's lastSyncTime: the *end* of this sync. The next sync
            // waits for an observation made after it (a relist whose listing began
            // after our runtime calls), so it never acts on a status from before them.
            last_sync_ns = self.clock.now_ns();
            let delay = match outcome {
                Ok(after) => {
                    errors = 0;
                    after.unwrap_or(self.config.resync).min(self.config.resync)
                }
                Err(e) => {
                    errors = errors.saturating_add(1);
                    let backoff = self
                        .config
                        .error_backoff_initial
                        .saturating_mul(1 << errors.min(16).saturating_sub(1))
                        .min(self.config.error_backoff_max);
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

    fn cached(&self) -> CacheEntry {
        self.cache.get(&self.uid).unwrap_or_else(|| CacheEntry {
            status: Arc::default(),
            observed_ns: 0,
            error: None,
        })
    }

    fn relist_now(&self) {
        if let Some(tx) = &self.pod_relist {
            let _ = tx.send(self.uid.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;
    use crate::clock::ManualClock;

    #[derive(Debug, Default)]
    struct Recorder {
        calls: Mutex<Vec<(String, String)>>,
        terminal_after: AtomicU32,
        fail_next: AtomicU32,
        notify: Notify,
    }

    impl Recorder {
        fn record(&self, what: &str, pod: &Pod) {
            let name = pod.metadata.name.clone().unwrap_or_default();
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
                ..SyncResult::default()
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

    fn workers(rec: Arc<Recorder>) -> (PodWorkers<Recorder>, mpsc::UnboundedReceiver<PodUid>) {
        let (done, done_rx) = mpsc::unbounded_channel();
        let w = PodWorkers::new(
            rec,
            Arc::new(PodStatusCache::new()),
            Arc::new(ManualClock::new(1)),
            None,
            WorkerConfig {
                cache_wait: Duration::from_millis(1),
                ..WorkerConfig::default()
            },
            done,
        );
        (w, done_rx)
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
        let (w, _done) = workers(rec.clone());
        let start = tokio::time::Instant::now();
        w.update_pod(&uid(), pod("v1", None), UpdateType::Create);
        // Three syncs: two failures with 0.5 s and 1 s back-off, then success.
        while rec.calls().len() < 3 {
            tokio::time::timeout(Duration::from_secs(5), rec.notify.notified())
                .await
                .unwrap();
        }
        let elapsed = start.elapsed();
        assert!(
            elapsed >= Duration::from_millis(1500) && elapsed < Duration::from_secs(3),
            "{elapsed:?}"
        );
        // Then the periodic resync (10 s).
        let before = rec.calls().len();
        tokio::time::timeout(Duration::from_secs(11), rec.notify.notified())
            .await
            .unwrap();
        assert_eq!(rec.calls().len(), before + 1);
        w.shutdown();
    }
}
