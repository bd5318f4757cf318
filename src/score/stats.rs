//! NLL accumulation and aggregation.
//!
//! Every sum is f64 and accumulated in target order. Aggregates over streams or domains
//! are token-weighted: they add NLL sums and scored-token counts, never average
//! perplexities. The standard error treats per-token NLLs as independent samples; tokens
//! of one document are correlated, so it is a lower bound on the true uncertainty and is
//! labelled that way in the docs.

use serde::{Deserialize, Serialize};

/// Sufficient statistics of a set of per-token NLLs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NllSum {
    pub scored: u64,
    pub nll_sum: f64,
    /// Sum of squared per-token NLLs (for the standard error).
    pub nll_sq_sum: f64,
}

impl NllSum {
    pub fn push(&mut self, logprob: f32) {
        let nll = -(logprob as f64);
        self.scored += 1;
        self.nll_sum += nll;
        self.nll_sq_sum += nll * nll;
    }

    pub fn add(&mut self, other: &NllSum) {
        self.scored += other.scored;
        self.nll_sum += other.nll_sum;
        self.nll_sq_sum += other.nll_sq_sum;
    }

    pub fn mean_nll(&self) -> f64 {
        self.nll_sum / self.scored as f64
    }

    pub fn ppl(&self) -> f64 {
        self.mean_nll().exp()
    }

    /// Standard error of the mean NLL (sample variance / n); 0 with fewer than 2 tokens.
    pub fn std_err(&self) -> f64 {
        let n = self.scored as f64;
        if self.scored < 2 {
            return 0.0;
        }
        let mean = self.nll_sum / n;
        let var = ((self.nll_sq_sum - n * mean * mean) / (n - 1.0)).max(0.0);
        (var / n).sqrt()
    }

    /// 95% interval of the perplexity: exp(mean ± 1.96·SE).
    pub fn ppl_interval(&self) -> (f64, f64) {
        let (m, se) = (self.mean_nll(), self.std_err());
        ((m - 1.96 * se).exp(), (m + 1.96 * se).exp())
    }

    /// Bits per UTF-8 byte of the text these tokens came from.
    pub fn bits_per_byte(&self, bytes: u64) -> f64 {
        self.nll_sum / std::f64::consts::LN_2 / bytes as f64
    }
}

/// One window's result. In `report.json` it also carries its unrounded `mean_nll` and
/// `ppl` (the spec asks for every window's), derived on writing and ignored on reading.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(into = "WindowOut")]
pub struct WindowScore {
    /// The window's place in its stream's plan (a shard's windows keep the whole plan's).
    #[serde(default)]
    pub index: usize,
    /// Wall time from the previous window's end (or the stream's start) to this one's: the
    /// windows' seconds add up to the stream's. With several windows in flight (CPU threads)
    /// or packed into one pass (CUDA) this is not one window's own latency.
    #[serde(default)]
    pub seconds: f64,
    pub begin: usize,
    /// The first scored target (`start` in report.json).
    #[serde(rename = "start")]
    pub first_target: usize,
    pub end: usize,
    pub scored: u64,
    pub nll_sum: f64,
    pub nll_sq_sum: f64,
    /// Per-target log-probabilities, only when asked for (tests, debugging).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<f32>>,
    /// The window's calibration sums: written in shard reports only (`--shard`), so that
    /// `merge` can add them up in window order exactly as an unsharded run does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<crate::score::Calibration>,
}

/// [`WindowScore`] as written: its fields, then `mean_nll` (nll_sum / scored) and `ppl`
/// (its exp; `null` past f64's range, as for every row).
#[derive(Serialize)]
struct WindowOut {
    // The seed engine's window fields.
    index: usize,
    input_begin: usize,
    input_end: usize,
    target_begin: usize,
    target_end: usize,
    /// Index of the first target within the window.
    first_target: usize,
    scored_tokens: u64,
    total_nll: f64,
    perplexity: Option<f64>,
    seconds: f64,
    // This project's.
    begin: usize,
    start: usize,
    end: usize,
    scored: u64,
    nll_sum: f64,
    nll_sq_sum: f64,
    mean_nll: f64,
    ppl: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<Vec<f32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    calibration: Option<crate::score::Calibration>,
}

impl From<WindowScore> for WindowOut {
    fn from(w: WindowScore) -> Self {
        let mean_nll = w.nll_sum / w.scored as f64;
        let ppl = Some(mean_nll.exp()).filter(|p| p.is_finite());
        WindowOut {
            index: w.index,
            input_begin: w.begin,
            input_end: w.end,
            target_begin: w.first_target,
            target_end: w.end,
            first_target: w.first_target - w.begin,
            scored_tokens: w.scored,
            total_nll: w.nll_sum,
            perplexity: ppl,
            seconds: w.seconds,
            begin: w.begin,
            start: w.first_target,
            end: w.end,
            scored: w.scored,
            nll_sum: w.nll_sum,
            nll_sq_sum: w.nll_sq_sum,
            mean_nll,
            ppl,
            logprobs: w.logprobs,
            calibration: w.calibration,
        }
    }
}

/// One stream's result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StreamScore {
    pub tokens: usize,
    /// Tokens fed through the model, summed over windows (context overlap counted again).
    pub processed_tokens: usize,
    pub totals: NllSum,
    pub windows: Vec<WindowScore>,
    /// Entropy, top-1 accuracy and calibration bins over every scored row; `None` from a
    /// backend whose head does not compute them (CUDA, for now).
    pub calibration: Option<super::Calibration>,
    /// The comparison with the reference pass, when the engine has one.
    #[serde(skip)]
    pub reference: Option<super::ReferenceAcc>,
    /// Token-to-expert assignments per expert, summed over the sparse layers (MoE models on
    /// the CPU); `None` otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing: Option<Vec<u64>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use approx::assert_relative_eq;

    #[test]
    fn aggregation_is_token_weighted() {
        let mut a = NllSum::default();
        for lp in [-1.0f32, -2.0, -3.0] {
            a.push(lp);
        }
        let mut b = NllSum::default();
        b.push(-10.0);
        let mut all = a;
        all.add(&b);
        assert_eq!(all.scored, 4);
        assert_relative_eq!(all.mean_nll(), 16.0 / 4.0);
        // Not the mean of the two perplexities, nor of the two mean NLLs.
        assert!((all.mean_nll() - (a.mean_nll() + b.mean_nll()) / 2.0).abs() > 1.0);
        assert_relative_eq!(all.ppl(), 4.0f64.exp());
    }

    #[test]
    fn standard_error_matches_textbook_formula() {
        let xs = [0.5f64, 1.5, 2.0, 4.0, 0.25];
        let mut s = NllSum::default();
        for x in xs {
            s.push(-(x as f32));
        }
        let n = xs.len() as f64;
        let mean = xs.iter().sum::<f64>() / n;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
        assert_relative_eq!(s.std_err(), (var / n).sqrt(), max_relative = 1e-12);
        let (lo, hi) = s.ppl_interval();
        assert!(lo < s.ppl() && s.ppl() < hi);
        let mut one = NllSum::default();
        one.push(-1.0);
        assert_eq!(one.std_err(), 0.0);
    }

    #[test]
    fn bits_per_byte() {
        let s = NllSum {
            scored: 2,
            nll_sum: 2.0 * std::f64::consts::LN_2,
            nll_sq_sum: 0.0,
        };
        assert_relative_eq!(s.bits_per_byte(4), 0.5);
    }
}
