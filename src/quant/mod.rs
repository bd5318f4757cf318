//! Weight formats beyond f32 and bf16: fp8 (e4m3fn with per-tensor, per-channel or
//! 128 × 128 block scales) and nvfp4 (packed e2m1 with e4m3 scales per 16 values and an f32
//! global scale).
//!
//! A quantized matrix is stored as its payload plus named scale tensors, exactly as the
//! checkpoints people download hold them (so an imported checkpoint keeps its bytes), and is
//! dequantized exactly to f32 where a kernel reads it: scoring is weight-only, activations stay in
//! the compute precision. [`nvfp4`] and [`fp8`] hold the formats' definitions, the packer's
//! quantizers (ModelOpt's rules for nvfp4, transformers' fine-grained FP8 for fp8 blocks) and
//! the dequantizers. The element codecs are the Main KV ones ([`crate::kv::fp8`],
//! [`crate::kv::nvfp4`]).

pub mod fp8;
pub mod nvfp4;
pub mod select;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What an artifact records about its quantized matrices (metadata key `quantization`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Imported {
    /// Where the quantized bytes came from, e.g. `ninfer-pack --weights nvfp4` or
    /// `modelopt NVFP4 (hf_quant_config.json)`.
    pub method: String,
    /// Activation (input) scales of the source checkpoint, by tensor name; recorded and not
    /// applied: activations stay in the compute precision.
    #[serde(default)]
    pub activation_scales: BTreeMap<String, f32>,
}

/// A quantized `[rows, cols]` matrix.
#[derive(Clone, Debug, PartialEq)]
pub enum QuantTensor {
    Fp8(fp8::Fp8Tensor),
    Nvfp4(nvfp4::Nvfp4Tensor),
}

impl QuantTensor {
    pub fn rows(&self) -> usize {
        match self {
            QuantTensor::Fp8(t) => t.rows,
            QuantTensor::Nvfp4(t) => t.rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            QuantTensor::Fp8(t) => t.cols,
            QuantTensor::Nvfp4(t) => t.cols,
        }
    }

    /// The format's name in reports: `fp8` or `nvfp4`.
    pub fn format(&self) -> &'static str {
        match self {
            QuantTensor::Fp8(_) => "fp8",
            QuantTensor::Nvfp4(_) => "nvfp4",
        }
    }

    /// Checks the parts fit the shape and every scale and code is usable.
    pub fn validate(&self) -> Result<()> {
        match self {
            QuantTensor::Fp8(t) => t.validate(),
            QuantTensor::Nvfp4(t) => t.validate(),
        }
    }

    /// The exact f32 values, row-major; an invalid scale is an error naming it.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        match self {
            QuantTensor::Fp8(t) => t.dequantize(),
            QuantTensor::Nvfp4(t) => t.dequantize(),
        }
    }

    /// Bytes stored: payload and scales.
    pub fn stored_bytes(&self) -> usize {
        match self {
            QuantTensor::Fp8(t) => t.codes.len() + 4 * t.scale.values().len(),
            QuantTensor::Nvfp4(t) => t.packed.len() + t.block_scales.len() + 4,
        }
    }
}

/// What the packer quantizes a model to (`ninfer-pack --weights`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// fp8 e4m3 with 128 × 128 block scales (transformers' fine-grained FP8).
    Fp8Block,
    /// nvfp4 with ModelOpt's default rules.
    Nvfp4,
}

impl Scheme {
    pub fn name(self) -> &'static str {
        match self {
            Scheme::Fp8Block => "fp8",
            Scheme::Nvfp4 => "nvfp4",
        }
    }
}

/// Refuses a matrix shape a format cannot store.
pub fn check_shape(scheme: Scheme, name: &str, rows: usize, cols: usize) -> Result<()> {
    if rows == 0 || cols == 0 {
        bail!("tensor `{name}`: an empty matrix cannot be quantized");
    }
    if scheme == Scheme::Nvfp4 && !cols.is_multiple_of(nvfp4::BLOCK) {
        bail!(
            "tensor `{name}`: nvfp4 needs the input dimension ({cols}) to be a multiple of {}",
            nvfp4::BLOCK
        );
    }
    Ok(())
}
