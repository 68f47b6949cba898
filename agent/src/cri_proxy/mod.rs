//! `evpleg cri-proxy`: a CRI proxy between an unmodified kubelet and its
//! runtime that gives the kubelet's Evented PLEG the kernel's speed.
//!
//! What it reproduces: the runtime's CRI, call for call. Every RuntimeService
//! and ImageService call is forwarded at the HTTP/2 level without decoding
//! ([`forward`]): metadata, streamed bodies, trailers, status codes and
//! errors come back as the runtime sent them.
//!
//! What it changes ([`server`] has the table):
//! - `GetContainerEvents` is served by the proxy from the kernel PLEG
//!   ([`events`]), as containerd 1.7 serves its own stream but when the kernel
//!   sees it (containerd 1.6 has none; 1.7 reported a STOPPED about 54 ms
//!   after the exit here), to several subscribers, each with a bounded buffer
//!   ([`hub`]).
//! - The overlay ([`overlay`]): a container whose death the kernel saw with
//!   certainty while the runtime still reports it running is shown exited in
//!   ListContainers, ContainerStatus and PodSandboxStatus answers, so that a
//!   kubelet relisting the pod on the event sees the death at once;
//!   `--overlay=false` switches it off.
//! - With `--merge-runtime-events`, the runtime's own stream (containerd 1.7
//!   and later) is merged in ([`merge`]): what the kernel and the calls did
//!   not show is passed on, nothing is served twice.
//!
//! The PLEG inside is the kernel PLEG of `evpleg run` in `ebpf` mode over the
//! runtime behind the proxy, with its trust rules (docs/pleg.md): only certain
//! deaths are STOPPED, an exec into a container never is.

pub mod events;
pub mod forward;
pub mod grpc;
pub mod hub;
pub mod merge;
pub mod overlay;
pub mod server;
pub mod stats;

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::clock::{MonotonicClock, SharedClock};
use crate::config::CriProxyArgs;
use crate::cri::{CriClient, CriClientConfig, CriError};
use crate::metrics::Metrics;
use crate::pleg::{Pleg, PlegError, PlegMode};
use crate::runtime::CriRuntime;
use crate::server::ServerState;

pub use stats::ProxyStats;

/// Errors of starting the proxy.
#[derive(Debug, thiserror::Error)]
pub enum CriProxyError {
    #[error("container runtime: {0}")]
    Cri(#[from] CriError),
    #[error(transparent)]
    Pleg(#[from] PlegError),
    #[error(transparent)]
    Listen(#[from] server::ListenError),
    #[error("cannot serve http on {addr}: {source}")]
    Http {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}

/// Calls that make events, queued for the event task.
const CALL_QUEUE: usize = 1000;

/// A running proxy.
#[derive(Debug)]
pub struct CriProxy {
    /// The HTTP endpoints' address (/metrics, /healthz).
    pub http_addr: std::net::SocketAddr,
    pub stats: Arc<ProxyStats>,
    pub hub: Arc<hub::Hub>,
    shutdown: CancellationToken,
    pleg: Option<Pleg>,
    tasks: Vec<JoinHandle<()>>,
    socket: std::path::PathBuf,
}

impl CriProxy {
    /// Starts the PLEG, the event task, the CRI socket and the HTTP endpoints.
    pub async fn start(args: &CriProxyArgs) -> Result<Self, CriProxyError> {
        let clock: SharedClock = Arc::new(MonotonicClock);
        let cri = CriClient::connect(&args.runtime_uri(), CriClientConfig::default()).await?;
        let http = tokio::net::TcpListener::bind(args.http_listen)
            .await
            .map_err(|source| CriProxyError::Http {
                addr: args.http_listen,
                source,
            })?;
        let http_addr = http.local_addr().map_err(|source| CriProxyError::Http {
            addr: args.http_listen,
            source,
        })?;
        let (tx, pleg_rx) = mpsc::channel(1000);
        let pleg = Pleg::start(
            PlegMode::Ebpf,
            CriRuntime::new(cri.clone()),
            args.kernel.config(),
            tx,
            clock.clone(),
            args.relist_period,
        )?;
        let listener = server::listen(&args.listen, args.socket_mode, args.socket_owner)?;
        let stats = Arc::new(ProxyStats::default());
        let hub = hub::Hub::new(args.subscriber_buffer, stats.clone());
        let overlay = Arc::new(overlay::Overlay::default());
        let (calls_tx, calls_rx) = mpsc::channel(CALL_QUEUE);
        let shutdown = CancellationToken::new();
        let mut tasks = Vec::new();
        let mut events = events::Events::new(
            cri.clone(),
            hub.clone(),
            overlay.clone(),
            stats.clone(),
            clock.clone(),
        );
        let runtime_rx = if args.merge_runtime_events {
            events = events.merging();
            let (tx, rx) = mpsc::channel(CALL_QUEUE);
            tasks.push(tokio::spawn(merge::follow(
                cri.clone(),
                tx,
                stats.clone(),
                shutdown.clone(),
            )));
            Some(rx)
        } else {
            None
        };
        tasks.push(tokio::spawn(events.run(
            pleg_rx,
            calls_rx,
            runtime_rx,
            shutdown.clone(),
        )));
        let service = Arc::new(server::Service {
            upstream: forward::Upstream::new(args.runtime_endpoint.clone()),
            hub: hub.clone(),
            overlay,
            overlay_on: args.overlay,
            calls: calls_tx,
            stats: stats.clone(),
        });
        tasks.push(tokio::spawn(server::serve(
            listener,
            service,
            shutdown.clone(),
        )));
        let mut metrics = Metrics::new(Some(&pleg), None)
            .with_cri(cri.metrics())
            .with_task_health(vec![pleg.task_health.clone()]);
        metrics.register_cri_proxy(&stats);
        let state = ServerState::new(
            Arc::new(metrics),
            Some(pleg.relist_stats.clone()),
            clock,
            pleg.relist_period(),
        )
        .with_path_health(pleg.path_health.clone())
        .with_tasks(vec![pleg.task_health.clone()]);
        let stop = shutdown.clone();
        let router = crate::server::router(state);
        tasks.push(tokio::spawn(async move {
            if let Err(e) = axum::serve(http, router)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await
            {
                warn!(error = %e, "http server failed");
            }
        }));
        info!(listen = %args.listen.display(), runtime = %args.runtime_endpoint.display(),
            overlay = args.overlay, merge_runtime_events = args.merge_runtime_events,
            http = %http_addr, "cri proxy serving");
        Ok(Self {
            http_addr,
            stats,
            hub,
            shutdown,
            pleg: Some(pleg),
            tasks,
            socket: args.listen.clone(),
        })
    }

    /// Stops serving (subscribers' streams end UNAVAILABLE), removes the
    /// socket, stops the PLEG.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
        let _ = std::fs::remove_file(&self.socket);
        if let Some(p) = self.pleg.take() {
            p.stop().await;
        }
    }
}
