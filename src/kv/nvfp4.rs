//! `nvfp4`: 4-bit e2m1 values in blocks of 16 with one e4m3fn scale per block.
//!
//! # The e2m1 element format
//!
//! A nibble: sign (bit 3), 2-bit exponent, 1-bit mantissa. Codes 0..=7 are the magnitudes
//! `0, 0.5, 1, 1.5, 2, 3, 4, 6`; code | 8 is the negative. `0x8` is negative zero. There are
//! no infinities and no NaN. The mantissa bit is the lowest code bit, so "ties to even" means
//! ties go to the even code.
//!
//! [`e2m1_from_f32`] rounds to the nearest magnitude, ties to the even code, and saturates at
//! ±6; the sign is kept, also for results of zero:
//!
//! | magnitude `a` | code |
//! | --- | --- |
//! | `a <= 0.25` | 0 (0) |
//! | `0.25 < a < 0.75` | 1 (0.5) |
//! | `0.75 <= a <= 1.25` | 2 (1) |
//! | `1.25 < a < 1.75` | 3 (1.5) |
//! | `1.75 <= a <= 2.5` | 4 (2) |
//! | `2.5 < a < 3.5` | 5 (3) |
//! | `3.5 <= a <= 5` | 6 (4) |
//! | `5 < a` (infinity included) | 7 (6) |
//!
//! NaN gives code 0 with NaN's sign bit (unspecified input; no panic).
//!
//! # The vector format (NInfer's `Nvfp4Group16`)
//!
//! For a vector `x` of `n` values (n = head_dim, any `n >= 1`), split along its length into
//! blocks of 16 consecutive values; when `n` is not a multiple of 16 the last block is
//! partial and is treated exactly like a full one. There is **no global or per-vector
//! scale**, only one e4m3fn scale byte per block. Per block, in f32:
//! 1. `amax_b = max |x_i|` over the block (exact).
//! 2. If `amax_b == 0`: the scale byte is 0, every code is 0, every decoded value `+0.0`.
//! 3. Otherwise `s_b = e4m3_from_f32(clamp(amax_b / 6, 2^-9, 448))`: one division, clamped
//!    to the positive e4m3 range (2^-9 is its smallest subnormal), then rounded to e4m3
//!    (nearest even; see [`super::fp8`]). `S_b = e4m3_to_f32(s_b)` is never 0.
//! 4. `c_i = e2m1_from_f32(x_i / S_b)` (one division, not a reciprocal multiply); quotients
//!    past ±6 (the scale rounded down, or clamped at 448) saturate.
//! 5. Decoding: `x̂_i = e2m1_to_f32(c_i) · S_b`, exact (2 × 4 significant bits). Code `0x8`
//!    decodes to `-0.0`.
//!
//! Values are rotated first in `nvfp4` and `k8v4`, keys in every quantized representation
//! ([`super::hadamard`]); that is the KV representation's business, not this codec's.
//!
//! Stored layout per vector: `ceil(n/2)` payload bytes holding two codes each, element `2i` in
//! the low nibble and `2i+1` in the high nibble of byte `i` (for odd `n` the last high nibble is
//! 0); then `ceil(n/16)` e4m3fn block scale bytes in block order. [`bytes_per_vector`] =
//! `ceil(n/2) + ceil(n/16)` (144 for head_dim 256, NInfer's size).
//!
//! Inputs must be finite (the engine checks with [`super::find_non_finite`]); for non-finite
//! inputs the result is unspecified, but nothing panics.

use super::amax;
use super::fp8::{e4m3_from_f32, e4m3_to_f32};

/// Values per block.
pub const BLOCK: usize = 16;
/// Largest e2m1 magnitude.
pub const E2M1_MAX: f32 = 6.0;
/// `6 · 448`: the global scale divisor of NVFP4 *weights* (`quant::nvfp4`); KV blocks have none.
pub const GLOBAL_DIVISOR: f32 = 2688.0;

/// The value of every e2m1 code (low nibble).
pub static E2M1_TO_F32: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The value of an e2m1 code (only the low nibble is read).
#[inline(always)]
pub fn e2m1_to_f32(c: u8) -> f32 {
    E2M1_TO_F32[(c & 0xF) as usize]
}

/// f32 → e2m1 code: nearest, ties to the even code, saturating at ±6 (see the module docs).
/// Branch free: the magnitude code counts the decision thresholds passed, with `>` at
/// thresholds whose lower neighbour is even and `>=` where the upper one is.
#[inline(always)]
pub fn e2m1_from_f32(v: f32) -> u8 {
    let sign = ((v.to_bits() >> 28) & 8) as u8;
    let a = v.abs();
    let c = (a > 0.25) as u8
        + (a >= 0.75) as u8
        + (a > 1.25) as u8
        + (a >= 1.75) as u8
        + (a > 2.5) as u8
        + (a >= 3.5) as u8
        + (a > 5.0) as u8;
    sign | c
}

/// `e2m1_to_f32(e2m1_from_f32(v))` computed without the code (for the in-place round trip):
/// the grid steps 0.5, 0.5, 0.5, 0.5, 1, 1, 2 summed over the same thresholds, with the sign of
/// `v`. The sums are exact, so the values are the table's.
#[inline(always)]
pub fn e2m1_round(v: f32) -> f32 {
    let a = v.abs();
    let step = |c: bool, s: f32| if c { s } else { 0.0 };
    let m = step(a > 0.25, 0.5)
        + step(a >= 0.75, 0.5)
        + step(a > 1.25, 0.5)
        + step(a >= 1.75, 0.5)
        + step(a > 2.5, 1.0)
        + step(a >= 3.5, 1.0)
        + step(a > 5.0, 2.0);
    m.copysign(v)
}

/// Smallest block scale: the smallest positive e4m3fn value (a subnormal), 2^-9.
pub const SCALE_MIN: f32 = 1.0 / 512.0;

/// One vector as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct Encoded {
    /// Number of values.
    pub len: usize,
    /// `ceil(len/2)` bytes, element `2i` in the low nibble of byte `i`.
    pub packed: Vec<u8>,
    /// `ceil(len/16)` e4m3fn block scales.
    pub block_scales: Vec<u8>,
}

impl Encoded {
    /// The code of element `i` (a nibble).
    pub fn code(&self, i: usize) -> u8 {
        (self.packed[i / 2] >> ((i & 1) * 4)) & 0xF
    }

    /// The stored bytes: packed codes, then block scales.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(bytes_per_vector(self.len));
        v.extend_from_slice(&self.packed);
        v.extend_from_slice(&self.block_scales);
        v
    }
}

/// Bytes to store one vector of `n` values: packed nibbles + block scales.
pub const fn bytes_per_vector(n: usize) -> usize {
    n.div_ceil(2) + n.div_ceil(BLOCK)
}

/// Number of blocks for `n` values (the last one possibly partial).
pub const fn blocks(n: usize) -> usize {
    n.div_ceil(BLOCK)
}

/// The scale byte of a block whose largest magnitude is `amax_b`.
#[inline(always)]
pub fn block_scale(amax_b: f32) -> u8 {
    if amax_b == 0.0 {
        0
    } else {
        e4m3_from_f32((amax_b / E2M1_MAX).clamp(SCALE_MIN, 448.0))
    }
}

/// Encodes one vector.
pub fn encode(x: &[f32]) -> Encoded {
    let n = x.len();
    let mut packed = vec![0u8; n.div_ceil(2)];
    let mut block_scales = vec![0u8; blocks(n)];
    for (b, (xb, sb)) in x.chunks(BLOCK).zip(block_scales.iter_mut()).enumerate() {
        let s = block_scale(amax(xb));
        *sb = s;
        let d = e4m3_to_f32(s);
        // Unused entries of a partial last block stay 0 (the pad nibble of an odd length).
        let mut codes = [0u8; BLOCK];
        if s != 0 {
            for (c, &v) in codes.iter_mut().zip(xb) {
                *c = e2m1_from_f32(v / d);
            }
        }
        let out = packed.iter_mut().skip(b * BLOCK / 2).take(BLOCK / 2);
        for (p, pair) in out.zip(codes.chunks_exact(2)) {
            *p = pair[0] | (pair[1] << 4);
        }
    }
    Encoded {
        len: n,
        packed,
        block_scales,
    }
}

/// Decodes one vector into `out` (`out.len() == e.len`).
pub fn decode(e: &Encoded, out: &mut [f32]) {
    for (b, (ob, &s)) in out.chunks_mut(BLOCK).zip(&e.block_scales).enumerate() {
        let sv = e4m3_to_f32(s);
        let bytes = e.packed.iter().skip(b * BLOCK / 2);
        for (pair, &p) in ob.chunks_mut(2).zip(bytes) {
            pair[0] = e2m1_to_f32(p) * sv;
            if let Some(hi) = pair.get_mut(1) {
                *hi = e2m1_to_f32(p >> 4) * sv;
            }
        }
    }
}

/// Encodes then decodes in place, without allocating; for finite input bit for bit
/// `decode(encode(x))`.
pub fn roundtrip(x: &mut [f32]) {
    for xb in x.chunks_mut(BLOCK) {
        let s = block_scale(amax(xb));
        if s == 0 {
            xb.iter_mut().for_each(|v| *v = 0.0);
            continue;
        }
        let d = e4m3_to_f32(s);
        for v in xb.iter_mut() {
            *v = e2m1_round(*v / d) * d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_and_ties() {
        for c in 0..16u8 {
            assert_eq!(e2m1_from_f32(e2m1_to_f32(c)), c);
        }
        let ties = [
            (0.25, 0),
            (0.75, 2),
            (1.25, 2),
            (1.75, 4),
            (2.5, 4),
            (3.5, 6),
            (5.0, 6),
        ];
        for (t, c) in ties {
            assert_eq!(e2m1_from_f32(t), c, "{t}");
            assert_eq!(e2m1_from_f32(-t), c | 8, "-{t}");
        }
        assert_eq!(e2m1_from_f32(7.0), 7);
        assert_eq!(e2m1_from_f32(f32::INFINITY), 7);
        assert_eq!(e2m1_from_f32(-1e30), 15);
        assert_eq!(e2m1_from_f32(-0.0), 8);
        assert_eq!(e2m1_from_f32(-0.1), 8);
    }

    #[test]
    fn round_matches_codes() {
        let mut v = 0.0f32;
        while v < 8.0 {
            for w in [
                v,
                -v,
                f32::from_bits(v.to_bits() + 1),
                -f32::from_bits(v.to_bits() + 1),
            ] {
                assert_eq!(
                    e2m1_round(w).to_bits(),
                    e2m1_to_f32(e2m1_from_f32(w)).to_bits(),
                    "{w}"
                );
            }
            v += 1.0 / 64.0;
        }
        for w in [
            f32::INFINITY,
            f32::MAX,
            1e-40,
            -1e-40,
            f32::from_bits(0x3E80_0001),
        ] {
            assert_eq!(
                e2m1_round(w).to_bits(),
                e2m1_to_f32(e2m1_from_f32(w)).to_bits(),
                "{w}"
            );
        }
    }

    #[test]
    fn zero_vector() {
        let mut x = [0.0f32; 24];
        x[3] = -0.0;
        let e = encode(&x);
        assert_eq!(e.block_scales, vec![0, 0]);
        assert!(e.packed.iter().all(|&b| b == 0));
        roundtrip(&mut x);
        assert!(x.iter().all(|v| v.to_bits() == 0));
    }

    /// Hand-computed: a block with amax 6 has scale 1 (`0x38`), codes are the e2m1 values;
    /// each block of 16 has its own scale; no global scale.
    #[test]
    fn packing_order_and_block_scales() {
        let mut x = vec![0.0f32; 19];
        x[0] = 1.0;
        x[1] = -2.0;
        x[2] = 6.0;
        x[16] = 0.75; // second block: amax 0.75, scale e4m3(0.125) = 0x20
        x[17] = -0.375;
        let e = encode(&x);
        assert_eq!(e.block_scales, vec![0x38, 0x20]);
        assert_eq!(&e.packed[..2], &[2 | (12 << 4), 7]);
        assert_eq!(e.code(1), 12);
        // 0.75 / 0.125 = 6 (code 7); -0.375 / 0.125 = -3 (code 13).
        assert_eq!(e.packed[8], 7 | (13 << 4));
        assert_eq!(e.to_bytes().len(), bytes_per_vector(19));
        assert_eq!(bytes_per_vector(256), 144);
        let mut y = x.clone();
        roundtrip(&mut y);
        assert_eq!(y, x, "every value is on its block's grid");
    }

    /// The block scale is clamped to [2^-9, 448] before rounding; a block beyond 6 · 448
    /// saturates its codes at ±6 · 448.
    #[test]
    fn block_scales_clamp_at_both_ends() {
        assert_eq!(block_scale(1e-30), 0x01, "2^-9");
        assert_eq!(block_scale(1e9), 0x7E, "448");
        let mut x = [1e9f32, -5.0];
        roundtrip(&mut x);
        assert_eq!(x, [2688.0, -0.0]);
        // Ties to even on the e2m1 grid under scale 1: 2.5 -> 2, 3.5 -> 4.
        let mut t = [6.0f32, 2.5, 3.5, 0.25];
        roundtrip(&mut t);
        assert_eq!(t, [6.0, 2.0, 4.0, 0.0]);
    }
}
