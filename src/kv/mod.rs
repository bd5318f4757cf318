//! Main KV representations.
//!
//! A representation says how post-RoPE keys and values are stored in the KV cache. The five
//! names the seed spec uses (`bf16`, `int8`, `fp8`, `nvfp4`, `k8v4`) mean exactly the formats
//! of the seed's engine, NInfer (`BFloat16`, `Int8Group64`, `Fp8E4M3Row256`, `Nvfp4Group16`,
//! `Fp8KeyNvfp4Value`); `f32` is this project's exact reference and `fp8-tensor` vLLM's
//! deployed default (one f32 scale per layer for K and for V, [`fp8_tensor`]). See
//! `docs/kv-formats.md`.
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

pub mod bf16;
pub mod f16;
pub mod fp8;
pub mod fp8_tensor;
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDtype {
    F32,
    Bf16,
    Int8,
    Fp8,
    Nvfp4,
    K8v4,
    /// vLLM's per-tensor FP8 with the run's per-layer scales (one set per process: the
    /// scales are read once and live as long as it).
    Fp8Tensor(&'static fp8_tensor::TensorScales),
}

/// vLLM's default: every scale 1.0.
static DEFAULT_TENSOR_SCALES: fp8_tensor::TensorScales = fp8_tensor::TensorScales {
    source: None,
    k: Vec::new(),
    v: Vec::new(),
};

impl Eq for fp8_tensor::TensorScales {}

impl std::hash::Hash for fp8_tensor::TensorScales {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.source.hash(h);
        for x in self.k.iter().chain(&self.v) {
            x.to_bits().hash(h);
        }
    }
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
    /// E4M3 codes under a per-tensor f32 scale ([`fp8_tensor`]).
    Fp8Tensor,
}

impl KvDtype {
    pub const ALL: [KvDtype; 7] = [
        KvDtype::Bf16,
        KvDtype::Int8,
        KvDtype::Fp8,
        KvDtype::Nvfp4,
        KvDtype::K8v4,
        KvDtype::F32,
        KvDtype::Fp8Tensor(&DEFAULT_TENSOR_SCALES),
    ];

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
            KvDtype::Int8 => "int8",
            KvDtype::Fp8 => "fp8",
            KvDtype::Nvfp4 => "nvfp4",
            KvDtype::K8v4 => "k8v4",
            KvDtype::Fp8Tensor(_) => "fp8-tensor",
        }
    }

    /// The name as it appears in kernel entry points (a C identifier).
    pub fn ident(self) -> &'static str {
        match self {
            KvDtype::Fp8Tensor(_) => "fp8tensor",
            other => other.name(),
        }
    }

    /// `fp8-tensor` with `scales` (given once per process: they are kept for its lifetime).
    pub fn fp8_tensor_with(scales: fp8_tensor::TensorScales) -> KvDtype {
        KvDtype::Fp8Tensor(Box::leak(Box::new(scales)))
    }

    /// The per-layer scales of `fp8-tensor`, `None` for every other representation.
    pub fn tensor_scales(self) -> Option<&'static fp8_tensor::TensorScales> {
        match self {
            KvDtype::Fp8Tensor(s) => Some(s),
            _ => None,
        }
    }

    /// The f32 scale layer `layer`'s keys (`Stored` key) or values are divided by before
    /// conversion: `fp8-tensor`'s, 1.0 (unused) for every other representation.
    pub fn layer_scales(self, layer: usize) -> (f32, f32) {
        match self {
            KvDtype::Fp8Tensor(s) => (s.k(layer), s.v(layer)),
            _ => (1.0, 1.0),
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
            KvDtype::Fp8Tensor(_) => Elem::Fp8Tensor,
        }
    }

    pub fn value_elem(self) -> Elem {
        match self {
            KvDtype::F32 => Elem::F32,
            KvDtype::Bf16 => Elem::F16,
            KvDtype::Int8 => Elem::Int8,
            KvDtype::Fp8 => Elem::Fp8,
            KvDtype::Nvfp4 | KvDtype::K8v4 => Elem::Nvfp4,
            KvDtype::Fp8Tensor(_) => Elem::Fp8Tensor,
        }
    }

    /// Which stored tensors are rotated by the normalized Hadamard matrix before they are
    /// quantized, for vectors of `head_dim` values: keys in every quantized representation,
    /// values in those whose values are NVFP4; nothing when `head_dim` is not a power of two
    /// (NInfer defines its formats for 256 only; this project's rule for other sizes).
    pub fn rotation(self, head_dim: usize) -> Rotation {
        // vLLM's per-tensor FP8 rotates nothing.
        let quantized = !matches!(self, KvDtype::F32 | KvDtype::Bf16 | KvDtype::Fp8Tensor(_));
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
            KvDtype::Fp8Tensor(_) => "fp8-e4m3-tensor".into(),
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

    /// Replaces one key vector (one token, one KV head) of `layer` by what the cache gives
    /// back.
    pub fn roundtrip_k(self, layer: usize, x: &mut [f32]) {
        self.key_elem()
            .roundtrip_scaled(x, self.layer_scales(layer).0)
    }

    /// Replaces one value vector (one token, one KV head) of `layer` by what the cache
    /// gives back.
    pub fn roundtrip_v(self, layer: usize, x: &mut [f32]) {
        self.value_elem()
            .roundtrip_scaled(x, self.layer_scales(layer).1)
    }
}

impl Elem {
    /// Every element format.
    pub const ALL: [Elem; 7] = [
        Elem::F32,
        Elem::Bf16,
        Elem::F16,
        Elem::Int8,
        Elem::Fp8,
        Elem::Nvfp4,
        Elem::Fp8Tensor,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::Bf16 => "bf16",
            Elem::F16 => "f16",
            Elem::Int8 => "int8",
            Elem::Fp8 => "fp8",
            Elem::Nvfp4 => "nvfp4",
            Elem::Fp8Tensor => "fp8tensor",
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
            Elem::Fp8Tensor => fp8_tensor::bytes_per_vector(head_dim),
        }
    }

    /// Quantize then dequantize in place (no allocation); `fp8tensor` under scale 1.0.
    pub fn roundtrip(self, x: &mut [f32]) {
        self.roundtrip_scaled(x, 1.0)
    }

    /// [`Elem::roundtrip`] with `fp8tensor`'s per-tensor `scale` (ignored by the others,
    /// whose scales come from the vector itself).
    pub fn roundtrip_scaled(self, x: &mut [f32], scale: f32) {
        match self {
            Elem::Fp8Tensor => fp8_tensor::roundtrip(x, scale),
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
            Elem::Fp8Tensor => fp8_tensor::encode(x, 1.0),
        }
    }
}
