//! Packers: turn models people already have into `.ninfer` artifacts.
//!
//! Every reader produces a [`PackSource`]: a normalized config, a Hugging Face
//! `tokenizer.json`, and f32 tensors under Hugging Face names in the rotate-half RoPE
//! layout (or, for a checkpoint that is already quantized, the matrices as it holds them).
//! The artifact writer then stores them in the requested weight format.

pub mod gguf;
pub mod gguf_tokenizer;
pub mod hf;
pub mod hf_quant;
pub mod moe;
pub mod qwen3_5;
pub mod rows;

use crate::model::config::ModelConfig;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// A source tensor's contents.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    /// Row-major values, to store in the pack's weight format (or quantize).
    Values(Vec<f32>),
    /// A matrix the source already holds quantized: stored as it is, never requantized.
    Quantized(crate::quant::QuantTensor),
}

impl TensorData {
    /// The values of a tensor that is not quantized.
    pub fn values(&self) -> Option<&[f32]> {
        match self {
            TensorData::Values(v) => Some(v),
            TensorData::Quantized(_) => None,
        }
    }
}

/// One tensor under its Hugging Face name; `shape` is the logical (dequantized) shape.
pub struct SourceTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: TensorData,
    /// The file it was read from, for errors.
    pub origin: PathBuf,
}

/// One input file of a pack, recorded in the artifact's provenance.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SourceFile {
    pub path: String,
    pub sha256: String,
    pub bytes: u64,
}

/// Everything a reader extracts from its input.
pub struct PackSource {
    pub config: ModelConfig,
    /// A Hugging Face `tokenizer.json`, verbatim (HF input) or rebuilt (GGUF input).
    pub tokenizer_json: String,
    pub tensors: Vec<SourceTensor>,
    /// Where the weights came from: "gguf" or "huggingface".
    pub source_kind: String,
    pub source_files: Vec<SourceFile>,
    /// The original tensor types seen in the input, e.g. {"Q4_1": 211, "F32": 61}.
    pub source_dtypes: std::collections::BTreeMap<String, usize>,
    /// What the reader left out or changed, for the packer to say on stderr
    /// (e.g. "dropped 15 tensors of mtp.* (the multi-token-prediction head)").
    pub notes: Vec<String>,
    /// For a quantized checkpoint: what it says it is and the activation scales it holds
    /// (recorded, not applied: scoring is weight-only).
    pub quantization: Option<crate::quant::Imported>,
}
