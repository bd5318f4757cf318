//! nvfp4 weights: e2m1 values in blocks of 16 along the input dimension, one e4m3 scale per
//! block and one f32 global scale per tensor.
//!
//! Stored (per matrix `[O, I]`, `I` a multiple of 16): the codes packed two per byte, the even
//! column in the low nibble (`[O, I/2]` u8), the block scales (`[O, I/16]` e4m3fn bytes) and
//! the global scale, in one of the two conventions checkpoints use:
//! `W = e2m1 · e4m3(scale) · g` (ModelOpt's `weight_scale_2`) or `W = e2m1 · e4m3(scale) / g'`
//! (compressed-tensors' inverted `weight_global_scale`, `g' = 2688 / amax`). The product
//! `e2m1 · e4m3` is exact in f32, so either is one rounding of the exact value.
//!
//! The quantizer follows ModelOpt's default ("max" calibration) rules, which give its exported
//! bytes: linears that read the same input share one global amax; `g = amax / 2688` (f32
//! division); per block `ps = block_amax / (6·g)`, 1 where it is 0, block scale
//! `e4m3_rne(clamp(ps, 2^-9, 448))`; then `y = w / (e4m3(block scale)·g)` rounded to the e2m1
//! grid (nearest, ties to the even code, saturating at 6), the sign from `y < 0`.

use crate::kv::fp8::{e4m3_from_f32, e4m3_to_f32};
use crate::kv::nvfp4::{e2m1_from_f32, e2m1_to_f32, GLOBAL_DIVISOR};
use anyhow::{bail, Result};

/// Values per block scale.
pub const BLOCK: usize = 16;

/// The global scale and how it applies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Global {
    /// `W = e2m1 · e4m3(block scale) · g` (ModelOpt `weight_scale_2`; the packer's).
    Multiply(f32),
    /// `W = e2m1 · e4m3(block scale) / g` (compressed-tensors `weight_global_scale`).
    Divide(f32),
}

impl Global {
    pub fn value(self) -> f32 {
        match self {
            Global::Multiply(g) | Global::Divide(g) => g,
        }
    }
}

/// One nvfp4 matrix `[rows, cols]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Nvfp4Tensor {
    pub rows: usize,
    pub cols: usize,
    /// `[rows, cols/2]`: column `2i` in the low nibble of byte `i`.
    pub packed: Vec<u8>,
    /// `[rows, cols/16]` e4m3fn bytes.
    pub block_scales: Vec<u8>,
    pub global: Global,
}

impl Nvfp4Tensor {
    /// Checks the parts' sizes and the scales' values; errors say what is wrong.
    pub fn validate(&self) -> Result<()> {
        validate(
            self.rows,
            self.cols,
            &self.packed,
            &self.block_scales,
            self.global,
        )
    }

    /// The exact f32 values, row-major.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        self.validate()?;
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, row) in out.chunks_mut(self.cols.max(1)).enumerate() {
            decode_row(
                &self.packed,
                &self.block_scales,
                self.global,
                self.cols,
                r,
                row,
            );
        }
        Ok(out)
    }
}

/// Checks an nvfp4 matrix `[rows, cols]` given as its parts: sizes, no NaN block scale, a
/// positive finite global scale.
pub fn validate(
    rows: usize,
    cols: usize,
    packed: &[u8],
    block_scales: &[u8],
    global: Global,
) -> Result<()> {
    let (r, c) = (rows, cols);
    if !c.is_multiple_of(BLOCK) {
        bail!("nvfp4 needs the input dimension ({c}) to be a multiple of {BLOCK}");
    }
    if packed.len() != r * c / 2 || block_scales.len() != r * c / BLOCK {
        bail!(
            "nvfp4 parts do not fit [{r}, {c}]: {} packed bytes (want {}), {} block scales (want {})",
            packed.len(),
            r * c / 2,
            block_scales.len(),
            r * c / BLOCK
        );
    }
    if let Some(i) = block_scales.iter().position(|&b| b & 0x7F == 0x7F) {
        bail!(
            "block scale {i} is an e4m3 NaN code (0x{:02X})",
            block_scales[i]
        );
    }
    let g = global.value();
    if !(g.is_finite() && g > 0.0) {
        bail!("the global scale is {g}; it must be a positive finite number");
    }
    // The largest block value, 6 · 448 = 2688, through the global scale must stay finite.
    let largest = match global {
        Global::Multiply(g) => 2688.0 * g,
        Global::Divide(g) => 2688.0 / g,
    };
    if !largest.is_finite() {
        bail!("the global scale is {g:e}; the largest weight it gives (6 · 448 through it) overflows f32");
    }
    Ok(())
}

/// Row `r` of a validated nvfp4 matrix with `cols` columns, decoded into `out` (`cols`
/// values): `e2m1 · e4m3(block scale)` (exact), times or divided by the global scale (one
/// rounding). The values [`Nvfp4Tensor::dequantize`] gives, a row at a time.
pub fn decode_row(
    packed: &[u8],
    block_scales: &[u8],
    global: Global,
    cols: usize,
    r: usize,
    out: &mut [f32],
) {
    let codes = &packed[r * cols / 2..(r + 1) * cols / 2];
    let scales = &block_scales[r * cols / BLOCK..(r + 1) * cols / BLOCK];
    for (i, (&byte, pair)) in codes.iter().zip(out.chunks_exact_mut(2)).enumerate() {
        // Byte i holds columns 2i and 2i + 1 (cols is even).
        let s = e4m3_to_f32(scales[2 * i / BLOCK]);
        for (o, code) in pair.iter_mut().zip([byte & 0xF, byte >> 4]) {
            let v = e2m1_to_f32(code) * s; // exact
            *o = match global {
                Global::Multiply(g) => v * g,
                Global::Divide(g) => v / g,
            };
        }
    }
}

/// The e2m1 code of `y`: the KV codec's rounding (nearest, ties to the even code, saturating),
/// with ModelOpt's sign rule, `y < 0`: a `-0.0` weight gets code 0, not 8.
fn e2m1_code(y: f32) -> u8 {
    let magnitude = e2m1_from_f32(y) & 7;
    magnitude | (((y < 0.0) as u8) << 3)
}

/// Quantizes matrices that read the same input (q/k/v, gate/up, a Gated DeltaNet's q|k|v and
/// z) with one shared global scale, each `[rows_i, cols]` row-major.
pub fn quantize_group(parts: &[&[f32]], cols: usize) -> Vec<Nvfp4Tensor> {
    assert!(cols.is_multiple_of(BLOCK), "checked by the caller");
    let amax = parts
        .iter()
        .flat_map(|p| p.iter())
        .fold(0.0f32, |m, v| m.max(v.abs()));
    // An all-zero group has no scale to take: 1 (every block scale is then 1, every code 0).
    let g = if amax > 0.0 {
        amax / GLOBAL_DIVISOR
    } else {
        1.0
    };
    parts
        .iter()
        .map(|w| {
            let rows = w.len() / cols;
            let mut packed = vec![0u8; w.len() / 2];
            let mut block_scales = Vec::with_capacity(w.len() / BLOCK);
            for (b, block) in w.chunks(BLOCK).enumerate() {
                let bamax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let ps = bamax / (6.0 * g);
                let ps = if ps == 0.0 { 1.0 } else { ps };
                let bs = e4m3_from_f32(ps.clamp(1.0 / 512.0, 448.0));
                block_scales.push(bs);
                let denom = e4m3_to_f32(bs) * g;
                for (j, &v) in block.iter().enumerate() {
                    let code = e2m1_code(v / denom);
                    let i = b * BLOCK + j;
                    packed[i / 2] |= code << (4 * (i % 2));
                }
            }
            Nvfp4Tensor {
                rows,
                cols,
                packed,
                block_scales,
                global: Global::Multiply(g),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sign_follows_modelopt() {
        // `y < 0` decides: -0.0 is code 0 (the KV codec keeps the sign bit: 8); a negative
        // that rounds to zero keeps its sign.
        let codes: Vec<u8> = [-0.0, 0.0, -0.1, -0.25, 0.25, 2.5, -2.6, -7.0, 1.25]
            .iter()
            .map(|&y| e2m1_code(y))
            .collect();
        assert_eq!(codes, [0, 0, 8, 8, 0, 4, 13, 15, 2]);
        assert_eq!(e2m1_from_f32(-0.0), 8);
    }

    #[test]
    fn a_hand_quantized_block() {
        // One block of 16, amax 6 → g = 6/2688; block amax 6 → ps = 6/(6g) = 448 → scale 448.
        let w: Vec<f32> = [
            6.0, -6.0, 0.0, -0.0, 1.0, -1.0, 0.3, 0.2, 2.6, 3.4, 3.5, 5.1, 4.9, 0.76, 0.75, -2.5,
        ]
        .to_vec();
        let t = &quantize_group(&[&w], 16)[0];
        assert_eq!(t.block_scales, vec![e4m3_from_f32(448.0)]);
        assert_eq!(t.global, Global::Multiply(6.0 / 2688.0));
        // y = w / (448 · 6/2688) = w: codes by the thresholds (ties to the even code).
        let codes: Vec<u8> = t.packed.iter().flat_map(|b| [b & 0xF, b >> 4]).collect();
        assert_eq!(
            codes,
            vec![7, 15, 0, 0, 2, 10, 1, 0, 5, 5, 6, 7, 6, 2, 2, 12]
        );
        let back = t.dequantize().unwrap();
        let want = [
            6.0, -6.0, 0.0, 0.0, 1.0, -1.0, 0.5, 0.0, 3.0, 3.0, 4.0, 6.0, 4.0, 1.0, 1.0, -2.0,
        ];
        for (a, b) in back.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{back:?}");
        }
    }

    #[test]
    fn groups_share_one_global_scale_and_conventions_agree() {
        let a: Vec<f32> = (0..64).map(|i| (i as f32 - 30.0) * 0.01).collect();
        let b: Vec<f32> = (0..32).map(|i| (i as f32) * 0.1).collect(); // the larger amax
        let ts = quantize_group(&[&a, &b], 16);
        assert_eq!(ts[0].global, ts[1].global);
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_eq!(ts[0].global.value(), amax / 2688.0);
        // The inverted convention with g' = 1/g gives nearly the same values.
        let mut inv = ts[0].clone();
        inv.global = Global::Divide(1.0 / ts[0].global.value());
        let (x, y) = (ts[0].dequantize().unwrap(), inv.dequantize().unwrap());
        assert!(x
            .iter()
            .zip(&y)
            .all(|(p, q)| (p - q).abs() <= 1e-6 * p.abs().max(1e-6)));
    }

    #[test]
    fn bad_parts_are_refused_with_the_reason() {
        let t = &quantize_group(&[&[0.5f32; 32]], 16)[0];
        let mut nan = t.clone();
        nan.block_scales[1] = 0x7F;
        assert!(nan
            .dequantize()
            .unwrap_err()
            .to_string()
            .contains("NaN code"));
        let mut zero = t.clone();
        zero.global = Global::Multiply(0.0);
        assert!(zero
            .dequantize()
            .unwrap_err()
            .to_string()
            .contains("global scale is 0"));
        for g in [Global::Multiply(1e36), Global::Divide(1e-36)] {
            let mut huge = t.clone();
            huge.global = g;
            assert!(huge
                .dequantize()
                .unwrap_err()
                .to_string()
                .contains("overflows f32"));
        }
        let mut short = t.clone();
        short.packed.pop();
        assert!(short
            .dequantize()
            .unwrap_err()
            .to_string()
            .contains("do not fit"));
    }
}
