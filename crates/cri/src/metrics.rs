//! The kubelet's runtime operation metrics (`instrumented_services.go`):
//! every CRI call counted by operation, with its duration and its errors,
//! under the kubelet's names and operation labels (`evpleg_` in place of
//! `kubelet_`): `runtime_operations_total`,
//! `runtime_operations_duration_seconds` (its buckets: 5 ms growing 2.5-fold,
//! 14 of them), `runtime_operations_errors_total`. A call retried while the
//! runtime was unavailable counts once, its duration the whole call's.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

/// The `operation_type` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Operation {
    pub operation_type: String,
}

type HistogramFamily = Family<Operation, Histogram, fn() -> Histogram>;

/// Counters shared by every clone of a client.
#[derive(Debug)]
pub struct CriMetrics {
    pub operations: Family<Operation, Counter>,
    pub errors: Family<Operation, Counter>,
    pub duration: HistogramFamily,
}

fn duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.5, 14))
}

impl Default for CriMetrics {
    fn default() -> Self {
        Self {
            operations: Family::default(),
            errors: Family::default(),
            duration: Family::new_with_constructor(duration_histogram),
        }
    }
}

/// The kubelet's operation name for a CRI method (`PodSandboxStatus` ->
/// `podsandbox_status`).
pub fn operation_type(call: &str) -> String {
    let mut out = String::new();
    for (i, ch) in call.chars().enumerate() {
        if ch.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(ch.to_ascii_lowercase());
    }
    // The kubelet writes "podsandbox" as one word.
    out.replace("pod_sandbox", "podsandbox")
}

impl CriMetrics {
    /// Records one finished call.
    pub fn observe(&self, call: &str, seconds: f64, failed: bool) {
        let label = Operation {
            operation_type: operation_type(call),
        };
        self.operations.get_or_create(&label).inc();
        self.duration.get_or_create(&label).observe(seconds);
        if failed {
            self.errors.get_or_create(&label).inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operation_names_are_the_kubelet_s() {
        let table = [
            ("Version", "version"),
            ("RunPodSandbox", "run_podsandbox"),
            ("PodSandboxStatus", "podsandbox_status"),
            ("ListPodSandbox", "list_podsandbox"),
            ("ListContainers", "list_containers"),
            ("ContainerStatus", "container_status"),
            ("StartContainer", "start_container"),
            ("PullImage", "pull_image"),
            ("ExecSync", "exec_sync"),
        ];
        for (call, want) in table {
            assert_eq!(operation_type(call), want, "{call}");
        }
    }
}
