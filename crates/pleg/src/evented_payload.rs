//! The Evented PLEG of kubelets 1.26 to 1.36 (KEP-3386 as first merged,
//! `pkg/kubelet/pleg/evented.go`), for comparison: what a stock kubelet with
//! the `EventedPLEG` feature gate runs. [`super::evented_cri`] reads the
//! stream; this module is what that design does with each event.
//!
//! # What it reproduces from the kubelet
//!
//! - `processCRIEvents`: the event's payload *is* the pod's status. The pod
//!   status built from the event's `pod_sandbox_status` and
//!   `containers_statuses` (`GeneratePodStatus`: the sandbox status as the
//!   pod's only sandbox, the containers newest first) is written to the cache
//!   at the event's creation time (`cache.Set(..., time.Unix(0, CreatedAt))`),
//!   which keeps it only when nothing newer is there; then, and only then,
//!   the lifecycle event goes to the workers (`processCRIEvent`): STOPPED a
//!   died event, STARTED a started one, CREATED none, DELETED a died and a
//!   removed one and no cache write (the pod's entry is deleted when the
//!   deleted object is its sandbox). An event without a sandbox status (or
//!   without its metadata) is dropped, as the kubelet drops it.
//! - The generic relist slowed to 300 s (`eventedPlegRelistPeriod`) with a
//!   10 min health threshold (`eventedPlegRelistThreshold`; the agent's
//!   threshold is twice the period); the cache's global time advanced every
//!   2 s (`updateGlobalCache`, `globalCacheUpdatePeriod`) so that workers
//!   waiting in `GetNewerThan` for a pod no event changed are released.
//! - `watchEventsChannel`: every failed stream counts an attempt and forces a
//!   full relist; at 5 attempts (`eventedPlegMaxStreamRetries`, never reset)
//!   the Evented PLEG stops for good and the relist returns to the generic
//!   1 s. The kubelet opens the next stream at once, without a delay; so does
//!   this. A runtime without the stream (containerd 1.6: `Unimplemented`)
//!   therefore falls back within five attempts.
//!
//! # Where it differs
//!
//! - The pod is the one of the `io.kubernetes.pod.uid` label (as
//!   [`super::evented_cri::pod_of_event`] finds it), not the sandbox
//!   metadata's uid: the same value for pods the agent made.
//! - The event's creation time (the runtime's wall clock) is turned into the
//!   agent's monotonic clock by the event's age at receipt.
//! - Lifecycle events go through the same "delivered once" record as the
//!   relist's ([`super::relist::KernelReports`]), so the relist does not send
//!   a transition the stream delivered; the kubelet's relist, after its own
//!   cache check, may send such a duplicate (harmless to the workers).

use std::sync::Arc;
use std::time::Duration;

use evpleg_core::cache::PodStatusCache;
use evpleg_core::clock::SharedClock;
use evpleg_core::container::PodStatus;
use evpleg_core::ids::{ContainerId, PodUid};
use evpleg_core::lifecycle::{EventKind, EventSource, PodLifecycleEvent};
use evpleg_cri::runtime::{convert_container_status, sandbox_ips, sandbox_status};
use evpleg_cri_api::v1;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::relist::{Delivery, KernelReports};
use super::stages::{self, Stage};

/// The full relist's period while the stream is in use (`eventedPlegRelistPeriod`).
pub const RELIST_PERIOD: Duration = Duration::from_secs(300);
/// How often the cache's global time is advanced (`globalCacheUpdatePeriod`).
pub const GLOBAL_CACHE_UPDATE: Duration = Duration::from_secs(2);
/// Failed streams after which the design falls back to the generic relist
/// for good (`eventedPlegMaxStreamRetries`).
pub const MAX_STREAM_RETRIES: u32 = 5;

/// Where the payload design writes: the cache, the workers' channel, the
/// record of delivered transitions and the relist's period (for the fallback).
#[derive(Debug)]
pub struct PayloadSink {
    pub cache: Arc<PodStatusCache>,
    pub events: mpsc::Sender<PodLifecycleEvent>,
    pub reports: Arc<KernelReports>,
    pub period: watch::Sender<Duration>,
    /// Stops the global cache update at the fallback (the kubelet's `Stop`).
    pub evented_in_use: CancellationToken,
}

/// What the payload design did with one event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Taken {
    /// The status was stored (or the pod deleted) and these events sent.
    Sent(Vec<EventKind>),
    /// The cache held a newer status: nothing sent.
    Stale,
    /// No sandbox status (or no metadata): dropped, as the kubelet drops it.
    NoSandbox,
}

/// The pod status an event carries (`GeneratePodStatus`).
pub fn status_of_event(uid: &PodUid, event: &v1::ContainerEventResponse) -> Option<PodStatus> {
    let sandbox = event.pod_sandbox_status.as_ref()?;
    let meta = sandbox.metadata.as_ref()?;
    let mut status = PodStatus {
        uid: Some(uid.clone()),
        name: meta.name.clone(),
        namespace: meta.namespace.clone(),
        ips: sandbox_ips(Some(sandbox)),
        ..PodStatus::default()
    };
    if let Some(id) = ContainerId::parse(&sandbox.id) {
        status.sandboxes.push(sandbox_status(id, sandbox, None));
    }
    status.containers = event
        .containers_statuses
        .iter()
        .filter_map(convert_container_status)
        .collect();
    // Newest first, as the kubelet sorts them (`containerStatusByCreated`).
    status
        .containers
        .sort_by_key(|c| std::cmp::Reverse(c.created_at));
    Some(status)
}

/// The lifecycle events of an event type (`processCRIEvent`); `sandbox`
/// when the event's object is the pod's sandbox.
pub fn kinds_of(event_type: i32, sandbox: bool) -> Vec<EventKind> {
    use EventKind::*;
    use v1::ContainerEventType as T;
    let (started, died, removed) = if sandbox {
        (SandboxStarted, SandboxDied, SandboxRemoved)
    } else {
        (ContainerStarted, ContainerDied, ContainerRemoved)
    };
    match T::try_from(event_type) {
        Ok(T::ContainerStoppedEvent) => vec![died],
        Ok(T::ContainerStartedEvent) => vec![started],
        Ok(T::ContainerDeletedEvent) => vec![died, removed],
        Ok(T::ContainerCreatedEvent) | Err(_) => Vec::new(),
    }
}

impl PayloadSink {
    /// Takes one event of pod `uid` as the kubelet 1.26-1.36 does.
    pub fn take(
        &self,
        uid: &PodUid,
        event: &v1::ContainerEventResponse,
        clock: &SharedClock,
    ) -> Taken {
        let Some(status) = status_of_event(uid, event) else {
            return Taken::NoSandbox;
        };
        let sandbox = event
            .pod_sandbox_status
            .as_ref()
            .is_some_and(|s| s.id == event.container_id);
        let deleted =
            event.container_event_type == v1::ContainerEventType::ContainerDeletedEvent as i32;
        if deleted {
            if sandbox {
                self.cache.delete(uid);
            }
        } else {
            // The runtime's creation time on the agent's clock: now less the
            // event's age.
            let age = evpleg_core::clock::wall_clock_ns()
                .saturating_sub(event.created_at)
                .max(0) as u64;
            let at = clock.now_ns().saturating_sub(age);
            if !self.cache.set(uid, status, at) {
                return Taken::Stale;
            }
        }
        let Some(id) = ContainerId::parse(&event.container_id) else {
            return Taken::Sent(Vec::new());
        };
        let mut sent = Vec::new();
        for kind in kinds_of(event.container_event_type, sandbox) {
            let e = PodLifecycleEvent {
                pod_uid: Some(uid.clone()),
                kind,
                container_id: Some(id.clone()),
                at_ns: clock.now_ns(),
                source: EventSource::Cri,
                exit: None,
                pid: None,
            };
            let delivery = self
                .reports
                .deliver(&id, kind, e.at_ns, || self.events.try_send(e).is_ok());
            if delivery == Delivery::Sent {
                if kind.is_died() {
                    stages::record_now(Stage::Delivered, &id);
                }
                sent.push(kind);
            }
        }
        Taken::Sent(sent)
    }

    /// The fallback after [`MAX_STREAM_RETRIES`] failed streams: the relist
    /// back to the generic period, the global cache update stopped.
    pub fn fall_back(&self) {
        self.evented_in_use.cancel();
        self.period.send_replace(super::relist::GENERIC_PERIOD);
    }
}

/// `updateGlobalCache` every [`GLOBAL_CACHE_UPDATE`] until `stop` (the
/// fallback) or `shutdown`.
pub async fn update_global_cache(
    cache: Arc<PodStatusCache>,
    clock: SharedClock,
    stop: CancellationToken,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(GLOBAL_CACHE_UPDATE);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = shutdown.cancelled() => return,
            _ = tick.tick() => cache.update_time(clock.now_ns()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use evpleg_core::clock::ManualClock;
    use evpleg_core::labels;

    const UID: &str = "1b4e28ba-2fa1-11d2-883f-0016d3cca427";

    fn event(
        kind: v1::ContainerEventType,
        id: &str,
        state: v1::ContainerState,
    ) -> v1::ContainerEventResponse {
        let sandbox_id = "a".repeat(64);
        v1::ContainerEventResponse {
            container_id: id.to_owned(),
            container_event_type: kind as i32,
            created_at: evpleg_core::clock::wall_clock_ns(),
            pod_sandbox_status: Some(v1::PodSandboxStatus {
                id: sandbox_id,
                metadata: Some(v1::PodSandboxMetadata {
                    name: "web".into(),
                    uid: UID.into(),
                    namespace: "default".into(),
                    attempt: 0,
                }),
                state: v1::PodSandboxState::SandboxReady as i32,
                labels: [(labels::POD_UID.to_owned(), UID.to_owned())].into(),
                ..Default::default()
            }),
            containers_statuses: vec![v1::ContainerStatus {
                id: "c".repeat(64),
                state: state as i32,
                exit_code: 7,
                metadata: Some(v1::ContainerMetadata {
                    name: "app".into(),
                    attempt: 0,
                }),
                ..Default::default()
            }],
        }
    }

    fn sink() -> (PayloadSink, mpsc::Receiver<PodLifecycleEvent>) {
        let (tx, rx) = mpsc::channel(10);
        let (period, _) = watch::channel(RELIST_PERIOD);
        (
            PayloadSink {
                cache: Arc::new(PodStatusCache::new()),
                events: tx,
                reports: Arc::new(KernelReports::default()),
                period,
                evented_in_use: CancellationToken::new(),
            },
            rx,
        )
    }

    /// Each event type as `processCRIEvent` maps it, the payload stored as
    /// the pod's status before the event is sent.
    #[test]
    fn the_payload_is_the_status_and_the_type_the_event() {
        use v1::ContainerEventType as T;
        use v1::ContainerState as S;
        let uid = PodUid::parse(UID).unwrap();
        let manual = ManualClock::new(1_000_000_000_000);
        let clock: SharedClock = Arc::new(manual.clone());
        let c = "c".repeat(64);
        let sandbox = "a".repeat(64);
        // (event, object, state in the payload, what is sent, cached afterwards)
        let table = [
            (
                T::ContainerCreatedEvent,
                &c,
                S::ContainerCreated,
                vec![],
                true,
            ),
            (
                T::ContainerStartedEvent,
                &c,
                S::ContainerRunning,
                vec![EventKind::ContainerStarted],
                true,
            ),
            (
                T::ContainerStoppedEvent,
                &c,
                S::ContainerExited,
                vec![EventKind::ContainerDied],
                true,
            ),
            (
                T::ContainerDeletedEvent,
                &c,
                S::ContainerExited,
                vec![EventKind::ContainerRemoved],
                true,
            ),
            (
                T::ContainerDeletedEvent,
                &sandbox,
                S::ContainerExited,
                vec![EventKind::SandboxDied, EventKind::SandboxRemoved],
                false,
            ),
        ];
        let (sink, mut rx) = sink();
        for (kind, id, state, sent, cached) in table {
            // Each event a second after the last (their ages at receipt
            // differ by microseconds).
            manual.advance(1_000_000_000);
            let taken = sink.take(&uid, &event(kind, id, state), &clock);
            // The container's died was delivered by STOPPED: DELETED sends
            // only its removal.
            assert_eq!(taken, Taken::Sent(sent.clone()), "{kind:?}");
            for k in &sent {
                assert_eq!(rx.try_recv().unwrap().kind, *k, "{kind:?}");
            }
            assert!(rx.try_recv().is_err(), "{kind:?}: nothing more");
            let entry = sink.cache.get(&uid);
            assert_eq!(entry.is_some(), cached, "{kind:?}");
            if kind != T::ContainerDeletedEvent {
                let e = entry.unwrap();
                let app = &e.status.containers[0];
                assert_eq!(app.state, self::state(state), "{kind:?}");
                assert_eq!(e.status.sandboxes.len(), 1);
            }
        }
    }

    fn state(s: v1::ContainerState) -> evpleg_core::container::ContainerState {
        evpleg_cri::runtime::container_state(s as i32)
    }

    /// An event older than the cached status (a relist inspected the pod
    /// after the event was created) is not stored and not sent; one without
    /// a sandbox status is dropped.
    #[test]
    fn stale_and_sandboxless_events_are_dropped() {
        use v1::ContainerEventType as T;
        let uid = PodUid::parse(UID).unwrap();
        let clock: SharedClock = Arc::new(ManualClock::new(1_000_000_000_000));
        let (sink, mut rx) = sink();
        assert!(sink.cache.set(&uid, PodStatus::default(), clock.now_ns()));
        let mut old = event(
            T::ContainerStoppedEvent,
            &"c".repeat(64),
            v1::ContainerState::ContainerExited,
        );
        old.created_at -= 5_000_000_000;
        assert_eq!(sink.take(&uid, &old, &clock), Taken::Stale);
        let mut bare = old.clone();
        bare.pod_sandbox_status = None;
        assert_eq!(sink.take(&uid, &bare, &clock), Taken::NoSandbox);
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn the_global_time_advances_every_two_seconds_until_the_fallback() {
        let (sink, _rx) = sink();
        let clock = Arc::new(ManualClock::new(1));
        let shared: SharedClock = clock.clone();
        let task = tokio::spawn(update_global_cache(
            sink.cache.clone(),
            shared,
            sink.evented_in_use.clone(),
            CancellationToken::new(),
        ));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(sink.cache.global_ns(), 1, "the first tick is at once");
        clock.advance(2_000_000_000);
        tokio::time::sleep(GLOBAL_CACHE_UPDATE).await;
        assert_eq!(sink.cache.global_ns(), 2_000_000_001);
        sink.fall_back();
        assert_eq!(*sink.period.borrow(), crate::relist::GENERIC_PERIOD);
        tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .unwrap()
            .unwrap();
    }
}
