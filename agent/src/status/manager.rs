//! The status manager: the only writer of pod status (the kubelet's
//! `pkg/kubelet/status/status_manager.go`).
//!
//! Pod workers hand it the status they generated; it keeps the newest per pod and
//! writes it through a [`StatusWriter`] (the API server or the local store). A
//! status equal to the last one handed in is not written again. A retryable
//! failure keeps the pod dirty and is retried with back-off (doubling from
//! 100 ms to 10 s); meanwhile newer statuses replace the pending one, so when the
//! destination returns the newest is written and nothing is lost.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, PodStatus as ApiPodStatus};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{StatusWriter, WriteError};
use crate::pleg::PodUid;

const RETRY_INITIAL: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Entry {
    pod: Arc<Pod>,
    status: ApiPodStatus,
    version: u64,
    written: u64,
    retry_delay: Duration,
    next_attempt: Option<Instant>,
    removed: bool,
}

/// Counters of the status manager.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StatusStats {
    pub writes: u64,
    pub unchanged: u64,
    pub retries: u64,
    pub dropped: u64,
}

/// The status manager.
#[derive(Debug, Default)]
pub struct StatusManager {
    entries: Mutex<HashMap<PodUid, Entry>>,
    stats: Mutex<StatusStats>,
    notify: Notify,
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl StatusManager {
    pub fn new() -> Self {
        Self::default()
    }

    /// Hands in a pod's newest status. Returns whether it differs from the last.
    pub fn set_pod_status(&self, uid: &PodUid, pod: Arc<Pod>, status: ApiPodStatus) -> bool {
        let mut entries = lock(&self.entries);
        let unchanged = entries.get(uid).is_some_and(|e| e.status == status);
        if !unchanged {
            info!(
                pod = pod.metadata.name.as_deref().unwrap_or("-"),
                phase = status.phase.as_deref().unwrap_or("-"),
                containers = %summary(&status),
                "pod status"
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

    /// The pod was removed from the node: forget it once its last status is out.
    pub fn remove(&self, uid: &PodUid) {
        if let Some(e) = lock(&self.entries).get_mut(uid) {
            e.removed = true;
        }
        self.notify.notify_one();
    }

    pub fn stats(&self) -> StatusStats {
        *lock(&self.stats)
    }

    /// Whether every status handed in was written.
    pub fn all_written(&self) -> bool {
        lock(&self.entries).values().all(|e| e.written == e.version)
    }

    /// Writes dirty statuses through `writer` until `shutdown`.
    pub async fn run<W: StatusWriter>(self: Arc<Self>, writer: W, shutdown: CancellationToken) {
        loop {
            let now = Instant::now();
            // Pick what is due: dirty and not waiting for a retry.
            let mut due = Vec::new();
            let mut next: Option<Instant> = None;
            let mut forget = Vec::new();
            {
                let entries = lock(&self.entries);
                for (uid, e) in entries.iter() {
                    if e.written == e.version {
                        if e.removed {
                            forget.push((uid.clone(), e.pod.clone()));
                        }
                        continue;
                    }
                    match e.next_attempt {
                        Some(t) if t > now => next = Some(next.map_or(t, |n| n.min(t))),
                        _ => due.push((uid.clone(), e.pod.clone(), e.status.clone(), e.version)),
                    }
                }
            }
            for (uid, pod) in forget {
                writer.forget(&pod).await;
                lock(&self.entries).remove(&uid);
            }
            for (uid, pod, status, version) in due {
                let result = writer.write(&pod, &status).await;
                let mut entries = lock(&self.entries);
                let Some(e) = entries.get_mut(&uid) else {
                    continue;
                };
                match result {
                    Ok(()) => {
                        e.written = e.written.max(version);
                        e.retry_delay = RETRY_INITIAL;
                        e.next_attempt = None;
                        lock(&self.stats).writes += 1;
                        debug!(pod = %uid, phase = ?status.phase, "pod status written");
                    }
                    Err(WriteError::Retryable { .. }) => {
                        let delay = e.retry_delay;
                        e.next_attempt = Some(Instant::now() + delay);
                        e.retry_delay = (delay * 2).min(RETRY_MAX);
                        lock(&self.stats).retries += 1;
                        if let Err(err) = result {
                            warn!(pod = %uid, error = %err, retry_in_ms = delay.as_millis() as u64, "status write failed; the newest status will be retried");
                        }
                        next = Some(
                            next.map_or(Instant::now() + delay, |n| n.min(Instant::now() + delay)),
                        );
                    }
                    Err(err @ WriteError::Permanent { .. }) => {
                        e.written = e.version;
                        lock(&self.stats).dropped += 1;
                        warn!(pod = %uid, error = %err, "status write failed for good");
                    }
                }
            }
            let wait = async {
                match next {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = self.notify.notified() => {}
                () = wait => {}
            }
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
}
