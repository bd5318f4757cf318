//! The CPU reference forward pass, fused with the scoring head.
//!
//! One call processes one window: tokens `x[0..T)` at positions `0..T` with an empty KV
//! cache, and returns `log p(x[i] | x[0..i))` for the requested targets. Keys (after RoPE)
//! and values pass through the selected Main KV representation before attention reads
//! them. Only the rows that predict a target go through the final norm and output head,
//! and the head never holds more than one vocabulary chunk of logits per row block.
//!
//! Test-only fault switch: when the environment variable `NINFER_TEST_FAULT` is set as a
//! [`CpuModel`] is built, the model is deliberately perturbed so that the regression
//! harness can prove it catches drift (`tests/harness_gate.rs`). `rope-shift` rotates the
//! keys of layer 0 one position too far; `skip-final-norm` feeds the un-normalized residual
//! stream to the output head; `embed-scale=E` multiplies the embeddings by `1 + E`, a
//! perturbation far below float32 model noise, to measure how sensitive a KV format's score
//! is to harmless numerical changes (docs/accuracy.md). Unset (the normal case), nothing
//! changes.

use crate::backend::cpu::attention::{causal_attention, AttnShape};
use crate::backend::cpu::head;
use crate::backend::cpu::matmul::matmul_wt;
use crate::backend::cpu::norm::{rms_norm, rms_norm_inplace, rms_norm_row, swiglu};
use crate::backend::cpu::rope::{inv_freq, RopeTable};
use crate::kv::KvDtype;
use crate::model::config::ModelConfig;
use crate::model::weights::Weights;
use rayon::prelude::*;
use thiserror::Error;

/// A numerical failure inside a window (positions are relative to the window).
#[derive(Debug, Error, PartialEq)]
pub enum ForwardError {
    #[error("token id {id} at window position {pos} is outside the vocabulary ({vocab})")]
    TokenOutOfRange { id: u32, pos: usize, vocab: usize },
    #[error("non-finite {which} value at layer {layer}, window position {pos}, KV head {head}")]
    NonFiniteKv {
        which: &'static str,
        layer: usize,
        pos: usize,
        head: usize,
    },
}

/// Phases of the forward pass timed when `NINFER_PROFILE=1` (see [`Laps`]).
const PHASES: [&str; 9] = [
    "norms",
    "qkv",
    "embed/split/rope/kv",
    "attention",
    "o-proj",
    "gate/up",
    "swiglu",
    "down",
    "head",
];

/// Wall-clock time per phase of one window, printed to stderr when the environment variable
/// `NINFER_PROFILE` is `1` as the model is built: the profile of the real pipeline, buffers
/// and all, which `benches/ops.rs` (each op alone) cannot give. Off, it costs one branch per
/// phase.
struct Laps {
    on: bool,
    last: std::time::Instant,
    acc: [f64; PHASES.len()],
}

impl Laps {
    fn new(on: bool) -> Laps {
        Laps {
            on,
            last: std::time::Instant::now(),
            acc: [0.0; PHASES.len()],
        }
    }

    /// Charges the time since the previous lap to `phase`.
    fn lap(&mut self, phase: usize) {
        if self.on {
            let now = std::time::Instant::now();
            self.acc[phase] += (now - self.last).as_secs_f64();
            self.last = now;
        }
    }

    fn report(&self, tokens: usize, scored: usize) {
        if self.on {
            let total: f64 = self.acc.iter().sum();
            let parts: Vec<String> = PHASES
                .iter()
                .zip(&self.acc)
                .map(|(n, s)| format!("{n} {:.0} ms", s * 1e3))
                .collect();
            eprintln!(
                "profile: window {tokens} tokens, {scored} scored, {:.0} ms: {}",
                total * 1e3,
                parts.join(", ")
            );
        }
    }
}

pub struct CpuModel {
    pub config: ModelConfig,
    pub weights: Weights,
    inv_freq: Vec<f64>,
    /// Test-only perturbation from `NINFER_TEST_FAULT` (see the module docs); `None` normally.
    fault: Option<Fault>,
    /// `NINFER_PROFILE=1`: print per-phase times of every window.
    profile: bool,
}

/// A deliberate engine perturbation for the harness's drift test.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    RopeShift,
    SkipFinalNorm,
    EmbedScale(f32),
}

impl Fault {
    fn from_env() -> Option<Fault> {
        let v = std::env::var("NINFER_TEST_FAULT").ok()?;
        match v.as_str() {
            "rope-shift" => return Some(Fault::RopeShift),
            "skip-final-norm" => return Some(Fault::SkipFinalNorm),
            _ => {}
        }
        if let Some(e) = v
            .strip_prefix("embed-scale=")
            .and_then(|e| e.parse::<f32>().ok())
        {
            return Some(Fault::EmbedScale(e));
        }
        eprintln!("warning: ignoring NINFER_TEST_FAULT=`{v}` (valid: rope-shift, skip-final-norm, embed-scale=E)");
        None
    }
}

impl CpuModel {
    pub fn new(config: ModelConfig, weights: Weights) -> CpuModel {
        let inv_freq = inv_freq(
            config.head_dim,
            config.rope_theta,
            config.rope_scaling.as_ref(),
        );
        CpuModel {
            config,
            weights,
            inv_freq,
            fault: Fault::from_env(),
            profile: std::env::var("NINFER_PROFILE").is_ok_and(|v| v == "1"),
        }
    }

    /// Bytes of working memory one call of [`CpuModel::window_logprobs`] holds at its peak
    /// for a window of `tokens` tokens (activation buffers, the attention's packed keys and
    /// values, the RoPE table, the head's input rows), not counting the weights. The engine
    /// uses it to decide how many windows may be in flight at once.
    pub fn window_bytes(&self, tokens: usize) -> usize {
        let c = &self.config;
        let (d, qd, kvd, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let qkv_w = qd + 2 * kvd;
        // x, h, final-norm rows: 3d; qkv; q and attn: 2qd; k, v and their packed copies:
        // 4kvd; gu and act: 3f; cos and sin: head_dim.
        let per_token = 3 * d + qkv_w + 2 * qd + 4 * kvd + 3 * f + c.head_dim;
        tokens * per_token * std::mem::size_of::<f32>()
    }

    /// Log-probabilities of `tokens[first_target..]`, each given all earlier tokens of the
    /// window. `first_target >= 1`.
    pub fn window_logprobs(
        &self,
        tokens: &[u32],
        first_target: usize,
        kv: KvDtype,
    ) -> Result<Vec<f32>, ForwardError> {
        let c = &self.config;
        let t_len = tokens.len();
        let mut laps = Laps::new(self.profile);
        assert!(
            first_target >= 1 && first_target <= t_len,
            "first_target out of range"
        );
        let (d, hd, hq, hkv) = (c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads);
        let (qd, kvd, f) = (c.q_dim(), c.kv_dim(), c.intermediate_size);
        let eps = c.rms_norm_eps;
        let w = &self.weights;

        // x[T, d]: the residual stream.
        let mut x = vec![0.0f32; t_len * d];
        for (pos, (&id, row)) in tokens.iter().zip(x.chunks_mut(d)).enumerate() {
            let id_us = id as usize;
            if id_us >= c.vocab_size {
                return Err(ForwardError::TokenOutOfRange {
                    id,
                    pos,
                    vocab: c.vocab_size,
                });
            }
            row.copy_from_slice(&w.embed[id_us * d..(id_us + 1) * d]);
        }
        if let Some(Fault::EmbedScale(e)) = self.fault {
            x.iter_mut().for_each(|v| *v *= 1.0 + e); // test-only perturbation
        }
        let rope = RopeTable::new(&self.inv_freq, t_len);
        let qkv_w = qd + 2 * kvd;
        let mut h = vec![0.0f32; t_len * d];
        let mut qkv = vec![0.0f32; t_len * qkv_w];
        let mut q = vec![0.0f32; t_len * qd];
        let mut k = vec![0.0f32; t_len * kvd];
        let mut v = vec![0.0f32; t_len * kvd];
        let mut attn = vec![0.0f32; t_len * qd];
        let mut gu = vec![0.0f32; t_len * 2 * f];
        let mut act = vec![0.0f32; t_len * f];
        let shape = AttnShape {
            tokens: t_len,
            q_heads: hq,
            kv_heads: hkv,
            head_dim: hd,
        };

        for (li, l) in w.layers.iter().enumerate() {
            // Attention block.
            laps.lap(2);
            rms_norm(&x, &l.attn_norm, eps, &mut h);
            laps.lap(0);
            matmul_wt(&h, t_len, d, &l.wqkv, qkv_w, &mut qkv, false);
            laps.lap(1);
            if let Some(b) = &l.bqkv {
                qkv.par_chunks_mut(qkv_w)
                    .for_each(|r| r.iter_mut().zip(b).for_each(|(a, b)| *a += b));
            }
            // Split qkv[T, q+2kv] into q[T, Hq, D], k[T, Hkv, D], v[T, Hkv, D].
            for t in 0..t_len {
                let r = &qkv[t * qkv_w..(t + 1) * qkv_w];
                q[t * qd..(t + 1) * qd].copy_from_slice(&r[..qd]);
                k[t * kvd..(t + 1) * kvd].copy_from_slice(&r[qd..qd + kvd]);
                v[t * kvd..(t + 1) * kvd].copy_from_slice(&r[qd + kvd..]);
            }
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                rms_norm_inplace(&mut q, qn, eps);
                rms_norm_inplace(&mut k, kn, eps);
            }
            rope.apply(&mut q, hq);
            if li == 0 && self.fault == Some(Fault::RopeShift) {
                // Test-only fault: layer 0's keys rotated for position t + 1.
                let t = RopeTable::new(&self.inv_freq, t_len + 1);
                let shifted = RopeTable {
                    half: t.half,
                    cos: t.cos[t.half..].to_vec(),
                    sin: t.sin[t.half..].to_vec(),
                };
                shifted.apply(&mut k, hkv);
            } else {
                rope.apply(&mut k, hkv);
            }
            store_kv(&mut k, hkv, hd, kv, li, "key")?;
            store_kv(&mut v, hkv, hd, kv, li, "value")?;
            // Every layer needs keys and values for all positions, but after the last
            // layer only the rows that predict a target are read: there, attention output,
            // o-projection and MLP run for rows r0.. only (the same bits as for all rows).
            let r0 = if li + 1 == w.layers.len() {
                first_target - 1
            } else {
                0
            };
            let n = t_len - r0;
            laps.lap(2);
            causal_attention(&q, &k, &v, &shape, r0, &mut attn);
            laps.lap(3);
            matmul_wt(&attn[r0 * qd..], n, qd, &l.wo, d, &mut x[r0 * d..], true);
            laps.lap(4);

            // MLP block.
            let (h, gu, act) = (&mut h[..n * d], &mut gu[..n * 2 * f], &mut act[..n * f]);
            rms_norm(&x[r0 * d..], &l.mlp_norm, eps, h);
            laps.lap(0);
            matmul_wt(h, n, d, &l.wgu, 2 * f, gu, false);
            laps.lap(5);
            swiglu(gu, f, act);
            laps.lap(6);
            matmul_wt(act, n, f, &l.wdown, d, &mut x[r0 * d..], true);
            laps.lap(7);
        }

        // Row i predicts token i + 1: rows first_target-1 .. T-1.
        let rows = t_len - first_target;
        let mut hn = vec![0.0f32; rows * d];
        hn.par_chunks_mut(d).enumerate().for_each(|(r, o)| {
            let i = first_target - 1 + r;
            if self.fault == Some(Fault::SkipFinalNorm) {
                o.copy_from_slice(&x[i * d..(i + 1) * d]); // test-only fault
                return;
            }
            rms_norm_row(&x[i * d..(i + 1) * d], &w.final_norm, eps, o);
        });
        let mut out = vec![0.0f32; rows];
        head::logprobs(
            &hn,
            d,
            w.head(),
            c.vocab_size,
            &tokens[first_target..],
            &mut out,
        );
        laps.lap(8);
        laps.report(t_len, rows);
        Ok(out)
    }
}

/// Passes every (token, KV head) vector of `x[T, Hkv, D]` through the KV representation,
/// refusing non-finite values (a broken model must not be silently quantized).
fn store_kv(
    x: &mut [f32],
    hkv: usize,
    hd: usize,
    kv: KvDtype,
    layer: usize,
    which: &'static str,
) -> Result<(), ForwardError> {
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        let vec_idx = i / hd;
        return Err(ForwardError::NonFiniteKv {
            which,
            layer,
            pos: vec_idx / hkv,
            head: vec_idx % hkv,
        });
    }
    let is_key = which == "key";
    x.par_chunks_mut(hd).for_each(|vec| {
        if is_key {
            kv.roundtrip_k(vec)
        } else {
            kv.roundtrip_v(vec)
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::Family;
    use crate::model::weights::LayerWeights;

    /// A small llama-shaped model with deterministic pseudo-random weights.
    fn synthetic_model() -> CpuModel {
        let (vocab, d, f, layers, hq, hkv, hd) = (300, 32, 48, 2, 4, 2, 8);
        let mut seed = 1usize;
        let mut gen = |n: usize, scale: f32| -> Vec<f32> {
            seed += 1;
            (0..n)
                .map(|i| ((((i + 7 * seed) * 2_654_435_761) % 2001) as f32 / 1000.0 - 1.0) * scale)
                .collect()
        };
        let layer = |gen: &mut dyn FnMut(usize, f32) -> Vec<f32>| LayerWeights {
            attn_norm: gen(d, 0.5).iter().map(|x| 1.0 + x).collect(),
            wqkv: gen((hq * hd + 2 * hkv * hd) * d, 0.3),
            bqkv: None,
            q_norm: None,
            k_norm: None,
            wo: gen(d * hq * hd, 0.3),
            mlp_norm: gen(d, 0.5).iter().map(|x| 1.0 + x).collect(),
            wgu: gen(2 * f * d, 0.3),
            wdown: gen(d * f, 0.3),
        };
        let weights = Weights {
            embed: gen(vocab * d, 1.0),
            layers: (0..layers).map(|_| layer(&mut gen)).collect(),
            final_norm: vec![1.0; d],
            lm_head: None,
        };
        let config = ModelConfig {
            tie_word_embeddings: true,
            ..ModelConfig::for_test(Family::Llama, layers, d, hq, hkv, hd, f, vocab)
        };
        CpuModel::new(config, weights)
    }

    #[test]
    fn scoring_fewer_targets_gives_the_same_bits_for_the_ones_scored() {
        // The last layer skips the rows that predict no target; whatever the first target,
        // the log-probabilities it does return must be bit-identical to a full run's.
        let m = synthetic_model();
        let tokens: Vec<u32> = (0..700).map(|i| ((i * 7919) % 300) as u32).collect();
        let all = m.window_logprobs(&tokens, 1, KvDtype::Bf16).unwrap();
        assert!(all.iter().all(|x| x.is_finite() && *x <= 0.0));
        for first in [2, 129, 200, 512, 699] {
            let part = m.window_logprobs(&tokens, first, KvDtype::Bf16).unwrap();
            assert_eq!(part.len(), tokens.len() - first);
            assert!(
                part.iter()
                    .zip(&all[first - 1..])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "first target {first}"
            );
        }
    }

    #[test]
    fn non_finite_kv_is_an_error_naming_layer_position_and_head() {
        // x[T=3, Hkv=2, D=4]: a NaN at position 2, head 1.
        let mut x = vec![0.5f32; 3 * 2 * 4];
        x[(2 * 2 + 1) * 4 + 3] = f32::NAN;
        let e = store_kv(&mut x, 2, 4, KvDtype::Int8, 7, "key").unwrap_err();
        assert_eq!(
            e,
            ForwardError::NonFiniteKv {
                which: "key",
                layer: 7,
                pos: 2,
                head: 1
            }
        );
        assert_eq!(
            e.to_string(),
            "non-finite key value at layer 7, window position 2, KV head 1"
        );
        let mut y = vec![1.0f32; 8];
        y[0] = f32::INFINITY;
        assert!(store_kv(&mut y, 1, 8, KvDtype::Nvfp4, 0, "value").is_err());
        let mut ok = vec![0.25f32; 8];
        assert!(store_kv(&mut ok, 1, 8, KvDtype::Fp8, 0, "value").is_ok());
    }
}
