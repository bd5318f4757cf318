//! A run against a reference over the same windows (`--reference-kv`, `--reference-artifact`):
//! how far the run's predictive distribution is from the reference's at every scored
//! position, over the full vocabulary.
//!
//! Per position the head gives KL(reference ‖ run) and KL(run ‖ reference), the
//! Jensen–Shannon divergence, both target log-probabilities, both top-1 tokens and how
//! many of the run's top 5 and top 10 are among the reference's; this keeps every KL and JS
//! value (12 bytes a position, for the percentiles), the sums for top-1 agreement, top-k
//! overlap and Δp (the
//! run's target probability minus the reference's), sums per depth in the window (so a
//! failure that grows with context shows as depth), and the per-window NLL sums that
//! [`crate::score::paired`] turns into an interval for the paired ΔNLL. Percentiles are
//! nearest-rank: the smallest value with at least `p` of the positions at or below it.
//!
//! Both directions, because they weigh different errors: KL(reference ‖ run) is large where
//! the run gives little mass to what the reference expects (a lost token), KL(run ‖
//! reference) where the run is confident about what the reference finds unlikely (a new,
//! wrong token). Jensen–Shannon is symmetric and bounded by ln 2, so one broken position
//! cannot dominate its mean the way an unbounded KL can; top-5 / top-10 overlap says whether
//! the candidates a sampler would choose from are still the same ones.

use crate::score::paired::{paired, Paired, WindowPair};
use serde::{Deserialize, Serialize};

/// One scored position of a run with a reference.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PositionPair {
    /// KL(reference ‖ run), nats.
    pub kld: f32,
    /// KL(run ‖ reference), nats.
    pub kld_reverse: f32,
    /// The run's and the reference's log-probability of the target.
    pub logprob: f32,
    pub ref_logprob: f32,
    /// Whether the two top-1 tokens are the same.
    pub top1_agree: bool,
    /// The target's index in its window (≥ 1: the tokens of history the model had).
    pub depth: usize,
    /// The target's index in its stream.
    pub position: usize,
    /// The reference's log-probability of its own top-1 token (its confidence).
    pub ref_top1_logprob: f32,
    /// Jensen–Shannon divergence, nats.
    pub js: f32,
    /// How many of the run's top 5 (top 10) tokens are among the reference's top 5 (10).
    pub top5: u8,
    pub top10: u8,
}

/// Confidence buckets: bucket `i` holds positions whose reference top-1 probability is in
/// `[i/10, (i+1)/10)` (1.0 in the last).
pub const CONFIDENCE_BUCKETS: usize = 10;

fn confidence_bucket(top1_logprob: f32) -> usize {
    ((top1_logprob as f64).exp() * CONFIDENCE_BUCKETS as f64).clamp(0.0, 9.0) as usize
}

/// Depth buckets: bucket `i` holds window positions `[2^i, 2^(i+1))`.
pub fn depth_bucket(depth: usize) -> usize {
    depth.max(1).ilog2() as usize
}

/// Sums over the positions of one depth bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DepthAcc {
    pub positions: u64,
    pub kld_sum: f64,
    /// Run and reference NLL sums.
    pub nll_sum: f64,
    pub ref_nll_sum: f64,
}

/// Sums over the positions of a stream (or several).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReferenceAcc {
    pub kld: Vec<f32>,
    pub kld_reverse: Vec<f32>,
    pub js: Vec<f32>,
    /// Sums of [`PositionPair::top5`] and [`PositionPair::top10`].
    pub top5_sum: u64,
    pub top10_sum: u64,
    /// Per [`depth_bucket`].
    pub depth: Vec<DepthAcc>,
    /// Per confidence bucket of the reference ([`CONFIDENCE_BUCKETS`]).
    pub confidence: Vec<DepthAcc>,
    /// Every position's stream index and ΔNLL (run − reference), beside `kld`: what the
    /// worst positions and windows of a stream are found from.
    pub positions: Vec<usize>,
    pub dnll: Vec<f32>,
    /// Each entry of `windows`: its first target's stream index and its summed KL.
    pub window_first: Vec<usize>,
    pub window_kld: Vec<f64>,
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
    /// KL(run ‖ reference): mean and percentiles as for KL(reference ‖ run).
    #[serde(default)]
    pub mean_kld_reverse: f64,
    #[serde(default)]
    pub kld_reverse_median: f64,
    #[serde(default)]
    pub kld_reverse_p99: f64,
    #[serde(default)]
    pub kld_reverse_max: f64,
    /// Jensen–Shannon divergence (nats, at most ln 2): mean and percentiles.
    #[serde(default)]
    pub mean_js: f64,
    #[serde(default)]
    pub js_median: f64,
    #[serde(default)]
    pub js_p99: f64,
    #[serde(default)]
    pub js_max: f64,
    /// Positions where the run's and the reference's top-1 tokens are the same.
    pub top1_agreement: f64,
    /// Mean share of the run's 5 (10) most likely tokens that are among the reference's 5
    /// (10).
    #[serde(default)]
    pub top5_overlap: f64,
    #[serde(default)]
    pub top10_overlap: f64,
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
    /// By depth in the window (`[from, to)`, powers of two): where in the context the run
    /// departs from the reference.
    #[serde(default)]
    pub by_depth: Vec<DepthSummary>,
    /// By the reference's confidence (its top-1 probability, `[from, to)` in tenths): does
    /// the run depart where the reference is sure, or where it hesitates.
    #[serde(default)]
    pub by_confidence: Vec<ConfidenceSummary>,
    /// A stream's positions with the largest KL(reference ‖ run), its windows with the
    /// largest ΔNLL, and the tokens around its worst position (streams only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub worst_positions: Vec<WorstPosition>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub worst_windows: Vec<WorstWindow>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub strip: Vec<WorstPosition>,
}

/// One bucket of [`ReferenceSummary::by_confidence`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConfidenceSummary {
    pub from: f64,
    pub to: f64,
    pub positions: u64,
    pub mean_kld: f64,
    pub delta_nll: f64,
}

/// One scored position of a stream: its index, target token (id and text, where the
/// report's writer knew the tokenizer), KL(reference ‖ run) and ΔNLL (run − reference).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorstPosition {
    pub position: usize,
    #[serde(default)]
    pub token_id: u32,
    #[serde(default)]
    pub token: String,
    pub kld: f64,
    pub delta_nll: f64,
}

/// One window of a stream by its targets `[first_target, end)`: ΔNLL per token and mean KL.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorstWindow {
    pub first_target: usize,
    pub end: usize,
    pub delta_nll: f64,
    pub mean_kld: f64,
}

/// One depth bucket of [`ReferenceSummary::by_depth`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DepthSummary {
    pub from: usize,
    pub to: usize,
    pub positions: u64,
    /// Mean KL(reference ‖ run).
    pub mean_kld: f64,
    /// Run − reference mean NLL over these positions.
    pub delta_nll: f64,
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
    /// Adds one window's positions, in target order.
    pub fn push_window(&mut self, rows: impl Iterator<Item = PositionPair>) {
        let mut w = WindowPair {
            scored: 0,
            base: 0.0,
            new: 0.0,
        };
        let (mut first, mut wkld) = (usize::MAX, 0.0f64);
        if self.confidence.is_empty() {
            self.confidence = vec![DepthAcc::default(); CONFIDENCE_BUCKETS];
        }
        for p in rows {
            first = first.min(p.position);
            wkld += p.kld as f64;
            self.positions.push(p.position);
            self.dnll.push(p.ref_logprob - p.logprob);
            let c = &mut self.confidence[confidence_bucket(p.ref_top1_logprob)];
            c.positions += 1;
            c.kld_sum += p.kld as f64;
            c.nll_sum -= p.logprob as f64;
            c.ref_nll_sum -= p.ref_logprob as f64;
            self.kld.push(p.kld);
            self.kld_reverse.push(p.kld_reverse);
            self.js.push(p.js);
            self.top5_sum += p.top5 as u64;
            self.top10_sum += p.top10 as u64;
            self.top1_agree += p.top1_agree as u64;
            let dp = (p.logprob as f64).exp() - (p.ref_logprob as f64).exp();
            self.dp_sum += dp;
            self.dp_sq_sum += dp * dp;
            let b = depth_bucket(p.depth);
            if self.depth.len() <= b {
                self.depth.resize(b + 1, DepthAcc::default());
            }
            let d = &mut self.depth[b];
            d.positions += 1;
            d.kld_sum += p.kld as f64;
            d.nll_sum -= p.logprob as f64;
            d.ref_nll_sum -= p.ref_logprob as f64;
            w.scored += 1;
            w.base -= p.ref_logprob as f64;
            w.new -= p.logprob as f64;
        }
        if w.scored > 0 {
            self.windows.push(w);
            self.window_first.push(first);
            self.window_kld.push(wkld);
        }
    }

    /// The `n` positions with the largest KL (ties: the earlier), in that order.
    pub fn worst_positions(&self, n: usize) -> Vec<WorstPosition> {
        let mut idx: Vec<usize> = (0..self.kld.len()).collect();
        idx.sort_by(|&a, &b| self.kld[b].total_cmp(&self.kld[a]).then(a.cmp(&b)));
        idx.truncate(n);
        idx.into_iter().map(|i| self.at(i)).collect()
    }

    /// Positions `[i − before, i + after]` around the position of largest KL, in order.
    pub fn strip(&self, before: usize, after: usize) -> Vec<WorstPosition> {
        let Some(worst) = (0..self.kld.len())
            .max_by(|&a, &b| self.kld[a].total_cmp(&self.kld[b]).then(b.cmp(&a)))
        else {
            return Vec::new();
        };
        let around = self.positions[worst];
        // Positions are unique within a stream; take those near the worst, in stream order.
        let mut idx: Vec<usize> = (0..self.kld.len())
            .filter(|&i| {
                self.positions[i] + before >= around && self.positions[i] <= around + after
            })
            .collect();
        idx.sort_by_key(|&i| self.positions[i]);
        idx.dedup_by_key(|i| self.positions[*i]);
        idx.into_iter().map(|i| self.at(i)).collect()
    }

    fn at(&self, i: usize) -> WorstPosition {
        WorstPosition {
            position: self.positions[i],
            token_id: 0,
            token: String::new(),
            kld: self.kld[i] as f64,
            delta_nll: self.dnll[i] as f64,
        }
    }

    /// The `n` windows with the largest ΔNLL per token, in that order.
    pub fn worst_windows(&self, n: usize) -> Vec<WorstWindow> {
        let mut v: Vec<WorstWindow> = self
            .windows
            .iter()
            .zip(&self.window_first)
            .zip(&self.window_kld)
            .map(|((w, &first), &k)| WorstWindow {
                first_target: first,
                end: first + w.scored as usize,
                delta_nll: (w.new - w.base) / w.scored as f64,
                mean_kld: k / w.scored as f64,
            })
            .collect();
        v.sort_by(|a, b| b.delta_nll.total_cmp(&a.delta_nll));
        v.truncate(n);
        v
    }
}

impl ReferenceAcc {
    pub fn add(&mut self, o: &ReferenceAcc) {
        self.kld.extend_from_slice(&o.kld);
        self.kld_reverse.extend_from_slice(&o.kld_reverse);
        self.js.extend_from_slice(&o.js);
        self.top5_sum += o.top5_sum;
        self.top10_sum += o.top10_sum;
        self.positions.extend_from_slice(&o.positions);
        self.dnll.extend_from_slice(&o.dnll);
        self.window_first.extend_from_slice(&o.window_first);
        self.window_kld.extend_from_slice(&o.window_kld);
        if self.confidence.len() < o.confidence.len() {
            self.confidence
                .resize(o.confidence.len(), DepthAcc::default());
        }
        for (a, b) in self.confidence.iter_mut().zip(&o.confidence) {
            a.positions += b.positions;
            a.kld_sum += b.kld_sum;
            a.nll_sum += b.nll_sum;
            a.ref_nll_sum += b.ref_nll_sum;
        }
        if self.depth.len() < o.depth.len() {
            self.depth.resize(o.depth.len(), DepthAcc::default());
        }
        for (a, b) in self.depth.iter_mut().zip(&o.depth) {
            a.positions += b.positions;
            a.kld_sum += b.kld_sum;
            a.nll_sum += b.nll_sum;
            a.ref_nll_sum += b.ref_nll_sum;
        }
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
        let sorted_of = |v: &[f32]| {
            let mut s = v.to_vec();
            s.sort_by(f32::total_cmp);
            s
        };
        let (sorted, sorted_rev) = (sorted_of(&self.kld), sorted_of(&self.kld_reverse));
        let sorted_js = sorted_of(&self.js);
        let rank_in = |s: &[f32], p: f64| {
            s[((p * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1] as f64
        };
        let rank = |p: f64| rank_in(&sorted, p);
        let nf = n as f64;
        let mean_kld = self.kld.iter().map(|&k| k as f64).sum::<f64>() / nf;
        // Every position has both directions (push_window adds them together).
        let rev = !sorted_rev.is_empty();
        let p: Paired = paired(&self.windows).ok()?;
        let mean_dp = self.dp_sum / nf;
        Some(ReferenceSummary {
            positions: n as u64,
            mean_kld,
            kld_median: rank(0.5),
            kld_p90: rank(0.9),
            kld_p99: rank(0.99),
            kld_max: sorted[n - 1] as f64,
            mean_kld_reverse: self.kld_reverse.iter().map(|&k| k as f64).sum::<f64>()
                / self.kld_reverse.len().max(1) as f64,
            kld_reverse_median: if rev { rank_in(&sorted_rev, 0.5) } else { 0.0 },
            kld_reverse_p99: if rev { rank_in(&sorted_rev, 0.99) } else { 0.0 },
            kld_reverse_max: sorted_rev.last().map_or(0.0, |&k| k as f64),
            mean_js: self.js.iter().map(|&k| k as f64).sum::<f64>() / self.js.len().max(1) as f64,
            js_median: if sorted_js.is_empty() {
                0.0
            } else {
                rank_in(&sorted_js, 0.5)
            },
            js_p99: if sorted_js.is_empty() {
                0.0
            } else {
                rank_in(&sorted_js, 0.99)
            },
            js_max: sorted_js.last().map_or(0.0, |&k| k as f64),
            top1_agreement: self.top1_agree as f64 / nf,
            top5_overlap: self.top5_sum as f64 / (5.0 * nf),
            top10_overlap: self.top10_sum as f64 / (10.0 * nf),
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
            by_depth: self
                .depth
                .iter()
                .enumerate()
                .filter(|(_, d)| d.positions > 0)
                .map(|(i, d)| DepthSummary {
                    from: 1 << i,
                    to: 1 << (i + 1),
                    positions: d.positions,
                    mean_kld: d.kld_sum / d.positions as f64,
                    delta_nll: (d.nll_sum - d.ref_nll_sum) / d.positions as f64,
                })
                .collect(),
            by_confidence: self
                .confidence
                .iter()
                .enumerate()
                .filter(|(_, d)| d.positions > 0)
                .map(|(i, d)| ConfidenceSummary {
                    from: i as f64 / CONFIDENCE_BUCKETS as f64,
                    to: (i + 1) as f64 / CONFIDENCE_BUCKETS as f64,
                    positions: d.positions,
                    mean_kld: d.kld_sum / d.positions as f64,
                    delta_nll: (d.nll_sum - d.ref_nll_sum) / d.positions as f64,
                })
                .collect(),
            worst_positions: Vec::new(),
            worst_windows: Vec::new(),
            strip: Vec::new(),
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
        let row = |i: usize, lp: f32, lp_ref: f32, agree: bool| PositionPair {
            kld: i as f32 / 100.0,
            kld_reverse: 2.0 * i as f32 / 100.0,
            logprob: lp,
            ref_logprob: lp_ref,
            top1_agree: agree,
            depth: i,
            position: i,
            ref_top1_logprob: -(i as f32) / 50.0,
            js: i as f32 / 400.0,
            top5: (i % 6) as u8,
            top10: (i % 11) as u8,
        };
        a.push_window((1..=60).map(|i| row(i, -1.0, -1.0, i % 2 == 0)));
        a.push_window((61..=100).map(|i| row(i, -2.0, -1.5, true)));
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
        assert_eq!(s.kld_reverse_median, 1.0f32 as f64);
        assert_eq!(s.kld_reverse_max, 2.0);
        assert!((s.mean_kld_reverse - 2.0 * s.mean_kld).abs() < 1e-6);
        assert_eq!(
            (s.js_median, s.js_p99, s.js_max),
            (0.125, 0.2475f32 as f64, 0.25)
        );
        assert!((s.mean_js - 50.5 / 400.0).abs() < 1e-7);
        // Σ i%6 over 1..=100 = 16·15 + (1+2+3+4) = 250; Σ i%11 = 9·55 + 1 = 496.
        assert_eq!(
            (s.top5_overlap, s.top10_overlap),
            (250.0 / 500.0, 496.0 / 1000.0)
        );
        // Depths 1..=100: buckets [1,2) .. [64,128); the last holds 64..=100, all in
        // window 2 (61..=100) but 61..=63, so ΔNLL there is 0.5.
        let last = s.by_depth.last().unwrap();
        assert_eq!((last.from, last.to, last.positions), (64, 128, 37));
        assert!((last.delta_nll - 0.5).abs() < 1e-12);
        assert_eq!(s.by_depth[0].positions, 1);
        assert_eq!(s.by_depth.iter().map(|d| d.positions).sum::<u64>(), 100);
        // Worst: the largest KL is the last position (1.0), the worst window the second.
        let wp = a.worst_positions(3);
        assert_eq!(
            wp.iter().map(|p| p.position).collect::<Vec<_>>(),
            [100, 99, 98]
        );
        assert!((wp[0].delta_nll - 0.5).abs() < 1e-6);
        let ww = a.worst_windows(2);
        assert_eq!((ww[0].first_target, ww[0].end), (61, 101));
        assert!((ww[0].delta_nll - 0.5).abs() < 1e-12 && ww[1].delta_nll == 0.0);
        let strip = a.strip(3, 5);
        assert_eq!(
            strip.iter().map(|p| p.position).collect::<Vec<_>>(),
            [97, 98, 99, 100]
        );
        // Confidence: p_ref(top1) = exp(−i/50) for position i; every position counted once.
        assert_eq!(
            s.by_confidence.iter().map(|c| c.positions).sum::<u64>(),
            100
        );
        assert!(s.by_confidence.iter().all(|c| c.from < c.to && c.to <= 1.0));
        assert!(ReferenceAcc::default().summary().is_none());
    }

    #[test]
    fn identical_runs_give_zero_kld_full_agreement_and_a_zero_interval() {
        let mut a = ReferenceAcc::default();
        for w in 0..5 {
            a.push_window((0..20).map(|i| PositionPair {
                kld: 0.0,
                kld_reverse: 0.0,
                logprob: -(i as f32 + w as f32) / 10.0,
                ref_logprob: -(i as f32 + w as f32) / 10.0,
                top1_agree: true,
                depth: i + 1,
                position: w * 20 + i + 1,
                ref_top1_logprob: -0.1,
                js: 0.0,
                top5: 5,
                top10: 10,
            }));
        }
        let s = a.summary().unwrap();
        assert_eq!((s.mean_kld, s.kld_max, s.top1_agreement), (0.0, 0.0, 1.0));
        assert_eq!((s.mean_kld_reverse, s.kld_reverse_max), (0.0, 0.0));
        assert_eq!((s.mean_js, s.js_max), (0.0, 0.0));
        assert_eq!((s.top5_overlap, s.top10_overlap), (1.0, 1.0));
        assert_eq!((s.delta_nll, s.delta_nll_ci95), (0.0, Some([0.0, 0.0])));
        assert_eq!((s.mean_delta_p, s.rms_delta_p), (0.0, 0.0));
    }
}
