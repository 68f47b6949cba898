//! `evpleg cri-proxy`'s wiring: the flags made into the proxy's
//! [`ProxyConfig`], the proxy started ([`evpleg_cri_proxy`]), and its HTTP
//! endpoints (/metrics, /healthz, /readyz) served beside it.

use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::info;

use evpleg_core::clock::{MonotonicClock, SharedClock};
use evpleg_cri_proxy::hub::Hub;
use evpleg_cri_proxy::{ProxyConfig, ProxyError, ProxyStats};

use crate::config::CriProxyArgs;
use crate::metrics::Metrics;
use crate::server::ServerState;

/// Errors of starting the proxy.
#[derive(Debug, thiserror::Error)]
pub enum CriProxyError {
    #[error(transparent)]
    Proxy(#[from] ProxyError),
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
        let http = tokio::net::TcpListener::bind(args.http_listen)
            .await
            .map_err(http_error)?;
        let http_addr = http.local_addr().map_err(http_error)?;
        let proxy = evpleg_cri_proxy::CriProxy::start(&args.proxy_config(), clock.clone()).await?;
        let pleg = proxy.pleg();
        let mut metrics = Metrics::new(Some(pleg), None)
            .with_cri(proxy.cri.metrics())
            .with_task_health(vec![pleg.task_health.clone()]);
        metrics.register_cri_proxy(&proxy.stats);
        let state = ServerState::new(
            Arc::new(metrics),
            Some(pleg.relist_stats.clone()),
            clock,
            pleg.relist_period(),
        )
        .with_path_health(pleg.path_health.clone())
        .with_tasks(vec![pleg.task_health.clone()]);
        let shutdown = CancellationToken::new();
        let router = crate::server::router(state);
        let http = tokio::spawn(crate::http::serve(
            http,
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

    /// Stops the HTTP endpoints, then the proxy.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.http.await;
        self.proxy.stop().await;
    }
}
