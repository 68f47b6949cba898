//! The events kept on the node: a bounded ring per pod, correlated as
//! client-go's `EventCorrelator` does before anything is written.
//!
//! * **Deduplication** (`EventLogger.eventObserve`, key `getEventKey`): the same
//!   source, object (with its field path), type, reason and message seen again
//!   bumps `count` and the last time of the entry already there instead of
//!   adding one; the first time and the name stay.
//! * **Aggregation** (`EventAggregator`, key `EventAggregatorByReasonFunc`:
//!   source, object without field path, type, reason): once 10 different
//!   messages were seen for one key, each within 10 min of the previous, the
//!   event becomes one entry keyed by the aggregate key whose message is
//!   `(combined from similar events): <the newest message>`.
//! * **Bounds** (the kubelet keeps no events, the API server drops them after
//!   its `--event-ttl` of 1 h): at most [`RING_CAPACITY`] entries per pod, the
//!   least recently seen evicted first (an entry seen again moves to the end);
//!   a pod's ring goes 1 h after its last event, and beyond [`MAX_PODS`] pods
//!   the one quiet for longest goes.

use std::collections::{BTreeSet, HashMap, VecDeque};

use super::{EventType, Source};

/// Entries kept per pod.
pub const RING_CAPACITY: usize = 64;
/// Pods whose events are kept.
pub const MAX_PODS: usize = 1024;
/// A pod's events are dropped this long after its last one (the API server's
/// default `--event-ttl`).
pub const POD_TTL_NS: u64 = 3600 * 1_000_000_000;
/// client-go's `defaultAggregateMaxEvents`.
pub const AGGREGATE_MAX_EVENTS: usize = 10;
/// client-go's `defaultAggregateIntervalInSeconds`, in nanoseconds.
pub const AGGREGATE_INTERVAL_NS: u64 = 600 * 1_000_000_000;
/// client-go's `EventAggregatorByReasonMessageFunc` prefix.
pub const COMBINED_PREFIX: &str = "(combined from similar events): ";
/// How often expired pods are looked for.
const PRUNE_PERIOD_NS: u64 = 60 * 1_000_000_000;

/// The object an event is about: a pod.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// An event to record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewEvent {
    pub pod: PodRef,
    /// `spec.containers{name}` for a container's event.
    pub field_path: Option<String>,
    pub kind: EventType,
    pub reason: String,
    pub message: String,
    pub source: Source,
}

/// An event as kept: what was recorded, how often, first and last (Unix ns).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recorded {
    pub pod: PodRef,
    /// The event object's name: `<pod name>.<first time in hex ns>`, as the
    /// kubelet's recorder names them.
    pub name: String,
    pub field_path: Option<String>,
    pub kind: EventType,
    pub reason: String,
    pub message: String,
    pub source: Source,
    pub count: u32,
    pub first_ns: u64,
    pub last_ns: u64,
    /// An aggregate of similar events (keyed without message and field path).
    pub combined: bool,
}

impl Recorded {
    fn matches(&self, e: &NewEvent, combined: bool) -> bool {
        let common = self.combined == combined
            && self.kind == e.kind
            && self.reason == e.reason
            && self.source == e.source;
        if combined {
            common
        } else {
            common && self.field_path == e.field_path && self.message == e.message
        }
    }
}

/// Similar events of one aggregate key: their distinct messages.
#[derive(Debug, Default)]
struct Similar {
    messages: BTreeSet<String>,
    last_ns: u64,
}

#[derive(Debug)]
struct PodEvents {
    ring: VecDeque<Recorded>,
    similar: HashMap<(EventType, String, Source), Similar>,
    last_ns: u64,
}

/// Every pod's ring.
#[derive(Debug)]
pub struct Store {
    pods: HashMap<String, PodEvents>,
    capacity: usize,
    max_pods: usize,
    last_prune_ns: u64,
    /// The last time used in a name: names stay unique when two events come
    /// in the same nanosecond (or a test's clock stands still).
    last_name_ns: u64,
}

impl Default for Store {
    fn default() -> Self {
        Self::new(RING_CAPACITY, MAX_PODS)
    }
}

impl Store {
    /// `capacity` entries per pod (at least 1), at most `max_pods` pods.
    pub fn new(capacity: usize, max_pods: usize) -> Self {
        Self {
            pods: HashMap::new(),
            capacity: capacity.max(1),
            max_pods: max_pods.max(1),
            last_prune_ns: 0,
            last_name_ns: 0,
        }
    }

    /// Records `e` at `now_ns` (Unix ns); returns the entry as it is now.
    pub fn record(&mut self, mut e: NewEvent, now_ns: u64) -> Recorded {
        self.prune(now_ns);
        let name_ns = now_ns.max(self.last_name_ns + 1);
        let pod = self
            .pods
            .entry(e.pod.uid.clone())
            .or_insert_with(|| PodEvents {
                ring: VecDeque::new(),
                similar: HashMap::new(),
                last_ns: now_ns,
            });
        pod.last_ns = now_ns;
        // Aggregation: too many different messages for one reason become one
        // combined entry.
        let similar = pod
            .similar
            .entry((e.kind, e.reason.clone(), e.source))
            .or_default();
        if now_ns.saturating_sub(similar.last_ns) > AGGREGATE_INTERVAL_NS {
            similar.messages.clear();
        }
        similar.messages.insert(e.message.clone());
        similar.last_ns = now_ns;
        let combined = similar.messages.len() >= AGGREGATE_MAX_EVENTS;
        if combined {
            // As client-go, the set does not grow beyond the threshold.
            if let Some(first) = similar.messages.iter().next().cloned() {
                similar.messages.remove(&first);
            }
            e.message = format!("{COMBINED_PREFIX}{}", e.message);
        }
        // Deduplication: seen again, counted; moved to the end of the ring.
        if let Some(i) = pod.ring.iter().position(|r| r.matches(&e, combined)) {
            let mut r = pod.ring.remove(i).expect("the position is in the ring");
            r.count = r.count.saturating_add(1);
            r.last_ns = now_ns;
            r.message = e.message;
            r.field_path = e.field_path;
            pod.ring.push_back(r.clone());
            return r;
        }
        self.last_name_ns = name_ns;
        let r = Recorded {
            name: format!("{}.{name_ns:x}", e.pod.name),
            pod: e.pod,
            field_path: e.field_path,
            kind: e.kind,
            reason: e.reason,
            message: e.message,
            source: e.source,
            count: 1,
            first_ns: now_ns,
            last_ns: now_ns,
            combined,
        };
        pod.ring.push_back(r.clone());
        while pod.ring.len() > self.capacity {
            pod.ring.pop_front();
        }
        if self.pods.len() > self.max_pods
            && let Some(oldest) = self
                .pods
                .iter()
                .min_by_key(|(_, p)| p.last_ns)
                .map(|(uid, _)| uid.clone())
        {
            self.pods.remove(&oldest);
        }
        r
    }

    /// Drops the pods quiet for longer than [`POD_TTL_NS`] (at most once a
    /// minute).
    fn prune(&mut self, now_ns: u64) {
        if now_ns.saturating_sub(self.last_prune_ns) < PRUNE_PERIOD_NS {
            return;
        }
        self.last_prune_ns = now_ns;
        self.pods
            .retain(|_, p| now_ns.saturating_sub(p.last_ns) <= POD_TTL_NS);
    }

    /// The events of the pods named `namespace/name` (every UID that had the
    /// name), oldest last time first.
    pub fn pod_events(&self, namespace: &str, name: &str) -> Vec<Recorded> {
        let mut out: Vec<Recorded> = self
            .pods
            .values()
            .filter(|p| {
                p.ring
                    .front()
                    .is_some_and(|r| r.pod.namespace == namespace && r.pod.name == name)
            })
            .flat_map(|p| p.ring.iter().cloned())
            .collect();
        out.sort_by_key(|r| (r.last_ns, r.first_ns));
        out
    }

    /// How many pods have events.
    pub fn pods(&self) -> usize {
        self.pods.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn pod(name: &str) -> PodRef {
        PodRef {
            namespace: "default".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        }
    }

    fn ev(p: &str, container: Option<&str>, reason: &str, message: &str) -> NewEvent {
        NewEvent {
            pod: pod(p),
            field_path: container.map(|c| format!("spec.containers{{{c}}}")),
            kind: EventType::Warning,
            reason: reason.into(),
            message: message.into(),
            source: Source::Kubelet,
        }
    }

    fn table(store: &Store, p: &str) -> Vec<(String, String, u32)> {
        store
            .pod_events("default", p)
            .into_iter()
            .map(|r| (r.reason, r.message, r.count))
            .collect()
    }

    #[test]
    fn the_same_event_again_bumps_count_and_last_time_instead_of_adding_one() {
        let mut store = Store::default();
        let back_off = ev(
            "p",
            Some("app"),
            "BackOff",
            "Back-off restarting failed container app",
        );
        let first = store.record(back_off.clone(), 10 * S);
        store.record(ev("p", Some("app"), "Started", "Container started"), 11 * S);
        let again = store.record(back_off.clone(), 12 * S);
        let third = store.record(back_off.clone(), 15 * S);
        assert_eq!((first.count, again.count, third.count), (1, 2, 3));
        assert_eq!((third.first_ns, third.last_ns), (10 * S, 15 * S));
        assert_eq!(third.name, first.name, "the same event object");
        // Seen again, it moves after the events seen since.
        assert_eq!(
            table(&store, "p"),
            [
                ("Started".into(), "Container started".into(), 1),
                ("BackOff".into(), back_off.message.clone(), 3)
            ]
        );
        // A different message, container, type or source is another event.
        let mut other_source = back_off.clone();
        other_source.source = Source::Kernel;
        let mut other_type = back_off.clone();
        other_type.kind = EventType::Normal;
        for (i, e) in [
            ev(
                "p",
                Some("app"),
                "BackOff",
                "Back-off restarting failed container x",
            ),
            ev("p", Some("side"), "BackOff", &back_off.message),
            ev("p", None, "BackOff", &back_off.message),
            other_source,
            other_type,
        ]
        .into_iter()
        .enumerate()
        {
            assert_eq!(store.record(e, (20 + i as u64) * S).count, 1, "case {i}");
        }
        assert_eq!(store.pod_events("default", "p").len(), 7);
    }

    #[test]
    fn each_pod_keeps_a_bounded_ring_the_least_recently_seen_going_first() {
        let mut store = Store::new(3, MAX_PODS);
        for i in 0..5u64 {
            store.record(ev("p", None, "Pulled", &format!("m{i}")), i * S);
        }
        store.record(ev("q", None, "Pulled", "other pod"), 5 * S);
        let messages = |s: &Store| -> Vec<String> {
            s.pod_events("default", "p")
                .into_iter()
                .map(|r| r.message)
                .collect()
        };
        assert_eq!(messages(&store), ["m2", "m3", "m4"]);
        // m2 seen again is the most recent: m3 goes next.
        store.record(ev("p", None, "Pulled", "m2"), 6 * S);
        store.record(ev("p", None, "Pulled", "m5"), 7 * S);
        assert_eq!(messages(&store), ["m4", "m2", "m5"]);
        assert_eq!(table(&store, "q").len(), 1, "another pod's ring is its own");
    }

    #[test]
    fn pods_are_dropped_an_hour_after_their_last_event_and_beyond_the_limit() {
        let mut store = Store::new(RING_CAPACITY, 2);
        store.record(ev("a", None, "Pulled", "x"), S);
        store.record(ev("b", None, "Pulled", "x"), 2 * S);
        store.record(ev("a", None, "Pulled", "x"), 3 * S);
        store.record(ev("c", None, "Pulled", "x"), 4 * S);
        assert!(table(&store, "b").is_empty(), "the quietest pod went");
        assert_eq!((table(&store, "a").len(), table(&store, "c").len()), (1, 1));
        store.record(ev("c", None, "Pulled", "y"), 3 * S + POD_TTL_NS + 2 * S);
        assert!(table(&store, "a").is_empty(), "a expired");
        assert_eq!(store.pods(), 1);
    }

    #[test]
    fn ten_different_messages_for_one_reason_become_one_combined_event() {
        let mut store = Store::default();
        for i in 0..9u64 {
            let r = store.record(ev("p", Some("app"), "Failed", &format!("error {i}")), i * S);
            assert!(!r.combined, "{i}");
        }
        let tenth = store.record(ev("p", Some("app"), "Failed", "error 9"), 9 * S);
        assert!(tenth.combined);
        assert_eq!(tenth.message, "(combined from similar events): error 9");
        // The next new message, from another container too, bumps the combined
        // entry (its message the newest).
        let next = store.record(ev("p", Some("side"), "Failed", "error 10"), 10 * S);
        assert_eq!((next.name.as_str(), next.count), (tenth.name.as_str(), 2));
        assert_eq!(next.message, "(combined from similar events): error 10");
        assert_eq!(next.field_path.as_deref(), Some("spec.containers{side}"));
        // Another reason is not aggregated with them.
        assert!(!store.record(ev("p", None, "BackOff", "b"), 11 * S).combined);
        // More than 10 min after the last similar event, it starts over.
        let later = 10 * S + AGGREGATE_INTERVAL_NS + S;
        let fresh = store.record(ev("p", Some("app"), "Failed", "error 11"), later);
        assert!(!fresh.combined);
        assert_eq!(fresh.message, "error 11");
    }

    #[test]
    fn names_are_unique_even_in_the_same_nanosecond() {
        let mut store = Store::default();
        let a = store.record(ev("p", None, "Pulled", "a"), 16);
        let b = store.record(ev("p", None, "Pulled", "b"), 16);
        assert_eq!((a.name.as_str(), b.name.as_str()), ("p.10", "p.11"));
    }
}
