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
//! # What it reproduces from the kubelet (1.37.2, `pkg/kubelet/pleg/evented.go`)
//!
//! - The redesign's contract: a STOPPED event is a hint that triggers a relist
//!   of one pod, the generic relist always runs.
//! - `watchEventsChannel`: a stream that fails or ends is opened again at
//!   once, without a back-off; every failure counts, over the task's whole
//!   life (the count is never reset, not even by a stream that delivered
//!   events for hours), and at [`MAX_STREAM_RETRIES`] (the kubelet's
//!   `eventedPlegMaxStreamRetries`, 5) the fast path is off until the agent
//!   restarts: warned, `fallen_back` in [`EventedCriStats`], the relist goes
//!   on. A runtime without the stream (containerd 1.6 answers
//!   `Unimplemented`) uses up the five at once, as it does the kubelet's;
//!   so does a runtime restart whose socket is away for the next four
//!   attempts.
//! - `processCRIEvents`: an event without a sandbox status (or without its
//!   metadata) is dropped, counted in `unattributed` (the kubelet logs an
//!   error).
//! - The pod is found from the event's `pod_sandbox_status`; the kubelet reads
//!   its `metadata.uid`, here its `io.kubernetes.pod.uid` label (then the
//!   labels of `containers_statuses`), the label [`evpleg_cri::runtime::CriRuntime`]
//!   attributes objects by. For pods the kubelet (or evpleg) created the label
//!   and `metadata.uid` are the same value. An event whose sandbox status is
//!   there but has no such label is not about a pod of this agent (the relist
//!   ignores such objects too) and is ignored.
//! - A broken event path degrades to relisting and never makes the node
//!   unhealthy by itself: health stays the relist's ("pleg was last seen
//!   active ..."), the stream's state is only reported in [`EventedCriStats`].
//!
//! # Where it differs (1.37)
//!
//! - `--relist-period` overrides the 1 s (the tests set a long one to see the
//!   event path alone).
//! - Events missed while the stream was down are not replayed by the runtime:
//!   once a new stream has subscribed after an outage (its call has been
//!   pending for [`EventedCriConfig::subscribed_after`], or it opened), a full
//!   relist is requested, so that nothing that happened in the gap waits for
//!   the next period.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use evpleg_cri_api::v1;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::evented_payload::{MAX_STREAM_RETRIES, PayloadSink, Taken};
use super::on_demand::PodRelistQueue;
use evpleg_core::clock::SharedClock;
use evpleg_core::ids::PodUid;
use evpleg_core::labels;
use evpleg_core::lifecycle::RelistSignal;
use evpleg_cri::{CriClient, CriError};

/// Timing of the stream's resubscription.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EventedCriConfig {
    /// A new stream whose call has neither failed nor opened after this long is
    /// taken as subscribed (containerd's headers come only with an event): the
    /// full relist that covers an outage's lost events runs then.
    pub subscribed_after: Duration,
}

impl Default for EventedCriConfig {
    fn default() -> Self {
        Self {
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
    /// 1.37: events without a sandbox status, dropped as the kubelet drops
    /// them.
    pub unattributed: AtomicU64,
    /// Events about objects without the pod UID label (not this agent's).
    pub foreign: AtomicU64,
    /// Failed attempts and broken or ended streams (an attempt answered
    /// `Unimplemented` is counted in `unimplemented` instead).
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
    /// The stream was given up after [`MAX_STREAM_RETRIES`] failures: the
    /// 1.26-1.36 design's relist is back at the generic period; 1.37's fast
    /// path is off (its relist goes on).
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
    /// 1.37: no sandbox status: dropped, as the kubelet drops it.
    Dropped,
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
    /// It failed (the runtime's error) or ended (`None`).
    Broken(Option<CriError>),
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
        // `processCRIEvents`: no sandbox status (or no metadata in it), no
        // event.
        if event
            .pod_sandbox_status
            .as_ref()
            .and_then(|s| s.metadata.as_ref())
            .is_none()
        {
            self.stats.unattributed.fetch_add(1, Ordering::Relaxed);
            debug!(
                container = event.container_id,
                "cri event without a sandbox status: dropped, as the kubelet drops it"
            );
            return Hint::Dropped;
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
            // A sandbox status with metadata and without the label: not a
            // pod of this agent.
            EventPod::Unknown | EventPod::Foreign => {
                self.stats.foreign.fetch_add(1, Ordering::Relaxed);
                Hint::Foreign
            }
        }
    }

    /// After a failed stream (`watchEventsChannel`): 1.26-1.36 forces a full
    /// relist; at [`MAX_STREAM_RETRIES`] failures over the task's life the
    /// stream is given up (1.26-1.36 falls back to the generic period, 1.37
    /// turns its fast path off). Returns whether the stream is to be opened
    /// again (at once, as the kubelet).
    fn failed(&self, attempts: &mut u32) -> bool {
        *attempts += 1;
        if matches!(self.design, Design::Payload(_)) {
            self.relist
                .request("cri event stream failed (evented pleg 1.26-1.36)");
        }
        if *attempts < MAX_STREAM_RETRIES {
            return true;
        }
        match &self.design {
            Design::Payload(sink) => {
                warn!(
                    attempts = *attempts,
                    "evented pleg (1.26-1.36): falling back to the generic relist every {}s for good",
                    super::relist::GENERIC_PERIOD.as_secs()
                );
                sink.fall_back();
            }
            Design::Hints => warn!(
                attempts = *attempts,
                "evented pleg (1.37): disabling the container-termination fast path after exhausting \
                 the event stream's retries, as the kubelet does; the relist goes on"
            ),
        }
        self.stats.fallen_back.store(true, Ordering::Relaxed);
        false
    }

    /// Runs until `shutdown`: opens the stream, passes its events on, and
    /// opens it again at once after every failure until [`Self::failed`]
    /// gives it up (then the task idles until `shutdown`: its end would fail
    /// the agent's health).
    pub async fn run(self, shutdown: CancellationToken) {
        let mut attempts = 0;
        // A full relist is owed once the next stream subscribes (1.37).
        let mut resync = false;
        let hints = matches!(self.design, Design::Hints);
        info!(
            design = if hints { "1.37" } else { "1.26-1.36" },
            "evented pleg: consuming GetContainerEvents"
        );
        loop {
            match self.one_stream(&shutdown, &mut resync).await {
                Ended::Shutdown => break,
                Ended::Broken(error) => {
                    let error = error
                        .map(|e| e.to_string())
                        .unwrap_or_else(|| "the stream ended".into());
                    warn!(
                        error,
                        attempt = attempts + 1,
                        max = MAX_STREAM_RETRIES,
                        "GetContainerEvents failed; opening it again at once (relisting meanwhile)"
                    );
                }
            }
            // Events from now until the next stream subscribes are lost.
            resync = hints;
            if !self.failed(&mut attempts) {
                shutdown.cancelled().await;
                break;
            }
        }
        self.stats.connected.store(false, Ordering::Relaxed);
        info!("evented pleg stopped");
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
            Err(e) => {
                // Counted once: `unimplemented` or `failures` (the metric
                // `evented_pleg_connection_error_count` is their sum).
                let counter = if e.code() == Some(tonic::Code::Unimplemented) {
                    &self.stats.unimplemented
                } else {
                    &self.stats.failures
                };
                counter.fetch_add(1, Ordering::Relaxed);
                return Ended::Broken(Some(e));
            }
        };
        self.stats.streams.fetch_add(1, Ordering::Relaxed);
        self.stats.connected.store(true, Ordering::Relaxed);
        loop {
            let next = tokio::select! {
                () = shutdown.cancelled() => return Ended::Shutdown,
                m = stream.message() => m,
            };
            match next {
                Ok(Some(event)) => {
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
                    return Ended::Broken(None);
                }
                Err(status) => {
                    self.stats.failures.fetch_add(1, Ordering::Relaxed);
                    self.stats.connected.store(false, Ordering::Relaxed);
                    let error = CriError::from_status(
                        "GetContainerEvents",
                        evpleg_cri::Target::Runtime(Arc::from(self.client.endpoint())),
                        &status,
                    );
                    return Ended::Broken(Some(error));
                }
            }
        }
    }
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
        // No sandbox status, or one without metadata: dropped, as the
        // kubelet's processCRIEvents drops it (a full relist before).
        let labelled = container(&[(labels::POD_UID, UID)]);
        assert_eq!(evented.handle(&event(None, vec![labelled])), Hint::Dropped);
        let no_metadata = v1::PodSandboxStatus {
            metadata: None,
            ..sandbox(&[(labels::POD_UID, UID)])
        };
        assert_eq!(
            evented.handle(&event(Some(no_metadata), vec![])),
            Hint::Dropped
        );
        assert_eq!((evented.relist.count(), rx.take().len()), (0, 0));
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
            (4, 1, 2, 1)
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
        assert_eq!(evented.relist.count(), 0);
        assert_eq!(evented.stats.events.load(Ordering::Relaxed), 4);
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

    /// 1.37 with no runtime at all, as the kubelet's `watchEventsChannel`:
    /// the stream is opened again at once after each failure, no back-off;
    /// at the fifth the fast path is off for good (no sixth attempt, no full
    /// relist forced), and the task idles until shutdown.
    #[tokio::test(start_paused = true)]
    async fn the_hint_design_gives_up_the_stream_after_five_failures() {
        let (evented, _rx) = fixture().await;
        let stats = evented.stats.clone();
        let relist = evented.relist.clone();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(evented.run(shutdown.clone()));
        // Paused time that never advances while this loop only yields: the
        // five attempts come at once (a back-off would sleep, and the loop
        // would run out of turns), and there is no sixth.
        let mut turns = 0;
        while !stats.fallen_back.load(Ordering::Relaxed) {
            let connects = stats.connects.load(Ordering::Relaxed);
            assert!(connects <= 5, "a sixth attempt: {stats:?}");
            turns += 1;
            assert!(
                turns < 100_000,
                "did not give up the stream at once: {stats:?}"
            );
            tokio::task::yield_now().await;
        }
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        assert_eq!((get(&stats.connects), get(&stats.failures)), (5, 5));
        assert_eq!(relist.count(), 0, "the 1 s relist goes on: nothing forced");
        tokio::time::sleep(Duration::from_secs(600)).await;
        assert_eq!(get(&stats.connects), 5, "no sixth attempt");
        assert!(!stats.connected.load(Ordering::Relaxed));
        assert!(!task.is_finished());
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .unwrap()
            .unwrap();
    }
}
