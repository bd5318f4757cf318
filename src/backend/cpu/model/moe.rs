//! The sparse mixture-of-experts MLP on the CPU: the numerical specification the CUDA path
//! is held to.
//!
//! Each token's router logits `h · Wrᵀ` go through a softmax (in f64, rounded to f32, where
//! transformers takes its f32 softmax), the `k` most probable experts are chosen — ties to
//! the lower expert index, so the choice never depends on a sort's stability — and their
//! probabilities, renormalised to sum to 1 where the family does, weight the experts'
//! SwiGLU outputs. Tokens are grouped by expert so each expert runs one GEMM over its tokens,
//! in token order; a GEMM row's bits do not depend on the other rows, so the grouping (and
//! the thread count) never changes a token's result. Each token's expert outputs are added
//! up in expert-index order from zero, the shared expert's `sigmoid(gate) · output` after
//! them, and the sum joins the residual stream.

use crate::backend::cpu::matmul::matmul_wt;
use crate::backend::cpu::model::fault::{Faults, Pitfall};
use crate::backend::cpu::model::weights::Moe;
use crate::backend::cpu::norm::swiglu;
use crate::backend::cpu::operand::{Operand, WeightRows};
use std::sync::atomic::{AtomicU64, Ordering};

/// Token-to-expert assignments counted per expert (summed over layers), for the report's
/// routing balance. Integer counts: the sum is the same in any order.
#[derive(Debug, Default)]
pub struct RoutingCounts {
    counts: Vec<AtomicU64>,
}

impl RoutingCounts {
    pub fn new(experts: usize) -> RoutingCounts {
        RoutingCounts {
            counts: (0..experts).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn add(&self, expert: usize, n: u64) {
        if let Some(c) = self.counts.get(expert) {
            c.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The counts so far, zeroing them.
    pub fn take(&self) -> Vec<u64> {
        self.counts
            .iter()
            .map(|c| c.swap(0, Ordering::Relaxed))
            .collect()
    }
}

/// The `k` experts with the highest probabilities, highest first, ties to the lower index,
/// into `idx` (reused across rows).
pub fn top_k_into(probs: &[f32], k: usize, idx: &mut Vec<usize>) {
    idx.clear();
    idx.extend(0..probs.len());
    idx.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    idx.truncate(k);
}

/// Softmax of one row of router logits into `out`, in f64, rounded to f32.
pub fn softmax_into(logits: &[f32], out: &mut [f32]) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    for (o, &x) in out.iter_mut().zip(logits) {
        *o = ((x as f64 - max).exp() / sum) as f32;
    }
}

/// One token's routing from its router logits: the probabilities into `probs`, the `k`
/// chosen experts (highest first, ties to the lower index) into `chosen` and their
/// weights into `wts`, divided by their f32 sum in choice order when `renorm`.
pub fn route_row(
    logits: &[f32],
    k: usize,
    renorm: bool,
    probs: &mut [f32],
    chosen: &mut Vec<usize>,
    wts: &mut Vec<f32>,
) {
    softmax_into(logits, probs);
    top_k_into(probs, k, chosen);
    wts.clear();
    wts.extend(chosen.iter().map(|&e| probs[e]));
    if renorm {
        let s: f32 = wts.iter().sum();
        wts.iter_mut().for_each(|v| *v /= s);
    }
}

/// One expert's share of the block output: `acc[r] += wt · y[j]` for its j-th token
/// `tokens[j] = (r, wt)`, with `y [tokens, d]` its outputs. Called expert by expert in index
/// order, so each row's sum has a fixed order whatever the grouping.
pub fn add_expert(acc: &mut [f32], tokens: &[(usize, f32)], y: &[f32], d: usize) {
    for (j, &(r, wt)) in tokens.iter().enumerate() {
        let out = &mut acc[r * d..(r + 1) * d];
        for (o, &v) in out.iter_mut().zip(&y[j * d..(j + 1) * d]) {
            *o += v * wt;
        }
    }
}

/// The gated shared expert: `acc[r] += sigmoid(g[r]) · s[r]` for `s [n, d]`, `g [n]`
/// (`silu(g[r])` in place of the sigmoid: a planted pitfall).
pub fn add_shared(acc: &mut [f32], s: &[f32], g: &[f32], d: usize, silu: bool) {
    for (r, &z) in g.iter().enumerate() {
        let sig = 1.0 / (1.0 + (-z).exp());
        let scale = if silu { z * sig } else { sig };
        for (o, &v) in acc[r * d..(r + 1) * d]
            .iter_mut()
            .zip(&s[r * d..(r + 1) * d])
        {
            *o += scale * v;
        }
    }
}

/// `out[n, d] = down(silu(gate(x)) · up(x))` for `x[n, d]`, with `gate_up [2f, d]` and
/// `down [d, f]`.
fn run_swiglu(
    gate_up: WeightRows,
    down: WeightRows,
    f: usize,
    x: &[f32],
    n: usize,
    d: usize,
    out: &mut [f32],
) {
    let mut gu = vec![0f32; n * 2 * f];
    let mut act = vec![0f32; n * f];
    matmul_wt(x, n, d, &gate_up, 2 * f, &mut gu, false);
    swiglu(&gu, f, &mut act);
    matmul_wt(&act, n, f, &down, d, out, false);
}

/// Adds the MoE block's output for the normed rows `h[n, d]` to the residual rows `x[n, d]`.
pub fn moe_block(
    w: &Moe,
    h: &[f32],
    n: usize,
    d: usize,
    x: &mut [f32],
    faults: Faults,
    counts: Option<&RoutingCounts>,
) {
    let (experts, f) = (w.experts.count, w.experts.width);
    let mut logits = vec![0f32; n * experts];
    matmul_wt(h, n, d, &w.router, experts, &mut logits, false);
    let k = if faults.pitfall(Pitfall::TopKOffByOne) {
        w.top_k.saturating_sub(1).max(1)
    } else {
        w.top_k
    };
    let renorm = w.norm_topk_prob && !faults.pitfall(Pitfall::NoRenorm);
    // Per expert, its tokens (in token order) and their routing weights.
    let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); experts];
    let (mut p, mut chosen, mut wts) = (vec![0f32; experts], Vec::new(), Vec::new());
    for (r, row) in logits.chunks(experts).enumerate() {
        route_row(row, k, renorm, &mut p, &mut chosen, &mut wts);
        for (&e, &wt) in chosen.iter().zip(&wts) {
            routed[e].push((r, wt));
        }
    }
    let mut acc = vec![0f32; n * d];
    let mut gathered = Vec::new();
    let mut y = Vec::new();
    for (e, tokens) in routed.iter().enumerate() {
        if tokens.is_empty() {
            continue;
        }
        if let Some(c) = counts {
            c.add(e, tokens.len() as u64);
        }
        let m = tokens.len();
        gathered.clear();
        for &(r, _) in tokens {
            gathered.extend_from_slice(&h[r * d..(r + 1) * d]);
        }
        y.resize(m * d, 0.0);
        // Expert e's rows of the stacked matrices.
        let gate_up = w.experts.gate_up.rows(d).slice(e * 2 * f, 2 * f);
        let down = w.experts.down.rows(f).slice(e * d, d);
        run_swiglu(gate_up, down, f, &gathered, m, d, &mut y);
        add_expert(&mut acc, tokens, &y, d);
    }
    if let Some(shared) = &w.shared {
        let mut s = vec![0f32; n * d];
        let m = &shared.mlp;
        run_swiglu(
            m.gate_up.rows(d),
            m.down.rows(m.width),
            m.width,
            h,
            n,
            d,
            &mut s,
        );
        let mut g = vec![0f32; n];
        matmul_wt(h, n, d, &shared.gate, 1, &mut g, false);
        add_shared(&mut acc, &s, &g, d, faults.pitfall(Pitfall::SharedGateSilu));
    }
    for (xi, a) in x.iter_mut().zip(&acc) {
        *xi += a;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::layout::{Experts, Shared, SwiGlu};

    fn top_k(probs: &[f32], k: usize) -> Vec<usize> {
        let mut idx = Vec::new();
        top_k_into(probs, k, &mut idx);
        idx
    }

    #[test]
    fn ties_go_to_the_lower_expert_and_order_is_by_probability() {
        assert_eq!(top_k(&[0.1, 0.3, 0.3, 0.2], 2), vec![1, 2]);
        assert_eq!(top_k(&[0.25, 0.25, 0.25, 0.25], 3), vec![0, 1, 2]);
        assert_eq!(top_k(&[0.1, 0.2, 0.7], 1), vec![2]);
    }

    #[test]
    fn softmax_sums_to_one_and_survives_large_logits() {
        let mut p = [0f32; 3];
        softmax_into(&[1000.0, 999.0, -1000.0], &mut p);
        assert!((p.iter().map(|&v| v as f64).sum::<f64>() - 1.0).abs() < 1e-6);
        assert!(p[0] > p[1] && p[2] == 0.0);
    }

    /// Grouping tokens by expert gives each token the bits it gets alone.
    #[test]
    fn a_token_gets_the_same_bits_in_any_batch() {
        let d = 8;
        let mut seed = 7u64;
        let mut gen = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
                })
                .collect()
        };
        let (router, mut gate_up, mut down) = (gen(5 * d), Vec::new(), Vec::new());
        for _ in 0..5 {
            gate_up.extend(gen(2 * 6 * d));
            down.extend(gen(d * 6));
        }
        let shared = Shared {
            mlp: SwiGlu {
                gate_up: gen(2 * 6 * d).into(),
                down: gen(d * 6).into(),
                width: 6,
            },
            gate: gen(d).into(),
        };
        let w = Moe {
            router: router.into(),
            experts: Experts {
                gate_up: gate_up.into(),
                down: down.into(),
                count: 5,
                width: 6,
            },
            shared: Some(shared),
            top_k: 2,
            norm_topk_prob: true,
        };
        let n = 9;
        let h = gen(n * d);
        let mut all = vec![0f32; n * d];
        let counts = RoutingCounts::new(5);
        moe_block(&w, &h, n, d, &mut all, Faults::NONE, Some(&counts));
        assert_eq!(counts.take().iter().sum::<u64>(), (n * 2) as u64);
        for r in 0..n {
            let mut one = vec![0f32; d];
            moe_block(
                &w,
                &h[r * d..(r + 1) * d],
                1,
                d,
                &mut one,
                Faults::NONE,
                None,
            );
            assert_eq!(one, all[r * d..(r + 1) * d], "row {r}");
        }
    }
}
