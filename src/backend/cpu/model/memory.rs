//! The CPU model's memory, planned before anything large is allocated: what a run needs (the
//! artifact read in place, the vectors widened to f32, working memory per window times the
//! windows in flight, the per-thread packing and head buffers) against what the machine
//! allows (`crate::host`: a cgroup's limit, available memory, the address-space limit, or
//! `--max-memory`). A run that cannot fit one window is refused at load with both figures,
//! and the windows in flight are as many as fit. CUDA's twin is `backend/cuda/plan.rs`
//! (device memory).

use crate::backend::cpu::head::{ROWS, VOCAB_CHUNK};
use crate::host::Limit;
use crate::model::config::ModelConfig;
use crate::model::layout::{Kind, Model, Tensor};
use serde::{Deserialize, Serialize};

/// Columns of weights `sgemm16` packs at a time (its column block).
const PACK_COLUMNS: usize = 768;
/// Address space beyond the plan: thread stacks, the allocator's slack, the tokenizer and
/// the corpus.
const SLACK_BYTES: u64 = 512 << 20;

/// Bytes of working memory one window of `tokens` tokens holds at its peak: activation
/// buffers, the attention's keys and values and their packed copies, one layer's State,
/// a sparse MLP's buffers, the head's input rows and per-chunk partial sums; not the weights.
pub fn window_bytes(c: &ModelConfig, tokens: usize) -> usize {
    let (d, qd, kvd, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let qkv_w = qd + 2 * kvd;
    // x, h, final-norm rows: 3d; qkv; q and attn: 2qd; k, v and their packed copies: 4kvd;
    // gu and act: 3f; cos and sin: head_dim.
    let mut per_token = 3 * d + qkv_w + 2 * qd + 4 * kvd + 3 * f + c.head_dim;
    if let Some(h) = &c.hybrid {
        // Gated DeltaNet: projections, conv output, gates, State read-out and its norm.
        let hv = h.linear_num_value_heads;
        per_token += (h.conv_dim() + h.value_dim() + 2 * hv)
            + h.conv_dim()
            + 2 * hv
            + 2 * h.value_dim()
            + if c.attention_output_gate() { qd } else { 0 };
    }
    if let Some(m) = &c.moe {
        // Router logits, the block's sum, an expert's gathered rows, outputs, gate/up and
        // SwiGLU rows (an expert sees at most every row), the shared expert's.
        let (i, s) = (m.moe_intermediate_size, m.shared_expert_intermediate_size);
        per_token += m.num_experts + 4 * d + 3 * i + 3 * s;
    }
    // The head's per-chunk partial sums (max, sums, target logit, top-1) per scored row.
    let head_partials = c.vocab_size.div_ceil(VOCAB_CHUNK) * 24;
    let state = c
        .hybrid
        .as_ref()
        .map_or(0, |h| 4 * h.state_floats_per_layer());
    tokens
        .saturating_mul(4 * per_token + head_partials)
        .saturating_add(state)
}

/// Bytes each worker thread holds while it computes: `sgemm16`'s packed weight block and
/// row buffer for the widest product, and a head task's logits block.
pub fn thread_bytes(c: &ModelConfig) -> usize {
    let mut k = c.hidden_size.max(c.intermediate_size).max(c.q_dim());
    if let Some(h) = &c.hybrid {
        k = k.max(h.value_dim());
    }
    if let Some(m) = &c.moe {
        k = k
            .max(m.moe_intermediate_size)
            .max(m.shared_expert_intermediate_size);
    }
    4 * (PACK_COLUMNS * k + k + ROWS * VOCAB_CHUNK + VOCAB_CHUNK)
}

/// Bytes of the parts held widened in memory: every vector (norms, biases, decay
/// parameters, convolution taps); the matrices are read in place.
pub fn vector_bytes(c: &ModelConfig) -> usize {
    let mut total = 0usize;
    let _ = Model::of(c).try_map(&mut |t: &Tensor| {
        if !matches!(t.kind, Kind::Matrix | Kind::GatedQkv { .. }) {
            total = total.saturating_add(4 * t.elements());
        }
        Ok::<(), ()>(())
    });
    total
}

/// What a run needs and what it may use.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryPlan {
    /// The artifact's bytes, read in place (they count in the resident set once read).
    pub artifact_bytes: u64,
    /// The vectors widened to f32.
    pub vector_bytes: u64,
    /// Working memory of one window of the longest length planned for.
    pub window_bytes: u64,
    pub window_tokens: usize,
    /// Per worker thread, and the threads.
    pub thread_bytes: u64,
    pub threads: usize,
    /// Windows that may compute at once (at least 1, at most the threads).
    pub windows_in_flight: usize,
    /// The total for that many windows.
    pub needed_bytes: u64,
    /// What the machine allows, and why (`None`: nothing could be read).
    pub allowed_bytes: Option<u64>,
    pub allowed_by: Option<String>,
    /// What counts against `allowed_bytes` besides the windows: the artifact too for a
    /// memory limit, not for the address-space limit (which is left after mapping it).
    #[serde(skip)]
    pub fixed_in_allowed: u64,
}

impl MemoryPlan {
    /// Plans a run of `threads` threads over windows of up to `tokens` tokens of model `c`
    /// stored in `artifact_bytes`, within `memory` (fillable memory) and `address_space`
    /// (what may still be mapped, the artifact already counted). `Err` says why not even one
    /// window fits, with both figures.
    pub fn new(
        c: &ModelConfig,
        artifact_bytes: u64,
        tokens: usize,
        threads: usize,
        memory: Option<Limit>,
        address_space: Option<Limit>,
    ) -> Result<MemoryPlan, String> {
        let window = window_bytes(c, tokens.max(1)) as u64;
        let per_thread = thread_bytes(c) as u64;
        let vectors = vector_bytes(c) as u64;
        let fixed_memory = artifact_bytes + vectors + per_thread * threads as u64;
        // The address space already holds the mapped artifact.
        let fixed_space = vectors + per_thread * threads as u64 + SLACK_BYTES;
        let fits = |limit: &Option<Limit>, fixed: u64| {
            limit
                .as_ref()
                .map_or(u64::MAX, |l| l.bytes.saturating_sub(fixed) / window.max(1))
        };
        let by_memory = fits(&memory, fixed_memory);
        let by_space = fits(&address_space, fixed_space);
        let binding = if by_space < by_memory {
            address_space.clone()
        } else {
            memory.clone()
        };
        let in_flight = by_memory.min(by_space).min(threads.max(1) as u64) as usize;
        let plan = MemoryPlan {
            artifact_bytes,
            vector_bytes: vectors,
            window_bytes: window,
            window_tokens: tokens,
            thread_bytes: per_thread,
            threads,
            windows_in_flight: in_flight.max(1),
            needed_bytes: fixed_memory + window * in_flight.max(1) as u64,
            allowed_bytes: binding.as_ref().map(|l| l.bytes),
            allowed_by: binding.as_ref().map(|l| l.source.clone()),
            fixed_in_allowed: if by_space < by_memory {
                fixed_space
            } else {
                fixed_memory
            },
        };
        if in_flight == 0 {
            let limit = binding.expect("a window can only fail to fit a limit");
            let parts = format!(
                "{} of vectors, {} for a window of {tokens} tokens, {} for {threads} threads",
                gib(vectors),
                gib(window),
                gib(per_thread * threads as u64)
            );
            return Err(if by_space < by_memory {
                format!(
                    "the CPU run needs about {} of address space beside the mapped artifact ({parts}, {} of slack) but {} is left ({}); lower --context or use fewer --threads",
                    gib(fixed_space + window),
                    gib(SLACK_BYTES),
                    gib(limit.bytes),
                    limit.source
                )
            } else {
                format!(
                    "the CPU run needs about {} (the artifact's {} read in place, {parts}) but {} is available ({}); lower --context, use fewer --threads, or free memory",
                    gib(plan.needed_bytes),
                    gib(artifact_bytes),
                    gib(limit.bytes),
                    limit.source
                )
            });
        }
        Ok(plan)
    }

    /// Windows of `tokens` tokens (or halves of split windows) that may compute at once
    /// within the plan's allowance.
    pub fn windows_that_fit(&self, tokens: usize, c: &ModelConfig) -> usize {
        let window = window_bytes(c, tokens.max(1)) as u64;
        let Some(allowed) = self.allowed_bytes else {
            return usize::MAX;
        };
        (allowed.saturating_sub(self.fixed_in_allowed) / window.max(1)) as usize
    }
}

/// `n` bytes as GiB with two decimals.
fn gib(n: u64) -> String {
    format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::presets::preset;

    fn limit(bytes: u64) -> Option<Limit> {
        Some(Limit {
            bytes,
            source: "a test limit".into(),
        })
    }

    #[test]
    fn windows_in_flight_are_as_many_as_fit_and_none_is_refused_with_both_figures() {
        let c = preset("qwen3-8b").unwrap().with_layers(2);
        let art = 3_261_162_024u64;
        let per_window = window_bytes(&c, 4096) as u64;
        let fixed = art + vector_bytes(&c) as u64 + 2 * thread_bytes(&c) as u64;
        let p = MemoryPlan::new(&c, art, 4096, 2, limit(fixed + per_window + 1), None).unwrap();
        assert_eq!(p.windows_in_flight, 1);
        let p = MemoryPlan::new(&c, art, 4096, 2, limit(fixed + 5 * per_window), None).unwrap();
        assert_eq!(p.windows_in_flight, 2, "never more than the threads");
        let e = MemoryPlan::new(&c, art, 4096, 2, limit(fixed + per_window / 2), None).unwrap_err();
        assert!(
            e.contains("needs about") && e.contains("is available (a test limit)"),
            "{e}"
        );
        // The address space already holds the artifact: only the rest counts against it.
        let space = vector_bytes(&c) as u64 + 2 * thread_bytes(&c) as u64 + SLACK_BYTES;
        assert!(MemoryPlan::new(&c, art, 4096, 2, None, limit(space + per_window)).is_ok());
        assert!(MemoryPlan::new(&c, art, 4096, 2, None, limit(space)).is_err());
    }

    /// The check at scoring time agrees with the plan made at load, whichever limit binds
    /// (an address-space limit is what is left after the artifact was mapped: the artifact
    /// must not be counted against it a second time).
    #[test]
    fn windows_that_fit_agrees_with_the_plan_under_either_limit() {
        let c = preset("qwen3-8b").unwrap();
        let art = 16_380_000_000u64;
        let per_window = window_bytes(&c, 512) as u64;
        let space = vector_bytes(&c) as u64 + 2 * thread_bytes(&c) as u64 + SLACK_BYTES;
        let p = MemoryPlan::new(&c, art, 512, 2, None, limit(space + per_window + 1)).unwrap();
        assert_eq!(p.windows_in_flight, 1);
        assert_eq!(p.windows_that_fit(512, &c), 1);
        let fixed = art + vector_bytes(&c) as u64 + 2 * thread_bytes(&c) as u64;
        let p = MemoryPlan::new(&c, art, 512, 2, limit(fixed + 2 * per_window), None).unwrap();
        assert_eq!(p.windows_that_fit(512, &c), 2);
        assert_eq!(
            p.windows_that_fit(1100, &c),
            0,
            "a longer window than two of 512 does not fit"
        );
    }

    #[test]
    fn the_27b_hybrid_at_context_512_needs_about_its_artifact() {
        let c = preset("qwen3_5-27b").unwrap();
        // Working memory is a small part of a 27B model's weights.
        let p = MemoryPlan::new(&c, 19 << 30, 512, 2, None, None).unwrap();
        let beyond = p.needed_bytes - p.artifact_bytes;
        assert!(beyond < 3 << 29, "{} MiB beyond the artifact", beyond >> 20);
    }
}
