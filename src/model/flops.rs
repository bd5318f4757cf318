//! Floating-point work of one window, for throughput figures.
//!
//! Multiply-adds count as two FLOPs. Three counts are in use, and the names say which work
//! each one credits, so a bench never divides by the wrong one:
//!
//! * [`Work::ForwardPass`]: every layer for every token, causal attention, and the output
//!   head for every position, the way a model forward is usually counted (what transformers
//!   computes when asked for logits). It does not depend on how many positions are scored, so
//!   two engines scoring the same windows are credited with the same work, and one that
//!   skips logits nobody reads shows it as a higher rate. The CPU speed target is stated in it.
//! * [`Work::HeadOnScoredRows`]: every layer for every token, the head for scored rows only.
//! * [`Work::CudaScoring`]: [`Work::HeadOnScoredRows`] less the last layer's MLP for the rows
//!   before the first that predicts a target (`model::pass::PassPlan::last_layer`): the work
//!   the CUDA backend does.
//! * [`Work::CpuScoring`]: [`Work::HeadOnScoredRows`] less what the CPU backend skips: after
//!   the last layer only the rows that predict a target are read, so there attention
//!   (queries from row `len - scored - 1` on), the o-projection and the MLP run for those rows
//!   only, while the q/k/v projection still runs for every token.

use crate::model::config::{LayerKind, ModelConfig};

/// Which work a FLOP count credits (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    ForwardPass,
    HeadOnScoredRows,
    CudaScoring,
    CpuScoring,
}

/// FLOPs of one window of `len` tokens that scores `scored` targets, counted as `work` says.
pub fn window_flops(c: &ModelConfig, work: Work, len: usize, scored: usize) -> f64 {
    let (d, qd, kvd, f, v) = (
        c.hidden_size,
        c.q_dim(),
        c.kv_dim(),
        c.intermediate_size,
        c.vocab_size,
    );
    let pairs = |n: f64| n * (n + 1.0) / 2.0; // (query, key) pairs under the causal mask
    let t = len as f64;
    // Layer i's MLP per token: dense, or a sparse block's router, its k chosen experts and
    // its gated shared expert (the work done, not the parameters held).
    let mlp_of = |i: usize| -> f64 {
        match &c.moe {
            Some(m) if m.sparse_layers.get(i).copied().unwrap_or(false) => {
                let s = m.shared_expert_intermediate_size;
                let shared = if s > 0 { 3 * d * s + d } else { 0 };
                2.0 * (d * m.num_experts
                    + m.num_experts_per_tok * 3 * d * m.moe_intermediate_size
                    + shared) as f64
            }
            _ => 2.0 * (d * 2 * f + f * d) as f64,
        }
    };
    let mlp_sum: f64 = (0..c.num_layers).map(mlp_of).sum();
    let gate = if c.attention_output_gate() { qd } else { 0 };
    let attn_linear = 2.0 * (d * (qd + 2 * kvd + gate) + qd * d) as f64;
    // A Gated DeltaNet layer per token: its projections, the conv, and the State's three
    // [Dk, Dv] products per value head (Sᵀk, k·deltaᵀ, Sᵀq) as multiply-adds.
    let delta_linear = c.hybrid.as_ref().map_or(0.0, |h| {
        let hv = h.linear_num_value_heads;
        let proj = d * (h.conv_dim() + h.value_dim() + 2 * hv) + h.value_dim() * d;
        let conv = h.linear_conv_kernel_dim * h.conv_dim();
        let state = 3 * hv * h.linear_key_head_dim * h.linear_value_head_dim;
        2.0 * (proj + conv + state) as f64
    });
    let attn_layers = c.kv_layers() as f64;
    let delta_layers = c.state_layers() as f64;
    let body = attn_layers * (t * attn_linear + 4.0 * pairs(t) * qd as f64)
        + delta_layers * t * delta_linear
        + t * mlp_sum;
    let head = |rows: usize| 2.0 * rows as f64 * (d * v) as f64;
    match work {
        Work::ForwardPass => body + head(len),
        Work::HeadOnScoredRows => body + head(scored),
        Work::CudaScoring => {
            let skipped_rows = len.saturating_sub(scored + 1) as f64;
            match c.num_layers {
                0 => body + head(scored),
                n => body + head(scored) - skipped_rows * mlp_of(n - 1),
            }
        }
        Work::CpuScoring => {
            let full = body + head(scored);
            if c.num_layers == 0 || scored == 0 {
                return full;
            }
            let skipped_rows = len.saturating_sub(scored + 1) as f64;
            // The last layer's o-projection (or out-projection) and MLP.
            let last = c.num_layers - 1;
            match c.layer_kind(last) {
                LayerKind::FullAttention => {
                    let per_row_tail = 2.0 * (qd * d) as f64 + mlp_of(last);
                    full - skipped_rows * per_row_tail - 4.0 * pairs(skipped_rows) * qd as f64
                }
                LayerKind::LinearAttention => {
                    let vdim = c.hybrid.as_ref().map_or(0, |h| h.value_dim());
                    full - skipped_rows * (2.0 * (vdim * d) as f64 + mlp_of(last))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::Family;

    #[test]
    fn counts_match_a_hand_count() {
        let c = ModelConfig::for_test(Family::Qwen3, 1, 4, 2, 1, 2, 8, 10);
        // Linear per token: 2*(4*(4+2*2) + 4*4 + 4*16 + 8*4) = 2*144 = 288.
        // Attention for 3 tokens: 6 pairs * 4 * (2*2) = 96. Head: 2 * 2 rows * 40 = 160.
        assert_eq!(
            window_flops(&c, Work::HeadOnScoredRows, 3, 2),
            3.0 * 288.0 + 96.0 + 160.0
        );
        // The forward pass has the head (2 * 40 per row) on all 3 rows.
        assert_eq!(
            window_flops(&c, Work::ForwardPass, 3, 2),
            3.0 * 288.0 + 96.0 + 3.0 * 80.0
        );
        // Qwen3-8B's shape: 15-20 GFLOP per token at context 4096.
        let q = ModelConfig::for_test(Family::Qwen3, 36, 4096, 32, 8, 128, 12288, 151_936);
        let per_token = window_flops(&q, Work::HeadOnScoredRows, 4096, 2048) / 4096.0;
        assert!((15e9..20e9).contains(&per_token), "{per_token:e}");
        // SmolLM2-135M at context 1024: 212.3 MFLOP of projections and MLP, 56.6 of head and
        // 35.4 of causal attention per token (the 0.30 GFLOP the CPU speed target assumes).
        let mut s = ModelConfig::for_test(Family::Llama, 30, 576, 9, 3, 64, 1536, 49_152);
        s.tie_word_embeddings = true;
        let per_token = window_flops(&s, Work::ForwardPass, 1024, 1023) / 1024.0;
        assert!((per_token / 1e6 - 304.4).abs() < 0.1, "{per_token:e}");
        // A sparse MLP is credited with its router, k experts and shared expert: the same
        // config with one expert chosen of one, no shared expert, and the router's 2·d
        // removed, is the dense MLP of that width.
        let mut m = c.clone();
        m.moe = Some(crate::model::config::MoeConfig {
            num_experts: 1,
            num_experts_per_tok: 1,
            moe_intermediate_size: 8,
            norm_topk_prob: true,
            shared_expert_intermediate_size: 0,
            sparse_layers: vec![true],
        });
        assert_eq!(
            window_flops(&m, Work::HeadOnScoredRows, 3, 2),
            window_flops(&c, Work::HeadOnScoredRows, 3, 2) + 3.0 * 2.0 * 4.0
        );
    }

    #[test]
    fn hybrid_counts_match_a_hand_count() {
        use crate::model::config::{HybridConfig, OutputGate};
        // One Gated DeltaNet layer, one gated attention layer; d 4, 2 query heads of 2, one
        // KV head, MLP 8, vocab 10; DeltaNet 1 key head of 2, 2 value heads of 3, conv 2.
        let mut c = ModelConfig::for_test(Family::Qwen3, 2, 4, 2, 1, 2, 8, 10);
        c.family = Family::Qwen3_5;
        c.hybrid = Some(HybridConfig {
            layer_types: vec![LayerKind::LinearAttention, LayerKind::FullAttention],
            rotary_dim: 2,
            linear_num_key_heads: 1,
            linear_num_value_heads: 2,
            linear_key_head_dim: 2,
            linear_value_head_dim: 3,
            linear_conv_kernel_dim: 2,
            output_gate: OutputGate::Silu,
        });
        // MLP: 2*(4*16 + 8*4) = 192. Attention: 2*(4*(4+2*2+4) + 4*4) = 128, + MLP = 320.
        // DeltaNet: conv_dim 2+2+6 = 10, width 10+6+4 = 20: 2*(4*20 + 6*4 + 2*10 +
        // 3*2*2*3) = 2*(80+24+20+36) = 320, + MLP = 512. 3 tokens: 6 pairs * 4 * 4 = 96.
        // Head on 2 rows: 160.
        assert_eq!(
            window_flops(&c, Work::HeadOnScoredRows, 3, 2),
            3.0 * (320.0 + 512.0) + 96.0 + 160.0
        );
    }

    #[test]
    fn cpu_savings_match_a_hand_count() {
        let c = ModelConfig::for_test(Family::Qwen3, 2, 4, 2, 1, 2, 8, 10);
        // 5 tokens, 2 scored: rows 0 and 1 of the last layer skip o/MLP (2 * (16 + 96) each)
        // and their attention (pairs 1 + 2 = 3, each 4 * 4 FLOPs).
        let skipped = 2.0 * 2.0 * (16.0 + 96.0) + 3.0 * 4.0 * 4.0;
        let scored = |n| window_flops(&c, Work::HeadOnScoredRows, 5, n);
        assert_eq!(
            window_flops(&c, Work::CpuScoring, 5, 2),
            scored(2) - skipped
        );
        // A window that scores every row after the first skips nothing.
        assert_eq!(window_flops(&c, Work::CpuScoring, 5, 4), scored(4));
        // CUDA skips the last layer's MLP (2 * 96 FLOPs a row) for those rows only.
        assert_eq!(
            window_flops(&c, Work::CudaScoring, 5, 2),
            scored(2) - 2.0 * 192.0
        );
        assert_eq!(window_flops(&c, Work::CudaScoring, 5, 4), scored(4));
    }

    /// What the CUDA backend's last-layer trimming saves, at the CLI's default protocol
    /// (4096 / 2048: every window after the first skips 2047 rows of the last MLP) and at
    /// the emulated parity tests' (96 / 48: 47 rows), for SmolLM2 and the Qwen3.5 27B.
    #[test]
    fn the_cuda_trimming_saves_the_last_mlp_of_the_unscored_rows() {
        let mut smollm2 = ModelConfig::for_test(Family::Llama, 30, 576, 9, 3, 64, 1536, 49_152);
        smollm2.tie_word_embeddings = true;
        let hybrid = crate::model::presets::preset("qwen3_5-27b").unwrap();
        for (name, c) in [("smollm2", &smollm2), ("qwen3_5-27b", &hybrid)] {
            for (len, scored) in [(4096, 2048), (96, 48)] {
                let all = window_flops(c, Work::HeadOnScoredRows, len, scored);
                let cuda = window_flops(c, Work::CudaScoring, len, scored);
                let saved = 1.0 - cuda / all;
                eprintln!(
                    "{name} {len}/{scored}: the CUDA trimming saves {:.2}% of a window's FLOPs",
                    100.0 * saved
                );
                assert!(saved > 0.0 && saved < 1.0 / c.num_layers as f64);
            }
        }
    }
}
