//! Percentiles and the summary of repetitions: each figure of the report is the
//! median over repetitions of a per-repetition percentile, with its spread
//! (the lowest and highest repetition).

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

/// Percentiles of one repetition's samples (microseconds).
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

/// Each percentile's spread over repetitions.
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
