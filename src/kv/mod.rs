//! Main KV representations.
//!
//! A representation says how post-RoPE keys and values are stored in the KV cache. The five
//! names the seed spec uses (`bf16`, `int8`, `fp8`, `nvfp4`, `k8v4`) mean exactly the formats
//! of the seed's engine, NInfer (`BFloat16`, `Int8Group64`, `Fp8E4M3Row256`, `Nvfp4Group16`,
//! `Fp8KeyNvfp4Value`); `f32` is this project's exact reference. See `docs/kv-formats.md`.
//!
//! The CPU code in this module is the specification: the CUDA path stores the same bits.
//! Per (token, KV head) vector of `head_dim` values, the engine
//! 1. rotates keys (every quantized representation) and values (`nvfp4`, `k8v4`) with the
//!    normalized Hadamard matrix ([`hadamard`]; queries are rotated the same way, and the
//!    attention output back where values were),
//! 2. replaces the vector by what the cache gives back ([`Elem::roundtrip`]), so attention
//!    reads only decoded values, the current token's own included.
//!
//! Each element format has its own module holding the exact definition (grouping, scale
//! type and rounding, order of f32 operations, zero handling, stored layout): [`int8`],
//! [`fp8`], [`nvfp4`], [`bf16`], [`f16`]. Each offers `encode` (the stored payload and
//! scales), `decode`, and an allocation-free in-place `roundtrip` that is, for finite input,
//! bit for bit `decode(encode(x))`. Inputs must be finite: the engine calls
//! [`find_non_finite`] first (non-finite input gives unspecified values, never a panic).
//! Every format accepts any `head_dim >= 1`; a trailing partial group or block is treated
//! like a full one.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

pub mod bf16;
pub mod f16;
pub mod fp8;
pub mod hadamard;
pub mod int8;
pub mod nvfp4;

/// The index of the first NaN or infinity in `x`, if any. Quantized formats are defined for
/// finite inputs only; the engine calls this before storing a vector and reports the position.
pub fn find_non_finite(x: &[f32]) -> Option<usize> {
    // Vectorizable scan first; the position only when something is there.
    let any = x.iter().fold(false, |acc, v| {
        acc | (v.to_bits() & 0x7F80_0000 == 0x7F80_0000)
    });
    if any {
        x.iter().position(|v| !v.is_finite())
    } else {
        None
    }
}

/// `max |x_i|`, exact, 0 for an empty slice. Compares the magnitude bits as integers (their
/// order is the order of the values for non-NaN floats), so it is branch free and
/// vectorizes. A NaN yields a NaN, an infinity an infinity.
#[inline]
pub(crate) fn amax(x: &[f32]) -> f32 {
    f32::from_bits(x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7FFF_FFFF)))
}

/// The storage format of keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    F32,
    Bf16,
    Int8,
    Fp8,
    Nvfp4,
    K8v4,
}

/// Which stored tensors a representation rotates ([`KvDtype::rotation`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rotation {
    pub keys: bool,
    pub values: bool,
}

/// How one tensor (K or V) is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    F32,
    Bf16,
    /// IEEE half precision: the values of `bf16` (NInfer stores V in FP16).
    F16,
    Int8,
    Fp8,
    Nvfp4,
}

impl KvDtype {
    pub const ALL: [KvDtype; 6] = [
        KvDtype::Bf16,
        KvDtype::Int8,
        KvDtype::Fp8,
        KvDtype::Nvfp4,
        KvDtype::K8v4,
        KvDtype::F32,
    ];

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
            KvDtype::Int8 => "int8",
            KvDtype::Fp8 => "fp8",
            KvDtype::Nvfp4 => "nvfp4",
            KvDtype::K8v4 => "k8v4",
        }
    }

    pub fn parse(s: &str) -> Result<KvDtype> {
        for k in KvDtype::ALL {
            if k.name() == s {
                return Ok(k);
            }
        }
        let names: Vec<&str> = KvDtype::ALL.iter().map(|k| k.name()).collect();
        bail!("unknown KV dtype `{s}` (valid: {})", names.join(", "))
    }

    pub fn key_elem(self) -> Elem {
        match self {
            KvDtype::F32 => Elem::F32,
            KvDtype::Bf16 => Elem::Bf16,
            KvDtype::Int8 => Elem::Int8,
            KvDtype::Fp8 | KvDtype::K8v4 => Elem::Fp8,
            KvDtype::Nvfp4 => Elem::Nvfp4,
        }
    }

    pub fn value_elem(self) -> Elem {
        match self {
            KvDtype::F32 => Elem::F32,
            KvDtype::Bf16 => Elem::F16,
            KvDtype::Int8 => Elem::Int8,
            KvDtype::Fp8 => Elem::Fp8,
            KvDtype::Nvfp4 | KvDtype::K8v4 => Elem::Nvfp4,
        }
    }

    /// Which stored tensors are rotated by the normalized Hadamard matrix before they are
    /// quantized, for vectors of `head_dim` values: keys in every quantized representation,
    /// values in those whose values are NVFP4; nothing when `head_dim` is not a power of two
    /// (NInfer defines its formats for 256 only; this project's rule for other sizes).
    pub fn rotation(self, head_dim: usize) -> Rotation {
        let quantized = !matches!(self, KvDtype::F32 | KvDtype::Bf16);
        let fits = hadamard::applies(head_dim);
        Rotation {
            keys: quantized && fits,
            values: self.value_elem() == Elem::Nvfp4 && fits,
        }
    }

    /// The representation's name in NInfer's reports: `bf16`, `int8-g64`,
    /// `fp8-e4m3-r<head_dim>` (`r256` at NInfer's head_dim), `nvfp4`, `k8v4`; `f32`.
    pub fn format_name(self, head_dim: usize) -> String {
        match self {
            KvDtype::Int8 => "int8-g64".into(),
            KvDtype::Fp8 => format!("fp8-e4m3-r{head_dim}"),
            other => other.name().into(),
        }
    }

    /// Checks, before any scoring, that vectors of `head_dim` values can be stored.
    pub fn check_head_dim(self, head_dim: usize) -> Result<()> {
        for e in [self.key_elem(), self.value_elem()] {
            e.check_head_dim(head_dim)
                .map_err(|m| anyhow::anyhow!("KV dtype `{}`: {m}", self.name()))?;
        }
        Ok(())
    }

    /// Storage cost in bytes per token per layer (keys + values, payload + scales).
    pub fn bytes_per_token_per_layer(self, num_kv_heads: usize, head_dim: usize) -> usize {
        num_kv_heads
            * (self.key_elem().bytes_per_vector(head_dim)
                + self.value_elem().bytes_per_vector(head_dim))
    }

    /// Replaces one key vector (one token, one KV head) by what the cache gives back.
    pub fn roundtrip_k(self, x: &mut [f32]) {
        self.key_elem().roundtrip(x)
    }

    /// Replaces one value vector (one token, one KV head) by what the cache gives back.
    pub fn roundtrip_v(self, x: &mut [f32]) {
        self.value_elem().roundtrip(x)
    }
}

impl Elem {
    /// Every element format.
    pub const ALL: [Elem; 6] = [
        Elem::F32,
        Elem::Bf16,
        Elem::F16,
        Elem::Int8,
        Elem::Fp8,
        Elem::Nvfp4,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::Bf16 => "bf16",
            Elem::F16 => "f16",
            Elem::Int8 => "int8",
            Elem::Fp8 => "fp8",
            Elem::Nvfp4 => "nvfp4",
        }
    }

    /// Every format stores any positive head_dim (`nvfp4` with a partial last block when
    /// head_dim is not a multiple of 16, and a zero pad nibble when it is odd); 0 is rejected.
    pub fn check_head_dim(self, head_dim: usize) -> std::result::Result<(), String> {
        if head_dim == 0 {
            return Err(format!(
                "{} cannot store vectors of head_dim 0",
                self.name()
            ));
        }
        Ok(())
    }

    /// Bytes to store one vector of `head_dim` values, scales included.
    pub fn bytes_per_vector(self, head_dim: usize) -> usize {
        match self {
            Elem::F32 => 4 * head_dim,
            Elem::Bf16 | Elem::F16 => 2 * head_dim,
            Elem::Int8 => int8::bytes_per_vector(head_dim),
            Elem::Fp8 => fp8::bytes_per_vector(head_dim),
            Elem::Nvfp4 => nvfp4::bytes_per_vector(head_dim),
        }
    }

    /// Quantize then dequantize in place (no allocation).
    pub fn roundtrip(self, x: &mut [f32]) {
        match self {
            Elem::F32 => {}
            Elem::Bf16 => bf16::roundtrip(x),
            Elem::F16 => f16::roundtrip(x),
            Elem::Int8 => int8::roundtrip(x),
            Elem::Fp8 => fp8::roundtrip(x),
            Elem::Nvfp4 => nvfp4::roundtrip(x),
        }
    }

    /// The stored bytes of one vector (payload, then scales; see each format's module).
    /// Its length is [`Elem::bytes_per_vector`].
    pub fn encode_bytes(self, x: &[f32]) -> Vec<u8> {
        match self {
            Elem::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Elem::Bf16 => x
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
            Elem::F16 => x
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
            Elem::Int8 => int8::encode(x).to_bytes(),
            Elem::Fp8 => fp8::encode(x).to_bytes(),
            Elem::Nvfp4 => nvfp4::encode(x).to_bytes(),
        }
    }
}
