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
//!   ListContainers, ContainerStatus and PodSandboxStatus answers (a sandbox
//!   whose pause process died is shown not ready in PodSandboxStatus and
//!   ListPodSandbox), so that a kubelet relisting the pod on the event sees
//!   the death at once; `--overlay=false` switches it off.
//! - Answers it reads whole and writes again, and its own errors, keep the
//!   runtime's HTTP/2 framing: a trailers-only answer ends with its headers
//!   (END_STREAM), as grpc-go (the kubelet, crictl) needs to read its status
//!   ([`grpc::body`]).
//! - With `--merge-runtime-events`, the runtime's own stream (containerd 1.7
//!   and later) is merged in ([`merge`]): what the kernel and the calls did
//!   not show is passed on, nothing is served twice.
//!
//! This crate is the proxy itself, handed a plain [`ProxyConfig`]; the
//! binary adds the flags, the HTTP endpoints (/metrics, /healthz, /readyz) and the
//! metrics registry around it.
//!
//! The PLEG inside is the kernel PLEG of `evpleg run` in `ebpf` mode over the
//! runtime behind the proxy, with its trust rules (docs/pleg.md): only certain
//! deaths are STOPPED, an exec into a container never is. The socket is
//! served before it loads and whether or not it runs: without it the proxy
//! forwards every call untouched and starts it again with a back-off
//! ([`kernel_path`]).

pub mod events;
pub mod forward;
pub mod grpc;
pub mod hub;
pub mod kernel_path;
pub mod merge;
pub mod overlay;
pub mod server;
pub mod stats;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::info;

use evpleg_core::clock::SharedClock;
use evpleg_cri::runtime::CriRuntime;
use evpleg_cri::{CriClient, CriClientConfig, CriError};
use evpleg_pleg::kernel::KernelPlegConfig;
use evpleg_pleg::{Pleg, PlegError, PlegMode};

pub use stats::ProxyStats;

/// Errors of starting the proxy (the kernel path's are not: without it the
/// proxy passes every call through, [`kernel_path`]).
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("container runtime: {0}")]
    Cri(#[from] CriError),
    #[error(transparent)]
    Listen(#[from] server::ListenError),
}

/// Calls that make events, queued for the event task.
const CALL_QUEUE: usize = 1000;

/// What the proxy serves and forwards to (`evpleg cri-proxy`'s flags, less
/// the HTTP endpoints).
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// The socket the CRI is served on.
    pub listen: PathBuf,
    /// The runtime's CRI socket.
    pub runtime_endpoint: PathBuf,
    /// Permission bits of the served socket.
    pub socket_mode: u32,
    /// Owner of the served socket (`UID`, `GID`); `None`: the proxy's own.
    pub socket_owner: Option<(u32, u32)>,
    /// Lay kernel deaths on status answers ([`overlay`]).
    pub overlay: bool,
    /// Merge the runtime's own event stream ([`merge`]).
    pub merge_runtime_events: bool,
    /// Events buffered for each subscriber ([`hub`]).
    pub subscriber_buffer: usize,
    /// The PLEG's full relist period (`None`: the `ebpf` mode's).
    pub relist_period: Option<Duration>,
    pub kernel: KernelPlegConfig,
}

impl ProxyConfig {
    /// The runtime's endpoint as the CRI client dials it.
    pub fn runtime_uri(&self) -> String {
        format!("unix://{}", self.runtime_endpoint.display())
    }
}

/// A running proxy.
#[derive(Debug)]
pub struct CriProxy {
    pub stats: Arc<ProxyStats>,
    pub hub: Arc<hub::Hub>,
    /// The client to the runtime behind the proxy (its metrics are the
    /// proxy's CRI metrics).
    pub cri: CriClient,
    /// The kernel PLEG, when it runs, and the pass-through state.
    pub kernel: Arc<kernel_path::KernelPath>,
    shutdown: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    socket: PathBuf,
}

impl CriProxy {
    /// Creates the CRI socket, then starts the kernel path (pass-through
    /// while it cannot start: [`kernel_path`]), the event task and the
    /// server.
    pub async fn start(config: &ProxyConfig, clock: SharedClock) -> Result<Self, ProxyError> {
        let listener = server::listen(&config.listen, config.socket_mode, config.socket_owner)?;
        let cri = CriClient::connect(&config.runtime_uri(), CriClientConfig::default()).await?;
        let stats = Arc::new(ProxyStats::default());
        let (tx, pleg_rx) = mpsc::channel(1000);
        let start_pleg: Box<dyn Fn() -> Result<Pleg, PlegError> + Send + Sync> = {
            let (cri, kernel, clock) = (cri.clone(), config.kernel.clone(), clock.clone());
            let relist_period = config.relist_period;
            Box::new(move || {
                Pleg::start(
                    PlegMode::Ebpf,
                    CriRuntime::new(cri.clone()).attributing_unlabelled(),
                    kernel.clone(),
                    tx.clone(),
                    clock.clone(),
                    relist_period,
                )
            })
        };
        let kernel = Arc::new(kernel_path::KernelPath::new(clock.now_ns()));
        kernel.attempt(&*start_pleg, &stats, clock.now_ns());
        let hub = hub::Hub::new(config.subscriber_buffer, stats.clone());
        let overlay = Arc::new(overlay::Overlay::default());
        let (calls_tx, calls_rx) = mpsc::channel(CALL_QUEUE);
        let shutdown = CancellationToken::new();
        let runtime_stream = Arc::new(merge::RuntimeStream::default());
        let mut tasks = vec![tokio::spawn(kernel_path::supervise(
            kernel.clone(),
            start_pleg,
            hub.clone(),
            runtime_stream.clone(),
            stats.clone(),
            clock.clone(),
            shutdown.clone(),
        ))];
        let mut events = events::Events::new(
            cri.clone(),
            hub.clone(),
            overlay.clone(),
            stats.clone(),
            clock,
        )
        .following(kernel.clone());
        let runtime_rx = if config.merge_runtime_events {
            events = events.merging();
            let (tx, rx) = mpsc::channel(CALL_QUEUE);
            tasks.push(tokio::spawn(merge::follow(
                cri.clone(),
                tx,
                stats.clone(),
                runtime_stream.clone(),
                kernel.clone(),
                hub.clone(),
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
            upstream: forward::Upstream::new(config.runtime_endpoint.clone()),
            hub: hub.clone(),
            overlay,
            overlay_on: config.overlay,
            calls: calls_tx,
            stats: stats.clone(),
            cri: cri.clone(),
            kernel: kernel.clone(),
            runtime_stream,
        });
        tasks.push(tokio::spawn(server::serve(
            listener,
            service,
            shutdown.clone(),
        )));
        info!(listen = %config.listen.display(), runtime = %config.runtime_endpoint.display(),
            overlay = config.overlay, merge_runtime_events = config.merge_runtime_events,
            kernel_path = kernel.serving(), "cri proxy serving");
        Ok(Self {
            stats,
            hub,
            cri,
            kernel,
            shutdown,
            tasks,
            socket: config.listen.clone(),
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
        self.kernel.stop().await;
    }
}
