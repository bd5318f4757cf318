//! The scoring head on the CPU: the final-normed rows through the output head, one
//! vocabulary chunk at a time, fused with log-softmax and the target's gather
//! (`backend/cpu/head.rs`), or side by side with a reference pass's rows
//! (`backend/cpu/head_pair.rs`). CUDA twin: `backend/cuda/model/head.rs`.

use super::profile::Laps;
use super::split::Split;
use super::CpuModel;
use crate::backend::cpu::head;
use crate::backend::cpu::head_pair::{self, Side};
use crate::backend::cpu::operand::Operand;
use crate::backend::{PairScore, RowScore};
use crate::kv::KvDtype;
use crate::model::error::ForwardError;

/// What the head compares the run's rows with.
#[derive(Clone, Copy)]
pub enum Against<'a> {
    Nothing,
    /// A reference pass of a model (this one or another with the same vocabulary) through
    /// its KV format.
    Model(&'a CpuModel, KvDtype),
    /// A reference's final-normed rows `[rows, d]`, saved by an earlier run of this head.
    Rows(&'a [f32]),
    /// Another engine's log-probabilities `[rows, vocab]` over this vocabulary.
    Logprobs(&'a [f32]),
}

impl CpuModel {
    /// Scores the final-normed rows `hn [rows, d]` (row `r` predicts
    /// `tokens[first_target + r]`); with a reference (a model with the same vocabulary and
    /// its KV format), its pass over the same window is compared at every row.
    #[allow(clippy::type_complexity)]
    pub(super) fn head(
        &self,
        hn: &[f32],
        tokens: &[u32],
        first_target: usize,
        against: Against,
    ) -> Result<(Vec<RowScore>, Option<Vec<PairScore>>), ForwardError> {
        let c = &self.config;
        let d = c.hidden_size;
        let rows = tokens.len() - first_target;
        let targets = &tokens[first_target..];
        let logit_error = |pos: usize, token: usize| ForwardError::NonFiniteLogit {
            pos: first_target - 1 + pos,
            token,
        };
        // A non-finite logit of either side, named as the run's or the reference's.
        let pair_error = |(side, e): (Side, head::NonFiniteLogit)| match side {
            Side::Run => logit_error(e.row, e.token),
            Side::Reference => ForwardError::InReference(Box::new(logit_error(e.row, e.token))),
        };
        let mut out = vec![RowScore::default(); rows];
        let reference = match against {
            Against::Nothing => None,
            Against::Model(m, ref_kv) => {
                let mut ref_laps = Laps::new(false);
                let (hr, _) = m
                    .hidden(tokens, first_target, ref_kv, Split::Never, &mut ref_laps)
                    .map_err(|e| ForwardError::InReference(Box::new(e)))?;
                Some((std::borrow::Cow::Owned(hr), m))
            }
            // Saved rows of a reference with this head (checked by its digest when opened).
            Against::Rows(hr) => Some((std::borrow::Cow::Borrowed(hr), self)),
            Against::Logprobs(lp) => {
                let mut pairs = vec![PairScore::default(); rows];
                head_pair::score_against_logprobs(
                    (hn, d, self.weights.head().rows(d)),
                    lp,
                    c.vocab_size,
                    targets,
                    &mut out,
                    &mut pairs,
                )
                .map_err(pair_error)?;
                return Ok((out, Some(pairs)));
            }
        };
        let pairs = match reference {
            None => {
                head::score_rows(hn, d, self.weights.head(), c.vocab_size, targets, &mut out)
                    .map_err(|e| logit_error(e.row, e.token))?;
                None
            }
            Some((hr, m)) => {
                let mut pairs = vec![PairScore::default(); rows];
                let dr = m.config.hidden_size;
                head_pair::score_pairs(
                    (hn, d, self.weights.head().rows(d)),
                    (&hr, dr, m.weights.head().rows(dr)),
                    c.vocab_size,
                    targets,
                    &mut out,
                    &mut pairs,
                )
                .map_err(pair_error)?;
                Some(pairs)
            }
        };
        Ok((out, pairs))
    }
}
