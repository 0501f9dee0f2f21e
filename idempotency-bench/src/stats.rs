//! Latency samples and their summary.

use std::time::Duration;

/// Throughput and latency of one workload run.
#[derive(Clone, Debug)]
pub(crate) struct Summary {
    pub ops: usize,
    pub elapsed: Duration,
    pub p50: Duration,
    pub p99: Duration,
}

impl Summary {
    pub(crate) fn from_samples(mut samples: Vec<Duration>, elapsed: Duration) -> Self {
        samples.sort_unstable();
        let pick = |q: f64| {
            if samples.is_empty() {
                Duration::ZERO
            } else {
                let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
                samples[i]
            }
        };
        Self {
            ops: samples.len(),
            elapsed,
            p50: pick(0.50),
            p99: pick(0.99),
        }
    }

    pub(crate) fn ops_per_sec(&self) -> f64 {
        if self.elapsed.is_zero() {
            0.0
        } else {
            self.ops as f64 / self.elapsed.as_secs_f64()
        }
    }
}

/// Formats a duration compactly (ns, µs or ms).
pub(crate) fn fmt_latency(d: Duration) -> String {
    let ns = d.as_nanos();
    if ns < 10_000 {
        format!("{ns}ns")
    } else if ns < 10_000_000 {
        format!("{:.1}µs", ns as f64 / 1e3)
    } else {
        format!("{:.2}ms", ns as f64 / 1e6)
    }
}

/// The median of `values` (the mean of the middle two for an even count); 0 when empty.
pub(crate) fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The median of integer `values`.
pub(crate) fn median_u64(values: &[u64]) -> f64 {
    median(&values.iter().map(|&v| v as f64).collect::<Vec<_>>())
}

/// The mean of the smallest `share` (0 to 1) of `values`, at least one of them; 0 when empty.
pub(crate) fn fastest_mean(values: &[u64], share: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_unstable();
    let keep = ((v.len() as f64 * share).ceil() as usize).clamp(1, v.len().max(1));
    match v.is_empty() {
        true => 0.0,
        false => v.iter().take(keep).sum::<u64>() as f64 / keep as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let samples: Vec<_> = (1..=100).map(Duration::from_micros).collect();
        let s = Summary::from_samples(samples, Duration::from_secs(1));
        assert_eq!(s.ops, 100);
        assert_eq!(s.p50, Duration::from_micros(51));
        assert_eq!(s.p99, Duration::from_micros(99));
        assert!((s.ops_per_sec() - 100.0).abs() < 1e-9);
    }

    #[test]
    fn medians_and_the_fastest_share() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median_u64(&[5, 1, 9]), 5.0);
        // Ten calls, one preempted: the fastest 90% leave it out.
        let calls = [5, 5, 6, 5, 6, 5, 5, 6, 5, 900];
        assert_eq!(fastest_mean(&calls, 0.9), 48.0 / 9.0);
        assert_eq!(fastest_mean(&calls, 1.0), 948.0 / 10.0);
        assert_eq!(fastest_mean(&[7], 0.1), 7.0);
        assert_eq!(fastest_mean(&[], 0.9), 0.0);
    }
}
