//! `evpleg observe`: shadow mode. The PLEG runs alone (no sources, no pod
//! workers, no status manager), so it is safe next to a real kubelet: it only
//! lists and inspects (the PLEG's runtime interface, [`evpleg_core::runtime::PodRuntime`],
//! has no call that changes the runtime). Beside it runs a comparison relist,
//! the kubelet's generic PLEG at `--compare-period` (1s), over the same
//! runtime; [`correlate`] pairs their reports, and each transition becomes one
//! [`ObservedEvent`]: the PLEG's view, how much earlier it was than the
//! relist's, and anything they disagree on.
//!
//! Transitions that happened before `observe` started (the first relists
//! report every existing container) are left out: a relist-sourced report is
//! printed only if the runtime's own time for it (startedAt, finishedAt) is
//! later than the start.
//!
//! With `--cri-endpoint none` only the kernel PLEG runs (no runtime, no
//! comparison): every kernel event is printed as it comes.

pub mod correlate;
pub mod output;

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::config::{NoEndpoint, OBSERVE_LISTEN, ObserveArgs};
use crate::metrics::Metrics;
use crate::server;
use crate::server::ServerState;
use correlate::{Compared, Correlator, Patience, Seen, Side, Transition};
use evpleg_core::cache::PodStatusCache;
use evpleg_core::clock::wall_clock_ns;
use evpleg_core::clock::{MonotonicClock, SharedClock};
use evpleg_core::container::PodStatus;
use evpleg_core::lifecycle::{EventSource, PodLifecycleEvent, RelistSignal};
use evpleg_cri::runtime::CriRuntime;
use evpleg_cri::{CriClient, CriClientConfig, CriError};
use evpleg_pleg::kernel::{KernelPleg, KernelPlegError};
use evpleg_pleg::{Pleg, PlegError, PlegMode};
pub use output::ObservedEvent;

/// Errors of starting `observe`.
#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    #[error(transparent)]
    NoRuntime(#[from] NoEndpoint),
    #[error("container runtime: {0}")]
    Cri(#[from] CriError),
    #[error(transparent)]
    Pleg(#[from] PlegError),
    #[error("kernel pleg: {0}")]
    Kernel(#[from] KernelPlegError),
    #[error("without a runtime (--cri-endpoint none) only the ebpf pleg can run, not {0:?}")]
    NeedsRuntime(PlegMode),
    #[error("the https endpoints: {0}")]
    Tls(#[from] crate::server::tls::TlsError),
    #[error("cannot serve on {addr}: {source}")]
    Listen {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}

/// What `observe` counts, on `/metrics`.
#[derive(Debug)]
pub struct ObserveStats {
    /// relist - pleg, for transitions both saw (`evpleg_observe_relist_lead_seconds`).
    pub lead_seconds: Histogram,
    /// Transitions the comparison relist did not report in time.
    pub relist_missed: Counter,
    /// Transitions the PLEG did not report in time.
    pub pleg_missed: Counter,
    /// Exit codes that differ between the PLEG and the runtime.
    pub exit_code_mismatches: Counter,
}

impl Default for ObserveStats {
    fn default() -> Self {
        Self {
            // 100 us to about 6.7 s.
            lead_seconds: Histogram::new(exponential_buckets(1e-4, 2.0, 17)),
            relist_missed: Counter::default(),
            pleg_missed: Counter::default(),
            exit_code_mismatches: Counter::default(),
        }
    }
}

/// A running observer; its events arrive on [`Observer::events`].
#[derive(Debug)]
pub struct Observer {
    pub events: mpsc::Receiver<ObservedEvent>,
    pub addr: std::net::SocketAddr,
    shutdown: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl Observer {
    /// Starts the PLEG, the comparison relist and the HTTP endpoints.
    pub async fn start(args: &ObserveArgs) -> Result<Self, ObserveError> {
        let common = &args.common;
        let endpoint = common.endpoint(std::path::Path::new("/"))?;
        let listen = common.listen_or(OBSERVE_LISTEN);
        let tls = args.http_tls.server_config(listen)?;
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|source| ObserveError::Listen {
                addr: listen,
                source,
            })?;
        let addr = listener
            .local_addr()
            .map_err(|source| ObserveError::Listen {
                addr: listen,
                source,
            })?;
        let clock: SharedClock = Arc::new(MonotonicClock);
        let shutdown = CancellationToken::new();
        let (out_tx, events) = mpsc::channel(common.event_channel);
        let stats = Arc::new(ObserveStats::default());
        let mut tasks = Vec::new();
        let (state, run) = match endpoint {
            None => {
                if common.pleg.mode() != PlegMode::Ebpf {
                    return Err(ObserveError::NeedsRuntime(common.pleg.mode()));
                }
                let (tx, rx) = mpsc::channel(common.event_channel);
                let kernel =
                    KernelPleg::start(common.kernel.config(), tx, Arc::new(RelistSignal::new()))?;
                let metrics = Metrics::new(None, Some(kernel.stats().clone()));
                let state =
                    ServerState::new(Arc::new(metrics), None, clock.clone(), Duration::ZERO);
                let run = kernel_only(kernel, rx, out_tx, clock.clone(), shutdown.clone());
                (state, tokio::spawn(run))
            }
            Some(endpoint) => {
                let cri = CriClient::connect(&endpoint, CriClientConfig::default()).await?;
                let (tx, rx) = mpsc::channel(common.event_channel);
                let pleg = Pleg::start(
                    common.pleg.mode(),
                    CriRuntime::new(cri.clone()),
                    common.kernel.config(),
                    tx,
                    clock.clone(),
                    common.relist_period,
                )?;
                let (ctx, crx) = mpsc::channel(common.event_channel);
                let compare = Pleg::start(
                    PlegMode::Generic,
                    CriRuntime::new(cri.clone()),
                    Default::default(),
                    ctx,
                    clock.clone(),
                    Some(args.compare_period),
                )?;
                let metrics = Metrics::new(Some(&pleg), None)
                    .with_cri(cri.metrics())
                    .with_task_health(vec![pleg.task_health.clone(), compare.task_health.clone()])
                    .with_observe(stats.clone());
                let state = ServerState::new(
                    Arc::new(metrics),
                    Some(pleg.relist_stats.clone()),
                    clock.clone(),
                    pleg.relist_period(),
                )
                .with_path_health(pleg.path_health.clone())
                .with_tasks(vec![pleg.task_health.clone(), compare.task_health.clone()]);
                info!(%endpoint, mode = ?common.pleg, compare_period = %crate::config::duration::format(args.compare_period), "observing");
                let run = Compare {
                    pleg,
                    compare,
                    correlator: Correlator::new(Patience::for_period(args.compare_period)),
                    clock: clock.clone(),
                    start_wall_ns: wall_clock_ns(),
                    stats,
                    out: out_tx,
                }
                .run(rx, crx, shutdown.clone());
                (state, tokio::spawn(run))
            }
        };
        tasks.push(run);
        let router = server::router(state);
        tasks.push(tokio::spawn(crate::http::serve(
            listener,
            tls,
            router,
            common.http.limits(),
            shutdown.clone(),
        )));
        Ok(Self {
            events,
            addr,
            shutdown,
            tasks,
        })
    }

    /// Stops the PLEGs and the endpoints; the events channel then ends.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
    }
}

/// Kernel events only: each printed as it comes.
async fn kernel_only(
    kernel: KernelPleg,
    mut rx: mpsc::Receiver<PodLifecycleEvent>,
    out: mpsc::Sender<ObservedEvent>,
    clock: SharedClock,
    shutdown: CancellationToken,
) {
    loop {
        let ev = tokio::select! {
            ev = rx.recv() => ev,
            () = shutdown.cancelled() => None,
        };
        let Some(ev) = ev else { break };
        let Some(transition) = Transition::of(ev.kind) else {
            continue;
        };
        let Some(seen) = seen_of(&ev, transition, None) else {
            continue;
        };
        let compared = Compared {
            pleg: Some(seen),
            relist: None,
            lead_ns: None,
            disagreement: None,
        };
        let line = ObservedEvent::new(&compared, None, clock.now_ns());
        if out.send(line).await.is_err() {
            break;
        }
    }
    let stats = kernel.stats().clone();
    kernel.stop();
    use std::sync::atomic::Ordering::Relaxed;
    info!(
        records = stats.records.load(Relaxed),
        events = stats.events.load(Relaxed),
        kernel_dropped = stats.kernel_dropped.load(Relaxed),
        kernel_filtered = stats.kernel_filtered.load(Relaxed),
        discarded = stats.discarded.load(Relaxed),
        "kernel pleg stopped"
    );
}

/// The observation of `ev`, with the exit code from `status` when the event
/// carries none.
fn seen_of(
    ev: &PodLifecycleEvent,
    transition: Transition,
    status: Option<&PodStatus>,
) -> Option<Seen> {
    let container_id = ev.container_id.clone()?;
    let exit_code = match transition {
        Transition::Started => None,
        Transition::Died => ev.exit.map(|e| e.code).or_else(|| {
            status
                .and_then(|s| s.container(&container_id))
                .and_then(|c| c.exit_code)
        }),
    };
    Some(Seen {
        pod_uid: ev.pod_uid.clone(),
        container_id,
        transition,
        at_ns: ev.at_ns,
        source: ev.source,
        exit_code,
        signal: ev.exit.and_then(|e| e.signal),
        oom_killed: ev.exit.is_some_and(|e| e.oom_killed),
    })
}

/// The PLEG and the comparison relist, paired.
struct Compare {
    pleg: Pleg,
    compare: Pleg,
    correlator: Correlator,
    clock: SharedClock,
    start_wall_ns: i64,
    stats: Arc<ObserveStats>,
    out: mpsc::Sender<ObservedEvent>,
}

impl Compare {
    async fn run(
        mut self,
        mut pleg_rx: mpsc::Receiver<PodLifecycleEvent>,
        mut compare_rx: mpsc::Receiver<PodLifecycleEvent>,
        shutdown: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let done = tokio::select! {
                ev = pleg_rx.recv() => match ev {
                    Some(ev) => self.event(Side::Pleg, &ev).await,
                    None => false,
                },
                ev = compare_rx.recv() => match ev {
                    Some(ev) => self.event(Side::Relist, &ev).await,
                    None => false,
                },
                _ = tick.tick() => {
                    let now = self.clock.now_ns();
                    let mut ok = true;
                    for c in self.correlator.tick(now) {
                        ok &= self.emit(c).await;
                    }
                    ok
                }
                () = shutdown.cancelled() => false,
            };
            if !done {
                break;
            }
        }
        self.pleg.stop().await;
        self.compare.stop().await;
    }

    /// Whether a relist-sourced report is about a transition from before the
    /// start (the first relists report every existing container).
    fn before_start(&self, cache: &PodStatusCache, ev: &PodLifecycleEvent, t: Transition) -> bool {
        if ev.source == EventSource::Kernel {
            return false;
        }
        let at = ev
            .pod_uid
            .as_ref()
            .and_then(|uid| cache.get(uid))
            .and_then(|e| {
                let c = e.status.container(ev.container_id.as_ref()?)?.clone();
                match t {
                    Transition::Started => c.started_at,
                    Transition::Died => c.finished_at,
                }
            });
        at.is_some_and(|at| at > 0 && at < self.start_wall_ns)
    }

    /// One side's event; false once nobody reads the output.
    async fn event(&mut self, side: Side, ev: &PodLifecycleEvent) -> bool {
        let Some(t) = Transition::of(ev.kind) else {
            return true;
        };
        let cache = match side {
            Side::Pleg => &self.pleg.cache,
            Side::Relist => &self.compare.cache,
        };
        if self.before_start(cache, ev, t) {
            return true;
        }
        let status = ev.pod_uid.as_ref().and_then(|u| cache.get(u));
        let Some(seen) = seen_of(ev, t, status.as_ref().map(|e| &*e.status)) else {
            return true;
        };
        match self.correlator.report(side, seen, self.clock.now_ns()) {
            Some(c) => self.emit(c).await,
            None => true,
        }
    }

    /// Prints one comparison; false once nobody reads the events.
    async fn emit(&self, c: Compared) -> bool {
        match (&c.lead_ns, &c.pleg, &c.relist) {
            (Some(lead), _, _) => self.stats.lead_seconds.observe(*lead as f64 / 1e9),
            (None, Some(_), None) => {
                self.stats.relist_missed.inc();
            }
            (None, None, Some(_)) => {
                self.stats.pleg_missed.inc();
            }
            _ => {}
        }
        if c.disagreement
            .as_deref()
            .is_some_and(|d| d.starts_with("exit code"))
        {
            self.stats.exit_code_mismatches.inc();
        }
        // Names from the comparison relist's cache (the fullest view), else
        // the PLEG's.
        let first = c.first();
        let status = first.pod_uid.as_ref().and_then(|u| {
            self.compare
                .cache
                .get(u)
                .filter(|e| e.status.container(&first.container_id).is_some())
                .or_else(|| self.pleg.cache.get(u))
        });
        let line = ObservedEvent::new(&c, status.as_ref().map(|e| &*e.status), self.clock.now_ns());
        self.out.send(line).await.is_ok()
    }
}
