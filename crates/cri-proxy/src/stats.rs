//! What the proxy counts, exported on `/metrics` (docs/operations.md).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The `type` label: the CRI's event type (`CONTAINER_STOPPED_EVENT`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventType {
    pub r#type: String,
}

/// The labels of a suppressed event: its type, where it came from (`proxy`:
/// the kernel or a call; `runtime`: the runtime's own stream) and why
/// (`duplicate`, `stale`: [`super::merge`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Suppressed {
    pub r#type: String,
    pub origin: String,
    pub reason: String,
}

/// The `method` label: `RuntimeService/ContainerStatus`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Method {
    pub method: String,
}

type HistogramFamily = Family<Method, Histogram, fn() -> Histogram>;

/// 50 us to about 3.3 s.
fn forward_histogram() -> Histogram {
    Histogram::new(exponential_buckets(50e-6, 2.0, 17))
}

/// The proxy's counters.
#[derive(Debug)]
pub struct ProxyStats {
    pub events: Family<EventType, Counter>,
    pub subscribers: Gauge,
    pub subscribers_dropped: Counter,
    pub forward_seconds: HistogramFamily,
    pub forward_errors: Counter,
    pub kernel_lead_seconds: Histogram,
    pub overlaid: Counter,
    pub contradictions: Counter,
    /// `--merge-runtime-events`: the runtime's events received, passed on,
    /// suppressed, and its stream's breaks.
    pub runtime_events: Counter,
    pub merged: Family<EventType, Counter>,
    pub suppressed: Family<Suppressed, Counter>,
    pub runtime_stream_failures: Counter,
    /// 1 while the proxy serves the CRI in pass-through ([`super::kernel_path`]).
    pub pass_through: Gauge,
    /// Starts of the kernel path that failed.
    pub kernel_start_failures: Counter,
    /// Deaths of a running kernel path.
    pub kernel_path_losses: Counter,
}

impl Default for ProxyStats {
    fn default() -> Self {
        let events = Family::<EventType, Counter>::default();
        let merged = Family::<EventType, Counter>::default();
        let suppressed = Family::<Suppressed, Counter>::default();
        // Every type from 0, so that a rate is defined before the first event.
        for t in [
            "CONTAINER_CREATED_EVENT",
            "CONTAINER_STARTED_EVENT",
            "CONTAINER_STOPPED_EVENT",
            "CONTAINER_DELETED_EVENT",
        ] {
            let t = EventType {
                r#type: t.to_owned(),
            };
            let _ = events.get_or_create(&t);
            let _ = merged.get_or_create(&t);
            // The proxy's own events are never stale (super::merge).
            for (origin, reason) in [
                ("proxy", "duplicate"),
                ("runtime", "duplicate"),
                ("runtime", "stale"),
            ] {
                let _ = suppressed.get_or_create(&Suppressed {
                    r#type: t.r#type.clone(),
                    origin: origin.to_owned(),
                    reason: reason.to_owned(),
                });
            }
        }
        Self {
            events,
            subscribers: Gauge::default(),
            subscribers_dropped: Counter::default(),
            forward_seconds: Family::new_with_constructor(forward_histogram),
            forward_errors: Counter::default(),
            // 1 ms to about 4 s.
            kernel_lead_seconds: Histogram::new(exponential_buckets(1e-3, 2.0, 13)),
            overlaid: Counter::default(),
            contradictions: Counter::default(),
            runtime_events: Counter::default(),
            merged,
            suppressed,
            runtime_stream_failures: Counter::default(),
            pass_through: Gauge::default(),
            kernel_start_failures: Counter::default(),
            kernel_path_losses: Counter::default(),
        }
    }
}

impl ProxyStats {
    /// Registers every counter under `cri_proxy_` in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "cri_proxy_events",
            "Container events served to GetContainerEvents subscribers, by type",
            self.events.clone(),
        );
        registry.register(
            "cri_proxy_subscribers",
            "GetContainerEvents subscribers connected",
            self.subscribers.clone(),
        );
        registry.register(
            "cri_proxy_subscribers_dropped",
            "Subscribers dropped because their buffer was full",
            self.subscribers_dropped.clone(),
        );
        registry.register(
            "cri_proxy_forward_duration_seconds",
            "Time from a call's arrival to the runtime's answer headers, by method",
            self.forward_seconds.clone(),
        );
        registry.register(
            "cri_proxy_forward_errors",
            "Calls that could not reach the runtime (answered UNAVAILABLE)",
            self.forward_errors.clone(),
        );
        registry.register(
            "cri_proxy_kernel_lead_seconds",
            "Time from a certain kernel death to the runtime first reporting it",
            self.kernel_lead_seconds.clone(),
        );
        registry.register(
            "cri_proxy_overlaid_answers",
            "Runtime answers in which a container the kernel saw die was shown exited",
            self.overlaid.clone(),
        );
        registry.register(
            "cri_proxy_contradictions",
            "Kernel deaths the runtime still contradicted past the bound (the runtime won)",
            self.contradictions.clone(),
        );
        registry.register(
            "cri_proxy_runtime_events",
            "Events received on the runtime's own stream (--merge-runtime-events)",
            self.runtime_events.clone(),
        );
        registry.register(
            "cri_proxy_merged_events",
            "Events of the runtime's own stream passed on because the proxy had not served them, by type",
            self.merged.clone(),
        );
        registry.register(
            "cri_proxy_suppressed_events",
            "Events not served because their container's stage was served already (duplicate) or a later one was (stale), by type, origin and reason",
            self.suppressed.clone(),
        );
        registry.register(
            "cri_proxy_runtime_stream_failures",
            "Breaks of the runtime's own event stream (subscribed again with a back-off)",
            self.runtime_stream_failures.clone(),
        );
        registry.register(
            "cri_proxy_pass_through",
            "1 while the kernel path does not run and every call, GetContainerEvents included, is forwarded untouched",
            self.pass_through.clone(),
        );
        registry.register(
            "cri_proxy_kernel_start_failures",
            "Starts of the kernel path that failed (retried with a back-off)",
            self.kernel_start_failures.clone(),
        );
        registry.register(
            "cri_proxy_kernel_path_losses",
            "Deaths of a running kernel path (pass-through until it is started again)",
            self.kernel_path_losses.clone(),
        );
    }

    pub fn event(&self, t: &str) {
        self.events
            .get_or_create(&EventType {
                r#type: t.to_owned(),
            })
            .inc();
    }
}
