//! A run against a reference over the same windows (`--reference-kv`, `--reference-artifact`):
//! how far the run's predictive distribution is from the reference's at every scored
//! position, over the full vocabulary.
//!
//! Per position the head gives KL(reference ‖ run), both target log-probabilities and both
//! top-1 tokens; this keeps every KL value (4 bytes a position, for the percentiles), the
//! sums for top-1 agreement and Δp (the run's target probability minus the reference's),
//! and the per-window NLL sums that [`crate::score::paired`] turns into an interval for
//! the paired ΔNLL. Percentiles are nearest-rank: the smallest value with at least `p` of
//! the positions at or below it.

use crate::score::paired::{paired, Paired, WindowPair};
use serde::{Deserialize, Serialize};

/// Sums over the positions of a stream (or several).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReferenceAcc {
    pub kld: Vec<f32>,
    pub top1_agree: u64,
    pub dp_sum: f64,
    pub dp_sq_sum: f64,
    /// (scored, run NLL sum, reference NLL sum) per window.
    pub windows: Vec<WindowPair>,
}

/// What the sums say (report.json's `reference` objects).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReferenceSummary {
    pub positions: u64,
    pub mean_kld: f64,
    pub kld_median: f64,
    pub kld_p90: f64,
    pub kld_p99: f64,
    pub kld_max: f64,
    /// Positions where the run's and the reference's top-1 tokens are the same.
    pub top1_agreement: f64,
    /// Mean and RMS of p_run(target) − p_ref(target).
    pub mean_delta_p: f64,
    pub rms_delta_p: f64,
    pub ref_mean_nll: f64,
    pub run_mean_nll: f64,
    /// run − reference mean NLL, nats per token, with its paired 95% interval over windows
    /// (`null` with one window).
    pub delta_nll: f64,
    pub delta_nll_ci95: Option<[f64; 2]>,
    /// Positions per decade of KL divergence: bin `i` holds `10^(i−7) <= KL < 10^(i−6)`, the
    /// first also everything below (0 included), the last (`[10, 100)`) everything above.
    pub kld_histogram: Vec<u64>,
}

/// Decades of [`ReferenceSummary::kld_histogram`]: 10^-7 up to 10^1 and beyond.
pub const KLD_DECADES: std::ops::Range<i32> = -7..2;

/// The histogram bin of one KL divergence.
pub fn kld_bin(k: f32) -> usize {
    let d = if k > 0.0 {
        (k as f64).log10().floor() as i32
    } else {
        KLD_DECADES.start
    };
    (d.clamp(KLD_DECADES.start, KLD_DECADES.end - 1) - KLD_DECADES.start) as usize
}

impl ReferenceAcc {
    /// Adds one window: per position (KL, run log-probability, reference log-probability,
    /// whether the top-1 tokens agree).
    pub fn push_window(&mut self, rows: impl Iterator<Item = (f32, f32, f32, bool)>) {
        let mut w = WindowPair {
            scored: 0,
            base: 0.0,
            new: 0.0,
        };
        for (kld, lp, lp_ref, agree) in rows {
            self.kld.push(kld);
            self.top1_agree += agree as u64;
            let dp = (lp as f64).exp() - (lp_ref as f64).exp();
            self.dp_sum += dp;
            self.dp_sq_sum += dp * dp;
            w.scored += 1;
            w.base -= lp_ref as f64;
            w.new -= lp as f64;
        }
        if w.scored > 0 {
            self.windows.push(w);
        }
    }
}

impl ReferenceAcc {
    pub fn add(&mut self, o: &ReferenceAcc) {
        self.kld.extend_from_slice(&o.kld);
        self.top1_agree += o.top1_agree;
        self.dp_sum += o.dp_sum;
        self.dp_sq_sum += o.dp_sq_sum;
        self.windows.extend_from_slice(&o.windows);
    }

    /// `None` without positions.
    pub fn summary(&self) -> Option<ReferenceSummary> {
        let n = self.kld.len();
        if n == 0 {
            return None;
        }
        let mut sorted = self.kld.clone();
        sorted.sort_by(f32::total_cmp);
        let rank = |p: f64| sorted[((p * n as f64).ceil() as usize).clamp(1, n) - 1] as f64;
        let nf = n as f64;
        let mean_kld = self.kld.iter().map(|&k| k as f64).sum::<f64>() / nf;
        let p: Paired = paired(&self.windows).ok()?;
        let mean_dp = self.dp_sum / nf;
        Some(ReferenceSummary {
            positions: n as u64,
            mean_kld,
            kld_median: rank(0.5),
            kld_p90: rank(0.9),
            kld_p99: rank(0.99),
            kld_max: sorted[n - 1] as f64,
            top1_agreement: self.top1_agree as f64 / nf,
            mean_delta_p: mean_dp,
            rms_delta_p: (self.dp_sq_sum / nf).sqrt(),
            ref_mean_nll: p.base_mean_nll,
            run_mean_nll: p.new_mean_nll,
            delta_nll: p.delta_nll,
            delta_nll_ci95: p.delta_nll_ci95,
            kld_histogram: {
                let mut h = vec![0u64; KLD_DECADES.len()];
                self.kld.iter().for_each(|&k| h[kld_bin(k)] += 1);
                h
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank_and_windows_pair() {
        let mut a = ReferenceAcc::default();
        // 100 positions with KL 1..=100 (scaled), in two windows.
        a.push_window((1..=60).map(|i| (i as f32 / 100.0, -1.0, -1.0, i % 2 == 0)));
        a.push_window((61..=100).map(|i| (i as f32 / 100.0, -2.0, -1.5, true)));
        let s = a.summary().unwrap();
        assert_eq!(s.positions, 100);
        assert_eq!(s.kld_median, 0.5f32 as f64);
        assert_eq!(s.kld_p90, 0.9f32 as f64);
        assert_eq!(s.kld_p99, 0.99f32 as f64);
        assert_eq!(s.kld_max, 1.0);
        assert_eq!(s.top1_agreement, 0.7);
        // 0.01..=0.09 in decade −2 (0.01 in f32 may fall just below it), 0.10..=0.99 in −1,
        // 1.0 in decade 0.
        let h = &s.kld_histogram;
        assert_eq!(
            (h[4] + h[5], h[6], h[7], h.iter().sum::<u64>()),
            (9, 90, 1, 100)
        );
        assert_eq!(
            (kld_bin(0.0), kld_bin(-1e-9), kld_bin(1e-12), kld_bin(50.0)),
            (0, 0, 0, 8)
        );
        // Window 2 is worse by 0.5 per token in the run: ΔNLL = 40·0.5/100.
        assert!((s.delta_nll - 0.2).abs() < 1e-12);
        let dp = ((-2.0f64).exp() - (-1.5f64).exp()) * 0.4;
        assert!((s.mean_delta_p - dp).abs() < 1e-12);
        assert!(ReferenceAcc::default().summary().is_none());
    }

    #[test]
    fn identical_runs_give_zero_kld_full_agreement_and_a_zero_interval() {
        let mut a = ReferenceAcc::default();
        for w in 0..5 {
            a.push_window((0..20).map(|i| {
                (
                    0.0,
                    -(i as f32 + w as f32) / 10.0,
                    -(i as f32 + w as f32) / 10.0,
                    true,
                )
            }));
        }
        let s = a.summary().unwrap();
        assert_eq!((s.mean_kld, s.kld_max, s.top1_agreement), (0.0, 0.0, 1.0));
        assert_eq!((s.delta_nll, s.delta_nll_ci95), (0.0, Some([0.0, 0.0])));
        assert_eq!((s.mean_delta_p, s.rms_delta_p), (0.0, 0.0));
    }
}
