//! `evpleg cri-proxy`'s wiring: the flags made into the proxy's
//! [`ProxyConfig`], the proxy started ([`evpleg_cri_proxy`]), and its HTTP
//! endpoints (/metrics, /healthz, /readyz) served beside it.
//!
//! `/healthz` is the agent's rule ([`crate::server::health_report`]) over
//! the running kernel PLEG; while the proxy serves the CRI in pass-through
//! (no kernel path: [`evpleg_cri_proxy::kernel_path`]) it answers 200 with
//! `degraded: ...` (the node keeps its runtime, only the events are slower).
//! The metrics of the PLEG are those of the one running now: they are
//! rebuilt when the kernel path starts again.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::info;

use evpleg_core::clock::{MonotonicClock, SharedClock};
use evpleg_cri_proxy::hub::Hub;
use evpleg_cri_proxy::kernel_path::PathState;
use evpleg_cri_proxy::{ProxyConfig, ProxyError, ProxyStats};

use crate::config::CriProxyArgs;
use crate::metrics::Metrics;
use crate::server::ServerState;

/// Errors of starting the proxy.
#[derive(Debug, thiserror::Error)]
pub enum CriProxyError {
    #[error(transparent)]
    Proxy(#[from] ProxyError),
    #[error("the https endpoints: {0}")]
    Tls(#[from] crate::server::tls::TlsError),
    #[error("cannot serve http on {addr}: {source}")]
    Http {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}

impl CriProxyArgs {
    /// The proxy's configuration from the flags.
    pub fn proxy_config(&self) -> ProxyConfig {
        ProxyConfig {
            listen: self.listen.clone(),
            runtime_endpoint: self.runtime_endpoint.clone(),
            socket_mode: self.socket_mode,
            socket_owner: self.socket_owner,
            overlay: self.overlay,
            merge_runtime_events: self.merge_runtime_events,
            subscriber_buffer: self.subscriber_buffer,
            relist_period: self.relist_period,
            kernel: self.kernel.config(),
        }
    }
}

/// A running proxy with its HTTP endpoints.
#[derive(Debug)]
pub struct CriProxy {
    /// The HTTP endpoints' address (/metrics, /healthz).
    pub http_addr: std::net::SocketAddr,
    pub stats: Arc<ProxyStats>,
    pub hub: Arc<Hub>,
    proxy: evpleg_cri_proxy::CriProxy,
    shutdown: CancellationToken,
    http: JoinHandle<()>,
}

impl CriProxy {
    /// Starts the proxy (its PLEG, event task and CRI socket) and the HTTP
    /// endpoints.
    pub async fn start(args: &CriProxyArgs) -> Result<Self, CriProxyError> {
        let clock: SharedClock = Arc::new(MonotonicClock);
        let http_error = |source| CriProxyError::Http {
            addr: args.http_listen,
            source,
        };
        let tls = args.http_tls.server_config(args.http_listen)?;
        let http = tokio::net::TcpListener::bind(args.http_listen)
            .await
            .map_err(http_error)?;
        let http_addr = http.local_addr().map_err(http_error)?;
        let proxy = evpleg_cri_proxy::CriProxy::start(&args.proxy_config(), clock.clone()).await?;
        let endpoints = Endpoints {
            kernel: proxy.kernel.clone(),
            stats: proxy.stats.clone(),
            cri: proxy.cri.metrics(),
            clock,
            view: Arc::new(Mutex::new(None)),
        };
        let router = Router::new()
            .route("/metrics", get(metrics))
            .route("/healthz", get(healthz))
            .route("/readyz", get(healthz))
            .with_state(endpoints);
        let shutdown = CancellationToken::new();
        let http = tokio::spawn(crate::http::serve(
            http,
            tls,
            router,
            args.http.limits(),
            shutdown.clone(),
        ));
        info!(http = %http_addr, "cri proxy http endpoints serving");
        Ok(Self {
            http_addr,
            stats: proxy.stats.clone(),
            hub: proxy.hub.clone(),
            proxy,
            shutdown,
            http,
        })
    }

    /// The kernel path: its state, and the PLEG when it runs.
    pub fn kernel(&self) -> &Arc<evpleg_cri_proxy::kernel_path::KernelPath> {
        &self.proxy.kernel
    }

    /// Stops the HTTP endpoints, then the proxy.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.http.await;
        self.proxy.stop().await;
    }
}

/// What the proxy's endpoints read.
#[derive(Clone, Debug)]
struct Endpoints {
    kernel: Arc<evpleg_cri_proxy::kernel_path::KernelPath>,
    stats: Arc<ProxyStats>,
    cri: Arc<evpleg_cri::metrics::CriMetrics>,
    clock: SharedClock,
    /// The metrics and health state of the kernel path's generation
    /// (`None`: not built yet).
    view: Arc<Mutex<Option<(u64, ServerState)>>>,
}

impl Endpoints {
    /// The state over the PLEG running now (or none), rebuilt when another
    /// one started.
    fn state(&self) -> ServerState {
        let generation = self.kernel.generation();
        let mut view = self.view.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((g, state)) = view.as_ref()
            && *g == generation
        {
            return state.clone();
        }
        let state = self.kernel.with_pleg(|pleg| {
            let tasks: Vec<_> = pleg.iter().map(|p| p.task_health.clone()).collect();
            let mut metrics = Metrics::new(pleg, None)
                .with_cri(self.cri.clone())
                .with_task_health(tasks.clone());
            metrics.register_cri_proxy(&self.stats);
            let state = ServerState::new(
                Arc::new(metrics),
                pleg.map(|p| p.relist_stats.clone()),
                self.clock.clone(),
                pleg.map_or(evpleg_pleg::relist::EBPF_PERIOD, |p| p.relist_period()),
            )
            .with_tasks(tasks);
            match pleg {
                Some(p) => state.with_path_health(p.path_health.clone()),
                None => state,
            }
        });
        *view = Some((generation, state.clone()));
        state
    }
}

async fn metrics(State(e): State<Endpoints>) -> String {
    e.state().metrics.render()
}

/// The agent's health rule over the running PLEG; in pass-through, 200 and
/// why (degraded, not down: the CRI is served).
async fn healthz(State(e): State<Endpoints>) -> (StatusCode, String) {
    match e.kernel.state() {
        PathState::Kernel => crate::server::health_report(&e.state()),
        PathState::PassThrough {
            since_ns,
            reason,
            failures,
        } => (
            StatusCode::OK,
            format!(
                "degraded: cri proxy in pass-through for {:.1}s, every call forwarded untouched \
                 (GetContainerEvents: the runtime's own stream); {reason}; \
                 {failures} failed start(s) of the kernel path, retried with a back-off\n",
                std::time::Duration::from_nanos(e.clock.now_ns().saturating_sub(since_ns))
                    .as_secs_f64()
            ),
        ),
    }
}
