//! How a window's forward pass fails: the input, or a non-finite value the model produced.
//!
//! A non-finite value anywhere in scoring is an error, never a silently finite number: the
//! forward pass checks the queries, the keys and values it stores, each layer's attention
//! output and every logit of the head, and names the first one met. Positions are relative
//! to the window; the engine adds the stream and the window.

use thiserror::Error;

/// Which per-head tensor of a layer a value belongs to, in the order a layer computes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Part {
    Query,
    Key,
    Value,
    /// Attention's output (a score that overflowed shows up here).
    AttentionOutput,
    /// A Gated DeltaNet's projections of its input (q|k|v, z, b, a).
    DeltaNetInput,
    /// A Gated DeltaNet's decay `g` or write strength `beta`.
    DeltaNetGate,
    /// A Gated DeltaNet's read-out of its recurrent State.
    State,
}

impl Part {
    pub fn name(self) -> &'static str {
        match self {
            Part::Query => "query",
            Part::Key => "key",
            Part::Value => "value",
            Part::AttentionOutput => "attention output",
            Part::DeltaNetInput => "Gated DeltaNet projection",
            Part::DeltaNetGate => "Gated DeltaNet decay or write gate",
            Part::State => "State read-out",
        }
    }

    /// The heads this part is indexed by.
    fn heads(self) -> &'static str {
        match self {
            Part::Key | Part::Value => "KV head",
            Part::Query | Part::AttentionOutput => "query head",
            Part::DeltaNetInput => "channel",
            Part::DeltaNetGate | Part::State => "value head",
        }
    }
}

/// A failure inside a window (positions are relative to the window).
#[derive(Debug, Error, PartialEq)]
pub enum ForwardError {
    #[error("token id {id} at window position {pos} is outside the vocabulary ({vocab})")]
    TokenOutOfRange { id: u32, pos: usize, vocab: usize },
    #[error("non-finite {} at layer {layer}, window position {pos}, {} {head}", .part.name(), .part.heads())]
    NonFinite {
        part: Part,
        layer: usize,
        pos: usize,
        head: usize,
    },
    #[error("non-finite logit of token {token} at window position {pos} (output head)")]
    NonFiniteLogit { pos: usize, token: usize },
    /// A failure of the reference model's pass over the same window (`--reference-*`).
    #[error("reference pass: {0}")]
    InReference(Box<ForwardError>),
    /// Saved reference rows that do not cover the window's targets.
    #[error(
        "the saved reference holds {got} values for this window, its {rows} targets need {want}"
    )]
    SavedRows {
        got: usize,
        want: usize,
        rows: usize,
    },
    /// The saved reference could not give this window's rows (its read error).
    #[error("{0}")]
    SavedRead(String),
}

/// `x[T, heads, D]` (rows from window position `first`) checked for NaN and infinity: the
/// first non-finite value's position and head as a [`ForwardError::NonFinite`].
pub fn check_finite(
    x: &[f32],
    heads: usize,
    head_dim: usize,
    part: Part,
    layer: usize,
    first: usize,
) -> Result<(), ForwardError> {
    match crate::kv::find_non_finite(x) {
        None => Ok(()),
        Some(i) => {
            let vec = i / head_dim;
            Err(ForwardError::NonFinite {
                part,
                layer,
                pos: first + vec / heads,
                head: vec % heads,
            })
        }
    }
}

impl ForwardError {
    /// The order in which an unsplit window meets these errors: by layer, then by part in
    /// the order a layer computes them, position and head; the head's logits come last (a
    /// split window reports the earlier one).
    pub(crate) fn order(&self) -> (usize, Part, usize, usize) {
        match *self {
            ForwardError::TokenOutOfRange { pos, .. } => (0, Part::Query, pos, 0),
            ForwardError::NonFinite {
                part,
                layer,
                pos,
                head,
            } => (1 + layer, part, pos, head),
            ForwardError::NonFiniteLogit { pos, token } => (usize::MAX, Part::Query, pos, token),
            ForwardError::InReference(_)
            | ForwardError::SavedRows { .. }
            | ForwardError::SavedRead(_) => (usize::MAX, Part::State, usize::MAX, usize::MAX),
        }
    }
}
