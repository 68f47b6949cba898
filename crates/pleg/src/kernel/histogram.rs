//! A latency histogram the real-time reader records into with atomics only
//! (`pleg_kernel_event_latency_seconds`; the kubelet has no kernel reader).
//!
//! `prometheus_client`'s `Histogram` keeps its buckets under a `RwLock` that a
//! `/metrics` scrape holds while it writes them out: a scrape preempted (or
//! writing to a slow client) in the middle held the reader thread, at
//! SCHED_FIFO, in `observe` (issue #25, item 8). Here each bucket is an
//! `AtomicU64`: recording is two `fetch_add`s and a scan of the bounds, and a
//! scrape reads the counters without blocking anyone. A scrape may see a
//! record's bucket and not yet its sum; the count it shows is the buckets'
//! sum, so the buckets and the count always agree.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::exemplar::Exemplar;
use prometheus_client::metrics::{MetricType, TypedMetric};

/// Buckets in ns; one more bucket counts what is above the last bound.
#[derive(Debug)]
struct Inner {
    bounds_ns: Box<[u64]>,
    buckets: Box<[AtomicU64]>,
    sum_ns: AtomicU64,
}

/// A histogram of durations with fixed bounds; cheap to clone (shared).
#[derive(Clone, Debug)]
pub struct AtomicHistogram(Arc<Inner>);

impl AtomicHistogram {
    /// Bounds `first_ns`, doubling, `count` of them (and +Inf).
    pub fn doubling(first_ns: u64, count: u32) -> Self {
        let bounds_ns: Box<[u64]> = (0..count).map(|i| first_ns << i).collect();
        let buckets = (0..=count).map(|_| AtomicU64::new(0)).collect();
        Self(Arc::new(Inner {
            bounds_ns,
            buckets,
            sum_ns: AtomicU64::new(0),
        }))
    }

    /// Records a duration in ns: no lock, no allocation.
    pub fn observe_ns(&self, ns: u64) {
        let i = self
            .0
            .bounds_ns
            .iter()
            .position(|b| ns <= *b)
            .unwrap_or(self.0.bounds_ns.len());
        self.0.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.0.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Records a duration in seconds (negative counts as 0).
    pub fn observe(&self, seconds: f64) {
        self.observe_ns((seconds.max(0.0) * 1e9) as u64);
    }

    /// How many durations were recorded.
    pub fn count(&self) -> u64 {
        self.0
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .sum()
    }

    /// The recorded durations' sum in seconds.
    pub fn sum(&self) -> f64 {
        self.0.sum_ns.load(Ordering::Relaxed) as f64 / 1e9
    }

    /// `(upper bound in seconds, count in that bucket)`, +Inf last (as
    /// `f64::MAX`, which the encoder writes `+Inf`).
    pub fn snapshot(&self) -> Vec<(f64, u64)> {
        let bounds = self.0.bounds_ns.iter().map(|b| *b as f64 / 1e9);
        bounds
            .chain(std::iter::once(f64::MAX))
            .zip(self.0.buckets.iter().map(|b| b.load(Ordering::Relaxed)))
            .collect()
    }
}

impl TypedMetric for AtomicHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for AtomicHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let buckets = self.snapshot();
        let count = buckets.iter().map(|(_, c)| c).sum();
        encoder.encode_histogram::<NoLabelSet>(
            self.sum(),
            count,
            &buckets,
            None::<&HashMap<usize, Exemplar<NoLabelSet, f64>>>,
        )
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;
    use std::sync::mpsc;
    use std::time::Duration;

    /// A scrape's writer that stops at the first bucket line until released.
    struct Stuck {
        held: mpsc::Sender<()>,
        release: mpsc::Receiver<()>,
        stopped: bool,
    }

    impl std::fmt::Write for Stuck {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            if s.contains("bucket") && !std::mem::replace(&mut self.stopped, true) {
                let _ = self.held.send(());
                let _ = self.release.recv();
            }
            Ok(())
        }
    }

    /// Issue #25 item 8: `prometheus_client`'s histogram kept its buckets
    /// under a lock a scrape held while writing them out, so the reader's
    /// `observe` waited for the slowest `/metrics` client.
    #[test]
    fn a_scrape_stuck_mid_write_does_not_hold_a_recording() {
        let h = AtomicHistogram::doubling(1_000, 24);
        let mut registry = Registry::default();
        registry.register("lat", "latency", h.clone());
        let (held, held_rx) = mpsc::channel();
        let (release, release_rx) = mpsc::channel();
        let scrape = std::thread::spawn(move || {
            let mut w = Stuck {
                held,
                release: release_rx,
                stopped: false,
            };
            prometheus_client::encoding::text::encode(&mut w, &registry)
        });
        held_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the scrape reached the buckets");
        let (done, done_rx) = mpsc::channel();
        let recorder = h.clone();
        std::thread::spawn(move || {
            for ns in 0..1000 {
                recorder.observe_ns(ns * 1000);
            }
            let _ = done.send(());
        });
        let recorded = done_rx.recv_timeout(Duration::from_secs(10));
        release.send(()).unwrap();
        scrape.join().unwrap().unwrap();
        recorded.expect("1000 recordings while a scrape was stuck");
        assert_eq!(h.count(), 1000);
    }

    #[test]
    fn buckets_count_and_sum_encode_as_a_histogram() {
        let h = AtomicHistogram::doubling(1_000, 3);
        for ns in [500, 1_000, 1_001, 3_000, 4_000, 9_000] {
            h.observe_ns(ns);
        }
        h.observe(-1.0);
        assert_eq!(h.count(), 7);
        let mut registry = Registry::default();
        registry.register("lat", "latency", h.clone());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("lat_")).collect();
        assert_eq!(
            lines,
            vec![
                "lat_sum 0.000018501",
                "lat_count 7",
                "lat_bucket{le=\"0.000001\"} 3",
                "lat_bucket{le=\"0.000002\"} 4",
                "lat_bucket{le=\"0.000004\"} 6",
                "lat_bucket{le=\"+Inf\"} 7",
            ],
            "{text}"
        );
    }
}
