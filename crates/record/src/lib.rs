//! Pod events: the kubelet's `record.EventRecorder` (`pkg/kubelet/events`
//! reasons, client-go's `tools/record`) as the runtime code and the PLEG call
//! it, with client-go's `EventCorrelator` before anything is kept or written.
//!
//! * [`Recorder::record`] is what the rest of the agent calls: an event about
//!   a pod, or about one of its containers (field path
//!   `spec.containers{name}`, `spec.initContainers{name}`), with the
//!   kubelet's type (Normal / Warning), reason and message. It takes a lock
//!   for a few microseconds and never waits for the API: the API writer gets
//!   the event through a bounded queue (1 000, client-go's
//!   `maxQueuedEvents`), and an event that finds it full is dropped and
//!   counted, as client-go drops it.
//! * Locally ([`store`]): a bounded ring per pod, deduplicated (the same
//!   event again bumps `count` and its last time) and aggregated (10
//!   different messages for one reason become one "combined from similar
//!   events" entry) as client-go's correlator does; served at
//!   `GET /pods/<namespace>/<name>/events` as a core/v1 `EventList`
//!   ([`Recorder::event_list`]), which `evpleg describe pod` reads.
//! * With `--kubeconfig` ([`api`]): written as `events.k8s.io/v1` Events,
//!   the first occurrence created, a repetition patched into its `series`
//!   (and the deprecated core/v1 count and last time, which `kubectl
//!   describe` shows), through client-go's spam filter (per source and pod,
//!   a token bucket of 25 refilled at one event every 5 min).
//!
//! Differences from the kubelet: the kubelet keeps no events itself (the
//! local ring is evpleg's, for nodes without an API server and for
//! `describe`); the spam filter applies only to what is written to the API,
//! the local ring keeps everything; events of the kernel PLEG (`ContainerDied`
//! with the exit code, source `kernel`) have no kubelet counterpart;
//! the kubelet writes core/v1 Events, evpleg the events.k8s.io/v1 view of
//! the same objects (with the core/v1 fields filled in), its `action` the
//! reason.

pub mod api;
pub mod store;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use serde::Serialize;
use tokio::sync::mpsc;

use evpleg_core::clock::{SharedClock, WallClock};
pub use store::{NewEvent, PodRef, Recorded};

// The kubelet's reasons (`pkg/kubelet/events/event.go`).
pub const CREATED: &str = "Created";
pub const STARTED: &str = "Started";
pub const FAILED: &str = "Failed";
pub const KILLING: &str = "Killing";
pub const BACK_OFF: &str = "BackOff";
pub const EXCEEDED_GRACE_PERIOD: &str = "ExceededGracePeriod";
pub const PULLING: &str = "Pulling";
pub const PULLED: &str = "Pulled";
pub const INSPECT_FAILED: &str = "InspectFailed";
pub const ERR_IMAGE_NEVER_PULL: &str = "ErrImageNeverPull";
pub const FAILED_CREATE_POD_SANDBOX: &str = "FailedCreatePodSandBox";
pub const SANDBOX_CHANGED: &str = "SandboxChanged";
pub const FAILED_KILL_POD: &str = "FailedKillPod";
pub const UNHEALTHY: &str = "Unhealthy";
pub const PROBE_WARNING: &str = "ProbeWarning";
pub const FAILED_POST_START_HOOK: &str = "FailedPostStartHook";
pub const FAILED_PRE_STOP_HOOK: &str = "FailedPreStopHook";
pub const LIFECYCLE_HTTP_FALLBACK: &str = "LifecycleHTTPFallback";
/// The kernel PLEG's: a container's main process exited (evpleg's own).
pub const CONTAINER_DIED: &str = "ContainerDied";

/// How many events may wait for the API writer (client-go's
/// `maxQueuedEvents`).
pub const API_QUEUE: usize = 1000;
/// The longest message kept (the events.k8s.io/v1 `note` limit, 1 kB).
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// An event's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum EventType {
    Normal,
    Warning,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Normal => "Normal",
            Self::Warning => "Warning",
        }
    }
}

/// Who reports the event (the core/v1 `source.component`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Source {
    /// The pod lifecycle machinery, as the kubelet reports it.
    Kubelet,
    /// The kernel PLEG.
    Kernel,
}

impl Source {
    pub fn component(self) -> &'static str {
        match self {
            Self::Kubelet => "kubelet",
            Self::Kernel => "kernel",
        }
    }
}

/// Counters of the recorder and its API writer.
#[derive(Debug, Default)]
pub struct Stats {
    pub recorded: AtomicU64,
    /// Recorded, by (type, reason): the reasons are the kubelet's constants
    /// above, a bounded set.
    pub by_reason: Mutex<std::collections::BTreeMap<(&'static str, String), u64>>,
    /// Dropped because the API writer's queue was full.
    pub queue_full: AtomicU64,
    /// Not written: the spam filter said no.
    pub spam_filtered: AtomicU64,
    pub written: AtomicU64,
    pub write_errors: AtomicU64,
}

#[derive(Debug)]
struct Inner {
    store: Mutex<store::Store>,
    clock: SharedClock,
    node: String,
    api: Option<mpsc::Sender<Recorded>>,
    stats: Arc<Stats>,
}

/// Records pod events; cheap to clone (one shared store).
#[derive(Clone, Debug)]
pub struct Recorder {
    inner: Arc<Inner>,
}

impl Default for Recorder {
    /// Local only, on the wall clock, no node name.
    fn default() -> Self {
        Self::new("", Arc::new(WallClock), store::Store::default(), None)
    }
}

/// Truncates `s` to at most `max` bytes, on a character boundary.
fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

/// The field path of container `name` in `pod`: `spec.initContainers{name}`
/// for an init container, else `spec.containers{name}` (the kubelet's
/// `GenerateContainerRef`).
pub fn field_path(pod: &Pod, name: &str) -> String {
    let init = pod
        .spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.name == name));
    if init {
        format!("spec.initContainers{{{name}}}")
    } else {
        format!("spec.containers{{{name}}}")
    }
}

/// Unix nanoseconds as an API time.
pub fn timestamp(ns: u64) -> Timestamp {
    Timestamp::from_nanosecond(i128::from(ns)).unwrap_or(Timestamp::UNIX_EPOCH)
}

impl Recorder {
    /// A recorder for node `node` on `clock` (wall time, Unix ns), keeping
    /// events in `store` and, with `api`, queueing them for the API writer
    /// ([`api::ApiWriter`]).
    pub fn new(
        node: &str,
        clock: SharedClock,
        store: store::Store,
        api: Option<mpsc::Sender<Recorded>>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                store: Mutex::new(store),
                clock,
                node: node.to_owned(),
                api,
                stats: Arc::default(),
            }),
        }
    }

    /// A recorder whose events also go to the API: the writer to run
    /// ([`api::ApiWriter::run`]) takes them from the returned queue.
    pub fn with_api(node: &str, clock: SharedClock) -> (Self, mpsc::Receiver<Recorded>) {
        let (tx, rx) = mpsc::channel(API_QUEUE);
        (
            Self::new(node, clock, store::Store::default(), Some(tx)),
            rx,
        )
    }

    /// The node's name (the events' `source.host`).
    pub fn node(&self) -> &str {
        &self.inner.node
    }

    pub fn stats(&self) -> Arc<Stats> {
        self.inner.stats.clone()
    }

    /// Records an event from the kubelet's machinery about `pod`, or about its
    /// `container`. Never blocks on the API.
    pub fn record(
        &self,
        pod: &Pod,
        container: Option<&str>,
        kind: EventType,
        reason: &str,
        message: impl Into<String>,
    ) {
        self.record_from(Source::Kubelet, pod, container, kind, reason, message);
    }

    /// [`Self::record`] with its source.
    pub fn record_from(
        &self,
        source: Source,
        pod: &Pod,
        container: Option<&str>,
        kind: EventType,
        reason: &str,
        message: impl Into<String>,
    ) {
        let m = &pod.metadata;
        let event = NewEvent {
            pod: PodRef {
                namespace: m.namespace.clone().unwrap_or_else(|| "default".into()),
                name: m.name.clone().unwrap_or_default(),
                uid: m.uid.clone().unwrap_or_default(),
            },
            field_path: container.map(|c| field_path(pod, c)),
            kind,
            reason: truncate(reason.to_owned(), 128),
            message: truncate(message.into(), MAX_MESSAGE_BYTES),
            source,
        };
        tracing::debug!(pod = %event.pod.uid, name = %event.pod.name, container, kind = kind.as_str(),
                        reason = %event.reason, message = %event.message, "event");
        let now = self.inner.clock.now_ns();
        let recorded = self
            .inner
            .store
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .record(event, now);
        self.inner.stats.recorded.fetch_add(1, Ordering::Relaxed);
        *self
            .inner
            .stats
            .by_reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((kind.as_str(), recorded.reason.clone()))
            .or_default() += 1;
        if let Some(api) = &self.inner.api
            && api.try_send(recorded).is_err()
        {
            self.inner.stats.queue_full.fetch_add(1, Ordering::Relaxed);
            tracing::debug!("event queue full: event not written to the API");
        }
    }

    /// The events of the pods named `namespace/name`, oldest last time first.
    pub fn pod_events(&self, namespace: &str, name: &str) -> Vec<Recorded> {
        self.inner
            .store
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pod_events(namespace, name)
    }

    /// [`Self::pod_events`] as a core/v1 `EventList` document.
    pub fn event_list(&self, namespace: &str, name: &str) -> serde_json::Value {
        let items: Vec<Event> = self
            .pod_events(namespace, name)
            .iter()
            .map(|r| core_event(r, &self.inner.node))
            .collect();
        serde_json::json!({
            "kind": "EventList",
            "apiVersion": "v1",
            "metadata": {},
            "items": items,
        })
    }
}

/// The pod (and container) an event is about.
pub fn object_reference(r: &Recorded) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(r.pod.namespace.clone()),
        name: Some(r.pod.name.clone()),
        uid: Some(r.pod.uid.clone()).filter(|u| !u.is_empty()),
        field_path: r.field_path.clone(),
        ..ObjectReference::default()
    }
}

/// A kept event as the core/v1 Event the kubelet would have written.
pub fn core_event(r: &Recorded, node: &str) -> Event {
    Event {
        metadata: ObjectMeta {
            name: Some(r.name.clone()),
            namespace: Some(r.pod.namespace.clone()),
            ..ObjectMeta::default()
        },
        involved_object: object_reference(r),
        reason: Some(r.reason.clone()),
        message: Some(r.message.clone()),
        type_: Some(r.kind.as_str().into()),
        count: Some(i32::try_from(r.count).unwrap_or(i32::MAX)),
        first_timestamp: Some(Time(timestamp(r.first_ns))),
        last_timestamp: Some(Time(timestamp(r.last_ns))),
        source: Some(EventSource {
            component: Some(r.source.component().into()),
            host: Some(node.to_owned()).filter(|n| !n.is_empty()),
        }),
        reporting_component: Some(r.source.component().into()),
        reporting_instance: Some(node.to_owned()).filter(|n| !n.is_empty()),
        ..Event::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use evpleg_core::clock::ManualClock;

    fn pod() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "prod", "uid": "u-1"},
            "spec": {
                "initContainers": [{"name": "setup"}],
                "containers": [{"name": "app"}],
            }
        }))
        .unwrap()
    }

    #[test]
    fn events_are_served_as_a_core_v1_event_list_with_counts_and_field_paths() {
        let clock = ManualClock::new(1_700_000_000_000_000_000);
        let rec = Recorder::new("node-1", Arc::new(clock.clone()), Default::default(), None);
        let p = pod();
        rec.record(&p, Some("app"), EventType::Warning, BACK_OFF, "Back-off");
        clock.advance(3_000_000_000);
        rec.record(&p, Some("app"), EventType::Warning, BACK_OFF, "Back-off");
        rec.record(
            &p,
            Some("setup"),
            EventType::Normal,
            STARTED,
            "Container started",
        );
        rec.record(&p, None, EventType::Normal, SANDBOX_CHANGED, "changed");
        let list = rec.event_list("prod", "web");
        let items = list["items"].as_array().unwrap();
        assert_eq!(items.len(), 3);
        let back_off = &items[0];
        assert_eq!(back_off["count"], 2);
        assert_eq!(back_off["type"], "Warning");
        assert_eq!(
            back_off["involvedObject"]["fieldPath"],
            "spec.containers{app}"
        );
        assert_eq!(back_off["involvedObject"]["uid"], "u-1");
        assert_eq!(back_off["source"]["component"], "kubelet");
        assert_eq!(back_off["source"]["host"], "node-1");
        assert_eq!(back_off["firstTimestamp"], "2023-11-14T22:13:20Z");
        assert_eq!(back_off["lastTimestamp"], "2023-11-14T22:13:23Z");
        assert_eq!(
            items[1]["involvedObject"]["fieldPath"],
            "spec.initContainers{setup}"
        );
        assert!(items[2]["involvedObject"]["fieldPath"].is_null());
        assert_eq!(
            rec.event_list("prod", "other")["items"],
            serde_json::json!([])
        );
        assert_eq!(rec.stats().recorded.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn a_full_api_queue_drops_the_event_without_blocking_and_counts_it() {
        let (tx, mut rx) = mpsc::channel(1);
        let rec = Recorder::new(
            "n",
            Arc::new(ManualClock::new(1)),
            Default::default(),
            Some(tx),
        );
        rec.record(&pod(), None, EventType::Normal, PULLED, "a");
        rec.record(&pod(), None, EventType::Normal, PULLED, "b");
        assert_eq!(rx.try_recv().unwrap().message, "a");
        assert!(rx.try_recv().is_err());
        assert_eq!(rec.stats().queue_full.load(Ordering::Relaxed), 1);
        assert_eq!(rec.pod_events("prod", "web").len(), 2, "kept locally");
    }

    #[test]
    fn long_messages_are_cut_on_a_character_boundary() {
        let long = "é".repeat(600);
        let cut = truncate(long, MAX_MESSAGE_BYTES);
        assert_eq!(cut.len(), MAX_MESSAGE_BYTES);
        assert_eq!(truncate("é".into(), 1), "");
    }
}
