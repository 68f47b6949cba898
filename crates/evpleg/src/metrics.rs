//! Prometheus metrics. Names mirror the kubelet's (`kubelet_pleg_relist_duration_seconds`
//! becomes `evpleg_pleg_relist_duration_seconds`, and so on) with its types,
//! labels and buckets, so that PLEG dashboards carry over; the kernel PLEG,
//! the status manager and `observe` add their own. docs/operations.md lists
//! every metric with its meaning, and a test checks that list against a scrape.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use evpleg_pleg::Pleg;
use evpleg_pleg::kernel::KernelStats;
use evpleg_pleg::kernel::offload::HandoffCause;
use evpleg_pleg::merge::MergeStats;
use evpleg_pleg::relist::{FullRelistCause, RelistStats};

/// The agent's registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
}

/// Reads the PLEG's counters at scrape time.
#[derive(Debug)]
struct PlegCollector {
    relist: Option<Arc<RelistStats>>,
    kernel: Option<Arc<KernelStats>>,
    merge: Option<Arc<MergeStats>>,
    path: Option<Arc<evpleg_pleg::PathHealth>>,
}

fn counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let c = ConstCounter::new(value);
    c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)
}

/// Counts running pods (a ready sandbox) and containers by state in the
/// PLEG's cache at scrape time, as the kubelet's relist sets its gauges.
#[derive(Debug)]
struct RunningCollector(Arc<evpleg_core::cache::PodStatusCache>);

impl Collector for RunningCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use evpleg_core::container::{ContainerState, SandboxState};
        let (mut pods, mut by_state) = (0i64, [0i64; 4]);
        for uid in self.0.uids() {
            let Some(entry) = self.0.get(&uid) else {
                continue;
            };
            let status = &entry.status;
            pods += status
                .sandboxes
                .iter()
                .filter(|s| s.state == SandboxState::Ready)
                .count() as i64;
            for c in &status.containers {
                by_state[c.state as usize] += 1;
            }
        }
        let g = ConstGauge::new(pods);
        g.encode(encoder.encode_descriptor(
            "running_pods",
            "Number of pods that have a running pod sandbox",
            None,
            g.metric_type(),
        )?)?;
        let mut family = encoder.encode_descriptor(
            "running_containers",
            "Number of containers currently running, by state",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        let states = [
            (ContainerState::Created, "created"),
            (ContainerState::Running, "running"),
            (ContainerState::Exited, "exited"),
            (ContainerState::Unknown, "unknown"),
        ];
        for (state, name) in states {
            let labels = [("container_state", name)];
            let g = ConstGauge::new(by_state[state as usize]);
            g.encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// Reads the status manager's counters at scrape time.
#[derive(Debug)]
struct StatusCollector(Arc<evpleg_kubelet::status::manager::StatusManager>);

impl Collector for StatusCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self.0.stats();
        let counters = [
            ("status_writes", "Pod statuses written", s.writes),
            (
                "status_write_retries",
                "Status writes or deletions that failed and are retried",
                s.retries,
            ),
            (
                "status_write_errors",
                "Status writes that failed for good",
                s.dropped,
            ),
            (
                "status_unchanged",
                "Statuses handed in equal to the last, not written",
                s.unchanged,
            ),
            (
                "status_illegal_transitions",
                "Statuses refused because they left a terminal phase or state",
                s.illegal_transitions,
            ),
            (
                "status_pods_deleted",
                "Gracefully deleted pods deleted for good once terminated",
                s.deleted,
            ),
        ];
        for (name, help, value) in counters {
            counter(&mut encoder, name, help, value)?;
        }
        Ok(())
    }
}

/// The CRI event stream's connection counters, under the kubelet's names.
#[derive(Debug)]
struct EventedCollector(Arc<evpleg_pleg::evented_cri::EventedCriStats>);

impl Collector for EventedCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = &self.0;
        counter(
            &mut encoder,
            "evented_pleg_connection_error_count",
            "The number of errors encountered during the establishment of streaming connection with the CRI runtime",
            s.failures.load(Ordering::Relaxed) + s.unimplemented.load(Ordering::Relaxed),
        )?;
        counter(
            &mut encoder,
            "evented_pleg_connection_success_count",
            "The number of times a streaming client was obtained to receive CRI Events",
            s.streams.load(Ordering::Relaxed),
        )?;
        let given_up = ConstGauge::new(i64::from(s.fallen_back.load(Ordering::Relaxed)));
        given_up.encode(encoder.encode_descriptor(
            "evented_pleg_stream_given_up",
            "1 once the CRI event stream was given up after its 5 failures (the kubelet's eventedPlegMaxStreamRetries): the relist alone reports from then on",
            None,
            given_up.metric_type(),
        )?)
    }
}

/// Reads the event recorder's counters at scrape time.
#[derive(Debug)]
struct EventsCollector(Arc<evpleg_record::Stats>);

impl Collector for EventsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = &self.0;
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        {
            let mut family = encoder.encode_descriptor(
                "events_recorded",
                "Pod events recorded, by reason and type",
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            let by_reason = s
                .by_reason
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            for ((kind, reason), n) in &by_reason {
                let labels = [("reason", reason.as_str()), ("type", kind)];
                ConstCounter::new(*n).encode(family.encode_family(&labels)?)?;
            }
        }
        // The kubelet counts a hook's fallback exactly where it records its
        // event: the count of those events.
        let fallbacks = s
            .by_reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&("Warning", evpleg_record::LIFECYCLE_HTTP_FALLBACK.to_owned()))
            .copied()
            .unwrap_or(0);
        counter(
            &mut encoder,
            "lifecycle_handler_http_fallbacks",
            "The number of times lifecycle handlers successfully fell back to http from https",
            fallbacks,
        )?;
        for (name, help, value) in [
            (
                "events_written",
                "Pod events written to the API server",
                load(&s.written),
            ),
            (
                "events_write_errors",
                "Pod event writes to the API server that failed for good",
                load(&s.write_errors),
            ),
            (
                "events_dropped",
                "Pod events not written to the API server: its queue was full",
                load(&s.queue_full),
            ),
            (
                "events_spam_filtered",
                "Pod events the spam filter kept from the API server",
                load(&s.spam_filtered),
            ),
        ] {
            counter(&mut encoder, name, help, value)?;
        }
        Ok(())
    }
}

/// Reads the essential tasks' failures at scrape time.
#[derive(Debug)]
struct TaskCollector(Vec<Arc<evpleg_core::tasks::TaskHealth>>);

impl Collector for TaskCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let failures = self
            .0
            .iter()
            .map(|h| h.failures.load(Ordering::Relaxed))
            .sum();
        counter(
            &mut encoder,
            "essential_task_failures",
            "Essential tasks (sync loop, relist, status manager...) that stopped before shutdown",
            failures,
        )
    }
}

impl Collector for PlegCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let mut discarded = 0;
        if let Some(r) = &self.relist {
            discarded += load(&r.discarded);
            let last = load(&r.last_relist_ns);
            if last != 0 {
                let g =
                    ConstGauge::new(evpleg_core::clock::monotonic_to_unix_ns(last) as f64 / 1e9);
                g.encode(encoder.encode_descriptor(
                    "pleg_last_seen_seconds",
                    "Timestamp in seconds when the relist PLEG was last seen active",
                    None,
                    g.metric_type(),
                )?)?;
            }
            counter(
                &mut encoder,
                "pleg_relists",
                "Full relists done",
                load(&r.relists),
            )?;
            {
                let mut family = encoder.encode_descriptor(
                    "pleg_relists_by_cause",
                    "Full relists started, by cause (period, requested, follow-up of a loss, retry)",
                    None,
                    prometheus_client::metrics::MetricType::Counter,
                )?;
                for cause in FullRelistCause::ALL {
                    let labels = [("cause", cause.as_str())];
                    ConstCounter::new(load(&r.by_cause[cause as usize]))
                        .encode(family.encode_family(&labels)?)?;
                }
            }
            counter(
                &mut encoder,
                "pleg_pod_relists",
                "On-demand relists of one pod",
                load(&r.pod_relists),
            )?;
            counter(
                &mut encoder,
                "pleg_failed_relists",
                "Relists whose listing failed",
                load(&r.failed_relists),
            )?;
            counter(
                &mut encoder,
                "pleg_kernel_exits_confirmed",
                "Kernel-observed exits the runtime confirmed",
                load(&r.confirmed),
            )?;
            counter(
                &mut encoder,
                "pleg_kernel_contradictions",
                "Kernel-observed exits the runtime still contradicted after the bound (the runtime won, the exit was forgotten)",
                load(&r.contradictions),
            )?;
            counter(
                &mut encoder,
                "pleg_pod_relists_skipped",
                "On-demand pod relists a full relist had already served",
                load(&r.pod_relists_skipped),
            )?;
            counter(
                &mut encoder,
                "pleg_failed_pod_relists",
                "On-demand pod relists whose listing failed (retried with back-off)",
                load(&r.failed_pod_relists),
            )?;
        }
        if let Some(p) = &self.path {
            counter(
                &mut encoder,
                "pleg_kernel_degradations",
                "Times the kernel path stopped and the relist fell back to 1 s",
                load(&p.degradations),
            )?;
        }
        if let Some(m) = &self.merge {
            discarded += load(&m.discarded);
            counter(
                &mut encoder,
                "pleg_kernel_events_unattributed",
                "Kernel events whose pod the cgroup path did not name",
                load(&m.unattributed),
            )?;
            counter(
                &mut encoder,
                "pleg_kernel_hints",
                "Kernel observations that were not certain: the pod was relisted, nothing written",
                load(&m.hints),
            )?;
            counter(
                &mut encoder,
                "pleg_kernel_events_deferred",
                "Certain kernel events for containers the pod's snapshot did not hold yet (the pod was relisted)",
                load(&m.deferred),
            )?;
        }
        if let Some(k) = &self.kernel {
            discarded += load(&k.discarded);
            for (name, help, value) in [
                (
                    "pleg_kernel_records_reported",
                    "Records the kernel programs submitted",
                    load(&k.kernel_reported),
                ),
                (
                    "pleg_kernel_records_filtered",
                    "Events the kernel filter left out",
                    load(&k.kernel_filtered),
                ),
                (
                    "pleg_kernel_records_dropped",
                    "Records lost to a full ring buffer (each raises a relist)",
                    load(&k.kernel_dropped),
                ),
                (
                    "pleg_kernel_program_runs_skipped",
                    "Program runs the kernel skipped, the program already running on that CPU (each raises a relist)",
                    load(&k.kernel_missed),
                ),
                (
                    "pleg_kernel_read_errors",
                    "Kernel memory reads that failed",
                    load(&k.kernel_read_errors),
                ),
                (
                    "pleg_kernel_records_read",
                    "Records read from the ring buffer",
                    load(&k.records),
                ),
                (
                    "pleg_kernel_records_malformed",
                    "Records rejected by the decoder",
                    load(&k.malformed),
                ),
                (
                    "pleg_kernel_unattributed",
                    "Task records in cgroups unknown after a rescan",
                    load(&k.unattributed),
                ),
                (
                    "pleg_kernel_rescans",
                    "Rescans of the cgroup tree",
                    load(&k.rescans),
                ),
                (
                    "pleg_kernel_containers_demoted",
                    "Containers whose main process became uncertain because kernel records were lost",
                    load(&k.demoted),
                ),
                (
                    "pleg_kernel_deaths_contradicted",
                    "Kernel deaths the runtime contradicted (the tracker forgot that main process)",
                    load(&k.contradicted),
                ),
                (
                    "pleg_kernel_walker_fallbacks",
                    "Rescans for relist views the ring-buffer reader ran itself because the cgroup walker thread was gone",
                    load(&k.walker_fallbacks),
                ),
                (
                    "pleg_kernel_rt_throttled",
                    "Times the ring-buffer reader spent its real-time CPU budget and ran at normal priority until its window ended",
                    load(&k.rt_throttled),
                ),
                (
                    "pleg_kernel_merge_handoff_failures",
                    "Kernel events the helper's full queue could not take (a full relist was requested)",
                    load(&k.handoff_failures),
                ),
                (
                    "pleg_kernel_log_lines_dropped",
                    "Ring-buffer reader log lines dropped because their queue was full",
                    load(&k.log_lines_dropped),
                ),
            ] {
                counter(&mut encoder, name, help, value)?;
            }
            {
                let mut family = encoder.encode_descriptor(
                    "pleg_kernel_merge_handoffs",
                    "Kernel events merged by the normal-priority helper, by cause: a lock busy on the reader (cache, reports, relist_queue) or an earlier event still with the helper (behind)",
                    None,
                    prometheus_client::metrics::MetricType::Counter,
                )?;
                for cause in HandoffCause::ALL {
                    let labels = [("cause", cause.label())];
                    let n = ConstCounter::new(k.handoffs.get(cause));
                    n.encode(family.encode_family(&labels)?)?;
                }
            }
            let unfound = ConstGauge::new(load(&k.unfound) as i64);
            unfound.encode(encoder.encode_descriptor(
                "pleg_kernel_unfound_containers",
                "Running containers the runtime lists whose cgroup is under no kernel pleg root (their deaths wait for a relist)",
                None,
                unfound.metric_type(),
            )?)?;
        }
        counter(
            &mut encoder,
            "pleg_discard_events",
            "Lifecycle events dropped because a channel was full",
            discarded,
        )
    }
}

impl Metrics {
    /// A registry with the PLEG's metrics.
    pub fn new(pleg: Option<&Pleg>, kernel: Option<Arc<KernelStats>>) -> Self {
        let mut registry = Registry::with_prefix("evpleg");
        let kernel = kernel.or_else(|| {
            pleg.and_then(|p| p.kernel.as_ref())
                .map(|k| k.stats().clone())
        });
        if let Some(p) = pleg {
            registry.register(
                "pleg_relist_duration_seconds",
                "Duration of a full relist",
                p.relist_stats.duration_seconds.clone(),
            );
            registry.register(
                "pleg_relist_interval_seconds",
                "Interval between two full relists",
                p.relist_stats.interval_seconds.clone(),
            );
        }
        if let Some(k) = &kernel {
            registry.register(
                "pleg_kernel_event_latency_seconds",
                "Delay from the kernel's timestamp of an event to its receipt by the reader",
                k.latency_seconds.clone(),
            );
            registry.register(
                "pleg_kernel_reconcile_duration_seconds",
                "Time the ring-buffer reader took to apply a relist's view (no record is read meanwhile)",
                k.reconcile_seconds.clone(),
            );
        }
        if let Some(p) = pleg {
            registry.register(
                "pleg_event_latency_seconds",
                "Delay from a container's start or death (the kernel's timestamp, else the runtime's) to its event's receipt, by source",
                p.event_latency.seconds.clone(),
            );
            registry.register_collector(Box::new(RunningCollector(p.cache.clone())));
            if let Some(e) = &p.evented_stats {
                registry.register(
                    "evented_pleg_connection_latency_seconds",
                    "The latency of streaming connection with the CRI runtime, measured in seconds",
                    e.latency_seconds.0.clone(),
                );
                registry.register_collector(Box::new(EventedCollector(e.clone())));
            }
        }
        registry.register_collector(Box::new(PlegCollector {
            relist: pleg.map(|p| p.relist_stats.clone()),
            kernel,
            merge: pleg.and_then(|p| p.merge_stats.clone()),
            path: pleg
                .filter(|p| p.kernel.is_some())
                .map(|p| p.path_health.clone()),
        }));
        Self { registry }
    }

    /// Also exports the CRI client's runtime operation metrics
    /// ([`evpleg_cri::metrics`]).
    pub fn with_cri(mut self, cri: Arc<evpleg_cri::metrics::CriMetrics>) -> Self {
        self.registry.register(
            "runtime_operations",
            "Cumulative number of runtime operations by operation type",
            cri.operations.clone(),
        );
        self.registry.register(
            "runtime_operations_duration_seconds",
            "Duration in seconds of runtime operations, by operation type",
            cri.duration.clone(),
        );
        self.registry.register(
            "runtime_operations_errors",
            "Cumulative number of runtime operation errors by operation type",
            cri.errors.clone(),
        );
        self
    }

    /// Also exports the CSI clients' `csi_operations_seconds` and the plugin
    /// watcher's `plugin_manager_total_plugins`
    /// ([`evpleg_volume::csi::metrics`]).
    pub fn with_csi(mut self, csi: Arc<evpleg_volume::csi::metrics::CsiMetrics>) -> Self {
        self.registry.register(
            "csi_operations_seconds",
            "Container Storage Interface operation duration with gRPC error code status total",
            csi.operations.clone(),
        );
        self.registry.register(
            "plugin_manager_total_plugins",
            "Number of plugins in Plugin Manager",
            csi.plugins.clone(),
        );
        self
    }

    /// Also exports the pod workers' `pod_worker_duration_seconds`.
    pub fn with_workers(mut self, workers: &evpleg_kubelet::pod_workers::WorkerMetrics) -> Self {
        workers.register(&mut self.registry);
        self
    }

    /// Also exports the volume manager's metrics ([`evpleg_volume::metrics`]).
    pub fn with_volumes(mut self, volumes: &evpleg_volume::VolumeManager) -> Self {
        volumes.register_metrics(&mut self.registry);
        self
    }

    /// Also exports the event recorder's counters.
    pub fn with_events(mut self, stats: Arc<evpleg_record::Stats>) -> Self {
        self.registry
            .register_collector(Box::new(EventsCollector(stats)));
        self
    }

    /// Also exports what `evpleg observe` measures.
    pub fn with_observe(mut self, stats: Arc<crate::observe::ObserveStats>) -> Self {
        self.registry.register(
            "observe_relist_lead_seconds",
            "How much earlier the PLEG saw a transition than the comparison relist",
            stats.lead_seconds.clone(),
        );
        self.registry.register(
            "observe_relist_missed",
            "Transitions the PLEG saw and the comparison relist did not report in time",
            stats.relist_missed.clone(),
        );
        self.registry.register(
            "observe_pleg_missed",
            "Transitions the comparison relist saw and the PLEG did not report in time",
            stats.pleg_missed.clone(),
        );
        self.registry.register(
            "observe_exit_code_mismatches",
            "Deaths whose exit code differs between the PLEG and the runtime",
            stats.exit_code_mismatches.clone(),
        );
        self
    }

    /// Also exports the status manager's counters.
    pub fn with_status(
        mut self,
        status: Arc<evpleg_kubelet::status::manager::StatusManager>,
    ) -> Self {
        self.registry.register(
            "pod_start_duration_seconds",
            "Duration in seconds from the agent seeing a pod for the first time to the pod starting to run",
            status.start_latency.duration.clone(),
        );
        self.registry.register(
            "pod_start_sli_duration_seconds",
            "Duration in seconds to start a pod, excluding time to pull images, measured from pod creation timestamp to when all its containers are reported as started",
            status.start_latency.sli.clone(),
        );
        self.registry
            .register_collector(Box::new(StatusCollector(status)));
        self
    }

    /// Also exports what `evpleg cri-proxy` counts.
    pub fn register_cri_proxy(&mut self, stats: &evpleg_cri_proxy::ProxyStats) {
        stats.register(&mut self.registry);
    }

    /// Also counts the essential tasks that stopped ([`evpleg_core::tasks`]).
    pub fn with_task_health(mut self, health: Vec<Arc<evpleg_core::tasks::TaskHealth>>) -> Self {
        self.registry
            .register_collector(Box::new(TaskCollector(health)));
        self
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_kernel_metrics() {
        let stats = Arc::new(KernelStats::default());
        stats.latency_seconds.observe(25e-6);
        stats.discarded.store(3, Ordering::Relaxed);
        stats.kernel_dropped.store(2, Ordering::Relaxed);
        stats.kernel_missed.store(6, Ordering::Relaxed);
        stats.unfound.store(4, Ordering::Relaxed);
        stats.demoted.store(5, Ordering::Relaxed);
        let text = Metrics::new(None, Some(stats)).render();
        assert!(
            text.contains("evpleg_pleg_kernel_unfound_containers 4"),
            "{text}"
        );
        assert!(
            text.contains("evpleg_pleg_kernel_containers_demoted_total 5"),
            "{text}"
        );
        assert!(
            text.contains("evpleg_pleg_kernel_event_latency_seconds_count 1"),
            "{text}"
        );
        assert!(
            text.contains("evpleg_pleg_discard_events_total 3"),
            "{text}"
        );
        assert!(
            text.contains("evpleg_pleg_kernel_records_dropped_total 2"),
            "{text}"
        );
        assert!(
            text.contains("evpleg_pleg_kernel_program_runs_skipped_total 6"),
            "{text}"
        );
    }

    #[test]
    fn runtime_operations_are_counted_with_the_kubelet_s_names() {
        let cri = Arc::new(evpleg_cri::metrics::CriMetrics::default());
        cri.observe("StartContainer", 0.02, false);
        cri.observe("StartContainer", 0.03, true);
        cri.observe("PodSandboxStatus", 0.001, false);
        let text = Metrics::new(None, None).with_cri(cri).render();
        for line in [
            "evpleg_runtime_operations_total{operation_type=\"start_container\"} 2",
            "evpleg_runtime_operations_total{operation_type=\"podsandbox_status\"} 1",
            "evpleg_runtime_operations_errors_total{operation_type=\"start_container\"} 1",
            "evpleg_runtime_operations_duration_seconds_count{operation_type=\"start_container\"} 2",
            "evpleg_runtime_operations_duration_seconds_bucket{le=\"0.005\",operation_type=\"podsandbox_status\"} 1",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
    }

    #[test]
    fn hook_fallbacks_are_counted_from_their_events() {
        let rec = evpleg_record::Recorder::new(
            "n",
            Arc::new(evpleg_core::clock::ManualClock::new(1)),
            Default::default(),
            None,
        );
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "default", "uid": "a".repeat(32)}
        }))
        .unwrap();
        let text = Metrics::new(None, None).with_events(rec.stats()).render();
        assert!(
            text.contains("evpleg_lifecycle_handler_http_fallbacks_total 0\n"),
            "{text}"
        );
        for _ in 0..2 {
            rec.record(
                &pod,
                None,
                evpleg_record::EventType::Warning,
                evpleg_record::LIFECYCLE_HTTP_FALLBACK,
                "request to HTTPS lifecycle hook 10.0.0.1:443 got HTTP response, retry with HTTP succeeded",
            );
        }
        rec.record(
            &pod,
            None,
            evpleg_record::EventType::Warning,
            evpleg_record::FAILED_PRE_STOP_HOOK,
            "x",
        );
        let text = Metrics::new(None, None).with_events(rec.stats()).render();
        assert!(
            text.contains("evpleg_lifecycle_handler_http_fallbacks_total 2\n"),
            "{text}"
        );
    }

    /// The event stream's counters: an `Unimplemented` answer counts once in
    /// the error count, and a stream given up shows (issue #30).
    #[test]
    fn the_event_streams_errors_and_its_end_are_exported() {
        let stats = Arc::new(evpleg_pleg::evented_cri::EventedCriStats::default());
        let render = || {
            let mut registry = Registry::with_prefix("evpleg");
            registry.register_collector(Box::new(EventedCollector(stats.clone())));
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
            text
        };
        let text = render();
        assert!(
            text.contains("evpleg_evented_pleg_stream_given_up 0\n"),
            "{text}"
        );
        stats.failures.store(3, Ordering::Relaxed);
        stats.unimplemented.store(2, Ordering::Relaxed);
        stats.fallen_back.store(true, Ordering::Relaxed);
        let text = render();
        assert!(
            text.contains("evpleg_evented_pleg_connection_error_count_total 5\n"),
            "{text}"
        );
        assert!(
            text.contains("evpleg_evented_pleg_stream_given_up 1\n"),
            "{text}"
        );
    }

    #[test]
    fn running_pods_and_containers_come_from_the_cache() {
        use evpleg_core::container::{
            ContainerState, ContainerStatus, PodStatus, SandboxState, SandboxStatus,
        };
        use evpleg_core::ids::{ContainerId, PodUid};
        use evpleg_core::lifecycle::EventSource;
        let cache = Arc::new(evpleg_core::cache::PodStatusCache::new());
        let id = |n: u8| ContainerId::parse(&format!("{n:02x}").repeat(32)).unwrap();
        let sandbox = |n: u8, state| SandboxStatus {
            id: id(n),
            state,
            attempt: 0,
            created_at: None,
            ip: None,
            pid: None,
        };
        let c = |n: u8, state| ContainerStatus::new(id(n), "c", state, EventSource::Relist);
        let pod = |n: u8| PodUid::parse(&format!("{n:02x}").repeat(16)).unwrap();
        cache.set(
            &pod(1),
            PodStatus {
                sandboxes: vec![sandbox(1, SandboxState::Ready)],
                containers: vec![c(2, ContainerState::Running), c(3, ContainerState::Exited)],
                ..PodStatus::default()
            },
            1,
        );
        cache.set(
            &pod(2),
            PodStatus {
                sandboxes: vec![sandbox(4, SandboxState::NotReady)],
                containers: vec![c(5, ContainerState::Exited)],
                ..PodStatus::default()
            },
            1,
        );
        let mut registry = Registry::with_prefix("evpleg");
        registry.register_collector(Box::new(RunningCollector(cache)));
        let metrics = Metrics { registry };
        let text = metrics.render();
        for line in [
            "evpleg_running_pods 1",
            "evpleg_running_containers{container_state=\"running\"} 1",
            "evpleg_running_containers{container_state=\"exited\"} 2",
            "evpleg_running_containers{container_state=\"created\"} 0",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
    }
}
