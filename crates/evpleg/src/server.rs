//! The agent's HTTP endpoints, like the kubelet's read-only port: `/metrics`
//! (Prometheus), `/healthz` (PLEG health, the kubelet's "pleg was last seen active
//! ... ago" check), `/readyz`; and, as the kubelet's `pkg/kubelet/server`, its
//! authenticated HTTPS server ([`secure`]: [`tls`], [`auth`], [`x509`],
//! container logs read by [`logs`], exec, attach and port forwarding proxied
//! by [`streaming`], resource usage by [`stats`] and [`resource_metrics`]).

pub mod auth;
pub mod configz;
pub mod logs;
pub mod resource_metrics;
pub mod secure;
pub mod stats;
pub mod streaming;
pub mod tls;
pub mod x509;

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use crate::metrics::Metrics;
use evpleg_core::clock::SharedClock;
use evpleg_core::tasks::TaskHealth;
use evpleg_pleg::PathHealth;
use evpleg_pleg::relist::{GENERIC_PERIOD, RELIST_THRESHOLD, RelistStats};

/// What the endpoints read.
#[derive(Clone, Debug)]
pub struct ServerState {
    pub metrics: Arc<Metrics>,
    pub relist: Option<Arc<RelistStats>>,
    /// The kernel path's health, in `ebpf` mode.
    pub path: Option<Arc<PathHealth>>,
    pub clock: SharedClock,
    /// The essential tasks ([`evpleg_core::tasks`]): one that died fails `/healthz`.
    pub tasks: Vec<Arc<TaskHealth>>,
    /// The health threshold: at least the kubelet's 3 min, and twice the period.
    pub threshold: std::time::Duration,
}

impl ServerState {
    pub fn new(
        metrics: Arc<Metrics>,
        relist: Option<Arc<RelistStats>>,
        clock: SharedClock,
        period: std::time::Duration,
    ) -> Self {
        Self {
            metrics,
            relist,
            path: None,
            clock,
            tasks: Vec::new(),
            threshold: RELIST_THRESHOLD.max(period * 2),
        }
    }

    /// Fails `/healthz` when one of these essential tasks died.
    pub fn with_tasks(mut self, tasks: Vec<Arc<TaskHealth>>) -> Self {
        self.tasks = tasks;
        self
    }

    /// Also reports the kernel path's degradation on `/healthz`.
    pub fn with_path_health(mut self, path: Arc<PathHealth>) -> Self {
        self.path = Some(path);
        self
    }
}

async fn metrics(State(s): State<ServerState>) -> String {
    s.metrics.render()
}

/// The kubelet's PLEG health rule decides the status code, and an essential
/// task that died fails it too (naming the task, since when, why); a degraded
/// kernel path is reported in the body (which part, since when) but keeps
/// 200: the fallback relist keeps the agent correct (docs/pleg.md, contract
/// clause 5).
async fn healthz(State(s): State<ServerState>) -> (StatusCode, String) {
    health_report(&s)
}

/// What `/healthz` and `/readyz` answer.
pub fn health_report(s: &ServerState) -> (StatusCode, String) {
    let now = s.clock.now_ns();
    let dead: Vec<String> = s
        .tasks
        .iter()
        .flat_map(|t| t.dead())
        .map(|d| {
            format!(
                "essential task {} stopped {:.1}s ago ({})",
                d.name,
                std::time::Duration::from_nanos(now.saturating_sub(d.since_ns)).as_secs_f64(),
                d.reason
            )
        })
        .collect();
    let health = s
        .relist
        .as_ref()
        .map(|r| r.healthy(now, s.threshold))
        .unwrap_or(Ok(()))
        .and_then(|()| {
            if dead.is_empty() {
                Ok(())
            } else {
                Err(dead.join("\n"))
            }
        });
    let degraded = s.path.as_ref().and_then(|p| p.degraded()).map(|d| {
        format!(
            "kernel pleg degraded: {} stopped {:.1}s ago ({}); relisting every {}s\n",
            d.part,
            std::time::Duration::from_nanos(now.saturating_sub(d.since_ns)).as_secs_f64(),
            d.reason,
            GENERIC_PERIOD.as_secs()
        )
    });
    let degraded = degraded.unwrap_or_default();
    match health {
        Ok(()) => (StatusCode::OK, format!("ok\n{degraded}")),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("{e}\n{degraded}"),
        ),
    }
}

/// The router; more routes (`/pods`) are merged by the caller.
pub fn router(state: ServerState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(healthz))
        .with_state(state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use evpleg_core::clock::ManualClock;
    use std::sync::atomic::Ordering;
    use std::time::Duration;
    use tokio_util::sync::CancellationToken;

    use evpleg_core::cache::PodStatusCache;
    use evpleg_core::container::PodStatus;
    use evpleg_core::ids::{ContainerId, PodUid};
    use evpleg_core::lifecycle::RelistSignal;
    use evpleg_core::runtime::{PlegState, PodRuntime, RuntimeEntry, RuntimeError};
    use evpleg_pleg::on_demand::PodRelistQueue;
    use evpleg_pleg::relist::{KernelReports, RelistPleg};
    use tokio::sync::watch;

    #[tokio::test]
    async fn a_dead_essential_task_fails_healthz_naming_it() {
        let clock = ManualClock::new(1_000_000_000);
        let shared: SharedClock = Arc::new(clock.clone());
        let tasks = TaskHealth::new(shared.clone());
        let state = ServerState::new(
            Arc::new(Metrics::new(None, None).with_task_health(vec![tasks.clone()])),
            None,
            shared,
            std::time::Duration::from_secs(1),
        )
        .with_tasks(vec![tasks.clone()]);
        let (code, body) = healthz(State(state.clone())).await;
        assert_eq!((code, body.as_str()), (StatusCode::OK, "ok\n"));
        let dead = tasks.spawn("sync loop", CancellationToken::new(), async {
            panic!("the sync loop broke")
        });
        tokio::time::timeout(std::time::Duration::from_secs(10), dead)
            .await
            .expect("the task ended")
            .expect("its supervisor did not fail");
        clock.advance(2_500_000_000);
        let (code, body) = healthz(State(state.clone())).await;
        assert_eq!(code, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            body,
            "essential task sync loop stopped 2.5s ago (panicked: the sync loop broke)\n"
        );
        assert!(
            metrics(State(state))
                .await
                .contains("evpleg_essential_task_failures_total 1")
        );
    }

    #[tokio::test]
    async fn the_status_manager_s_counters_are_exported() {
        use evpleg_kubelet::status::manager::StatusManager;
        let status = Arc::new(StatusManager::new());
        let uid = evpleg_core::ids::PodUid::parse(&"a".repeat(32)).unwrap();
        let pod: Arc<k8s_openapi::api::core::v1::Pod> = Arc::new(Default::default());
        let phase = |p: &str| k8s_openapi::api::core::v1::PodStatus {
            phase: Some(p.into()),
            ..Default::default()
        };
        status.set_pod_status(&uid, pod.clone(), phase("Succeeded"));
        // Refused: a pod never leaves a terminal phase.
        status.set_pod_status(&uid, pod, phase("Running"));
        let text = Metrics::new(None, None).with_status(status).render();
        assert!(
            text.contains("evpleg_status_illegal_transitions_total 1"),
            "{text}"
        );
        assert!(text.contains("evpleg_status_writes_total 0"), "{text}");
    }

    /// A runtime with one running container whose list waits while a test
    /// holds `stall` for writing (a runtime that stopped answering).
    #[derive(Debug, Default)]
    struct StallRuntime {
        stall: tokio::sync::RwLock<()>,
    }

    impl PodRuntime for StallRuntime {
        async fn list(&self, _pod: Option<&PodUid>) -> Result<Vec<RuntimeEntry>, RuntimeError> {
            let _running = self.stall.read().await;
            Ok(vec![RuntimeEntry {
                pod: PodUid::parse(&"1".repeat(32)).unwrap(),
                id: ContainerId::parse(&"1".repeat(64)).unwrap(),
                sandbox: false,
                state: PlegState::Running,
            }])
        }

        async fn pod_status(&self, _pod: &PodUid) -> Result<PodStatus, RuntimeError> {
            Ok(PodStatus::default())
        }
    }

    /// Waits (paused time advances itself) until `cond` holds, for at most 10 s.
    async fn wait_for(cond: impl Fn() -> bool) {
        tokio::time::timeout(Duration::from_secs(10), async {
            while !cond() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("condition not reached within 10 s");
    }

    /// `/healthz` follows the kubelet's rule through the running relist loop: it
    /// fails once the relist has stalled past the threshold (3 min) and is healthy
    /// again as soon as a relist completes.
    #[tokio::test(start_paused = true)]
    async fn healthz_fails_while_the_relist_is_stalled_past_the_threshold() {
        let clock = ManualClock::new(1_000);
        let runtime = Arc::new(StallRuntime::default());
        let (events, _rx) = tokio::sync::mpsc::channel(100);
        let pleg = RelistPleg::new(
            runtime.clone(),
            Arc::new(PodStatusCache::new()),
            events,
            Arc::new(clock.clone()),
            Arc::new(KernelReports::default()),
        );
        let stats = pleg.stats();
        let state = ServerState::new(
            Arc::new(Metrics::new(None, None)),
            Some(stats.clone()),
            Arc::new(clock.clone()),
            GENERIC_PERIOD,
        );
        let (_period_tx, period_rx) = watch::channel(GENERIC_PERIOD);
        let shutdown = CancellationToken::new();
        let queue = Arc::new(PodRelistQueue::new(Arc::new(clock.clone())));
        let task = tokio::spawn(pleg.run(
            period_rx,
            Arc::new(RelistSignal::new()),
            queue,
            shutdown.clone(),
        ));
        wait_for(|| stats.relists.load(Ordering::Relaxed) >= 1).await;
        assert_eq!(health_report(&state).0, axum::http::StatusCode::OK);
        // The runtime stops answering: the relists block.
        let stalled = runtime.stall.write().await;
        let before = stats.relists.load(Ordering::Relaxed);
        for _ in 0..179 {
            clock.advance(1_000_000_000);
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        assert_eq!(stats.relists.load(Ordering::Relaxed), before, "stalled");
        assert_eq!(
            health_report(&state).0,
            axum::http::StatusCode::OK,
            "179 s: within the threshold"
        );
        clock.advance(2_000_000_000);
        tokio::time::advance(Duration::from_secs(2)).await;
        let (code, body) = health_report(&state);
        assert_eq!(code, axum::http::StatusCode::INTERNAL_SERVER_ERROR);
        assert!(
            body.starts_with("pleg was last seen active 181.0s ago; threshold is 180.0s"),
            "{body}"
        );
        // The runtime answers again: the blocked relist completes.
        drop(stalled);
        wait_for(|| stats.relists.load(Ordering::Relaxed) > before).await;
        assert_eq!(
            health_report(&state),
            (axum::http::StatusCode::OK, "ok\n".into())
        );
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .unwrap()
            .unwrap();
    }
}
