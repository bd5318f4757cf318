//! `int8` (NInfer's `Int8Group64`, reported as `int8-g64`): symmetric 8-bit integers with one
//! FP16 scale per 64 consecutive elements of a (token, KV head) vector.
//!
//! For a vector `x` of `n` values (n = head_dim), split into groups of 64 consecutive values
//! (a last partial group, when 64 does not divide `n`, is treated exactly like a full one):
//! - `amax = max |x_i|` over the group (exact).
//! - `scale = fp16(amax / 127)`: one f32 division, then rounded to FP16 (nearest even,
//!   subnormals kept). It is **not clamped**: a scale that rounds to 0 gives all-zero codes
//!   and decodes to `+0.0`; an amax above `127 · 65504` rounds the scale to infinity, which
//!   decodes to NaN (NInfer's behaviour), and the engine then stops with a non-finite error.
//! - Otherwise `q_i = clamp(round_half_even(x_i · r), -127, 127)` with `r = 1 / scale` as one
//!   f32 division and the product one f32 multiplication (a reciprocal multiply, as NInfer
//!   does). -128 is never produced.
//! - Decoding: `x̂_i = (q_i as f32) · scale`, one f32 multiplication.
//! - There is no negative zero: `-0.0` and small negatives that round to 0 decode to `+0.0`.
//!
//! Keys are rotated first ([`super::hadamard`]); that is the KV representation's business,
//! not this codec's.
//!
//! Stored layout per vector: `n` i8 codes, then `ceil(n/64)` FP16 scales (2 bytes each,
//! little endian in [`Encoded::to_bytes`]) — [`bytes_per_vector`] = `n + 2·ceil(n/64)`
//! (264 for head_dim 256, NInfer's size).
//!
//! Inputs must be finite (the engine checks with [`super::find_non_finite`]); for non-finite
//! inputs the result is unspecified, but nothing panics.

use super::amax;
use half::f16;

/// Largest code magnitude.
pub const QMAX: f32 = 127.0;
/// Values per scale group.
pub const GROUP: usize = 64;

/// One vector as stored: i8 codes and one FP16 scale per group.
#[derive(Clone, Debug, PartialEq)]
pub struct Encoded {
    pub codes: Vec<i8>,
    pub scales: Vec<f16>,
}

impl Encoded {
    /// The stored bytes: codes, then the scales (little endian).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(bytes_per_vector(self.codes.len()));
        v.extend(self.codes.iter().map(|&q| q as u8));
        for s in &self.scales {
            v.extend_from_slice(&s.to_le_bytes());
        }
        v
    }
}

/// Number of scale groups for `n` values.
pub const fn groups(n: usize) -> usize {
    n.div_ceil(GROUP)
}

/// Bytes to store one vector of `n` values: `n` codes + one FP16 scale per group.
pub const fn bytes_per_vector(n: usize) -> usize {
    n + 2 * groups(n)
}

/// A group's scale, `fp16(amax / 127)`.
#[inline]
pub fn scale_of(group: &[f32]) -> f16 {
    f16::from_f32(amax(group) / QMAX)
}

/// `clamp(round_half_even(v), -127, 127)` without a branch or a libm call: after the clamp
/// (which commutes with rounding, the bounds being integers) `v + 1.5·2^23` lies in
/// [2^23, 2^24), where the f32 spacing is 1, so the addition itself rounds to an integer,
/// ties to even; that integer is then read from the low mantissa bits.
#[inline(always)]
pub fn round_clamp(v: f32) -> i8 {
    let v = v.clamp(-QMAX, QMAX);
    let t = v + 12_582_912.0;
    (t.to_bits() as i32).wrapping_sub(0x4B40_0000) as i8
}

/// The codes of one group under `scale` (f32 value of the FP16 scale).
#[inline(always)]
fn quantize_group(x: &[f32], scale: f32, codes: &mut [i8]) {
    if scale == 0.0 {
        codes.iter_mut().for_each(|q| *q = 0);
        return;
    }
    let r = 1.0 / scale;
    for (q, &v) in codes.iter_mut().zip(x) {
        *q = round_clamp(v * r);
    }
}

/// Encodes one vector.
pub fn encode(x: &[f32]) -> Encoded {
    let mut codes = vec![0i8; x.len()];
    let mut scales = Vec::with_capacity(groups(x.len()));
    for (g, c) in x.chunks(GROUP).zip(codes.chunks_mut(GROUP)) {
        let s = scale_of(g);
        quantize_group(g, s.to_f32(), c);
        scales.push(s);
    }
    Encoded { codes, scales }
}

/// Decodes one vector into `out` (`out.len() == e.codes.len()`).
pub fn decode(e: &Encoded, out: &mut [f32]) {
    for ((o, q), s) in out
        .chunks_mut(GROUP)
        .zip(e.codes.chunks(GROUP))
        .zip(&e.scales)
    {
        let s = s.to_f32();
        for (o, &q) in o.iter_mut().zip(q) {
            *o = q as f32 * s;
        }
    }
}

/// Encodes then decodes in place, without allocating; bit for bit `decode(encode(x))`.
pub fn roundtrip(x: &mut [f32]) {
    for g in x.chunks_mut(GROUP) {
        let s = scale_of(g).to_f32();
        if s == 0.0 {
            g.iter_mut().for_each(|v| *v = 0.0);
            continue;
        }
        let r = 1.0 / s;
        for v in g.iter_mut() {
            *v = round_clamp(*v * r) as f32 * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_clamp_is_half_even() {
        for k in -300..=300 {
            let v = k as f32 * 0.5;
            let want = v.round_ties_even().clamp(-127.0, 127.0) as i8;
            assert_eq!(round_clamp(v), want, "{v}");
            for w in [
                f32::from_bits(v.to_bits() + 1),
                f32::from_bits(v.to_bits().wrapping_sub(1)),
            ] {
                if w.is_finite() {
                    assert_eq!(
                        round_clamp(w),
                        w.round_ties_even().clamp(-127.0, 127.0) as i8,
                        "{w}"
                    );
                }
            }
        }
        assert_eq!(round_clamp(f32::MAX), 127);
        assert_eq!(round_clamp(f32::MIN), -127);
        assert_eq!(round_clamp(-0.0), 0);
    }

    #[test]
    fn zero_vector() {
        let mut x = [0.0f32, -0.0, 0.0];
        assert_eq!(
            encode(&x),
            Encoded {
                codes: vec![0; 3],
                scales: vec![f16::ZERO]
            }
        );
        roundtrip(&mut x);
        assert!(x.iter().all(|v| v.to_bits() == 0));
    }

    /// Hand-computed: amax 127 gives scale 1 (exact), codes are the rounded values, ties to
    /// even; a second group of 64 has its own scale.
    #[test]
    fn groups_of_64_with_fp16_scales() {
        let mut x = vec![0.0f32; 130];
        x[0] = 127.0;
        x[1] = 2.5; // tie: 2
        x[2] = -3.5; // tie: -4
        x[64] = 0.5; // second group: amax 0.5, scale fp16(0.5/127)
        x[65] = 0.25;
        x[128] = 1e-9; // third (partial) group: the scale rounds to 0 in fp16
        let e = encode(&x);
        assert_eq!(e.scales.len(), 3);
        assert_eq!(e.scales[0], f16::ONE);
        assert_eq!(&e.codes[..3], &[127, 2, -4]);
        let s1 = f16::from_f32(0.5 / 127.0);
        assert_eq!(e.scales[1], s1);
        assert_ne!(s1.to_f32(), 0.5 / 127.0, "the scale is rounded to fp16");
        let r = 1.0 / s1.to_f32();
        assert_eq!(e.codes[64], (0.5 * r).round_ties_even() as i8);
        assert_eq!(e.codes[65], (0.25 * r).round_ties_even() as i8);
        assert_eq!(e.scales[2], f16::ZERO);
        assert_eq!(e.codes[128], 0);
        assert_eq!(e.to_bytes().len(), bytes_per_vector(130));
        assert_eq!(bytes_per_vector(256), 264);
        let mut y = x.clone();
        roundtrip(&mut y);
        let mut z = vec![0.0; 130];
        decode(&e, &mut z);
        assert_eq!(y, z);
        assert_eq!(y[64], e.codes[64] as f32 * s1.to_f32());
    }

    /// The scale is not clamped: past 127 · 65504 it is infinite and decodes to NaN, which the
    /// engine reports as a non-finite error.
    #[test]
    fn an_amax_past_the_fp16_range_decodes_to_nan() {
        let mut x = vec![1.0f32; 64];
        x[3] = 1e7;
        assert!(scale_of(&x).is_infinite());
        roundtrip(&mut x);
        assert!(x.iter().all(|v| v.is_nan()));
    }
}
