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
use crate::pleg::relist::{RELIST_THRESHOLD, RelistStats};

/// What the endpoints read.
#[derive(Clone, Debug)]
pub struct ServerState {
    pub metrics: Arc<Metrics>,
    pub relist: Option<Arc<RelistStats>>,
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
            clock,
            threshold: RELIST_THRESHOLD.max(period * 2),
        }
    }
}

async fn metrics(State(s): State<ServerState>) -> String {
    s.metrics.render()
}

async fn healthz(State(s): State<ServerState>) -> (StatusCode, String) {
    let health = s
        .relist
        .as_ref()
        .map(|r| r.healthy(s.clock.now_ns(), s.threshold))
        .unwrap_or(Ok(()));
    match health {
        Ok(()) => (StatusCode::OK, "ok\n".into()),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
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
