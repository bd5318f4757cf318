//! `int8`: symmetric 8-bit integers with one f32 scale per (token, KV head) vector.
//!
//! For a vector `x` of `n` values (n = head_dim):
//! - `amax = max |x_i|` (exact).
//! - `scale = amax / 127` as one f32 division (round to nearest even).
//! - If `scale == 0` (amax is 0, or amax is so small that `amax / 127` underflows to zero in
//!   f32): every code is 0 and every decoded value is `+0.0`.
//! - Otherwise `q_i = clamp(round_half_even(x_i / scale), -127, 127)`, the quotient being one
//!   f32 division (not a multiplication by a reciprocal). -128 is never produced. The clamp
//!   only acts when `x_i / scale` rounds past 127.5, which for finite inputs happens only
//!   when `scale` is an f32 subnormal (amax below about 1.5e-36).
//! - Decoding: `x̂_i = (q_i as f32) * scale`, one f32 multiplication, clamped to
//!   ±`f32::MAX` (the product overflows only when amax is within a few ulps of `f32::MAX`, the
//!   scale having rounded up).
//! - There is no negative zero: `-0.0` and small negatives that round to 0 decode to `+0.0`.
//! - f32 subnormal inputs and scales are used as they are (no flush to zero).
//!
//! Stored layout per vector: `n` i8 codes, then the f32 scale (4 bytes, little endian in
//! [`Encoded::to_bytes`]) — [`bytes_per_vector`] = `n + 4`.
//!
//! Inputs must be finite (the engine checks with [`super::find_non_finite`]); for non-finite
//! inputs the result is unspecified, but nothing panics.

use super::{amax, clamp_finite};

/// Largest code magnitude.
pub const QMAX: f32 = 127.0;

/// One vector as stored: i8 codes and the f32 scale.
#[derive(Clone, Debug, PartialEq)]
pub struct Encoded {
    pub codes: Vec<i8>,
    pub scale: f32,
}

impl Encoded {
    /// The stored bytes: codes, then the scale (little endian).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.codes.len() + 4);
        v.extend(self.codes.iter().map(|&q| q as u8));
        v.extend_from_slice(&self.scale.to_le_bytes());
        v
    }
}

/// Bytes to store one vector of `n` values: `n` codes + one f32 scale.
pub const fn bytes_per_vector(n: usize) -> usize {
    n + 4
}

/// The per-vector scale, `amax / 127` in f32.
#[inline]
pub fn scale_of(x: &[f32]) -> f32 {
    amax(x) / QMAX
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

#[inline(always)]
fn quantize(x: f32, scale: f32, nonzero: bool) -> i8 {
    if nonzero {
        round_clamp(x / scale)
    } else {
        0
    }
}

/// Encodes `x` into `codes` (same length; only the common prefix is written if they differ)
/// and returns the scale.
pub fn encode_into(x: &[f32], codes: &mut [i8]) -> f32 {
    debug_assert_eq!(x.len(), codes.len());
    let scale = scale_of(x);
    let nonzero = scale != 0.0;
    for (q, &v) in codes.iter_mut().zip(x) {
        *q = quantize(v, scale, nonzero);
    }
    scale
}

/// Encodes one vector.
pub fn encode(x: &[f32]) -> Encoded {
    let mut codes = vec![0i8; x.len()];
    let scale = encode_into(x, &mut codes);
    Encoded { codes, scale }
}

/// Decodes `codes` with `scale` into `out` (same length; only the common prefix is written if
/// they differ).
pub fn decode_into(codes: &[i8], scale: f32, out: &mut [f32]) {
    debug_assert_eq!(codes.len(), out.len());
    for (o, &q) in out.iter_mut().zip(codes) {
        *o = clamp_finite(q as f32 * scale);
    }
}

/// Decodes one vector into `out` (`out.len() == e.codes.len()`).
pub fn decode(e: &Encoded, out: &mut [f32]) {
    decode_into(&e.codes, e.scale, out)
}

/// Encodes then decodes in place, without allocating; bit for bit `decode(encode(x))`.
pub fn roundtrip(x: &mut [f32]) {
    let scale = scale_of(x);
    let nonzero = scale != 0.0;
    for v in x.iter_mut() {
        *v = clamp_finite(quantize(*v, scale, nonzero) as f32 * scale);
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
                scale: 0.0
            }
        );
        roundtrip(&mut x);
        assert!(x.iter().all(|v| v.to_bits() == 0));
    }
}
