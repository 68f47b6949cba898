//! Essential tasks and their health. The kubelet runs its loops (the sync
//! loop, the PLEG's relist, the status manager) as goroutines whose panic
//! ends the process, and the node's supervisor restarts it. Here each
//! essential loop is a tokio task: one that ends or panics before shutdown is
//! noticed at once, logged at error, counted
//! (`evpleg_essential_task_failures_total`) and makes `/healthz` fail, naming
//! the task, since when and why, so that the supervisor (systemd, the
//! kubelet-style liveness probe of a DaemonSet) restarts the agent. A task
//! that ends because of shutdown is not a failure.

use std::future::Future;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::error;

use crate::clock::SharedClock;

/// An essential task that stopped before shutdown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadTask {
    pub name: &'static str,
    /// Clock ns when it was noticed.
    pub since_ns: u64,
    /// "returned", or "panicked: <message>".
    pub reason: String,
}

/// The essential tasks that died.
#[derive(Debug)]
pub struct TaskHealth {
    clock: SharedClock,
    dead: Mutex<Vec<DeadTask>>,
    /// `evpleg_essential_task_failures_total`.
    pub failures: AtomicU64,
}

/// Aborts the task it holds when dropped (the supervisor was aborted).
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl TaskHealth {
    pub fn new(clock: SharedClock) -> Arc<Self> {
        Arc::new(Self {
            clock,
            dead: Mutex::new(Vec::new()),
            failures: AtomicU64::new(0),
        })
    }

    /// Spawns `task` as the essential task `name`. The returned handle ends
    /// when the task does; aborting it aborts the task.
    pub fn spawn<F>(
        self: &Arc<Self>,
        name: &'static str,
        shutdown: CancellationToken,
        task: F,
    ) -> JoinHandle<()>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let inner = tokio::spawn(task);
        let health = self.clone();
        // Owned by the supervisor's future from the start, so that aborting
        // the supervisor before its first poll aborts the task too.
        let abort = AbortOnDrop(inner.abort_handle());
        tokio::spawn(async move {
            let _abort = abort;
            let reason = match inner.await {
                Ok(()) => "returned".to_owned(),
                Err(e) if e.is_panic() => {
                    let payload = e.into_panic();
                    let message = payload
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| payload.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "(no message)".into());
                    format!("panicked: {message}")
                }
                Err(_) => "aborted".to_owned(),
            };
            if !shutdown.is_cancelled() {
                health.died(name, reason);
            }
        })
    }

    fn died(&self, name: &'static str, reason: String) {
        error!(task = name, %reason, "an essential task stopped: the agent is unhealthy");
        self.failures.fetch_add(1, Ordering::Relaxed);
        let since_ns = self.clock.now_ns();
        self.dead
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(DeadTask {
                name,
                since_ns,
                reason,
            });
    }

    /// The tasks that died, oldest first.
    pub fn dead(&self) -> Vec<DeadTask> {
        self.dead.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use std::time::Duration;

    fn health() -> Arc<TaskHealth> {
        TaskHealth::new(Arc::new(ManualClock::new(7)))
    }

    async fn ended(h: JoinHandle<()>) {
        tokio::time::timeout(Duration::from_secs(10), h)
            .await
            .expect("the supervisor ends with its task")
            .expect("the supervisor itself does not fail");
    }

    #[tokio::test]
    async fn a_task_that_panics_or_returns_before_shutdown_is_dead() {
        let h = health();
        let shutdown = CancellationToken::new();
        ended(h.spawn("sync loop", shutdown.clone(), async { panic!("boom") })).await;
        ended(h.spawn("status manager", shutdown.clone(), async {})).await;
        assert_eq!(
            h.dead(),
            [
                DeadTask {
                    name: "sync loop",
                    since_ns: 7,
                    reason: "panicked: boom".into()
                },
                DeadTask {
                    name: "status manager",
                    since_ns: 7,
                    reason: "returned".into()
                }
            ]
        );
        assert_eq!(h.failures.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn a_task_ending_at_shutdown_is_not_a_failure() {
        let h = health();
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        let handle = h.spawn("relist", shutdown.clone(), async move {
            token.cancelled().await;
        });
        shutdown.cancel();
        ended(handle).await;
        assert_eq!(h.dead(), []);
    }

    #[tokio::test]
    async fn aborting_the_handle_aborts_the_task() {
        let h = health();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let handle = h.spawn("forever", CancellationToken::new(), async move {
            let _tx = tx; // dropped when the task is aborted
            std::future::pending::<()>().await;
        });
        handle.abort();
        // The task's future was dropped: the sender is gone.
        assert!(
            tokio::time::timeout(Duration::from_secs(10), rx)
                .await
                .expect("the task was aborted")
                .is_err()
        );
    }
}
