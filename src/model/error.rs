//! How a window's forward pass fails: the input or a non-finite value the model produced.
//!
//! Positions are relative to the window; the engine adds the stream and the window.

use thiserror::Error;

/// Which of a layer's stored tensors a value belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum KvPart {
    Key,
    Value,
}

impl KvPart {
    pub fn name(self) -> &'static str {
        match self {
            KvPart::Key => "key",
            KvPart::Value => "value",
        }
    }
}

/// A failure inside a window (positions are relative to the window).
#[derive(Debug, Error, PartialEq)]
pub enum ForwardError {
    #[error("token id {id} at window position {pos} is outside the vocabulary ({vocab})")]
    TokenOutOfRange { id: u32, pos: usize, vocab: usize },
    #[error("non-finite {} at layer {layer}, window position {pos}, KV head {head}", .part.name())]
    NonFiniteKv {
        part: KvPart,
        layer: usize,
        pos: usize,
        head: usize,
    },
}

impl ForwardError {
    /// The order in which an unsplit window meets these errors: by layer, keys before
    /// values, then by position and head (a split window reports the earlier one).
    pub(crate) fn order(&self) -> (usize, KvPart, usize, usize) {
        match *self {
            ForwardError::TokenOutOfRange { pos, .. } => (0, KvPart::Key, pos, 0),
            ForwardError::NonFiniteKv {
                part,
                layer,
                pos,
                head,
            } => (1 + layer, part, pos, head),
        }
    }
}
