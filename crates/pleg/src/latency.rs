//! `evpleg_pleg_event_latency_seconds{source}`: how long after a container
//! transition its lifecycle event reached the consumer (the sync loop, or
//! `observe`). A kernel event is timed from the kernel's own timestamp of the
//! exit or exec (CLOCK_MONOTONIC); a relist or CRI-stream event from the
//! runtime's time of the transition (the container's startedAt or finishedAt,
//! wall clock), so the relist's period shows in it. The kubelet has no such
//! metric; its buckets start at 10 us, as the kernel path is that fast.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

use evpleg_core::cache::PodStatusCache;
use evpleg_core::clock::wall_clock_ns;
use evpleg_core::lifecycle::{EventKind, EventSource, PodLifecycleEvent};

/// The `source` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabel {
    pub source: &'static str,
}

/// 10 us doubling 21 times (about 10.5 s).
fn histogram() -> Histogram {
    Histogram::new(exponential_buckets(1e-5, 2.0, 21))
}

/// The histogram family, shared by the PLEG and its consumer.
#[derive(Debug)]
pub struct EventLatency {
    pub seconds: Family<SourceLabel, Histogram, fn() -> Histogram>,
}

impl Default for EventLatency {
    fn default() -> Self {
        Self {
            seconds: Family::new_with_constructor(histogram),
        }
    }
}

impl EventLatency {
    /// The event's latency at `now_mono_ns`, if its transition time is known;
    /// `cache` gives the runtime's times of relist-sourced events.
    pub fn latency_ns(
        ev: &PodLifecycleEvent,
        cache: &PodStatusCache,
        now_mono_ns: u64,
        now_wall_ns: i64,
    ) -> Option<u64> {
        if ev.source == EventSource::Kernel {
            return Some(now_mono_ns.saturating_sub(ev.at_ns));
        }
        let id = ev.container_id.as_ref()?;
        let entry = cache.get(ev.pod_uid.as_ref()?)?;
        let c = entry.status.container(id)?;
        let at = match ev.kind {
            EventKind::ContainerStarted => c.started_at,
            EventKind::ContainerDied => c.finished_at,
            _ => None,
        }
        .filter(|&t| t > 0)?;
        Some(now_wall_ns.saturating_sub(at).max(0) as u64)
    }

    /// Observes a container transition's event as it is taken from the PLEG.
    pub fn observe(&self, ev: &PodLifecycleEvent, cache: &PodStatusCache) {
        if !matches!(
            ev.kind,
            EventKind::ContainerStarted | EventKind::ContainerDied
        ) {
            return;
        }
        let now = evpleg_core::clock::monotonic_ns();
        if let Some(ns) = Self::latency_ns(ev, cache, now, wall_clock_ns()) {
            let source = match ev.source {
                EventSource::Kernel => "kernel",
                EventSource::Relist => "relist",
                EventSource::Cri => "cri",
            };
            self.seconds
                .get_or_create(&SourceLabel { source })
                .observe(ns as f64 / 1e9);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use evpleg_core::container::{ContainerState, ContainerStatus, PodStatus};
    use evpleg_core::ids::{ContainerId, PodUid};
    use evpleg_core::lifecycle::ExitStatus;

    #[test]
    fn kernel_events_from_the_kernel_s_stamp_relist_events_from_the_runtime_s() {
        let uid = PodUid::parse(&"a".repeat(32)).unwrap();
        let id = ContainerId::parse(&"c".repeat(64)).unwrap();
        let cache = PodStatusCache::new();
        let mut c = ContainerStatus::new(
            id.clone(),
            "app",
            ContainerState::Exited,
            EventSource::Relist,
        );
        c.finished_at = Some(5_000_000_000);
        cache.set(
            &uid,
            PodStatus {
                uid: Some(uid.clone()),
                name: "p".into(),
                namespace: "ns".into(),
                ips: vec![],
                sandboxes: vec![],
                containers: vec![c],
            },
            1,
        );
        let mut ev = PodLifecycleEvent {
            pod_uid: Some(uid),
            kind: EventKind::ContainerDied,
            container_id: Some(id),
            at_ns: 100_000,
            source: EventSource::Kernel,
            exit: Some(ExitStatus::from_wait_status(0, false)),
            pid: None,
        };
        assert_eq!(
            EventLatency::latency_ns(&ev, &cache, 130_000, 0),
            Some(30_000)
        );
        ev.source = EventSource::Relist;
        assert_eq!(
            EventLatency::latency_ns(&ev, &cache, 0, 5_700_000_000),
            Some(700_000_000)
        );
        ev.kind = EventKind::ContainerStarted;
        assert_eq!(
            EventLatency::latency_ns(&ev, &cache, 0, 5_700_000_000),
            None,
            "no startedAt"
        );
        // Observed under its source; a start without startedAt is not.
        let latency = Arc::new(EventLatency::default());
        latency.observe(&ev, &cache);
        ev.kind = EventKind::ContainerDied;
        latency.observe(&ev, &cache);
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register("lat", "", latency.seconds.clone());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("lat_count{source=\"relist\"} 1\n"), "{text}");
    }
}
