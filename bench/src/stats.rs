//! Percentiles of the report. The tails ([`Pooled`]) are taken over every
//! sample of every counted repetition pooled together, with the true maximum;
//! a percentile is given only when the sample count supports it
//! ([`P90_MIN_SAMPLES`], [`P99_MIN_SAMPLES`]). The spread across repetitions
//! ([`Summary`]: each repetition's own percentiles, their median, lowest and
//! highest) is shown beside them, never in their place: a repetition of ten
//! deaths has no p99 of its own (its "p99" is its maximum).

use serde::{Deserialize, Serialize};

/// The `p`-th percentile (0..=100) of `sorted` by the nearest-rank method;
/// `None` when empty.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// The fewest samples a p90 is given over: ten samples above it.
pub const P90_MIN_SAMPLES: usize = 20;
/// The fewest samples a p99 is given over (issue #29): two samples above it;
/// below that count the p99 is the maximum or next to it.
pub const P99_MIN_SAMPLES: usize = 200;

/// Percentiles over pooled samples, each only where the count supports it.
#[derive(Clone, Debug, PartialEq)]
pub struct Pooled {
    pub n: usize,
    pub p50: f64,
    /// `None` below [`P90_MIN_SAMPLES`].
    pub p90: Option<f64>,
    /// `None` below [`P99_MIN_SAMPLES`].
    pub p99: Option<f64>,
    /// The largest sample.
    pub max: f64,
}

impl Pooled {
    /// `None` for no samples.
    pub fn of(samples: &[f64]) -> Option<Self> {
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        Some(Self {
            n,
            p50: percentile(&sorted, 50.0)?,
            p90: (n >= P90_MIN_SAMPLES)
                .then(|| percentile(&sorted, 90.0))
                .flatten(),
            p99: (n >= P99_MIN_SAMPLES)
                .then(|| percentile(&sorted, 99.0))
                .flatten(),
            max: *sorted.last()?,
        })
    }

    /// The highest percentile the count supports: `p99`, `p90` or `p50`.
    pub fn supports(&self) -> &'static str {
        if self.p99.is_some() {
            "p99"
        } else if self.p90.is_some() {
            "p90"
        } else {
            "p50"
        }
    }
}

/// Percentiles of one repetition's samples (microseconds), whatever their
/// count: for the spread across repetitions and progress lines, not for tails.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub n: usize,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Percentiles {
    /// `None` for no samples.
    pub fn of(samples: &[f64]) -> Option<Self> {
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        Some(Self {
            n: sorted.len(),
            p50: percentile(&sorted, 50.0)?,
            p90: percentile(&sorted, 90.0)?,
            p99: percentile(&sorted, 99.0)?,
            max: *sorted.last()?,
        })
    }
}

/// A figure over repetitions: the median and the spread.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// `None` for no repetitions. The median of an even count is the lower middle
    /// (a measured value, not an average of two).
    pub fn of(values: &[f64]) -> Option<Self> {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        Some(Self {
            median: *sorted.get((sorted.len().checked_sub(1)?) / 2)?,
            min: *sorted.first()?,
            max: *sorted.last()?,
        })
    }
}

/// A 95 % interval of the median of `values`, free of any assumption on
/// their distribution: the order statistics `k` and `n + 1 - k` (1-based)
/// with `k` the largest for which fewer than `k` of `n` fair coin flips come
/// up heads with probability at most 2.5 % (for 20 values, the 6th and 15th).
/// `None` below 6 values, where no such `k` exists, and above 1 000 (where
/// `0.5^n` underflows).
pub fn median_interval(values: &[f64]) -> Option<(f64, f64)> {
    let n = values.len();
    // P(X <= j) for X ~ Binomial(n, 1/2), j = 0, 1, ...: the largest k with
    // P(X <= k - 1) <= 0.025.
    if n > 1000 {
        return None;
    }
    let mut term = 0.5f64.powi(n as i32);
    let mut below = 0.0;
    let mut k = 0;
    for j in 0..n {
        below += term;
        if below > 0.025 {
            break;
        }
        k = j + 1;
        term *= (n - j) as f64 / (j + 1) as f64;
    }
    if k == 0 {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    Some((sorted[k - 1], sorted[n - k]))
}

/// Each per-repetition percentile's spread over repetitions (not the tails:
/// see [`Pooled`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub repetitions: usize,
    pub samples: usize,
    pub p50: Spread,
    pub p90: Spread,
    pub p99: Spread,
    pub max: Spread,
}

impl Summary {
    pub fn of(reps: &[Percentiles]) -> Option<Self> {
        let pick = |f: fn(&Percentiles) -> f64| Spread::of(&reps.iter().map(f).collect::<Vec<_>>());
        Some(Self {
            repetitions: reps.len(),
            samples: reps.iter().map(|r| r.n).sum(),
            p50: pick(|r| r.p50)?,
            p90: pick(|r| r.p90)?,
            p99: pick(|r| r.p99)?,
            max: pick(|r| r.max)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_medians_interval_is_the_binomial_order_statistics() {
        // (count, the interval of 1..=count given in reverse): 6th and 15th
        // of 20 (P(X <= 5) = 0.021, P(X <= 6) = 0.058), 40th and 61st of 100.
        let table: [(u32, Option<(f64, f64)>); 6] = [
            (0, None),
            (5, None),
            (6, Some((1.0, 6.0))),
            (20, Some((6.0, 15.0))),
            (100, Some((40.0, 61.0))),
            (1001, None),
        ];
        for (n, want) in table {
            let v: Vec<f64> = (1..=n).rev().map(f64::from).collect();
            assert_eq!(median_interval(&v), want, "{n} values");
        }
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 90.0), Some(90.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
        // Three samples: p50 is the second, p90 and p99 the third.
        assert_eq!(percentile(&[1.0, 2.0, 3.0], 50.0), Some(2.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0], 90.0), Some(3.0));
    }

    #[test]
    fn percentiles_sort_their_samples() {
        let p = Percentiles::of(&[5.0, 1.0, 4.0, 2.0, 3.0]).unwrap();
        assert_eq!(
            p,
            Percentiles {
                n: 5,
                p50: 3.0,
                p90: 5.0,
                p99: 5.0,
                max: 5.0
            }
        );
        assert_eq!(Percentiles::of(&[]), None);
    }

    #[test]
    fn spread_is_the_lower_median_and_the_extremes() {
        assert_eq!(
            Spread::of(&[3.0, 1.0, 2.0]),
            Some(Spread {
                median: 2.0,
                min: 1.0,
                max: 3.0
            })
        );
        assert_eq!(Spread::of(&[4.0, 1.0]).unwrap().median, 1.0);
        assert_eq!(Spread::of(&[]), None);
    }

    /// Issue #29's recomputation from the raw samples of the run it read
    /// (`bench/results/full.json` as commit 0a4caeb wrote it, 5 repetitions
    /// of 10 deaths; the four series copied to `testdata/issue29-full.json`):
    /// the pooled p99 of 50 samples (by nearest rank their largest), where the
    /// report showed the median of the five repetitions' maxima.
    #[test]
    fn pooled_tails_reproduce_the_issue_s_recomputation() {
        let raw: serde_json::Value =
            serde_json::from_str(include_str!("testdata/issue29-full.json")).unwrap();
        let series = raw["latency"].as_array().unwrap();
        // (mode, workload, stage, pooled p99, what the report said it was)
        let table = [
            ("ebpf", "killed", "delivered", 142.3, 67.9),
            ("ebpf", "self-exit", "event", 729.0, 517.3),
            ("ebpf", "agent-killed", "worker-sync", 28_778.7, 444.7),
            ("ebpf", "agent-killed", "status-held", 28_821.3, 715.4),
        ];
        for (mode, workload, stage, p99, reported) in table {
            let l = series
                .iter()
                .find(|l| l["mode"] == mode && l["workload"] == workload && l["stage"] == stage)
                .unwrap_or_else(|| panic!("{mode} {workload} {stage}"));
            let samples: Vec<f64> = serde_json::from_value(l["samples_us"].clone()).unwrap();
            assert_eq!(samples.len(), 50, "{mode} {workload} {stage}");
            let mut sorted = samples.clone();
            sorted.sort_by(f64::total_cmp);
            let pooled_p99 = percentile(&sorted, 99.0).unwrap();
            assert!(
                (pooled_p99 - p99).abs() < 0.1,
                "{stage}: {pooled_p99} != {p99}"
            );
            // The old figure: the median of the five repetitions' maxima.
            let maxima: Vec<f64> = samples
                .chunks(10)
                .map(|c| c.iter().copied().fold(f64::MIN, f64::max))
                .collect();
            let old = Spread::of(&maxima).unwrap().median;
            assert!((old - reported).abs() < 0.1, "{stage}: {old} != {reported}");
            // 50 samples support a p90, not a p99: the pooled summary says so,
            // and its maximum is the true one.
            let p = Pooled::of(&samples).unwrap();
            assert_eq!((p.n, p.p99, p.supports()), (50, None, "p90"));
            assert_eq!(p.max, *sorted.last().unwrap());
            assert_eq!(p.p90, percentile(&sorted, 90.0));
        }
    }

    #[test]
    fn pooled_percentiles_need_their_sample_counts() {
        // (samples 1..=n, p90, p99)
        let table: [(usize, Option<f64>, Option<f64>); 5] = [
            (1, None, None),
            (19, None, None),
            (20, Some(18.0), None),
            (199, Some(180.0), None),
            (200, Some(180.0), Some(198.0)),
        ];
        for (n, p90, p99) in table {
            let v: Vec<f64> = (1..=n).rev().map(|i| i as f64).collect();
            let p = Pooled::of(&v).unwrap();
            assert_eq!(
                (p.n, p.p90, p.p99, p.max),
                (n, p90, p99, n as f64),
                "n = {n}"
            );
            assert_eq!(p.p50, ((n as f64) / 2.0).ceil(), "n = {n}");
        }
        assert_eq!(Pooled::of(&[]), None);
    }

    #[test]
    fn summary_over_repetitions() {
        let reps = [
            Percentiles::of(&[10.0, 20.0, 30.0]).unwrap(),
            Percentiles::of(&[11.0, 21.0, 100.0]).unwrap(),
            Percentiles::of(&[9.0, 19.0, 29.0, 39.0]).unwrap(),
        ];
        let s = Summary::of(&reps).unwrap();
        assert_eq!((s.repetitions, s.samples), (3, 10));
        assert_eq!(
            s.p50,
            Spread {
                median: 20.0,
                min: 19.0,
                max: 21.0
            }
        );
        assert_eq!(s.max.max, 100.0);
        assert_eq!(Summary::of(&[]), None);
    }
}
