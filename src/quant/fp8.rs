//! fp8 weights: e4m3fn codes with f32 scales per tensor, per output channel, or per
//! 128 × 128 block, `W[r, c] = e4m3(q[r, c]) · s` with `s` the scale that covers `(r, c)`.
//!
//! The quantizer is transformers' fine-grained FP8 (the Qwen `*-FP8` and DeepSeek layout):
//! per 128 × 128 tile `amax` (1 where it is 0), `s = 448 / amax` evaluated as PyTorch does
//! (`reciprocal(amax) · 448`, two roundings), `q = e4m3(clamp(w · s, ±448))`, stored scale
//! `1 / s` (a multiplier despite its checkpoint name `weight_scale_inv`).

use crate::kv::fp8::{e4m3_from_f32, e4m3_to_f32, E4M3_MAX};
use anyhow::{bail, Result};

/// Rows and columns of one scale block.
pub const BLOCK: usize = 128;

/// How an fp8 matrix is scaled.
#[derive(Clone, Debug, PartialEq)]
pub enum Fp8Scale {
    Tensor(f32),
    /// `[rows]`
    Channel(Vec<f32>),
    /// `[ceil(rows/128), ceil(cols/128)]`
    Block(Vec<f32>),
}

impl Fp8Scale {
    pub fn values(&self) -> &[f32] {
        match self {
            Fp8Scale::Tensor(s) => std::slice::from_ref(s),
            Fp8Scale::Channel(v) | Fp8Scale::Block(v) => v,
        }
    }
}

/// One fp8 matrix `[rows, cols]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Tensor {
    pub rows: usize,
    pub cols: usize,
    /// `[rows, cols]` e4m3fn bytes.
    pub codes: Vec<u8>,
    pub scale: Fp8Scale,
}

impl Fp8Tensor {
    /// Checks the parts' sizes and values.
    pub fn validate(&self) -> Result<()> {
        validate(self.rows, self.cols, &self.codes, &self.scale)
    }

    /// The exact-product f32 values, row-major (one rounding of `e4m3 · s`).
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        self.validate()?;
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, row) in out.chunks_mut(self.cols.max(1)).enumerate() {
            decode_row(&self.codes, &self.scale, self.cols, r, row);
        }
        Ok(out)
    }
}

/// Checks an fp8 matrix `[rows, cols]` given as its codes and scale: sizes, finite scales, no
/// NaN code.
pub fn validate(rows: usize, cols: usize, codes: &[u8], scale: &Fp8Scale) -> Result<()> {
    let (r, c) = (rows, cols);
    if codes.len() != r * c {
        bail!("{} fp8 codes do not fit [{r}, {c}]", codes.len());
    }
    let want = match scale {
        Fp8Scale::Tensor(_) => 1,
        Fp8Scale::Channel(_) => r,
        Fp8Scale::Block(_) => r.div_ceil(BLOCK) * c.div_ceil(BLOCK),
    };
    if scale.values().len() != want {
        bail!(
            "{} fp8 scales for [{r}, {c}], want {want}",
            scale.values().len()
        );
    }
    if let Some(s) = scale.values().iter().find(|s| !s.is_finite()) {
        bail!("an fp8 scale is {s}; scales must be finite");
    }
    // The largest code, 448, times the scale must stay finite: a finite scale past
    // f32::MAX / 448 would dequantize to infinities.
    if let Some(s) = scale.values().iter().find(|s| !(448.0 * **s).is_finite()) {
        bail!("an fp8 scale is {s:e}; 448 times it overflows f32 (the weights would be infinite)");
    }
    if let Some(i) = codes.iter().position(|&b| b & 0x7F == 0x7F) {
        bail!("fp8 code {i} is an e4m3 NaN code (0x{:02X})", codes[i]);
    }
    Ok(())
}

/// Row `r` of a validated fp8 matrix with `cols` columns (`codes` all its e4m3 bytes), decoded
/// into `out` (`cols` values): `e4m3(q) · s` with the scale that covers each element, one
/// rounding. The values [`Fp8Tensor::dequantize`] gives, a row at a time (what the CPU's GEMM
/// packs its panels from).
pub fn decode_row(codes: &[u8], scale: &Fp8Scale, cols: usize, r: usize, out: &mut [f32]) {
    let row = &codes[r * cols..(r + 1) * cols];
    match scale {
        Fp8Scale::Tensor(s) => {
            for (o, &q) in out.iter_mut().zip(row) {
                *o = e4m3_to_f32(q) * s;
            }
        }
        Fp8Scale::Channel(v) => {
            let s = v[r];
            for (o, &q) in out.iter_mut().zip(row) {
                *o = e4m3_to_f32(q) * s;
            }
        }
        Fp8Scale::Block(v) => {
            let scales = &v[(r / BLOCK) * cols.div_ceil(BLOCK)..];
            for (c, (o, &q)) in out.iter_mut().zip(row).enumerate() {
                *o = e4m3_to_f32(q) * scales[c / BLOCK];
            }
        }
    }
}

/// transformers' fine-grained FP8 of a `[rows, cols]` matrix (see the module docs).
pub fn quantize_block(w: &[f32], rows: usize, cols: usize) -> Fp8Tensor {
    let (br, bc) = (rows.div_ceil(BLOCK), cols.div_ceil(BLOCK));
    let mut scales = Vec::with_capacity(br * bc);
    let mut codes = vec![0u8; rows * cols];
    for bi in 0..br {
        for bj in 0..bc {
            let (r0, r1) = (bi * BLOCK, ((bi + 1) * BLOCK).min(rows));
            let (c0, c1) = (bj * BLOCK, ((bj + 1) * BLOCK).min(cols));
            let mut amax = 0.0f32;
            for r in r0..r1 {
                for &v in &w[r * cols + c0..r * cols + c1] {
                    amax = amax.max(v.abs());
                }
            }
            let amax = if amax == 0.0 { 1.0 } else { amax };
            let s = (1.0 / amax) * E4M3_MAX;
            for r in r0..r1 {
                for c in c0..c1 {
                    codes[r * cols + c] =
                        e4m3_from_f32((w[r * cols + c] * s).clamp(-E4M3_MAX, E4M3_MAX));
                }
            }
            scales.push(1.0 / s);
        }
    }
    Fp8Tensor {
        rows,
        cols,
        codes,
        scale: Fp8Scale::Block(scales),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_partial_edges_and_round_trip_closely() {
        let (rows, cols) = (130, 200);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| {
                (((i * 7919) % 2001) as f32 / 1000.0 - 1.0) * if i % 97 == 0 { 40.0 } else { 1.0 }
            })
            .collect();
        let t = quantize_block(&w, rows, cols);
        assert_eq!(t.scale.values().len(), 2 * 2);
        let back = t.dequantize().unwrap();
        for (a, b) in w.iter().zip(&back) {
            // e4m3 keeps 3 mantissa bits: relative error at most 1/16 (plus the subnormals).
            assert!((a - b).abs() <= a.abs() / 16.0 + 1e-2, "{a} vs {b}");
        }
        // A block's largest value is exactly representable: it maps to ±448.
        let m = w.iter().take(128).fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(m > 0.0);
    }

    #[test]
    fn bad_parts_are_refused_with_the_reason() {
        let t = quantize_block(&[0.5f32; 256], 2, 128);
        let mut nan = t.clone();
        nan.codes[3] = 0xFF;
        assert!(nan
            .dequantize()
            .unwrap_err()
            .to_string()
            .contains("NaN code"));
        let mut inf = t.clone();
        inf.scale = Fp8Scale::Block(vec![f32::INFINITY]);
        assert!(inf
            .dequantize()
            .unwrap_err()
            .to_string()
            .contains("must be finite"));
        let mut huge = t.clone();
        huge.scale = Fp8Scale::Block(vec![1e36]);
        assert!(huge
            .dequantize()
            .unwrap_err()
            .to_string()
            .contains("448 times it overflows"));
        let mut chan = t.clone();
        chan.scale = Fp8Scale::Channel(vec![1.0]);
        assert!(chan
            .dequantize()
            .unwrap_err()
            .to_string()
            .contains("want 2"));
    }
}
