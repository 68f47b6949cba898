//! The volume manager's metrics under the kubelet's names (after the
//! `evpleg_` prefix): `storage_operation_duration_seconds` (each plugin
//! operation by `volume_plugin`, `operation_name` — `volume_mount`,
//! `volume_unmount`, `mount_device`, `unmount_device` — and `status`,
//! `success` or `fail-unknown`, the kubelet's buckets) and
//! `volume_manager_total_volumes` (volumes by `plugin_name` and `state`,
//! `desired_state_of_world` or `actual_state_of_world`, read at scrape time).

use std::collections::BTreeMap;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;

use super::Shared;

/// The kubelet's `storage_operation_duration_seconds` buckets.
pub const BUCKETS: [f64; 13] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 25.0, 50.0, 120.0, 300.0, 600.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    pub volume_plugin: String,
    pub operation_name: &'static str,
    pub status: &'static str,
    pub migrated: &'static str,
}

fn histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

pub type OperationFamily = Family<OperationLabels, Histogram, fn() -> Histogram>;

#[derive(Debug)]
pub struct VolumeMetrics {
    pub duration: OperationFamily,
}

impl Default for VolumeMetrics {
    fn default() -> Self {
        Self {
            duration: OperationFamily::new_with_constructor(histogram),
        }
    }
}

/// Counts the desired and actual volumes at scrape time.
#[derive(Debug)]
pub(crate) struct TotalVolumes(pub(crate) Arc<Shared>);

impl Collector for TotalVolumes {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut counts: BTreeMap<(&'static str, &'static str), i64> = BTreeMap::new();
        {
            let w = self.0.lock();
            for (_, _, v) in w.desired.volumes_to_mount() {
                *counts
                    .entry((v.plugin.name(), "desired_state_of_world"))
                    .or_default() += 1;
            }
            for v in w.actual.volumes().values() {
                let mounted = v.pods.values().filter(|p| p.state.is_mounted()).count() as i64;
                *counts
                    .entry((v.plugin.name(), "actual_state_of_world"))
                    .or_default() += mounted;
            }
        }
        let mut family = encoder.encode_descriptor(
            "volume_manager_total_volumes",
            "Number of volumes in Volume Manager",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for ((plugin, state), n) in counts {
            let labels = [("plugin_name", plugin), ("state", state)];
            let g = ConstGauge::new(n);
            g.encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
