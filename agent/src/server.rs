//! The agent's HTTP endpoints, like the kubelet's read-only port: `/metrics`
//! (Prometheus), `/healthz` (PLEG health, the kubelet's "pleg was last seen active
//! ... ago" check), `/readyz`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use crate::clock::SharedClock;
use crate::metrics::Metrics;
use crate::pleg::PathHealth;
use crate::pleg::relist::{GENERIC_PERIOD, RELIST_THRESHOLD, RelistStats};

/// What the endpoints read.
#[derive(Clone, Debug)]
pub struct ServerState {
    pub metrics: Arc<Metrics>,
    pub relist: Option<Arc<RelistStats>>,
    /// The kernel path's health, in `ebpf` mode.
    pub path: Option<Arc<PathHealth>>,
    pub clock: SharedClock,
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
            threshold: RELIST_THRESHOLD.max(period * 2),
        }
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

/// The kubelet's PLEG health rule decides the status code; a degraded kernel path
/// is reported in the body (which part, since when) but keeps 200: the fallback
/// relist keeps the agent correct (docs/pleg.md, contract clause 5).
async fn healthz(State(s): State<ServerState>) -> (StatusCode, String) {
    let now = s.clock.now_ns();
    let health = s
        .relist
        .as_ref()
        .map(|r| r.healthy(now, s.threshold))
        .unwrap_or(Ok(()));
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

/// Serves `router` on `addr` until `shutdown`.
pub async fn serve(
    addr: SocketAddr,
    router: Router,
    shutdown: tokio_util::sync::CancellationToken,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving /metrics, /healthz");
    axum::serve(listener, router)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}
