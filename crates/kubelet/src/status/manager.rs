//! The status manager: the only writer of pod status (the kubelet's
//! `pkg/kubelet/status/status_manager.go`).
//!
//! Pod workers hand it the status they generated; it keeps the newest per pod and
//! writes it through a [`StatusWriter`] (the API server or the local store):
//! concurrently across pods, one operation at a time per pod, so a pod whose
//! write hangs does not hold back the others. A
//! status equal to the last one handed in is not written again. A retryable
//! failure keeps the pod dirty and is retried with back-off (doubling from
//! 100 ms to 10 s); meanwhile newer statuses replace the pending one, so when the
//! destination returns the newest is written and nothing is lost. A write
//! the Node authorizer refuses (the pod not bound to this node in its graph:
//! not yet, or no longer) is retried the same way while the pod is on the
//! node, and given up once it was removed.
//!
//! Terminal states are final ([`super::finish`]): a status that would move a pod
//! out of `Succeeded`/`Failed`, or a container that terminated for good back to
//! another state, is refused, logged and counted. A pod's `startTime` is set
//! once: the first one handed in (or the API server's) is kept. Once a pod's
//! worker finished ([`StatusManager::pod_finished`]) and the pod is being deleted
//! with a terminal status written, the manager deletes it for good through
//! [`StatusWriter::delete`] and forgets it (the kubelet's `canBeDeleted` path),
//! once: a late `pod_finished` for a pod deleted for good (an update of the pod
//! from its source, queued before the deletion) does not queue a second
//! delete (it did, found by `fidelity::a_gracefully_deleted_api_pod_is_deleted_once_its_containers_stopped`
//! in CI: the second answered 404).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use k8s_openapi::api::core::v1::{Pod, PodStatus as ApiPodStatus};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{StatusWriter, WriteError, finish};
use evpleg_core::ids::PodUid;

const RETRY_INITIAL: Duration = Duration::from_millis(100);
/// Pods whose operation is in flight at once.
pub const MAX_IN_FLIGHT: usize = 32;
const RETRY_MAX: Duration = Duration::from_secs(10);
/// At shutdown, pending statuses are written for at most this long.
pub const FLUSH_BOUND: Duration = Duration::from_secs(5);
/// How many pods deleted for good are remembered, so that none is deleted
/// twice (a UID is never reused; the oldest are forgotten).
const DELETED_KEPT: usize = 1024;

/// What is done for one pod.
#[derive(Debug)]
enum Op {
    Write {
        version: u64,
        status: Box<ApiPodStatus>,
    },
    Delete,
    Forget,
}

/// An operation done, with its outcome.
#[derive(Debug)]
struct Done {
    uid: PodUid,
    pod: Arc<Pod>,
    op: Op,
    result: Result<(), WriteError>,
}

#[derive(Debug)]
struct Entry {
    pod: Arc<Pod>,
    status: ApiPodStatus,
    version: u64,
    written: u64,
    retry_delay: Duration,
    next_attempt: Option<Instant>,
    removed: bool,
    /// The pod's worker finished terminating (the kubelet's `podIsFinished`).
    finished: bool,
}

/// Counters of the status manager.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StatusStats {
    pub writes: u64,
    pub unchanged: u64,
    pub retries: u64,
    pub dropped: u64,
    /// Statuses refused because they moved a pod out of a terminal phase.
    pub illegal_transitions: u64,
    /// Gracefully deleted pods deleted for good after they terminated.
    pub deleted: u64,
}

/// The status manager.
#[derive(Debug, Default)]
pub struct StatusManager {
    entries: Mutex<HashMap<PodUid, Entry>>,
    /// The last [`DELETED_KEPT`] pods deleted for good, oldest first.
    deleted: Mutex<VecDeque<PodUid>>,
    /// Pods the agent is ending on its own (preempted for a critical pod):
    /// the status their every sync publishes says so.
    evictions: Mutex<HashMap<PodUid, Eviction>>,
    stats: Mutex<StatusStats>,
    notify: Notify,
    /// `pod_start_duration_seconds` and `pod_start_sli_duration_seconds`.
    pub start_latency: super::start_latency::StartLatency,
}

/// `name=state(restarts)` for each container, for the log.
fn summary(status: &ApiPodStatus) -> String {
    let all = status
        .init_container_statuses
        .iter()
        .flatten()
        .chain(status.container_statuses.iter().flatten());
    all.map(|c| {
        let st = c.state.clone().unwrap_or_default();
        let state = if st.running.is_some() {
            "running".to_owned()
        } else if let Some(t) = st.terminated {
            format!(
                "terminated:{}:{}",
                t.reason.unwrap_or_default(),
                t.exit_code
            )
        } else if let Some(w) = st.waiting {
            format!("waiting:{}", w.reason.unwrap_or_default())
        } else {
            "unknown".to_owned()
        };
        format!("{}={state}({})", c.name, c.restart_count)
    })
    .collect::<Vec<_>>()
    .join(" ")
}

/// A pod the agent ends on its own, as the kubelet's `killPodFunc` with a
/// status function: its status's reason and message (phase Failed), and the
/// reason and message of the `DisruptionTarget` condition it adds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Eviction {
    pub reason: &'static str,
    pub message: &'static str,
    pub disruption: (&'static str, &'static str),
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl StatusManager {
    pub fn new() -> Self {
        Self::default()
    }

    /// Hands in a pod's newest status. Returns whether it differs from the last
    /// (`false` also for a status refused because it leaves a terminal phase).
    pub fn set_pod_status(&self, uid: &PodUid, pod: Arc<Pod>, mut status: ApiPodStatus) -> bool {
        let mut entries = lock(&self.entries);
        // The start time is set once (the kubelet's status manager keeps the
        // first one it had, or the API server's).
        let first_start = entries
            .get(uid)
            .map(|e| &e.status)
            .or(pod.status.as_ref())
            .and_then(|s| s.start_time.clone());
        if first_start.is_some() {
            status.start_time = first_start;
        }
        // A condition's lastTransitionTime moves only when its status does
        // (the kubelet's status manager).
        let old_conditions = entries
            .get(uid)
            .map(|e| &e.status)
            .or(pod.status.as_ref())
            .and_then(|s| s.conditions.clone())
            .unwrap_or_default();
        for c in status.conditions.iter_mut().flatten() {
            let same = old_conditions
                .iter()
                .find(|o| o.type_ == c.type_ && o.status == c.status);
            let now = || {
                k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::now(),
                )
            };
            c.last_transition_time = Some(
                same.and_then(|o| o.last_transition_time.clone())
                    .unwrap_or_else(now),
            );
        }
        let unchanged = entries.get(uid).is_some_and(|e| e.status == status);
        if !unchanged {
            let last = entries.get(uid).and_then(|e| e.status.phase.as_deref());
            let api = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            if let Some(from) = finish::illegal_transition(api, last, status.phase.as_deref()) {
                warn!(
                    pod = pod.metadata.name.as_deref().unwrap_or("-"),
                    namespace = pod.metadata.namespace.as_deref().unwrap_or("-"),
                    %uid,
                    from,
                    to = status.phase.as_deref().unwrap_or("-"),
                    "status refused: a pod never leaves a terminal phase"
                );
                lock(&self.stats).illegal_transitions += 1;
                return false;
            }
            let old = entries.get(uid).map(|e| &e.status).or(pod.status.as_ref());
            if let Some(container) = old.and_then(|old| {
                finish::illegal_container_transition(old, &status, pod.spec.as_ref())
            }) {
                warn!(
                    pod = pod.metadata.name.as_deref().unwrap_or("-"),
                    namespace = pod.metadata.namespace.as_deref().unwrap_or("-"),
                    %uid,
                    container,
                    "status refused: a terminated container never leaves the terminated state"
                );
                lock(&self.stats).illegal_transitions += 1;
                return false;
            }
            info!(
                pod = pod.metadata.name.as_deref().unwrap_or("-"),
                phase = status.phase.as_deref().unwrap_or("-"),
                containers = %summary(&status),
                "pod status"
            );
            evpleg_pleg::stages::status_held(&status);
        }
        if !unchanged {
            let last = entries.get(uid).and_then(|e| e.status.phase.as_deref());
            self.start_latency.accepted(
                uid,
                &pod,
                last,
                &status,
                evpleg_core::clock::wall_clock_ns(),
            );
        }
        if let Some(e) = entries.get_mut(uid) {
            e.pod = pod;
            if unchanged {
                lock(&self.stats).unchanged += 1;
                return false;
            }
            e.status = status;
            e.version += 1;
        } else {
            entries.insert(
                uid.clone(),
                Entry {
                    pod,
                    status,
                    version: 1,
                    written: 0,
                    retry_delay: RETRY_INITIAL,
                    next_attempt: None,
                    removed: false,
                    finished: false,
                },
            );
        }
        drop(entries);
        self.notify.notify_one();
        true
    }

    /// The last status handed in for a pod.
    pub fn get_pod_status(&self, uid: &PodUid) -> Option<ApiPodStatus> {
        lock(&self.entries).get(uid).map(|e| e.status.clone())
    }

    /// The agent ends `uid` on its own: every status published for it from
    /// now on says `eviction` (`crate::kuberuntime`'s `publish`).
    pub fn evict(&self, uid: &PodUid, eviction: Eviction) {
        lock(&self.evictions).insert(uid.clone(), eviction);
    }

    /// How the agent ends `uid`, if it does ([`Self::evict`]).
    pub fn eviction(&self, uid: &PodUid) -> Option<Eviction> {
        lock(&self.evictions).get(uid).copied()
    }

    /// The pod was removed from the node: forget it once its last status is out.
    pub fn remove(&self, uid: &PodUid) {
        lock(&self.evictions).remove(uid);
        self.start_latency.forget(uid);
        if let Some(e) = lock(&self.entries).get_mut(uid) {
            e.removed = true;
        }
        self.notify.notify_one();
    }

    /// The pod's worker finished terminating (containers stopped, sandboxes
    /// gone): a pod being deleted can now be deleted for good. `pod` is the
    /// newest object from its source (with its `deletionTimestamp`). A pod with
    /// no status here yet is remembered with the status its source has, when it
    /// is being deleted.
    pub fn pod_finished(&self, uid: &PodUid, pod: Arc<Pod>) {
        let mut entries = lock(&self.entries);
        match entries.get_mut(uid) {
            Some(e) => {
                e.finished = true;
                e.pod = pod;
            }
            None if pod.metadata.deletion_timestamp.is_some()
                && !lock(&self.deleted).contains(uid) =>
            {
                let status = pod.status.clone().unwrap_or_default();
                entries.insert(
                    uid.clone(),
                    Entry {
                        pod,
                        status,
                        version: 0,
                        written: 0,
                        retry_delay: RETRY_INITIAL,
                        next_attempt: None,
                        removed: false,
                        finished: true,
                    },
                );
            }
            None => return,
        }
        drop(entries);
        self.notify.notify_one();
    }

    /// Deletes a mirror pod whose static pod is not on the node (the
    /// kubelet's `deleteOrphanedMirrorPods`, at housekeeping: a manifest
    /// removed while the agent was down). Done through the writer's
    /// [`super::StatusWriter::forget`] of the static pod the mirror stands
    /// for (its `config.hash` is the mirror's `config.mirror`), which deletes
    /// the mirror pod only if it still carries that hash, with its UID as
    /// precondition. A mirror pod already queued is not queued again.
    pub fn delete_orphaned_mirror(&self, mirror: &Pod) {
        let Some(uid) = mirror.metadata.uid.as_deref().and_then(PodUid::parse) else {
            return;
        };
        let Some(hash) = mirror
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(crate::source::annotations::CONFIG_MIRROR))
            .cloned()
        else {
            return;
        };
        let mut entries = lock(&self.entries);
        if entries.contains_key(&uid) {
            return;
        }
        let mut gone = mirror.clone();
        let annotations = gone.metadata.annotations.get_or_insert_default();
        annotations.remove(crate::source::annotations::CONFIG_MIRROR);
        annotations.insert(crate::source::annotations::CONFIG_HASH.into(), hash);
        annotations.insert(
            crate::source::annotations::CONFIG_SOURCE.into(),
            crate::source::SourceName::File.as_str().into(),
        );
        info!(pod = ?mirror.metadata.name, namespace = ?mirror.metadata.namespace, %uid,
              "housekeeping: deleting an orphaned mirror pod (its static pod is not on the node)");
        entries.insert(
            uid,
            Entry {
                pod: Arc::new(gone),
                status: ApiPodStatus::default(),
                version: 0,
                written: 0,
                retry_delay: RETRY_INITIAL,
                next_attempt: None,
                removed: true,
                finished: false,
            },
        );
        drop(entries);
        self.notify.notify_one();
    }

    /// Forgets a pod at once, its pending status unwritten: the same UID starts
    /// again from scratch (a static pod restored after its manifest was removed).
    pub fn reset(&self, uid: &PodUid) {
        lock(&self.evictions).remove(uid);
        lock(&self.entries).remove(uid);
    }

    /// Whether the manager still holds a status for the pod.
    pub fn knows(&self, uid: &PodUid) -> bool {
        lock(&self.entries).contains_key(uid)
    }

    pub fn stats(&self) -> StatusStats {
        *lock(&self.stats)
    }

    /// Whether every status handed in was written.
    pub fn all_written(&self) -> bool {
        lock(&self.entries).values().all(|e| e.written == e.version)
    }

    /// Writes, deletes and forgets until `shutdown`, then flushes what is
    /// pending. Pods are served concurrently (at most [`MAX_IN_FLIGHT`] at a
    /// time), each pod's operations one after the other: a slow or hanging
    /// destination for one pod does not hold back another's status.
    pub async fn run<W: StatusWriter>(self: Arc<Self>, writer: W, shutdown: CancellationToken) {
        let mut in_flight: FuturesUnordered<BoxFuture<'_, Done>> = FuturesUnordered::new();
        let mut busy: HashSet<PodUid> = HashSet::new();
        loop {
            let next = self.start_due(&writer, &mut in_flight, &mut busy);
            let wait = async {
                match next {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                // A shutdown does not wait for operations in flight: the flush
                // writes the newest statuses within its bound.
                () = shutdown.cancelled() => break,
                Some(done) = in_flight.next(), if !in_flight.is_empty() => {
                    busy.remove(&done.uid);
                    self.complete(done);
                }
                () = self.notify.notified() => {}
                () = wait => {}
            }
        }
        drop(in_flight);
        self.flush(&writer).await;
    }

    /// Starts what is due for pods with nothing in flight: forget a removed
    /// pod whose last status is out, delete a finished one that can be
    /// deleted, write a dirty status. Returns when the next retry is due.
    fn start_due<'a, W: StatusWriter>(
        &self,
        writer: &'a W,
        in_flight: &mut FuturesUnordered<BoxFuture<'a, Done>>,
        busy: &mut HashSet<PodUid>,
    ) -> Option<Instant> {
        let now = Instant::now();
        let mut next: Option<Instant> = None;
        let mut later = |t: Instant| next = Some(next.map_or(t, |n: Instant| n.min(t)));
        let entries = lock(&self.entries);
        for (uid, e) in entries.iter() {
            if in_flight.len() >= MAX_IN_FLIGHT {
                break;
            }
            if busy.contains(uid) {
                continue;
            }
            let op = if e.written == e.version {
                if e.removed {
                    Op::Forget
                } else if finish::can_be_deleted(&e.pod, &e.status, e.finished) {
                    Op::Delete
                } else {
                    continue;
                }
            } else {
                Op::Write {
                    version: e.version,
                    status: Box::new(e.status.clone()),
                }
            };
            if !matches!(op, Op::Forget)
                && let Some(t) = e.next_attempt.filter(|t| *t > now)
            {
                later(t);
                continue;
            }
            busy.insert(uid.clone());
            let (uid, pod) = (uid.clone(), e.pod.clone());
            in_flight.push(Box::pin(async move {
                let result = match &op {
                    Op::Write { status, .. } => writer.write(&pod, status).await,
                    Op::Delete => {
                        let r = writer.delete(&pod).await;
                        if !matches!(r, Err(WriteError::Retryable { .. })) {
                            writer.forget(&pod).await;
                        }
                        r
                    }
                    Op::Forget => {
                        writer.forget(&pod).await;
                        Ok(())
                    }
                };
                Done {
                    uid,
                    pod,
                    op,
                    result,
                }
            }));
        }
        next
    }

    /// Records the outcome of an operation.
    fn complete(&self, done: Done) {
        let Done {
            uid,
            pod,
            op,
            result,
        } = done;
        let name = pod.metadata.name.as_deref().unwrap_or("-");
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("-");
        let mut entries = lock(&self.entries);
        let Some(e) = entries.get_mut(&uid) else {
            return;
        };
        let mut stats = lock(&self.stats);
        // Not bound to the node in the API server's view (`Unbound`): retried
        // while the pod is on the node (the authorizer's graph lags a new
        // binding), given up once it was removed (the object is gone).
        let retry = match &result {
            Err(WriteError::Retryable { .. }) => true,
            Err(WriteError::Unbound { .. }) => !e.removed,
            _ => false,
        };
        match (op, result) {
            (Op::Forget, _) => {
                if e.removed {
                    entries.remove(&uid);
                }
            }
            (Op::Write { version, status }, Ok(())) => {
                e.written = e.written.max(version);
                e.retry_delay = RETRY_INITIAL;
                e.next_attempt = None;
                stats.writes += 1;
                debug!(pod = %uid, phase = ?status.phase, "pod status written");
            }
            (Op::Delete, Ok(())) => {
                info!(pod = name, namespace, %uid, "pod terminated and deleted from the API server");
                stats.deleted += 1;
                entries.remove(&uid);
                let mut deleted = lock(&self.deleted);
                if deleted.len() == DELETED_KEPT {
                    deleted.pop_front();
                }
                deleted.push_back(uid);
            }
            (op, Err(err)) if retry => {
                let delay = e.retry_delay;
                e.next_attempt = Some(Instant::now() + delay);
                e.retry_delay = (delay * 2).min(RETRY_MAX);
                stats.retries += 1;
                let what = match op {
                    Op::Delete => "deleting a terminated pod failed; retrying",
                    _ => "status write failed; the newest status will be retried",
                };
                warn!(pod = name, namespace, %uid, error = %err, retry_in_ms = delay.as_millis() as u64, "{what}");
            }
            (Op::Write { version, .. }, Err(err)) => {
                // This status will never be taken; a newer one still is tried.
                e.written = e.written.max(version);
                stats.dropped += 1;
                warn!(pod = name, namespace, %uid, error = %err, "status write failed for good");
            }
            (Op::Delete, Err(err)) => {
                warn!(pod = name, namespace, %uid, error = %err, "deleting a terminated pod failed for good; forgetting it");
                entries.remove(&uid);
            }
        }
    }

    /// Writes every pending status once (concurrently), retries ignored, within [`FLUSH_BOUND`]
    /// (at shutdown: what the workers last handed in goes out).
    async fn flush<W: StatusWriter>(&self, writer: &W) {
        let pending: Vec<_> = lock(&self.entries)
            .iter()
            .filter(|(_, e)| e.written != e.version)
            .map(|(uid, e)| (uid.clone(), e.pod.clone(), e.status.clone(), e.version))
            .collect();
        if pending.is_empty() {
            return;
        }
        let total = pending.len();
        let mut written = 0;
        let all = async {
            let mut writes = futures::stream::iter(pending)
                .map(|(uid, pod, status, version)| async move {
                    let ok = writer.write(&pod, &status).await.is_ok();
                    (uid, version, ok)
                })
                .buffer_unordered(MAX_IN_FLIGHT);
            while let Some((uid, version, ok)) = writes.next().await {
                if ok {
                    if let Some(e) = lock(&self.entries).get_mut(&uid) {
                        e.written = e.written.max(version);
                    }
                    lock(&self.stats).writes += 1;
                    written += 1;
                }
            }
        };
        let in_time = tokio::time::timeout(FLUSH_BOUND, all).await.is_ok();
        if written == total {
            info!(written, "pending pod statuses written at shutdown");
        } else {
            warn!(
                written,
                left = total - written,
                in_time,
                bound_ms = FLUSH_BOUND.as_millis() as u64,
                "not every pending pod status could be written at shutdown"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// A destination that can be switched off.
    #[derive(Debug, Default)]
    struct Flaky {
        down: AtomicBool,
        /// Refuses as the Node authorizer does a pod it does not see bound.
        unbound: AtomicBool,
        written: Mutex<Vec<(String, String)>>,
        attempts: Mutex<u32>,
        notify: Notify,
    }

    impl StatusWriter for Arc<Flaky> {
        async fn write(&self, pod: &Pod, status: &ApiPodStatus) -> Result<(), WriteError> {
            *lock(&self.attempts) += 1;
            let name = pod.metadata.name.clone().unwrap_or_default();
            let r = if self.down.load(Ordering::SeqCst) {
                Err(WriteError::Retryable {
                    pod: name,
                    message: "connection refused".into(),
                })
            } else if self.unbound.load(Ordering::SeqCst) {
                Err(WriteError::Unbound {
                    pod: name,
                    message: "no relationship found (403)".into(),
                })
            } else {
                lock(&self.written).push((name, status.phase.clone().unwrap_or_default()));
                Ok(())
            };
            self.notify.notify_waiters();
            r
        }

        async fn forget(&self, _pod: &Pod) {}
    }

    fn pod() -> Arc<Pod> {
        Arc::new(serde_json::from_value(serde_json::json!({"metadata": {"name": "p"}})).unwrap())
    }

    fn status(phase: &str) -> ApiPodStatus {
        ApiPodStatus {
            phase: Some(phase.into()),
            ..ApiPodStatus::default()
        }
    }

    fn uid() -> PodUid {
        PodUid::parse(&"a".repeat(32)).unwrap()
    }

    /// The whole fidelity corpus: a pod rejected at admission had its status
    /// written at once, the Node authorizer refused it (its graph had not
    /// seen the binding yet) and the status was dropped for good. A refusal
    /// is retried while the pod is on the node, as the kubelet retries; once
    /// the pod was removed it is final.
    #[tokio::test(start_paused = true)]
    async fn a_status_the_authorizer_refuses_is_retried_while_the_pod_is_on_the_node() {
        let m = Arc::new(StatusManager::new());
        let w = Arc::new(Flaky::default());
        w.unbound.store(true, Ordering::SeqCst);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(m.clone().run(w.clone(), shutdown.clone()));
        assert!(m.set_pod_status(&uid(), pod(), status("Failed")));
        tokio::time::sleep(Duration::from_secs(1)).await;
        let tries = *lock(&w.attempts);
        assert!(tries >= 3, "retried: {tries} attempts");
        w.unbound.store(false, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(*lock(&w.written), [("p".to_owned(), "Failed".to_owned())]);
        // Another pod, removed from the node: refused once, not retried.
        w.unbound.store(true, Ordering::SeqCst);
        let other = PodUid::parse(&"b".repeat(32)).unwrap();
        let before = *lock(&w.attempts);
        assert!(m.set_pod_status(&other, pod(), status("Failed")));
        m.remove(&other);
        tokio::time::sleep(Duration::from_secs(5)).await;
        let after = *lock(&w.attempts);
        assert!(
            after - before <= 1,
            "{} attempts after its removal",
            after - before
        );
        shutdown.cancel();
        task.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn unchanged_statuses_are_not_written_again() {
        let m = Arc::new(StatusManager::new());
        let w = Arc::new(Flaky::default());
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(m.clone().run(w.clone(), shutdown.clone()));
        assert!(m.set_pod_status(&uid(), pod(), status("Pending")));
        tokio::time::timeout(Duration::from_secs(1), w.notify.notified())
            .await
            .unwrap();
        assert!(!m.set_pod_status(&uid(), pod(), status("Pending")));
        assert!(m.set_pod_status(&uid(), pod(), status("Running")));
        tokio::time::timeout(Duration::from_secs(1), w.notify.notified())
            .await
            .unwrap();
        assert_eq!(lock(&w.written).len(), 2);
        assert_eq!(m.stats().unchanged, 1);
        shutdown.cancel();
        task.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn an_unreachable_destination_loses_nothing_and_gets_the_newest() {
        let m = Arc::new(StatusManager::new());
        let w = Arc::new(Flaky::default());
        w.down.store(true, Ordering::SeqCst);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(m.clone().run(w.clone(), shutdown.clone()));
        m.set_pod_status(&uid(), pod(), status("Pending"));
        tokio::time::timeout(Duration::from_secs(1), w.notify.notified())
            .await
            .unwrap();
        m.set_pod_status(&uid(), pod(), status("Running"));
        m.set_pod_status(&uid(), pod(), status("Failed"));
        // Several retries while down.
        while *lock(&w.attempts) < 4 {
            tokio::time::timeout(Duration::from_secs(30), w.notify.notified())
                .await
                .unwrap();
        }
        assert!(!m.all_written());
        w.down.store(false, Ordering::SeqCst);
        while lock(&w.written).is_empty() {
            tokio::time::timeout(Duration::from_secs(30), w.notify.notified())
                .await
                .unwrap();
        }
        assert_eq!(
            lock(&w.written).as_slice(),
            &[("p".to_owned(), "Failed".to_owned())]
        );
        assert!(m.all_written());
        assert!(m.stats().retries >= 3);
        shutdown.cancel();
        task.await.unwrap();
    }
    /// Records writes, deletes and forgets in order.
    #[derive(Debug, Default)]
    struct Ops {
        ops: Mutex<Vec<String>>,
        down: AtomicBool,
        notify: Notify,
    }

    impl StatusWriter for Arc<Ops> {
        async fn write(&self, _pod: &Pod, status: &ApiPodStatus) -> Result<(), WriteError> {
            let r = if self.down.load(Ordering::SeqCst) {
                Err(WriteError::Retryable {
                    pod: "p".into(),
                    message: "connection refused".into(),
                })
            } else {
                lock(&self.ops).push(format!(
                    "write {}",
                    status.phase.clone().unwrap_or_default()
                ));
                Ok(())
            };
            self.notify.notify_waiters();
            r
        }

        async fn forget(&self, _pod: &Pod) {
            lock(&self.ops).push("forget".into());
            self.notify.notify_waiters();
        }

        async fn delete(&self, _pod: &Pod) -> Result<(), WriteError> {
            lock(&self.ops).push("delete".into());
            self.notify.notify_waiters();
            Ok(())
        }
    }

    impl Ops {
        fn ops(&self) -> Vec<String> {
            lock(&self.ops).clone()
        }

        async fn wait_for(&self, n: usize) -> Vec<String> {
            tokio::time::timeout(Duration::from_secs(30), async {
                loop {
                    let notified = self.notify.notified();
                    if self.ops().len() >= n {
                        return self.ops();
                    }
                    notified.await;
                }
            })
            .await
            .unwrap_or_else(|_| panic!("fewer than {n} operations: {:?}", self.ops()))
        }
    }

    fn deleting_pod(api_phase: Option<&str>) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p", "namespace": "ns", "uid": "u1",
                             "deletionTimestamp": "2026-01-01T00:00:00Z"},
                "status": {"phase": api_phase},
            }))
            .unwrap(),
        )
    }

    #[test]
    fn a_status_never_leaves_a_terminal_phase() {
        let m = StatusManager::new();
        assert!(m.set_pod_status(&uid(), pod(), status("Running")));
        assert!(m.set_pod_status(&uid(), pod(), status("Failed")));
        assert!(!m.set_pod_status(&uid(), pod(), status("Running")));
        assert!(!m.set_pod_status(&uid(), pod(), status("Succeeded")));
        assert_eq!(
            m.get_pod_status(&uid()).unwrap().phase.as_deref(),
            Some("Failed")
        );
        assert_eq!(m.stats().illegal_transitions, 2);
        // The API server's terminal phase counts too (an agent restart: nothing
        // handed in yet).
        let other = PodUid::parse(&"b".repeat(32)).unwrap();
        let api_succeeded: Arc<Pod> = Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "q"}, "status": {"phase": "Succeeded"}
            }))
            .unwrap(),
        );
        assert!(!m.set_pod_status(&other, api_succeeded.clone(), status("Pending")));
        assert!(m.get_pod_status(&other).is_none());
        assert!(m.set_pod_status(&other, api_succeeded, status("Succeeded")));
        assert_eq!(m.stats().illegal_transitions, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_deleted_pod_is_deleted_once_finished_with_a_terminal_status_written() {
        let m = Arc::new(StatusManager::new());
        let w = Arc::new(Ops::default());
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(m.clone().run(w.clone(), shutdown.clone()));
        let pod = deleting_pod(Some("Running"));
        m.set_pod_status(&uid(), pod.clone(), status("Running"));
        m.set_pod_status(&uid(), pod.clone(), status("Failed"));
        // Terminal and written, but the worker has not finished: no delete.
        assert_eq!(w.wait_for(1).await.last().unwrap(), "write Failed");
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(w.ops(), ["write Failed"]);
        assert!(m.knows(&uid()));
        m.pod_finished(&uid(), pod);
        assert_eq!(w.wait_for(3).await, ["write Failed", "delete", "forget"]);
        assert!(!m.knows(&uid()));
        assert_eq!(m.stats().deleted, 1);
        shutdown.cancel();
        task.await.unwrap();
    }

    /// A `pod_finished` after the pod was deleted for good (an update from
    /// its source queued before the deletion) queues no second delete.
    #[tokio::test(start_paused = true)]
    async fn a_pod_deleted_for_good_is_not_deleted_again() {
        let m = Arc::new(StatusManager::new());
        let w = Arc::new(Ops::default());
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(m.clone().run(w.clone(), shutdown.clone()));
        let pod = deleting_pod(Some("Running"));
        m.set_pod_status(&uid(), pod.clone(), status("Succeeded"));
        m.pod_finished(&uid(), pod.clone());
        assert_eq!(w.wait_for(3).await, ["write Succeeded", "delete", "forget"]);
        m.pod_finished(&uid(), pod);
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(w.ops(), ["write Succeeded", "delete", "forget"]);
        assert_eq!(m.stats().deleted, 1);
        assert!(!m.knows(&uid()));
        shutdown.cancel();
        task.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_finished_pod_is_deleted_only_after_its_terminal_status_is_out() {
        let m = Arc::new(StatusManager::new());
        let w = Arc::new(Ops::default());
        w.down.store(true, Ordering::SeqCst);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(m.clone().run(w.clone(), shutdown.clone()));
        let pod = deleting_pod(Some("Running"));
        m.set_pod_status(&uid(), pod.clone(), status("Succeeded"));
        m.pod_finished(&uid(), pod);
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(w.ops().is_empty(), "{:?}", w.ops());
        w.down.store(false, Ordering::SeqCst);
        assert_eq!(w.wait_for(3).await, ["write Succeeded", "delete", "forget"]);
        shutdown.cancel();
        task.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_finished_pod_without_a_terminal_phase_or_a_deletion_stays() {
        let m = Arc::new(StatusManager::new());
        let w = Arc::new(Ops::default());
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(m.clone().run(w.clone(), shutdown.clone()));
        // Being deleted, but the last status is not terminal.
        m.set_pod_status(&uid(), deleting_pod(None), status("Running"));
        m.pod_finished(&uid(), deleting_pod(None));
        // Terminal, finished, but not being deleted.
        let other = PodUid::parse(&"b".repeat(32)).unwrap();
        m.set_pod_status(&other, pod(), status("Failed"));
        m.pod_finished(&other, pod());
        w.wait_for(2).await;
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(w.ops().len(), 2, "{:?}", w.ops());
        assert!(w.ops().iter().all(|o| o.starts_with("write")));
        // A pod finished before any status and deleted with a terminal API
        // phase (it was terminal when the agent started) is deleted too.
        let third = PodUid::parse(&"c".repeat(32)).unwrap();
        m.pod_finished(&third, deleting_pod(Some("Succeeded")));
        assert_eq!(&w.wait_for(4).await[2..], ["delete", "forget"]);
        shutdown.cancel();
        task.await.unwrap();
    }

    #[test]
    fn the_start_time_is_set_once() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let at = |secs| {
            Some(Time(
                k8s_openapi::jiff::Timestamp::from_second(secs).unwrap(),
            ))
        };
        let m = StatusManager::new();
        let with_start = |phase: &str, secs| ApiPodStatus {
            start_time: at(secs),
            ..status(phase)
        };
        m.set_pod_status(&uid(), pod(), with_start("Pending", 100));
        m.set_pod_status(&uid(), pod(), with_start("Running", 200));
        assert_eq!(m.get_pod_status(&uid()).unwrap().start_time, at(100));
        // After an agent restart: the API server's start time wins.
        let other = PodUid::parse(&"b".repeat(32)).unwrap();
        let api_pod: Arc<Pod> = Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "q"},
                "status": {"phase": "Running", "startTime": "1970-01-01T00:00:50Z"}
            }))
            .unwrap(),
        );
        m.set_pod_status(&other, api_pod, with_start("Running", 300));
        assert_eq!(m.get_pod_status(&other).unwrap().start_time, at(50));
    }

    #[tokio::test(start_paused = true)]
    async fn pending_statuses_are_flushed_at_shutdown_within_a_bound() {
        let m = Arc::new(StatusManager::new());
        let w = Arc::new(Flaky::default());
        w.down.store(true, Ordering::SeqCst);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(m.clone().run(w.clone(), shutdown.clone()));
        m.set_pod_status(&uid(), pod(), status("Running"));
        tokio::time::timeout(Duration::from_secs(1), w.notify.notified())
            .await
            .unwrap();
        // The destination is back; the retry is 100 ms away, the shutdown now.
        w.down.store(false, Ordering::SeqCst);
        shutdown.cancel();
        tokio::time::timeout(FLUSH_BOUND, task)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            lock(&w.written).as_slice(),
            &[("p".to_owned(), "Running".to_owned())]
        );
        assert!(m.all_written());
        // A destination that never answers: run returns within the bound.
        let m = Arc::new(StatusManager::new());
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(m.clone().run(Hang, shutdown.clone()));
        m.set_pod_status(&uid(), pod(), status("Running"));
        tokio::task::yield_now().await;
        let start = tokio::time::Instant::now();
        shutdown.cancel();
        tokio::time::timeout(FLUSH_BOUND * 2, task)
            .await
            .unwrap()
            .unwrap();
        assert!(
            start.elapsed() <= FLUSH_BOUND + Duration::from_millis(1),
            "{:?}",
            start.elapsed()
        );
        assert!(!m.all_written());
    }

    /// A destination that never answers.
    struct Hang;

    impl StatusWriter for Hang {
        async fn write(&self, _pod: &Pod, _status: &ApiPodStatus) -> Result<(), WriteError> {
            std::future::pending().await
        }

        async fn forget(&self, _pod: &Pod) {}
    }

    /// Hangs for the pod named "slow"; takes 10 ms for the others, counting
    /// how many writes of each pod, and of all pods, are in flight at once.
    #[derive(Debug, Default)]
    struct Concurrency {
        written: Mutex<Vec<(String, String)>>,
        in_flight: Mutex<HashMap<String, usize>>,
        max_per_pod: Mutex<usize>,
        max_total: Mutex<usize>,
        notify: Notify,
    }

    impl StatusWriter for Arc<Concurrency> {
        async fn write(&self, pod: &Pod, status: &ApiPodStatus) -> Result<(), WriteError> {
            let name = pod.metadata.name.clone().unwrap_or_default();
            if name == "slow" {
                std::future::pending::<()>().await;
            }
            {
                let mut f = lock(&self.in_flight);
                *f.entry(name.clone()).or_default() += 1;
                let per_pod = f[&name];
                let total: usize = f.values().sum();
                let mut m = lock(&self.max_per_pod);
                *m = (*m).max(per_pod);
                let mut t = lock(&self.max_total);
                *t = (*t).max(total);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            *lock(&self.in_flight).get_mut(&name).unwrap() -= 1;
            lock(&self.written).push((name, status.phase.clone().unwrap_or_default()));
            self.notify.notify_waiters();
            Ok(())
        }

        async fn forget(&self, _pod: &Pod) {}
    }

    fn named(name: &str) -> Arc<Pod> {
        Arc::new(serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap())
    }

    fn uid_n(n: u8) -> PodUid {
        PodUid::parse(&format!("{n:02x}").repeat(16)).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn pods_are_written_concurrently_each_pod_in_order() {
        let m = Arc::new(StatusManager::new());
        let w = Arc::new(Concurrency::default());
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(m.clone().run(w.clone(), shutdown.clone()));
        // A pod whose write never returns holds back no other pod.
        m.set_pod_status(&uid_n(0), named("slow"), status("Pending"));
        for n in 1..=5 {
            m.set_pod_status(&uid_n(n), named(&format!("p{n}")), status("Pending"));
        }
        // Newer statuses of the same pods arrive while their writes are in flight.
        tokio::time::sleep(Duration::from_millis(5)).await;
        for n in 1..=5 {
            m.set_pod_status(&uid_n(n), named(&format!("p{n}")), status("Running"));
        }
        let written = |w: &Concurrency| {
            lock(&w.written)
                .iter()
                .filter(|(_, phase)| phase == "Running")
                .count()
        };
        tokio::time::timeout(Duration::from_secs(10), async {
            while written(&w) < 5 {
                w.notify.notified().await;
            }
        })
        .await
        .expect("every fast pod's newest status written while another pod hangs");
        assert_eq!(*lock(&w.max_per_pod), 1, "one write per pod at a time");
        assert!(*lock(&w.max_total) > 1, "pods are written concurrently");
        // Each pod's statuses went out in order.
        for n in 1..=5 {
            let name = format!("p{n}");
            let phases: Vec<String> = lock(&w.written)
                .iter()
                .filter(|(p, _)| *p == name)
                .map(|(_, phase)| phase.clone())
                .collect();
            assert_eq!(
                phases.last().map(String::as_str),
                Some("Running"),
                "{name}: {phases:?}"
            );
        }
        shutdown.cancel();
        tokio::time::timeout(FLUSH_BOUND * 2, task)
            .await
            .unwrap()
            .unwrap();
    }
}
