//! Events to the API server as `events.k8s.io/v1` Events: what client-go's
//! `recordToSink` does with the correlator's result, minus the retries'
//! length.
//!
//! * The first occurrence of an event is created (POST); a repetition (the
//!   store bumped its count) is a merge patch of its `series` (`count`,
//!   `lastObservedTime`) alone, as client-go's `createPatchBytesForSeries`.
//!   The deprecated core/v1 fields (`deprecatedSource`,
//!   `deprecatedFirstTimestamp`, `deprecatedLastTimestamp`,
//!   `deprecatedCount`) are never set: the API server refuses an
//!   `events.k8s.io/v1` Event that sets them ("needs to be unset") and a
//!   patch that changes them or the `note` ("field is immutable");
//!   `kubectl describe` reads the series. A patch that finds no event (it
//!   expired, or its creation was filtered or failed) creates it with its
//!   series, as client-go creates after a failed patch.
//! * The spam filter (`EventSourceObjectSpamFilter`): per source and pod, a
//!   token bucket of 25 events refilled at one every 5 minutes; an event
//!   without a token is not written (counted in [`super::Stats`]).
//! * A write that fails for a reason other than the request itself (5xx,
//!   the connection) is tried 3 times in all, 0.2 s then 1 s apart (client-go:
//!   12 times, 10 s apart); then dropped with a warning.
//!
//! kube-rs's `kube::runtime::events::Recorder` is not used: it keys repeated
//! events without their message (two `Failed` events of a container with
//! different messages become one series that keeps the first message, where
//! the kubelet keeps two events), has no spam filter, reads the wall clock
//! itself, and awaits the API on the caller's path.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, Patch, PatchParams, PostParams};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{Recorded, Source, Stats, object_reference, timestamp};
use evpleg_core::clock::SharedClock;

/// client-go's `defaultSpamBurst`.
pub const SPAM_BURST: u32 = 25;
/// client-go's `defaultSpamQPS` (1/300): one more event every 5 minutes.
pub const SPAM_REFILL: Duration = Duration::from_secs(300);
/// Buckets kept before full ones are forgotten (client-go's LRU of 4096).
const MAX_BUCKETS: usize = 4096;
/// The reporting controller of every event written.
pub const REPORTING_CONTROLLER: &str = "kubelet";
/// Delays before the second and third attempt of a failed write.
const RETRY_DELAYS: [Duration; 2] = [Duration::from_millis(200), Duration::from_secs(1)];

/// Why a write failed.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("event {name}: not found")]
    NotFound { name: String },
    #[error("event {name}: already exists")]
    AlreadyExists { name: String },
    /// The API server refused the request itself (4xx): not tried again.
    #[error("event {name} refused: {message}")]
    Refused { name: String, message: String },
    /// Anything else (5xx, the connection): tried again.
    #[error("event {name}: {message}")]
    Failed { name: String, message: String },
}

/// Where events are written (the API server; a fake in tests).
pub trait EventSink: Send + Sync {
    fn create(
        &self,
        namespace: &str,
        event: &Event,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;
    fn patch(
        &self,
        namespace: &str,
        name: &str,
        patch: &serde_json::Value,
    ) -> impl Future<Output = Result<(), SinkError>> + Send;
}

fn sink_error(name: &str, e: kube::Error) -> SinkError {
    let name = name.to_owned();
    match e {
        kube::Error::Api(s) if s.code == 404 => SinkError::NotFound { name },
        kube::Error::Api(s) if s.code == 409 => SinkError::AlreadyExists { name },
        kube::Error::Api(s) if (400..500).contains(&s.code) && s.code != 429 => {
            SinkError::Refused {
                name,
                message: format!("{} ({} {})", s.message, s.code, s.reason),
            }
        }
        e => SinkError::Failed {
            name,
            message: e.to_string(),
        },
    }
}

impl EventSink for kube::Client {
    async fn create(&self, namespace: &str, event: &Event) -> Result<(), SinkError> {
        let api: Api<Event> = Api::namespaced(self.clone(), namespace);
        let name = event.metadata.name.clone().unwrap_or_default();
        api.create(&PostParams::default(), event)
            .await
            .map(drop)
            .map_err(|e| sink_error(&name, e))
    }

    async fn patch(
        &self,
        namespace: &str,
        name: &str,
        patch: &serde_json::Value,
    ) -> Result<(), SinkError> {
        let api: Api<Event> = Api::namespaced(self.clone(), namespace);
        api.patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .map(drop)
            .map_err(|e| sink_error(name, e))
    }
}

/// client-go's `EventSourceObjectSpamFilter`: a token bucket per source and
/// pod, full at first.
#[derive(Debug)]
pub struct SpamFilter {
    burst: f64,
    refill_ns: f64,
    buckets: HashMap<(Source, String), (f64, u64)>,
}

impl Default for SpamFilter {
    fn default() -> Self {
        Self::new(SPAM_BURST, SPAM_REFILL)
    }
}

impl SpamFilter {
    /// `burst` events at once, then one more every `refill`.
    pub fn new(burst: u32, refill: Duration) -> Self {
        Self {
            burst: f64::from(burst),
            refill_ns: refill.as_nanos().max(1) as f64,
            buckets: HashMap::new(),
        }
    }

    /// Whether an event of `source` about pod `uid` may be written at `now_ns`.
    pub fn allow(&mut self, source: Source, uid: &str, now_ns: u64) -> bool {
        let (burst, refill) = (self.burst, self.refill_ns);
        let level = |(tokens, at): (f64, u64)| -> f64 {
            (tokens + now_ns.saturating_sub(at) as f64 / refill).min(burst)
        };
        if self.buckets.len() >= MAX_BUCKETS {
            // A full bucket is the same as none.
            self.buckets.retain(|_, b| level(*b) < burst);
        }
        let bucket = self
            .buckets
            .entry((source, uid.to_owned()))
            .or_insert((burst, now_ns));
        let tokens = level(*bucket);
        if tokens >= 1.0 {
            *bucket = (tokens - 1.0, now_ns);
            true
        } else {
            *bucket = (tokens, now_ns);
            false
        }
    }
}

/// A kept event as the `events.k8s.io/v1` Event written for it.
pub fn v1_event(r: &Recorded, node: &str) -> Event {
    Event {
        metadata: ObjectMeta {
            name: Some(r.name.clone()),
            namespace: Some(r.pod.namespace.clone()),
            ..ObjectMeta::default()
        },
        event_time: Some(MicroTime(timestamp(r.first_ns))),
        series: series(r),
        reporting_controller: Some(REPORTING_CONTROLLER.into()),
        reporting_instance: Some(node.to_owned()),
        action: Some(r.reason.clone()),
        reason: Some(r.reason.clone()),
        regarding: Some(object_reference(r)),
        note: Some(r.message.clone()),
        type_: Some(r.kind.as_str().into()),
        deprecated_source: None,
        deprecated_first_timestamp: None,
        deprecated_last_timestamp: None,
        deprecated_count: None,
        related: None,
    }
}

fn count(r: &Recorded) -> i32 {
    i32::try_from(r.count).unwrap_or(i32::MAX)
}

fn series(r: &Recorded) -> Option<EventSeries> {
    (r.count > 1).then(|| EventSeries {
        count: count(r),
        last_observed_time: MicroTime(timestamp(r.last_ns)),
    })
}

/// The merge patch of a repetition: its series alone (every other field of
/// an `events.k8s.io/v1` Event is immutable).
pub fn series_patch(r: &Recorded) -> serde_json::Value {
    serde_json::json!({ "series": series(r) })
}

/// Writes the recorder's events to a sink.
#[derive(Debug)]
pub struct ApiWriter<S> {
    sink: S,
    node: String,
    clock: SharedClock,
    filter: SpamFilter,
    stats: Arc<Stats>,
}

impl<S: EventSink> ApiWriter<S> {
    /// Events of node `node`, times of `clock` (the recorder's) for the spam
    /// filter, counted in `stats` (the recorder's, [`super::Recorder::stats`]).
    pub fn new(sink: S, node: &str, clock: SharedClock, stats: Arc<Stats>) -> Self {
        Self {
            sink,
            node: node.to_owned(),
            clock,
            filter: SpamFilter::default(),
            stats,
        }
    }

    /// Writes events from `events` until it closes or `shutdown`.
    pub async fn run(mut self, mut events: mpsc::Receiver<Recorded>, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                e = events.recv() => match e {
                    Some(e) => self.write(&e).await,
                    None => return,
                },
            }
        }
    }

    /// Writes one event (created, or its series patched), through the spam
    /// filter.
    pub async fn write(&mut self, r: &Recorded) {
        if !self.filter.allow(r.source, &r.pod.uid, self.clock.now_ns()) {
            self.stats.spam_filtered.fetch_add(1, Ordering::Relaxed);
            debug!(event = %r.name, reason = %r.reason, "event not written: spam filter");
            return;
        }
        let mut delays = RETRY_DELAYS.iter();
        loop {
            match self.try_write(r).await {
                Ok(()) => {
                    self.stats.written.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                Err(e @ SinkError::Failed { .. }) if delays.len() > 0 => {
                    debug!(error = %e, "event write failed: trying again");
                    if let Some(d) = delays.next() {
                        tokio::time::sleep(*d).await;
                    }
                }
                Err(e) => {
                    self.stats.write_errors.fetch_add(1, Ordering::Relaxed);
                    warn!(error = %e, reason = %r.reason, pod = %r.pod.uid, "event not written to the API server");
                    return;
                }
            }
        }
    }

    async fn try_write(&self, r: &Recorded) -> Result<(), SinkError> {
        let ns = &r.pod.namespace;
        if r.count > 1 {
            match self.sink.patch(ns, &r.name, &series_patch(r)).await {
                Err(SinkError::NotFound { .. }) => {}
                other => return other,
            }
        }
        match self.sink.create(ns, &v1_event(r, &self.node)).await {
            // Created already (a retry whose first answer was lost): patch.
            Err(SinkError::AlreadyExists { .. }) => {
                self.sink.patch(ns, &r.name, &series_patch(r)).await
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::store::{NewEvent, PodRef, Store};
    use crate::{EventType, Source};
    use evpleg_core::clock::ManualClock;

    const S: u64 = 1_000_000_000;

    #[test]
    fn the_spam_filter_lets_25_events_per_pod_through_then_one_every_5_minutes() {
        let mut f = SpamFilter::default();
        let allowed = |f: &mut SpamFilter, uid: &str, at: u64, n: usize| {
            (0..n).filter(|_| f.allow(Source::Kubelet, uid, at)).count()
        };
        assert_eq!(allowed(&mut f, "a", S, 30), 25);
        assert_eq!(
            allowed(&mut f, "b", S, 1),
            1,
            "another pod has its own bucket"
        );
        assert!(f.allow(Source::Kernel, "a", S), "another source too");
        assert_eq!(allowed(&mut f, "a", S + 299 * S, 1), 0);
        assert_eq!(allowed(&mut f, "a", S + 301 * S, 2), 1);
        // Ten refills later, ten more (never more than the burst).
        assert_eq!(allowed(&mut f, "a", S + 301 * S + 3000 * S, 30), 10);
        assert_eq!(allowed(&mut f, "a", 1_000_000 * S, 30), 25);
    }

    #[derive(Debug, Default)]
    struct FakeSink {
        calls: Mutex<Vec<String>>,
        stored: Mutex<HashMap<String, serde_json::Value>>,
        /// Fail (5xx) this many calls first.
        failures: Mutex<u32>,
    }

    impl EventSink for &FakeSink {
        async fn create(&self, namespace: &str, event: &Event) -> Result<(), SinkError> {
            let name = event.metadata.name.clone().unwrap();
            self.calls
                .lock()
                .unwrap()
                .push(format!("POST {namespace}/{name}"));
            let mut failures = self.failures.lock().unwrap();
            if *failures > 0 {
                *failures -= 1;
                return Err(SinkError::Failed {
                    name,
                    message: "503".into(),
                });
            }
            let mut stored = self.stored.lock().unwrap();
            if stored.contains_key(&name) {
                return Err(SinkError::AlreadyExists { name });
            }
            stored.insert(name, serde_json::to_value(event).unwrap());
            Ok(())
        }

        async fn patch(
            &self,
            namespace: &str,
            name: &str,
            patch: &serde_json::Value,
        ) -> Result<(), SinkError> {
            self.calls
                .lock()
                .unwrap()
                .push(format!("PATCH {namespace}/{name}"));
            let mut stored = self.stored.lock().unwrap();
            let Some(e) = stored.get_mut(name) else {
                return Err(SinkError::NotFound { name: name.into() });
            };
            for (k, v) in patch.as_object().unwrap() {
                e[k] = v.clone();
            }
            Ok(())
        }
    }

    fn back_off(store: &mut Store, pod: &str, at: u64) -> Recorded {
        store.record(
            NewEvent {
                pod: PodRef {
                    namespace: "ns".into(),
                    name: pod.into(),
                    uid: format!("uid-{pod}"),
                },
                field_path: Some("spec.containers{app}".into()),
                kind: EventType::Warning,
                reason: "BackOff".into(),
                message: "Back-off restarting failed container app".into(),
                source: Source::Kubelet,
            },
            at,
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_repetition_patches_the_series_and_a_missing_event_is_created() {
        let sink = FakeSink::default();
        let clock = ManualClock::new(S);
        let stats = Arc::new(Stats::default());
        let mut w = ApiWriter::new(&sink, "node-1", Arc::new(clock.clone()), stats.clone());
        let mut store = Store::default();
        let first = back_off(&mut store, "p", S);
        w.write(&first).await;
        let second = back_off(&mut store, "p", 5 * S);
        w.write(&second).await;
        let stored = sink.stored.lock().unwrap()[&first.name].clone();
        assert_eq!(stored["series"]["count"], 2);
        assert_eq!(
            stored["series"]["lastObservedTime"],
            "1970-01-01T00:00:05.000000Z"
        );
        assert_eq!(stored["reportingController"], "kubelet");
        assert_eq!(stored["reportingInstance"], "node-1");
        assert_eq!(stored["regarding"]["fieldPath"], "spec.containers{app}");
        assert_eq!(stored["action"], "BackOff");
        // Its first write lost: the repetition creates it, with its series.
        let lost = back_off(&mut store, "q", 6 * S);
        let again = back_off(&mut store, "q", 7 * S);
        assert_eq!(lost.count, 1);
        w.write(&again).await;
        assert_eq!(
            sink.stored.lock().unwrap()[&again.name]["series"]["count"],
            2
        );
        // A 503 is tried again.
        *sink.failures.lock().unwrap() = 2;
        let third = back_off(&mut store, "r", 8 * S);
        w.write(&third).await;
        assert!(sink.stored.lock().unwrap().contains_key(&third.name));
        let r = format!("POST ns/{}", third.name);
        assert_eq!(
            sink.calls
                .lock()
                .unwrap()
                .iter()
                .filter(|c| **c == r)
                .count(),
            3
        );
        assert_eq!(stats.written.load(Ordering::Relaxed), 4);
        assert_eq!(stats.write_errors.load(Ordering::Relaxed), 0);
    }

    /// What the API server's strict `events.k8s.io/v1` validation allows
    /// (`ValidateEventCreate`, `ValidateEventUpdate`): no deprecated core/v1
    /// field on a create, and a repetition's patch touching the series alone.
    #[test]
    fn an_event_sets_no_deprecated_field_and_a_repetition_patches_only_its_series() {
        let mut store = Store::default();
        let first = back_off(&mut store, "p", S);
        let created = serde_json::to_value(v1_event(&first, "node-1")).unwrap();
        let fields: Vec<&str> = created
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .filter(|k| k.starts_with("deprecated"))
            .collect();
        assert!(fields.is_empty(), "{created:#}");
        assert!(created["eventTime"].is_string(), "{created:#}");
        let second = back_off(&mut store, "p", 5 * S);
        let patch = series_patch(&second);
        assert_eq!(
            patch,
            serde_json::json!({"series": {"count": 2, "lastObservedTime": "1970-01-01T00:00:05.000000Z"}})
        );
    }

    #[tokio::test]
    async fn events_beyond_the_spam_filter_s_burst_are_not_written() {
        let sink = FakeSink::default();
        let stats = Arc::new(Stats::default());
        let mut w = ApiWriter::new(&sink, "n", Arc::new(ManualClock::new(S)), stats.clone());
        let mut store = Store::default();
        for i in 0..30 {
            w.write(&back_off(&mut store, "p", S + i)).await;
        }
        assert_eq!(sink.calls.lock().unwrap().len(), 25);
        assert_eq!(stats.spam_filtered.load(Ordering::Relaxed), 5);
        let stored = sink.stored.lock().unwrap();
        assert_eq!(stored.values().next().unwrap()["series"]["count"], 25);
    }
}
