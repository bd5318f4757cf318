//! `nvfp4`: 4-bit e2m1 values in blocks of 16, an e4m3fn scale per block and an f32 global
//! scale per (token, KV head) vector.
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
//! # The vector format
//!
//! For a vector `x` of `n` values (n = head_dim, any `n >= 1`), split along its length into
//! blocks of 16 consecutive values; when `n` is not a multiple of 16 the last block is
//! partial (`n % 16` values) and is treated exactly like a full one (its amax is over the
//! values it has). All arithmetic is f32, each operation rounded to nearest even, nothing
//! flushed to zero, in this order:
//! 1. `amax = max |x_i|` (exact); `g = amax / 2688` (2688 = 6·448; one division).
//! 2. If `g == 0` (amax is 0 or `amax / 2688` underflows): every block scale byte is 0,
//!    every code is 0, every decoded value is `+0.0`.
//! 3. Otherwise `d6 = 6 * g` (one rounded product), and per block `b`:
//!    `amax_b = max |x_i|` over the block; `s_b = e4m3_from_f32(amax_b / d6)` (one division;
//!    round to nearest even, saturating at 448, see [`super::fp8`]). The quotient is at most
//!    448 up to rounding; `s_b` may be an e4m3 subnormal (kept) or 0.
//! 4. `S_b = e4m3_to_f32(s_b)`, `d_b = S_b * g` (one rounded product). If `d_b == 0` (S_b
//!    rounded to 0 because the block is tiny next to the vector's amax, or the product
//!    underflows), all codes of the block are 0. Otherwise `c_i = e2m1_from_f32(x_i / d_b)`
//!    (one division, not a reciprocal multiply); quotients past ±6 saturate. They exceed 6
//!    when `s_b` rounded down: by at most 6/16 when `S_b` is an e4m3 normal, by more when it
//!    is subnormal (step 2^-9), but the saturated value is then short of the input by at most
//!    `6·2^-10·g`. The error per block is at most `max(S_b·g, 6·2^-10·g)` (up to f32
//!    rounding), the first term being half the widest grid gap (4 to 6).
//! 5. Decoding: `x̂_i = (e2m1_to_f32(c_i) * S_b) * g`, left to right. The first product is
//!    exact (2 × 4 significant bits), so `x̂_i` is the exact product `e2m1·S_b·g` rounded
//!    once. The result is clamped to ±`f32::MAX` (the product overflows only when amax is
//!    within a few ulps of `f32::MAX`, `g` having rounded up). Code `0x8` decodes to `-0.0`.
//!
//! Stored layout per vector: `ceil(n/2)` payload bytes holding two codes each, element `2i` in
//! the low nibble and `2i+1` in the high nibble of byte `i` (for odd `n` the last high nibble is
//! 0); then `ceil(n/16)` e4m3fn block scale bytes in block order; then the f32 global scale
//! `g` (4 bytes, little endian in [`Encoded::to_bytes`]). [`bytes_per_vector`] =
//! `ceil(n/2) + ceil(n/16) + 4`.
//!
//! Inputs must be finite (the engine checks with [`super::find_non_finite`]); for non-finite
//! inputs the result is unspecified, but nothing panics.

use super::fp8::{e4m3_from_f32, e4m3_to_f32};
use super::{amax, clamp_finite};

/// Values per block.
pub const BLOCK: usize = 16;
/// Largest e2m1 magnitude.
pub const E2M1_MAX: f32 = 6.0;
/// `6 · 448`: the global scale divisor.
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

/// One vector as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct Encoded {
    /// Number of values.
    pub len: usize,
    /// `ceil(len/2)` bytes, element `2i` in the low nibble of byte `i`.
    pub packed: Vec<u8>,
    /// `ceil(len/16)` e4m3fn block scales.
    pub block_scales: Vec<u8>,
    /// The f32 global scale `g = amax / 2688`.
    pub global_scale: f32,
}

impl Encoded {
    /// The code of element `i` (a nibble).
    pub fn code(&self, i: usize) -> u8 {
        (self.packed[i / 2] >> ((i & 1) * 4)) & 0xF
    }

    /// The stored bytes: packed codes, block scales, then `g` (little endian).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(bytes_per_vector(self.len));
        v.extend_from_slice(&self.packed);
        v.extend_from_slice(&self.block_scales);
        v.extend_from_slice(&self.global_scale.to_le_bytes());
        v
    }
}

/// Bytes to store one vector of `n` values: packed nibbles + block scales + f32 global scale.
pub const fn bytes_per_vector(n: usize) -> usize {
    n.div_ceil(2) + n.div_ceil(BLOCK) + 4
}

/// Number of blocks for `n` values (the last one possibly partial).
pub const fn blocks(n: usize) -> usize {
    n.div_ceil(BLOCK)
}

/// The per-vector global scale `amax / 2688`.
#[inline]
pub fn global_scale_of(x: &[f32]) -> f32 {
    amax(x) / GLOBAL_DIVISOR
}

/// Block scale byte for a block with max magnitude `amax_b` under global scale `g`.
#[inline(always)]
fn block_scale(amax_b: f32, g: f32) -> u8 {
    if g != 0.0 {
        e4m3_from_f32(amax_b / (E2M1_MAX * g))
    } else {
        0
    }
}

/// Encodes one block: codes into `codes` (one per value, unpacked), returns the scale byte.
#[inline(always)]
fn encode_block(x: &[f32], g: f32, codes: &mut [u8; BLOCK]) -> u8 {
    let s = block_scale(amax(x), g);
    let d = e4m3_to_f32(s) * g;
    let nonzero = d != 0.0;
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = if nonzero { e2m1_from_f32(v / d) } else { 0 };
    }
    s
}

/// Encodes `x` into caller buffers: `packed` of `ceil(n/2)` bytes and `block_scales` of
/// `ceil(n/16)` bytes (shorter buffers get only what fits). Returns `g`.
pub fn encode_into(x: &[f32], packed: &mut [u8], block_scales: &mut [u8]) -> f32 {
    debug_assert_eq!(packed.len(), x.len().div_ceil(2));
    debug_assert_eq!(block_scales.len(), blocks(x.len()));
    let g = global_scale_of(x);
    for (b, (xb, sb)) in x.chunks(BLOCK).zip(block_scales.iter_mut()).enumerate() {
        // Unused entries of a partial last block stay 0 (the pad nibble of an odd length).
        let mut codes = [0u8; BLOCK];
        *sb = encode_block(xb, g, &mut codes);
        let out = packed.iter_mut().skip(b * BLOCK / 2).take(BLOCK / 2);
        for (p, pair) in out.zip(codes.chunks_exact(2)) {
            *p = pair[0] | (pair[1] << 4);
        }
    }
    g
}

/// Encodes one vector.
pub fn encode(x: &[f32]) -> Encoded {
    let n = x.len();
    let mut packed = vec![0u8; n.div_ceil(2)];
    let mut block_scales = vec![0u8; blocks(n)];
    let global_scale = encode_into(x, &mut packed, &mut block_scales);
    Encoded {
        len: n,
        packed,
        block_scales,
        global_scale,
    }
}

/// Decodes `n = out.len()` values from their packed codes, block scales and global scale.
pub fn decode_into(packed: &[u8], block_scales: &[u8], g: f32, out: &mut [f32]) {
    debug_assert_eq!(packed.len(), out.len().div_ceil(2));
    debug_assert_eq!(block_scales.len(), blocks(out.len()));
    for (b, (ob, &s)) in out.chunks_mut(BLOCK).zip(block_scales).enumerate() {
        let sv = e4m3_to_f32(s);
        let bytes = packed.iter().skip(b * BLOCK / 2);
        for (pair, &p) in ob.chunks_mut(2).zip(bytes) {
            pair[0] = clamp_finite((e2m1_to_f32(p) * sv) * g);
            if let Some(hi) = pair.get_mut(1) {
                *hi = clamp_finite((e2m1_to_f32(p >> 4) * sv) * g);
            }
        }
    }
}

/// Decodes one vector into `out` (`out.len() == e.len`).
pub fn decode(e: &Encoded, out: &mut [f32]) {
    decode_into(&e.packed, &e.block_scales, e.global_scale, out)
}

/// Encodes then decodes in place, without allocating; for finite input bit for bit
/// `decode(encode(x))`.
pub fn roundtrip(x: &mut [f32]) {
    let g = global_scale_of(x);
    let mut blocks = x.chunks_exact_mut(BLOCK);
    for xb in &mut blocks {
        // Fixed-length blocks let the compiler unroll and vectorize the element loop.
        if let Ok(xb) = <&mut [f32; BLOCK]>::try_from(xb) {
            roundtrip_block(xb, g);
        }
    }
    roundtrip_block(blocks.into_remainder(), g);
}

#[inline(always)]
fn roundtrip_block(xb: &mut [f32], g: f32) {
    if xb.is_empty() {
        return;
    }
    let sv = e4m3_to_f32(block_scale(amax(xb), g));
    let d = sv * g;
    if d != 0.0 {
        for v in xb.iter_mut() {
            *v = clamp_finite((e2m1_round(*v / d) * sv) * g);
        }
    } else {
        // What decoding all-zero codes gives.
        for v in xb.iter_mut() {
            *v = clamp_finite((0.0 * sv) * g);
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
        assert_eq!(e.global_scale, 0.0);
        assert_eq!(e.block_scales, vec![0, 0]);
        assert!(e.packed.iter().all(|&b| b == 0));
        roundtrip(&mut x);
        assert!(x.iter().all(|v| v.to_bits() == 0));
    }

    #[test]
    fn packing_order() {
        let x: Vec<f32> = [1.0f32, -2.0, 6.0].to_vec();
        let e = encode(&x);
        // amax 6: g = 6/2688, block scale 448 (0x7E); codes 2, 12, 7.
        assert_eq!(e.block_scales, vec![0x7E]);
        assert_eq!(e.packed, vec![2 | (12 << 4), 7]);
        assert_eq!(e.code(1), 12);
    }
}
