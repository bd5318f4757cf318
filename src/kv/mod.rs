//! Main KV representations.
//!
//! A representation says how post-RoPE keys and values are stored in the KV cache. The
//! CPU code in this module is the specification: the CUDA path must store the same bits.
//! The engine applies [`KvDtype::roundtrip_k`] / [`KvDtype::roundtrip_v`] to every
//! (token, KV head) vector of `head_dim` values as it is written, and attention then reads
//! only the dequantized values, the current token's own included.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

pub mod bf16;

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

/// How one tensor (K or V) is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    F32,
    Bf16,
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
            KvDtype::Int8 | KvDtype::K8v4 => Elem::Int8,
            KvDtype::Fp8 => Elem::Fp8,
            KvDtype::Nvfp4 => Elem::Nvfp4,
        }
    }

    pub fn value_elem(self) -> Elem {
        match self {
            KvDtype::F32 => Elem::F32,
            KvDtype::Bf16 => Elem::Bf16,
            KvDtype::Int8 => Elem::Int8,
            KvDtype::Fp8 => Elem::Fp8,
            KvDtype::Nvfp4 | KvDtype::K8v4 => Elem::Nvfp4,
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
        num_kv_heads * (self.key_elem().bytes_per_vector(head_dim) + self.value_elem().bytes_per_vector(head_dim))
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
    pub fn check_head_dim(self, head_dim: usize) -> std::result::Result<(), String> {
        match self {
            Elem::F32 | Elem::Bf16 | Elem::Int8 | Elem::Fp8 => Ok(()),
            Elem::Nvfp4 => Err(format!("nvfp4 is not implemented yet (head_dim {head_dim})")),
        }
    }

    /// Bytes to store one vector of `head_dim` values, scales included.
    pub fn bytes_per_vector(self, head_dim: usize) -> usize {
        match self {
            Elem::F32 => 4 * head_dim,
            Elem::Bf16 => 2 * head_dim,
            Elem::Int8 | Elem::Fp8 => head_dim + 4,
            Elem::Nvfp4 => head_dim / 2 + head_dim.div_ceil(16) + 4,
        }
    }

    /// Quantize then dequantize in place.
    pub fn roundtrip(self, x: &mut [f32]) {
        match self {
            Elem::F32 => {}
            Elem::Bf16 => bf16::roundtrip(x),
            Elem::Int8 | Elem::Fp8 | Elem::Nvfp4 => {
                unimplemented!("KV format not implemented yet")
            }
        }
    }
}
