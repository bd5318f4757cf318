//! The `.ninfer` container: one safetensors file whose `__metadata__` describes the model.
//!
//! Safetensors is what the ecosystem already reads, so an artifact can be inspected with
//! ordinary tools. Metadata keys (all strings, as safetensors requires):
//!
//! | key              | value                                                           |
//! |------------------|-----------------------------------------------------------------|
//! | `format`         | `"ninfer"` (the magic)                                          |
//! | `format_version` | `"1"`                                                           |
//! | `config`         | [`ModelConfig`] as JSON                                         |
//! | `tokenizer`      | a Hugging Face `tokenizer.json`, verbatim                       |
//! | `weight_format`  | `"f32"` or `"bf16"`: how the dense matrices are stored          |
//! | `quantization`   | only with quantized matrices: [`crate::quant::Imported`] as JSON |
//! | `provenance`     | [`Provenance`] as JSON (packer, source files with sha256, ...)  |
//! | `digest`         | `sha256:<hex>` over everything else (see [`digest`])            |
//!
//! Tensors use Hugging Face names and row-major shapes; RoPE rows are in the rotate-half
//! layout. Norm weights are always stored as f32; matrices in the weight format, or quantized
//! (fp8 or nvfp4, per matrix, scales beside the payload: see [`quantized`]).

pub mod digest;
pub mod quantized;
pub mod random;
pub mod reader;
pub mod source;
pub mod stored;
pub mod stream;
pub mod writer;

pub use reader::{Artifact, FormatUse};
pub use writer::{write_artifact, WeightPlan};

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use source::SourceFile;
use std::collections::BTreeMap;

pub use crate::model::config::ModelConfig;

/// The value of the `format` metadata key.
pub const MAGIC: &str = "ninfer";
/// The container version this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;

/// How the weight matrices are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightFormat {
    F32,
    Bf16,
}

impl WeightFormat {
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::Bf16 => "bf16",
        }
    }

    pub fn parse(s: &str) -> Result<WeightFormat> {
        match s {
            "f32" => Ok(WeightFormat::F32),
            "bf16" => Ok(WeightFormat::Bf16),
            other => bail!("unknown weight format `{other}` (valid: f32, bf16)"),
        }
    }
}

/// Where an artifact came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Provenance {
    /// e.g. "ninfer-pack 0.1.0".
    pub packer: String,
    /// "gguf" or "huggingface".
    pub source_kind: String,
    pub source_files: Vec<SourceFile>,
    /// Tensor types found in the source and how many tensors had each.
    pub source_dtypes: BTreeMap<String, usize>,
}

/// Tensors stored in f32 whatever the weight format: the small per-channel vectors.
pub fn is_vector_tensor(name: &str, shape: &[usize]) -> bool {
    shape.len() == 1 || name.ends_with("norm.weight")
}
