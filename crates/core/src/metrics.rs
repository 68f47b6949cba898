//! The metrics' shared pieces: the kubelet's default histogram buckets. Each
//! subsystem keeps its own counters; the binary's registry reads them at
//! scrape time.

use prometheus_client::metrics::histogram::Histogram;

/// The kubelet's `DefBuckets` (Prometheus's default buckets), which its PLEG
/// relist, pod worker and evented PLEG histograms use.
pub const DEF_BUCKETS: [f64; 11] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A histogram with [`DEF_BUCKETS`].
pub fn def_histogram() -> Histogram {
    Histogram::new(DEF_BUCKETS)
}

/// A [`def_histogram`] that can be `Default` inside a counters struct.
#[derive(Debug)]
pub struct DefHistogram(pub Histogram);

impl Default for DefHistogram {
    fn default() -> Self {
        Self(def_histogram())
    }
}
