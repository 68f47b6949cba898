//! The `evented-cri` PLEGs: the CRI event stream (`GetContainerEvents`) as
//! the kubelet's Evented PLEG uses it, for comparison with the kernel PLEG.
//! Two designs, both the kubelet's ([`Design`]):
//!
//! - **1.37, "events are hints"** (`--pleg evented-cri`; kubernetes/kubernetes#139262):
//!   the generic 1 s relist always runs; each CONTAINER_STOPPED asks the relist
//!   PLEG for an on-demand relist of its pod
//!   ([`super::relist::RelistPleg::relist_pod`]), which inspects the runtime
//!   and writes the cache and sends the lifecycle events exactly as a periodic
//!   relist would; CREATED, STARTED and DELETED only feed the latency metric
//!   (a started container is found by the relist the pod worker asks for after
//!   its sync, or by the 1 s relist). Nothing in an event (state, exit code,
//!   timestamps) reaches the cache.
//! - **1.26 to 1.36** (`--pleg evented-cri-1.26`): each event's payload is the
//!   pod's status, the relist runs every 300 s, and after 5 failed streams the
//!   design falls back to the generic 1 s relist for good
//!   ([`super::evented_payload`]).
//!
//! This task reads the stream in both; what an event does is the design's.
//!
//! # What it reproduces from the kubelet (1.37)
//!
//! - The redesign's contract: a STOPPED event is a hint that triggers a relist
//!   of one pod, the generic relist always runs, the stream is reconnected
//!   forever with a capped exponential backoff with jitter, and drops are
//!   counted.
//! - The pod is found as the kubelet's `evented.go` finds it, from the event's
//!   `pod_sandbox_status`; here by its `io.kubernetes.pod.uid` label (then the
//!   labels of `containers_statuses`), the label [`evpleg_cri::runtime::CriRuntime`]
//!   attributes objects by. For pods the kubelet (or evpleg) created the label
//!   and `metadata.uid` are the same value. An event whose sandbox status is
//!   there but has no such label is not about a pod of this agent (the relist
//!   ignores such objects too) and is ignored; an event that names no pod at all
//!   asks for a full relist ([`RelistSignal`]).
//! - A broken event path degrades to relisting and never makes the node
//!   unhealthy by itself: health stays the relist's ("pleg was last seen
//!   active ..."), the stream's state is only reported in [`EventedCriStats`].
//!
//! # Where it differs (1.37)
//!
//! - `--relist-period` overrides the 1 s (the tests set a long one to see the
//!   event path alone).
//! - Runtimes without the stream (Debian bookworm's containerd 1.6.20 answers
//!   `Unimplemented`) are logged once and probed again only every
//!   [`EventedCriConfig::unimplemented_retry`] (a runtime upgrade restarts it),
//!   never in a busy loop; the 1 s relist carries the mode meanwhile.
//! - Events missed while the stream was down are not replayed by the runtime:
//!   once a new stream has subscribed after an outage (its call has been
//!   pending for [`EventedCriConfig::subscribed_after`], or it opened), a full
//!   relist is requested, so that nothing that happened in the gap waits for
//!   the next period.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use evpleg_cri_api::v1;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::evented_payload::{MAX_STREAM_RETRIES, PayloadSink, Taken};
use super::on_demand::PodRelistQueue;
use evpleg_core::clock::SharedClock;
use evpleg_core::ids::PodUid;
use evpleg_core::labels;
use evpleg_core::lifecycle::RelistSignal;
use evpleg_cri::{BackoffConfig, CriClient, CriError};

/// Timing of the stream's reconnection.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EventedCriConfig {
    /// Delays between attempts after a failure: 200 ms doubling up to 30 s,
    /// +-20 % jitter so that agents restarted with their runtime spread out.
    pub backoff: BackoffConfig,
    /// The delay after an `Unimplemented` answer (+-20 % jitter): 5 min.
    pub unimplemented_retry: Duration,
    /// A stream that lived this long, or delivered an event, counts as healthy:
    /// the backoff starts again from its base after it breaks.
    pub healthy_after: Duration,
    /// A new stream whose call has neither failed nor opened after this long is
    /// taken as subscribed (containerd's headers come only with an event): the
    /// full relist that covers an outage's lost events runs then.
    pub subscribed_after: Duration,
}

impl Default for EventedCriConfig {
    fn default() -> Self {
        Self {
            backoff: BackoffConfig {
                base: Duration::from_millis(200),
                max: Duration::from_secs(30),
                multiplier: 2.0,
                jitter: 0.2,
            },
            unimplemented_retry: Duration::from_secs(300),
            healthy_after: Duration::from_secs(10),
            subscribed_after: Duration::from_millis(100),
        }
    }
}

/// Counters and state of the event stream.
#[derive(Debug, Default)]
pub struct EventedCriStats {
    /// Attempts to open the stream.
    pub connects: AtomicU64,
    /// Streams that opened (the runtime sent the response headers; containerd
    /// does that with the first event).
    pub streams: AtomicU64,
    /// Events received.
    pub events: AtomicU64,
    /// On-demand pod relists requested from events.
    pub pod_relists: AtomicU64,
    /// Events that named no pod: a full relist was requested for each.
    pub unattributed: AtomicU64,
    /// Events about objects without the pod UID label (not this agent's).
    pub foreign: AtomicU64,
    /// Failed attempts and broken or ended streams.
    pub failures: AtomicU64,
    /// Attempts the runtime answered with `Unimplemented`.
    pub unimplemented: AtomicU64,
    /// Full relists requested once a stream is back after an outage (the
    /// runtime does not replay the events of the gap).
    pub resync_relists: AtomicU64,
    /// A stream is open and has not failed since.
    pub connected: AtomicBool,
    /// The 1.26-1.36 design: events whose payload the cache did not take (it
    /// held a newer status).
    pub stale: AtomicU64,
    /// The 1.26-1.36 design gave up the stream after its failures and the
    /// relist is back at the generic period.
    pub fallen_back: AtomicBool,
    /// Monotonic ns (the agent's clock) of the last event, 0 before the first.
    pub last_event_ns: AtomicU64,
    /// From an event's creation by the runtime to its receipt (the kubelet's
    /// `evented_pleg_connection_latency_seconds`).
    pub latency_seconds: evpleg_core::metrics::DefHistogram,
}

/// Which of the kubelet's Evented PLEG designs a stream serves.
#[derive(Debug)]
pub enum Design {
    /// 1.37: STOPPED relists its pod, the rest feeds the latency metric.
    Hints,
    /// 1.26-1.36: the payload is the pod's status ([`super::evented_payload`]).
    Payload(PayloadSink),
}

/// What became of one event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hint {
    /// An on-demand relist of this pod was requested.
    Pod(PodUid),
    /// Not a STOPPED event (1.37): the latency metric only.
    LatencyOnly,
    /// 1.26-1.36: the payload was stored as the pod's status and these
    /// events sent (or the cache held a newer status: stored nothing).
    Payload(Taken),
    /// The pod is unknown: a full relist was requested.
    FullRelist,
    /// Not about a pod of this agent.
    Foreign,
}

/// Whose an event is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventPod {
    /// A pod of this agent.
    Pod(PodUid),
    /// The sandbox status is there without the pod UID label: an object this
    /// agent does not manage.
    Foreign,
    /// Nothing in the event names a pod.
    Unknown,
}

/// The pod an event is about, by the `io.kubernetes.pod.uid` label of its
/// sandbox status, or of its container statuses.
pub fn pod_of_event(event: &v1::ContainerEventResponse) -> EventPod {
    let label = |l: &std::collections::HashMap<String, String>| {
        l.get(labels::POD_UID).and_then(|u| PodUid::parse(u))
    };
    let from_containers = || {
        event
            .containers_statuses
            .iter()
            .find_map(|c| label(&c.labels))
    };
    let sandbox = event
        .pod_sandbox_status
        .as_ref()
        .filter(|s| !s.id.is_empty() || s.metadata.is_some());
    match (
        sandbox,
        sandbox
            .and_then(|s| label(&s.labels))
            .or_else(from_containers),
    ) {
        (_, Some(uid)) => EventPod::Pod(uid),
        (Some(_), None) => EventPod::Foreign,
        (None, None) => EventPod::Unknown,
    }
}

/// The task that consumes `GetContainerEvents`.
#[derive(Debug)]
pub struct EventedCri {
    client: CriClient,
    pod_relist: Arc<PodRelistQueue>,
    relist: Arc<RelistSignal>,
    stats: Arc<EventedCriStats>,
    clock: SharedClock,
    config: EventedCriConfig,
    design: Design,
}

/// How one stream ended.
enum Ended {
    Shutdown,
    /// It failed or ended; `healthy` when it had been up long enough or
    /// delivered events (the backoff restarts from its base).
    Broken {
        healthy: bool,
        error: Option<CriError>,
    },
    Unimplemented(CriError),
}

impl EventedCri {
    pub fn new(
        client: CriClient,
        pod_relist: Arc<PodRelistQueue>,
        relist: Arc<RelistSignal>,
        stats: Arc<EventedCriStats>,
        clock: SharedClock,
        config: EventedCriConfig,
        design: Design,
    ) -> Self {
        Self {
            client,
            pod_relist,
            relist,
            stats,
            clock,
            config,
            design,
        }
    }

    /// What the design does with one event: 1.37 turns a STOPPED into a relist
    /// of its pod (a full relist when no pod is named); 1.26-1.36 stores the
    /// payload as the pod's status.
    pub fn handle(&self, event: &v1::ContainerEventResponse) -> Hint {
        self.stats.events.fetch_add(1, Ordering::Relaxed);
        self.stats
            .last_event_ns
            .store(self.clock.now_ns(), Ordering::Relaxed);
        let pod = pod_of_event(event);
        if let Design::Payload(sink) = &self.design {
            return match pod {
                EventPod::Pod(uid) => {
                    let taken = sink.take(&uid, event, &self.clock);
                    if taken == Taken::Stale {
                        self.stats.stale.fetch_add(1, Ordering::Relaxed);
                    }
                    Hint::Payload(taken)
                }
                // No sandbox status: the kubelet drops the event.
                EventPod::Unknown => Hint::Payload(Taken::NoSandbox),
                EventPod::Foreign => {
                    self.stats.foreign.fetch_add(1, Ordering::Relaxed);
                    Hint::Foreign
                }
            };
        }
        let stopped =
            event.container_event_type == v1::ContainerEventType::ContainerStoppedEvent as i32;
        match pod {
            EventPod::Pod(_) | EventPod::Unknown if !stopped => Hint::LatencyOnly,
            EventPod::Pod(uid) => {
                debug!(pod = %uid, container = event.container_id,
                       kind = ?v1::ContainerEventType::try_from(event.container_event_type).ok(),
                       "cri event: relisting the pod");
                self.pod_relist.request(uid.clone());
                self.stats.pod_relists.fetch_add(1, Ordering::Relaxed);
                Hint::Pod(uid)
            }
            EventPod::Unknown => {
                self.stats.unattributed.fetch_add(1, Ordering::Relaxed);
                self.relist.request("cri event without a pod uid");
                Hint::FullRelist
            }
            EventPod::Foreign => {
                self.stats.foreign.fetch_add(1, Ordering::Relaxed);
                Hint::Foreign
            }
        }
    }

    /// 1.26-1.36 after a failed stream (`watchEventsChannel`): a forced full
    /// relist, and at [`MAX_STREAM_RETRIES`] failures the fallback. Returns
    /// whether the stream is to be opened again (at once, as the kubelet).
    fn payload_failed(&self, attempts: &mut u32) -> bool {
        let Design::Payload(sink) = &self.design else {
            return true;
        };
        *attempts += 1;
        self.relist
            .request("cri event stream failed (evented pleg 1.26-1.36)");
        if *attempts < MAX_STREAM_RETRIES {
            return true;
        }
        warn!(
            attempts = *attempts,
            "evented pleg (1.26-1.36): falling back to the generic relist every {}s for good",
            super::relist::GENERIC_PERIOD.as_secs()
        );
        sink.fall_back();
        self.stats.fallen_back.store(true, Ordering::Relaxed);
        false
    }

    /// Runs until `shutdown`: opens the stream, passes its events on, and opens
    /// it again after every failure: 1.37 forever, with backoff; 1.26-1.36 at
    /// once, until its fallback (then the task idles until `shutdown`).
    pub async fn run(self, shutdown: CancellationToken) {
        if matches!(self.design, Design::Payload(_)) {
            let mut attempts = 0;
            let mut resync = false;
            info!("evented pleg (1.26-1.36): consuming GetContainerEvents");
            loop {
                match self.one_stream(&shutdown, &mut resync).await {
                    Ended::Shutdown => break,
                    Ended::Unimplemented(e) | Ended::Broken { error: Some(e), .. } => {
                        debug!(error = %e, "GetContainerEvents failed");
                    }
                    Ended::Broken { error: None, .. } => {}
                }
                if !self.payload_failed(&mut attempts) {
                    shutdown.cancelled().await;
                    break;
                }
            }
            self.stats.connected.store(false, Ordering::Relaxed);
            return;
        }
        let mut backoff = evpleg_cri::Backoff::new(self.config.backoff);
        let mut logged_unimplemented = false;
        let mut outage_logged = false;
        // A full relist is owed once the next stream subscribes.
        let mut resync = false;
        info!("evented-cri pleg: consuming GetContainerEvents");
        loop {
            let delay = match self.one_stream(&shutdown, &mut resync).await {
                Ended::Shutdown => break,
                Ended::Unimplemented(e) => {
                    if !logged_unimplemented {
                        warn!(error = %e, retry_s = self.config.unimplemented_retry.as_secs(),
                              "the runtime does not implement GetContainerEvents (containerd before 1.7): \
                               evented-cri keeps relisting and probes the stream again rarely");
                        logged_unimplemented = true;
                    } else {
                        debug!(error = %e, "GetContainerEvents still unimplemented");
                    }
                    jittered(self.config.unimplemented_retry, self.config.backoff.jitter)
                }
                Ended::Broken { healthy, error } => {
                    // Events from now until the next stream subscribes are lost.
                    resync = true;
                    if healthy {
                        backoff = evpleg_cri::Backoff::new(self.config.backoff);
                        outage_logged = false;
                    }
                    let delay = backoff.next_delay();
                    let error = error
                        .map(|e| e.to_string())
                        .unwrap_or_else(|| "the stream ended".into());
                    if outage_logged {
                        debug!(
                            error,
                            ?delay,
                            "GetContainerEvents: still failing; trying again"
                        );
                    } else {
                        warn!(
                            error,
                            ?delay,
                            "GetContainerEvents stream lost; reconnecting (relisting meanwhile)"
                        );
                        outage_logged = true;
                    }
                    delay
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(delay) => {}
            }
        }
        self.stats.connected.store(false, Ordering::Relaxed);
        info!("evented-cri pleg stopped");
    }

    /// After an outage, once the new stream has subscribed: a full relist, for
    /// what happened while no stream was there.
    fn resync(&self, resync: &mut bool) {
        if std::mem::take(resync) {
            self.stats.resync_relists.fetch_add(1, Ordering::Relaxed);
            self.relist
                .request("cri event stream back after an outage: events of the gap are lost");
        }
    }

    /// Opens one stream and reads it until it breaks or `shutdown`. `resync`:
    /// a full relist is owed once it has subscribed.
    async fn one_stream(&self, shutdown: &CancellationToken, resync: &mut bool) -> Ended {
        self.stats.connects.fetch_add(1, Ordering::Relaxed);
        let opened_at = Instant::now();
        // Resolves when the runtime sends the response headers: containerd does
        // that only with the first event, hence this task of its own.
        let call = self.client.get_container_events();
        tokio::pin!(call);
        let subscribed = tokio::time::sleep(self.config.subscribed_after);
        tokio::pin!(subscribed);
        let result = loop {
            tokio::select! {
                () = shutdown.cancelled() => return Ended::Shutdown,
                r = &mut call => break r,
                () = &mut subscribed, if *resync => self.resync(resync),
            }
        };
        let mut stream = match result {
            Ok(s) => {
                self.resync(resync);
                s
            }
            Err(e) if e.code() == Some(tonic::Code::Unimplemented) => {
                self.stats.unimplemented.fetch_add(1, Ordering::Relaxed);
                return Ended::Unimplemented(e);
            }
            Err(e) => {
                self.stats.failures.fetch_add(1, Ordering::Relaxed);
                // Waited long for the headers: the connection was fine.
                let healthy = opened_at.elapsed() >= self.config.healthy_after;
                return Ended::Broken {
                    healthy,
                    error: Some(e),
                };
            }
        };
        self.stats.streams.fetch_add(1, Ordering::Relaxed);
        self.stats.connected.store(true, Ordering::Relaxed);
        let mut delivered = false;
        loop {
            let next = tokio::select! {
                () = shutdown.cancelled() => return Ended::Shutdown,
                m = stream.message() => m,
            };
            match next {
                Ok(Some(event)) => {
                    delivered = true;
                    let age_ns =
                        evpleg_core::clock::wall_clock_ns().saturating_sub(event.created_at);
                    self.stats
                        .latency_seconds
                        .0
                        .observe(age_ns.max(0) as f64 / 1e9);
                    self.handle(&event);
                }
                Ok(None) => {
                    self.stats.failures.fetch_add(1, Ordering::Relaxed);
                    self.stats.connected.store(false, Ordering::Relaxed);
                    let healthy = delivered || opened_at.elapsed() >= self.config.healthy_after;
                    return Ended::Broken {
                        healthy,
                        error: None,
                    };
                }
                Err(status) => {
                    self.stats.failures.fetch_add(1, Ordering::Relaxed);
                    self.stats.connected.store(false, Ordering::Relaxed);
                    let healthy = delivered || opened_at.elapsed() >= self.config.healthy_after;
                    let error = CriError::from_status(
                        "GetContainerEvents",
                        evpleg_cri::Target::Runtime(Arc::from(self.client.endpoint())),
                        &status,
                    );
                    return Ended::Broken {
                        healthy,
                        error: Some(error),
                    };
                }
            }
        }
    }
}

/// `d` spread by a uniform factor in `[1 - jitter, 1 + jitter]`.
fn jittered(d: Duration, jitter: f64) -> Duration {
    let jitter = jitter.clamp(0.0, 0.99);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|t| t.subsec_nanos())
        .unwrap_or(0);
    let unit = f64::from(nanos % 1_000_000) / 1_000_000.0;
    d.mul_f64(1.0 - jitter + 2.0 * jitter * unit)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use evpleg_core::clock::ManualClock;
    use evpleg_cri::CriClientConfig;

    const UID: &str = "1b4e28ba-2fa1-11d2-883f-0016d3cca427";

    fn sandbox(labels: &[(&str, &str)]) -> v1::PodSandboxStatus {
        v1::PodSandboxStatus {
            id: "a".repeat(64),
            metadata: Some(v1::PodSandboxMetadata {
                name: "web".into(),
                uid: UID.into(),
                namespace: "default".into(),
                attempt: 0,
            }),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..Default::default()
        }
    }

    fn container(labels: &[(&str, &str)]) -> v1::ContainerStatus {
        v1::ContainerStatus {
            id: "c".repeat(64),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<HashMap<_, _>>(),
            ..Default::default()
        }
    }

    fn event(
        sandbox: Option<v1::PodSandboxStatus>,
        containers: Vec<v1::ContainerStatus>,
    ) -> v1::ContainerEventResponse {
        v1::ContainerEventResponse {
            container_id: "c".repeat(64),
            container_event_type: v1::ContainerEventType::ContainerStoppedEvent as i32,
            created_at: 1,
            pod_sandbox_status: sandbox,
            containers_statuses: containers,
        }
    }

    #[test]
    fn the_pod_comes_from_the_labels() {
        let uid = PodUid::parse(UID).unwrap();
        let labelled = sandbox(&[(labels::POD_UID, UID)]);
        let ours = EventPod::Pod(uid);
        assert_eq!(pod_of_event(&event(Some(labelled), vec![])), ours);
        // Sandbox status without labels, a container status with them.
        let bare = sandbox(&[]);
        let c = container(&[(labels::POD_UID, UID)]);
        assert_eq!(
            pod_of_event(&event(Some(bare.clone()), vec![c.clone()])),
            ours
        );
        // No sandbox status (it is gone): the containers' labels.
        assert_eq!(pod_of_event(&event(None, vec![c])), ours);
        // An object without the label is not ours, even with a metadata uid.
        assert_eq!(
            pod_of_event(&event(Some(bare), vec![container(&[])])),
            EventPod::Foreign
        );
        // Nothing names a pod.
        assert_eq!(pod_of_event(&event(None, vec![])), EventPod::Unknown);
        let empty = v1::PodSandboxStatus::default();
        assert_eq!(pod_of_event(&event(Some(empty), vec![])), EventPod::Unknown);
    }

    async fn fixture() -> (EventedCri, Arc<PodRelistQueue>) {
        let client = CriClient::connect_unchecked(
            "unix:///nonexistent/evpleg.sock",
            CriClientConfig::default(),
        )
        .await
        .unwrap();
        let rx = Arc::new(PodRelistQueue::new(Arc::new(ManualClock::new(5))));
        let evented = EventedCri::new(
            client,
            rx.clone(),
            Arc::new(RelistSignal::new()),
            Arc::new(EventedCriStats::default()),
            Arc::new(ManualClock::new(5)),
            EventedCriConfig::default(),
            Design::Hints,
        );
        (evented, rx)
    }

    #[tokio::test]
    async fn events_are_hints_counted_by_outcome() {
        let (evented, rx) = fixture().await;
        let uid = PodUid::parse(UID).unwrap();
        let ours = event(Some(sandbox(&[(labels::POD_UID, UID)])), vec![]);
        assert_eq!(evented.handle(&ours), Hint::Pod(uid.clone()));
        let taken = rx.take();
        assert_eq!(taken.len(), 1);
        assert_eq!(
            (&taken[0].0, taken[0].1.at_ns, taken[0].1.watch),
            (&uid, 5, crate::on_demand::Watch::Once)
        );
        assert_eq!(evented.handle(&event(None, vec![])), Hint::FullRelist);
        assert_eq!(evented.relist.count(), 1);
        assert_eq!(
            evented.handle(&event(Some(sandbox(&[])), vec![])),
            Hint::Foreign
        );
        let s = &evented.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        assert_eq!(
            (
                get(&s.events),
                get(&s.pod_relists),
                get(&s.unattributed),
                get(&s.foreign),
            ),
            (3, 1, 1, 1)
        );
        assert_eq!(get(&s.last_event_ns), 5);
    }

    /// 1.37: only CONTAINER_STOPPED relists its pod; the other types feed the
    /// latency metric alone.
    #[tokio::test]
    async fn only_stopped_events_relist_their_pod() {
        use v1::ContainerEventType as T;
        let (evented, rx) = fixture().await;
        let uid = PodUid::parse(UID).unwrap();
        let table = [
            (T::ContainerCreatedEvent, Hint::LatencyOnly),
            (T::ContainerStartedEvent, Hint::LatencyOnly),
            (T::ContainerDeletedEvent, Hint::LatencyOnly),
            (T::ContainerStoppedEvent, Hint::Pod(uid.clone())),
        ];
        for (kind, hint) in table {
            let mut e = event(Some(sandbox(&[(labels::POD_UID, UID)])), vec![]);
            e.container_event_type = kind as i32;
            assert_eq!(evented.handle(&e), hint, "{kind:?}");
            let relists = rx.take().len();
            assert_eq!(
                relists,
                usize::from(kind == T::ContainerStoppedEvent),
                "{kind:?}"
            );
        }
        // Naming no pod: only a STOPPED asks for a full relist.
        let mut started = event(None, vec![]);
        started.container_event_type = T::ContainerStartedEvent as i32;
        assert_eq!(evented.handle(&started), Hint::LatencyOnly);
        assert_eq!(evented.relist.count(), 0);
        assert_eq!(evented.stats.events.load(Ordering::Relaxed), 5);
    }

    /// 1.26-1.36 with no runtime at all: each failure forces a full relist,
    /// the stream is opened again at once, and the fifth failure falls back
    /// to the generic period for good; the task then idles until shutdown.
    #[tokio::test(start_paused = true)]
    async fn the_payload_design_falls_back_after_five_failures() {
        let (hints, _rx) = fixture().await;
        let (events, _events_rx) = tokio::sync::mpsc::channel(10);
        let (period, period_rx) =
            tokio::sync::watch::channel(crate::evented_payload::RELIST_PERIOD);
        let sink = PayloadSink {
            cache: Arc::new(evpleg_core::cache::PodStatusCache::new()),
            events,
            reports: Arc::default(),
            period,
            evented_in_use: CancellationToken::new(),
        };
        let stop = sink.evented_in_use.clone();
        let evented = EventedCri {
            design: Design::Payload(sink),
            ..hints
        };
        let stats = evented.stats.clone();
        let relist = evented.relist.clone();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(evented.run(shutdown.clone()));
        tokio::time::timeout(Duration::from_secs(5), stop.cancelled())
            .await
            .expect("fell back");
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        assert_eq!((get(&stats.connects), get(&stats.failures)), (5, 5));
        assert_eq!(relist.count(), 5, "a full relist forced by each failure");
        assert!(stats.fallen_back.load(Ordering::Relaxed));
        assert_eq!(*period_rx.borrow(), crate::relist::GENERIC_PERIOD);
        // No sixth attempt, and the task is still there (its end would fail
        // the agent's health).
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(get(&stats.connects), 5);
        assert!(!task.is_finished());
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .unwrap()
            .unwrap();
    }

    /// No runtime at all: the task keeps trying with growing delays, never in a
    /// busy loop, and stops on shutdown.
    #[tokio::test(start_paused = true)]
    async fn a_missing_runtime_is_retried_with_capped_backoff() {
        let (evented, _rx) = fixture().await;
        let stats = evented.stats.clone();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(evented.run(shutdown.clone()));
        // Connecting to a missing socket fails at once; the delays are 200 ms,
        // 400 ms, 800 ms, ... (+-20 %), capped at 30 s.
        tokio::time::sleep(Duration::from_secs(60)).await;
        let connects = stats.connects.load(Ordering::Relaxed);
        assert!((5..=12).contains(&connects), "{connects} attempts in 60 s");
        assert_eq!(stats.failures.load(Ordering::Relaxed), connects);
        assert!(!stats.connected.load(Ordering::Relaxed));
        assert_eq!(
            stats.resync_relists.load(Ordering::Relaxed),
            0,
            "no stream was ever up"
        );
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .unwrap()
            .unwrap();
    }

    #[test]
    fn jitter_stays_within_bounds() {
        for _ in 0..100 {
            let d = jittered(Duration::from_secs(10), 0.2);
            assert!(
                d >= Duration::from_secs(8) && d <= Duration::from_secs(12),
                "{d:?}"
            );
        }
    }
}
