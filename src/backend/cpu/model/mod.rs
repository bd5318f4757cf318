//! The CPU reference forward pass, fused with the scoring head: the numerical specification.
//! CUDA twin: `backend/cuda/model/mod.rs`, which runs the same steps over several windows
//! packed into one pass.
//!
//! One call processes one window: tokens `x[0..T)` at positions `0..T` with an empty KV
//! cache, and returns `log p(x[i] | x[0..i))` for the requested targets. Keys (after RoPE)
//! and values pass through the selected Main KV representation before attention reads
//! them ([`kv_store`]). Only the rows that predict a target go through the final norm and
//! output head ([`head`]), and the head never holds more than one vocabulary chunk of logits
//! per row block.
//!
//! The files of this folder and of `backend/cuda/model/` are twins, file for file: the
//! embedding and the layer loop here, a layer in [`layer`], the mixers in [`attention`] and
//! [`delta_net`], the sparse MLP in [`moe`], the head in [`head`], the weights in
//! [`weights`], and how windows are scheduled in [`schedule`]. The CPU's own helpers: how a
//! window is split between threads ([`split`]), where keys and values are stored
//! ([`kv_store`]), the phase timer ([`profile`]) and the test-only perturbations ([`fault`]).
//! A window split between two threads for its remaining layers gives the same bits.

pub mod attention;
pub mod delta_net;
pub mod fault;
pub mod head;
pub mod kv_store;
pub mod layer;
pub mod memory;
pub mod moe;
pub mod profile;
pub mod schedule;
pub(crate) mod split;
pub mod weights;

#[cfg(test)]
pub(crate) mod synthetic;

use crate::backend::cpu::norm::rms_norm_row;
use crate::backend::cpu::operand::Operand;
use crate::backend::cpu::rope::{inv_freq, RopeTable};
use crate::backend::{PairScore, RowScore};
use crate::kv::KvDtype;
use crate::model::config::ModelConfig;
use crate::model::error::ForwardError;
use crate::model::layout::Mixer;
use fault::{Faults, Pitfall};
use head::Against;
use layer::{Bufs, Pass};
use moe::RoutingCounts;
use profile::{Laps, Phase};
use rayon::prelude::*;
use split::{Link, Split, Stop};
use weights::Weights;

/// A window's rows, its comparison with a reference where there is one, and its
/// final-normed hidden rows where they were asked for.
type RowsPairsHidden = (Vec<RowScore>, Option<Vec<PairScore>>, Option<Vec<f32>>);

pub struct CpuModel {
    pub config: ModelConfig,
    pub weights: Weights,
    inv_freq: Vec<f64>,
    /// Test-only perturbation ([`super::fault`]); none in ordinary builds.
    faults: Faults,
    /// `NINFER_PROFILE=1`: print per-phase times of every window ([`super::profile`]).
    pub(crate) profile: bool,
    /// Tokens each expert was given, summed over layers and windows (MoE models).
    routing: Option<RoutingCounts>,
}

impl CpuModel {
    pub fn new(config: ModelConfig, weights: Weights) -> CpuModel {
        let inv_freq = inv_freq(
            config.rotary_dim(),
            config.rope_theta,
            config.rope_scaling.as_ref(),
        );
        let routing = config
            .moe
            .as_ref()
            .map(|m| RoutingCounts::new(m.num_experts));
        CpuModel {
            config,
            weights,
            inv_freq,
            faults: Faults::NONE,
            profile: profile::enabled_by_env(),
            routing,
        }
    }

    /// Token-to-expert assignments per expert since the last call (summed over the sparse
    /// layers), zeroing them; `None` for a dense model.
    pub fn take_routing(&self) -> Option<Vec<u64>> {
        self.routing.as_ref().map(RoutingCounts::take)
    }

    /// The same model run with `faults` (only `fault-injection` builds have any).
    pub fn with_faults(mut self, faults: Faults) -> CpuModel {
        self.set_faults(faults);
        self
    }

    /// Replaces the model's faults (a zero-centred norm pitfall edits the norm scales).
    pub fn set_faults(&mut self, faults: Faults) {
        let plain = |f: &Faults| f.pitfall(Pitfall::NormPlain) && self.config.zero_centred_norms();
        let delta = match (plain(&self.faults), plain(&faults)) {
            (false, true) => -1.0,
            (true, false) => 1.0,
            _ => 0.0,
        };
        if delta != 0.0 {
            let w = &mut self.weights;
            let mut norms: Vec<&mut weights::Leaf> = vec![&mut w.final_norm];
            for l in &mut w.layers {
                norms.push(&mut l.norm);
                norms.push(&mut l.ffn_norm);
                if let Mixer::Attention(a) = &mut l.mixer {
                    norms.extend(a.q_norm.iter_mut());
                    norms.extend(a.k_norm.iter_mut());
                }
            }
            for n in norms {
                n.iter_mut().for_each(|x| *x += delta);
            }
        }
        self.faults = faults;
    }

    /// Bytes of working memory one window of `tokens` tokens holds at its peak, not counting
    /// the weights ([`memory::window_bytes`]).
    pub fn window_bytes(&self, tokens: usize) -> usize {
        memory::window_bytes(&self.config, tokens)
    }

    /// Log-probabilities of `tokens[first_target..]`, each given all earlier tokens of the
    /// window. `first_target >= 1`.
    pub fn window_logprobs(
        &self,
        tokens: &[u32],
        first_target: usize,
        kv: KvDtype,
    ) -> Result<Vec<f32>, ForwardError> {
        let rows = self.forward(tokens, first_target, kv, Split::Never)?;
        Ok(rows.iter().map(|r| r.logprob).collect())
    }

    /// [`CpuModel::window_logprobs`], with the option of splitting the window's rows between
    /// two threads: `may_split` is asked at each layer boundary until it says yes (and then
    /// never again); a yes means a worker thread is free to take the later rows. The result
    /// has the same bits either way (`super::split`).
    pub fn window_logprobs_with(
        &self,
        tokens: &[u32],
        first_target: usize,
        kv: KvDtype,
        may_split: &(dyn Fn() -> bool + Sync),
    ) -> Result<Vec<f32>, ForwardError> {
        let rows = self.window_rows_with(tokens, first_target, kv, may_split)?;
        Ok(rows.iter().map(|r| r.logprob).collect())
    }

    /// [`CpuModel::window_logprobs_with`] with each target's entropy and top-1 token
    /// ([`head::RowScore`]); the log-probabilities have the same bits.
    pub fn window_rows_with(
        &self,
        tokens: &[u32],
        first_target: usize,
        kv: KvDtype,
        may_split: &(dyn Fn() -> bool + Sync),
    ) -> Result<Vec<RowScore>, ForwardError> {
        self.forward(tokens, first_target, kv, Split::Ask(may_split))
    }

    /// [`CpuModel::window_rows_with`] with a reference pass over the same window (`reference`:
    /// a model with the same vocabulary and its KV format) compared at every target by
    /// [`head_pair::score_pairs`]; the run's rows have the same bits as without it.
    pub fn window_pairs_with(
        &self,
        tokens: &[u32],
        first_target: usize,
        kv: KvDtype,
        reference: (&CpuModel, KvDtype),
        may_split: &(dyn Fn() -> bool + Sync),
    ) -> Result<(Vec<RowScore>, Vec<PairScore>), ForwardError> {
        let (rows, pairs, _) = self.forward_with(
            tokens,
            first_target,
            kv,
            Split::Ask(may_split),
            Against::Model(reference.0, reference.1),
            false,
        )?;
        Ok((rows, pairs.unwrap_or_default()))
    }

    /// [`CpuModel::window_pairs_with`] against a saved reference's rows of this window
    /// (`[rows, d]`, from `--save-reference` with this head): the same numbers an
    /// in-process reference pass gives.
    pub fn window_pairs_saved_with(
        &self,
        tokens: &[u32],
        first_target: usize,
        kv: KvDtype,
        reference: &crate::score::saved::SavedRows,
        may_split: &(dyn Fn() -> bool + Sync),
    ) -> Result<(Vec<RowScore>, Vec<PairScore>), ForwardError> {
        use crate::score::saved::SavedRows;
        let against = match reference {
            SavedRows::Hidden(h) => Against::Rows(h),
            SavedRows::Logprobs(l) => Against::Logprobs(l),
        };
        let (rows, pairs, _) = self.forward_with(
            tokens,
            first_target,
            kv,
            Split::Ask(may_split),
            against,
            false,
        )?;
        Ok((rows, pairs.unwrap_or_default()))
    }

    /// [`CpuModel::window_rows_with`] and the final-normed rows the head read (`[rows, d]`),
    /// for `--save-reference`.
    pub fn window_rows_hidden_with(
        &self,
        tokens: &[u32],
        first_target: usize,
        kv: KvDtype,
        may_split: &(dyn Fn() -> bool + Sync),
    ) -> Result<(Vec<RowScore>, Vec<f32>), ForwardError> {
        let (rows, _, hn) = self.forward_with(
            tokens,
            first_target,
            kv,
            Split::Ask(may_split),
            Against::Nothing,
            true,
        )?;
        Ok((rows, hn.unwrap_or_default()))
    }

    pub(crate) fn forward(
        &self,
        tokens: &[u32],
        first_target: usize,
        kv: KvDtype,
        split: Split,
    ) -> Result<Vec<RowScore>, ForwardError> {
        Ok(self
            .forward_with(tokens, first_target, kv, split, Against::Nothing, false)?
            .0)
    }

    fn forward_with(
        &self,
        tokens: &[u32],
        first_target: usize,
        kv: KvDtype,
        split: Split,
        against: Against,
        keep_hidden: bool,
    ) -> Result<RowsPairsHidden, ForwardError> {
        let t_len = tokens.len();
        let mut laps = Laps::new(self.profile);
        let (hn, cut) = self.hidden(tokens, first_target, kv, split, &mut laps)?;
        let want = match against {
            Against::Rows(_) => Some(hn.len()),
            Against::Logprobs(_) => Some((t_len - first_target) * self.config.vocab_size),
            _ => None,
        };
        if let (Against::Rows(hr) | Against::Logprobs(hr), Some(want)) = (against, want) {
            if hr.len() != want {
                return Err(ForwardError::SavedRows {
                    got: hr.len(),
                    want,
                    rows: t_len - first_target,
                });
            }
        }
        let (rows, pairs) = self.head(&hn, tokens, first_target, against)?;
        let out = (rows, pairs, keep_hidden.then_some(hn));
        laps.lap(Phase::Head);
        let after_split = if cut { " (after the split)" } else { "" };
        laps.report(&format!(
            "window {t_len} tokens, {} scored{after_split}",
            t_len - first_target
        ));
        Ok(out)
    }

    /// The final-normed hidden states of the rows that predict a target (`[rows, d]`, row `r`
    /// predicting `tokens[first_target + r]`), and whether the window was split.
    fn hidden(
        &self,
        tokens: &[u32],
        first_target: usize,
        kv: KvDtype,
        split: Split,
        laps: &mut Laps,
    ) -> Result<(Vec<f32>, bool), ForwardError> {
        let c = &self.config;
        let t_len = tokens.len();
        assert!(
            first_target >= 1 && first_target <= t_len,
            "first_target out of range"
        );
        let (d, layers) = (c.hidden_size, self.weights.layers.len());
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
            w.embed.rows(d).decode_row(id_us, row);
        }
        if let Some(e) = self.faults.embed_scale() {
            x.iter_mut().for_each(|v| *v *= 1.0 + e);
        }
        if let Some(f) = self.faults.embed_jitter(t_len) {
            for (row, s) in x.chunks_mut(d).zip(f) {
                row.iter_mut().for_each(|v| *v *= s);
            }
        }
        let rope = RopeTable::partial(&self.inv_freq, t_len, c.head_dim);
        let shifted_rope = self
            .faults
            .rope_shift()
            .then(|| rope_one_ahead(&self.inv_freq, t_len, c.head_dim));
        let pass = Pass {
            first_target,
            kv,
            rope: &rope,
            shifted_rope: shifted_rope.as_ref(),
        };

        // The whole window, layer by layer, until (if ever) it is split.
        let mut cut = None;
        {
            let mut bufs = Bufs::new(c, 0, t_len);
            for li in 0..layers {
                if let Some(h) = self.split_here(&split, li, t_len, first_target) {
                    cut = Some((li, h));
                    break;
                }
                self.layer(li, 0..t_len, &mut x, &mut bufs, &pass, &Link::Alone, laps)
                    .map_err(Stop::into_error)?;
            }
        }
        if let Some((from, h)) = cut {
            laps.report(&format!("window {t_len} tokens, layers 0..{from}"));
            self.split_layers(from, h, &mut x, &pass)?;
            *laps = Laps::new(self.profile);
        }

        // Row i predicts token i + 1: rows first_target-1 .. T-1.
        let rows = t_len - first_target;
        let mut hn = vec![0.0f32; rows * d];
        hn.par_chunks_mut(d).enumerate().for_each(|(r, o)| {
            let i = first_target - 1 + r;
            if self.faults.skip_final_norm() {
                o.copy_from_slice(&x[i * d..(i + 1) * d]);
                return;
            }
            rms_norm_row(&x[i * d..(i + 1) * d], &w.final_norm, c.rms_norm_eps, o);
        });
        Ok((hn, cut.is_some()))
    }
}

/// The `rope-shift` fault's table: position `t` rotated as `t + 1`.
fn rope_one_ahead(inv_freq: &[f64], t_len: usize, head_dim: usize) -> RopeTable {
    let t = RopeTable::partial(inv_freq, t_len + 1, head_dim);
    RopeTable {
        half: t.half,
        head_dim: t.head_dim,
        cos: t.cos[t.half..].to_vec(),
        sin: t.sin[t.half..].to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::model::fault::Fault;
    use crate::backend::cpu::model::synthetic::synthetic_model;
    use crate::model::error::Part;
    use weights::Attention;

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

    fn attention_mut(m: &mut CpuModel, layer: usize) -> &mut Attention {
        match &mut m.weights.layers[layer].mixer {
            Mixer::Attention(a) => a,
            Mixer::DeltaNet(_) => unreachable!("the synthetic model has attention only"),
        }
    }

    #[test]
    fn non_finite_values_fail_the_window_with_where_they_are() {
        let tokens: Vec<u32> = (0..100).map(|i| ((i * 7919) % 290) as u32).collect();
        let d = 32;
        // A NaN logit: vocabulary row 295 of the (tied) head, a token no input uses. The max
        // would drop it and the fast exp clamp it; the first scored row reports it.
        let mut m = synthetic_model();
        m.weights.embed[295 * d + 3] = f32::NAN;
        assert_eq!(
            m.window_logprobs(&tokens, 40, KvDtype::Bf16).unwrap_err(),
            ForwardError::NonFiniteLogit {
                pos: 39,
                token: 295
            }
        );
        // An infinite query: layer 1's query projection (rows 0..Hq·D of the stacked qkv).
        let mut m = synthetic_model();
        attention_mut(&mut m, 1).qkv[8 * d] = f32::INFINITY; // query head 1, first row
        let e = m.window_logprobs(&tokens, 1, KvDtype::F32).unwrap_err();
        assert!(
            matches!(
                e,
                ForwardError::NonFinite {
                    part: Part::Query,
                    layer: 1,
                    pos: 0,
                    head: 1
                }
            ),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "non-finite query at layer 1, window position 0, query head 1"
        );
        // Finite queries and keys whose scores overflow: attention's output is refused.
        let mut m = synthetic_model();
        let qkv = &mut attention_mut(&mut m, 0).qkv;
        qkv[..(4 + 2) * 8 * d].iter_mut().for_each(|w| *w *= 1e20);
        let e = m.window_logprobs(&tokens, 1, KvDtype::F32).unwrap_err();
        assert!(
            matches!(
                e,
                ForwardError::NonFinite {
                    part: Part::AttentionOutput,
                    layer: 0,
                    ..
                }
            ),
            "{e:?}"
        );
    }

    #[test]
    fn a_hybrid_model_scores_fewer_targets_with_the_same_bits() {
        // Gated DeltaNet layers run the whole window; the skipped rows of the last layer
        // and the head are the same as for attention models.
        let m = crate::backend::cpu::model::synthetic::synthetic_hybrid_model();
        let tokens: Vec<u32> = (0..200).map(|i| ((i * 7919) % 300) as u32).collect();
        let all = m.window_logprobs(&tokens, 1, KvDtype::Bf16).unwrap();
        assert!(all.iter().all(|x| x.is_finite() && *x <= 0.0));
        for first in [2, 64, 65, 150, 199] {
            let part = m.window_logprobs(&tokens, first, KvDtype::Bf16).unwrap();
            assert!(
                part.iter()
                    .zip(&all[first - 1..])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "first target {first}"
            );
        }
        // The KV format reaches the full-attention layer only, and does change its result.
        let int8 = m.window_logprobs(&tokens, 1, KvDtype::Nvfp4).unwrap();
        assert!(int8.iter().zip(&all).any(|(a, b)| a != b));
        // Splits are never offered for hybrid windows (the State is sequential).
        let long: Vec<u32> = (0..700).map(|i| ((i * 31) % 300) as u32).collect();
        m.window_logprobs_with(&long, 1, KvDtype::Bf16, &|| -> bool { unreachable!() })
            .unwrap();
    }

    #[test]
    fn a_non_finite_gated_delta_net_value_fails_the_window() {
        let mut m = crate::backend::cpu::model::synthetic::synthetic_hybrid_model();
        if let Mixer::DeltaNet(g) = &mut m.weights.layers[2].mixer {
            g.dt_bias[4] = f32::NAN;
        }
        let tokens: Vec<u32> = (0..80).map(|i| ((i * 7919) % 300) as u32).collect();
        let e = m.window_logprobs(&tokens, 1, KvDtype::Bf16).unwrap_err();
        assert_eq!(
            e.to_string(),
            "non-finite Gated DeltaNet decay or write gate at layer 2, window position 0, value head 4"
        );
    }

    #[test]
    fn every_fault_changes_the_result_and_none_is_the_clean_model() {
        let tokens: Vec<u32> = (0..200).map(|i| ((i * 7919) % 300) as u32).collect();
        let clean = synthetic_model()
            .window_logprobs(&tokens, 1, KvDtype::F32)
            .unwrap();
        for f in [
            Fault::RopeShift,
            Fault::SkipFinalNorm,
            Fault::EmbedScale(1e-3),
        ] {
            let m = synthetic_model().with_faults(Faults::of(f));
            let got = m.window_logprobs(&tokens, 1, KvDtype::F32).unwrap();
            assert!(got.iter().zip(&clean).any(|(a, b)| a != b), "{f:?}");
        }
        let m = synthetic_model().with_faults(Faults::NONE);
        let got = m.window_logprobs(&tokens, 1, KvDtype::F32).unwrap();
        assert!(got
            .iter()
            .zip(&clean)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}
