//! Calibration and uncertainty of the predictive distribution, from the same head pass that
//! gives the NLL: the mean entropy, top-1 accuracy and the expected calibration error (ECE) of
//! the top-1 confidence.
//!
//! The accumulator keeps only sums and counts, so streams, domains and shards add up exactly
//! like the NLL totals; the summary values are derived from them. ECE uses
//! [`BINS`] equal-width confidence bins, `Σ_b (n_b / N) · |accuracy_b − confidence_b|`, the
//! common definition (Guo et al., 2017), with a confidence of exactly 1 in the last bin.

use serde::{Deserialize, Serialize};

/// Confidence bins of the ECE.
pub const BINS: usize = 10;

/// One confidence bin: rows whose top-1 probability fell in it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Bin {
    pub rows: u64,
    pub confidence_sum: f64,
    pub correct: u64,
}

/// Sums over scored rows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub rows: u64,
    /// Σ entropy of the predictive distribution (nats).
    pub entropy_sum: f64,
    /// Rows whose top-1 token was the target.
    pub top1_correct: u64,
    /// Σ top-1 probability.
    pub top1_confidence_sum: f64,
    pub bins: Vec<Bin>,
}

impl Default for Calibration {
    fn default() -> Self {
        Calibration {
            rows: 0,
            entropy_sum: 0.0,
            top1_correct: 0,
            top1_confidence_sum: 0.0,
            bins: vec![Bin::default(); BINS],
        }
    }
}

/// What the sums say.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub mean_entropy: f64,
    pub top1_accuracy: f64,
    pub mean_top1_confidence: f64,
    pub ece: f64,
}

impl Calibration {
    /// Adds one row: its entropy, its top-1 log-probability and whether the top-1 was the
    /// target. Non-finite inputs are the caller's error to report (checked there).
    pub fn push(&mut self, entropy: f32, top1_logprob: f32, correct: bool) {
        let conf = (top1_logprob as f64).exp().clamp(0.0, 1.0);
        let b = ((conf * BINS as f64) as usize).min(BINS - 1);
        self.rows += 1;
        self.entropy_sum += entropy as f64;
        self.top1_correct += correct as u64;
        self.top1_confidence_sum += conf;
        let bin = &mut self.bins[b];
        bin.rows += 1;
        bin.confidence_sum += conf;
        bin.correct += correct as u64;
    }

    pub fn add(&mut self, o: &Calibration) {
        self.rows += o.rows;
        self.entropy_sum += o.entropy_sum;
        self.top1_correct += o.top1_correct;
        self.top1_confidence_sum += o.top1_confidence_sum;
        for (a, b) in self.bins.iter_mut().zip(&o.bins) {
            a.rows += b.rows;
            a.confidence_sum += b.confidence_sum;
            a.correct += b.correct;
        }
    }

    /// `None` when no row was added.
    pub fn summary(&self) -> Option<Summary> {
        if self.rows == 0 {
            return None;
        }
        let n = self.rows as f64;
        let ece = self
            .bins
            .iter()
            .filter(|b| b.rows > 0)
            .map(|b| {
                let k = b.rows as f64;
                (k / n) * (b.correct as f64 / k - b.confidence_sum / k).abs()
            })
            .sum();
        Some(Summary {
            mean_entropy: self.entropy_sum / n,
            top1_accuracy: self.top1_correct as f64 / n,
            mean_top1_confidence: self.top1_confidence_sum / n,
            ece,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use approx::assert_relative_eq;

    #[test]
    fn hand_checked_ece() {
        // Confidences 0.95 (right), 0.95 (wrong), 0.35 (right), 0.35 (wrong), 0.35 (wrong):
        // bin 9 accuracy 0.5 vs 0.95, bin 3 accuracy 1/3 vs 0.35.
        let mut c = Calibration::default();
        for (p, ok) in [
            (0.95, true),
            (0.95, false),
            (0.35, true),
            (0.35, false),
            (0.35, false),
        ] {
            c.push(1.0, (p as f32).ln(), ok);
        }
        let s = c.summary().unwrap();
        let want = 0.4 * (0.5f64 - 0.95).abs() + 0.6 * (1.0f64 / 3.0 - 0.35).abs();
        assert_relative_eq!(s.ece, want, max_relative = 1e-6);
        assert_relative_eq!(s.top1_accuracy, 0.4);
        assert_relative_eq!(s.mean_entropy, 1.0);
        assert_eq!(c.bins[9].rows, 2);
        assert_eq!(c.bins[3].rows, 3);
    }

    #[test]
    fn a_calibrated_source_has_ece_near_zero_and_sums_add() {
        // Rows whose top-1 is right with exactly the stated probability (deterministic
        // pattern): ECE 0 up to the pattern's granularity.
        let mut c = Calibration::default();
        for b in 0..BINS {
            let p = (b as f64 + 0.5) / BINS as f64;
            for i in 0..100 {
                c.push(0.5, (p as f32).ln(), (i as f64) < p * 100.0);
            }
        }
        assert!(c.summary().unwrap().ece < 2e-3, "{:?}", c.summary());
        let (mut a, mut b) = (Calibration::default(), Calibration::default());
        a.push(0.1, -0.1, true);
        b.push(0.2, -2.0, false);
        a.add(&b);
        assert_eq!((a.rows, a.top1_correct), (2, 1));
        assert!(Calibration::default().summary().is_none());
        // Confidence 1 (log-probability 0) lands in the last bin.
        let mut one = Calibration::default();
        one.push(0.0, 0.0, true);
        assert_eq!(one.bins[BINS - 1].rows, 1);
    }
}
