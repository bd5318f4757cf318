//! What the artifact writer takes: a model as a packer read it (a normalized config, a
//! Hugging Face `tokenizer.json`, and tensors under Hugging Face names, f32 or quantized as
//! the checkpoint holds them), and the dtype widening the readers and the artifact reader
//! share. The packers (`crate::pack`) produce it; the writer (`super::writer`) stores it.

use crate::model::config::ModelConfig;
use safetensors::tensor::Dtype;
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

/// Little-endian F32/BF16/F16 safetensors bytes widened to f32 (`None` for other dtypes).
pub fn widen(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        _ => return None,
    })
}
