//! `fp8`: OCP FP8 E4M3 ("e4m3fn") codes with one FP16 scale per (token, KV head) vector.
//!
//! # The e4m3fn element format
//!
//! One byte: sign (bit 7), a 4-bit exponent field `e` with bias 7 (bits 6..3) and a 3-bit
//! mantissa `m` (bits 2..0).
//! - `e == 0`: subnormal, value `m · 2^-9` (smallest positive 2^-9, largest 7·2^-9).
//! - `e in 1..=15`: normal, value `(1 + m/8) · 2^(e-7)`, except `e == 15, m == 7`.
//! - `0x7F` / `0xFF`: NaN. There are no infinities. The largest finite value is
//!   `0x7E` = 448.
//! - `0x80` is negative zero.
//!
//! [`e4m3_from_f32`] converts an f32 to the nearest e4m3fn value, ties to the even mantissa,
//! in one rounding step from the exact f32 value (no double rounding), keeping the sign:
//! - magnitudes `>= 448` (infinity included) saturate to ±448 (`0x7E` | sign), so the result is
//!   never NaN for a non-NaN input;
//! - magnitudes below 2^-6 round onto the subnormal grid of step 2^-9 (ties to even, so
//!   2^-10 goes to ±0 and 3·2^-10 to ±2·2^-9); a value that rounds up to 8·2^-9 becomes the
//!   smallest normal `0x08`;
//! - anything that rounds to zero keeps its sign: `-0.0` and tiny negatives give `0x80`;
//! - f32 subnormal inputs are used as they are (no flush to zero anywhere);
//! - NaN gives `0x7F` | sign.
//!
//! [`e4m3_to_f32`] is exact (every e4m3fn value is an f32).
//!
//! # The vector format (NInfer's `Fp8E4M3Row256`, reported as `fp8-e4m3-r<head_dim>`)
//!
//! For a vector `x` of `n` values (n = head_dim; the whole row shares one scale):
//! - `amax = max |x_i|` (exact).
//! - If `amax == 0`: the scale is FP16 `+0`, every code is `0x00`, every decoded value `+0.0`.
//! - Otherwise `scale = fp16(clamp(amax / 448, 2^-24, 65504))`: one f32 division, clamped to
//!   the positive finite FP16 range, then rounded to FP16 (nearest even).
//! - `q_i = e4m3_from_f32(x_i · r)` with `r = 1 / scale` one f32 division and the product one
//!   f32 multiplication; `|x_i · r|` can pass 448 (the scale rounded down, or clamped): it
//!   then saturates to ±448.
//! - Decoding: `x̂_i = e4m3_to_f32(q_i) · scale`, one f32 multiplication (never overflows:
//!   448 · 65504 is finite). A `0x80` code decodes to `-0.0`.
//!
//! Keys are rotated first ([`super::hadamard`]); that is the KV representation's business.
//!
//! Stored layout per vector: `n` code bytes, then the FP16 scale (2 bytes, little endian in
//! [`Encoded::to_bytes`]) — [`bytes_per_vector`] = `n + 2` (258 for head_dim 256).
//!
//! Inputs must be finite (the engine checks with [`super::find_non_finite`]); for non-finite
//! inputs the result is unspecified, but nothing panics.

use super::amax;
use half::f16;

/// Largest finite e4m3fn value.
pub const E4M3_MAX: f32 = 448.0;

/// The f32 value of every e4m3fn byte (NaN for `0x7F` and `0xFF`).
pub static E4M3_TO_F32: [f32; 256] = build_e4m3_table();

const fn build_e4m3_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut b = 0usize;
    while b < 256 {
        let sign = ((b as u32) & 0x80) << 24;
        let e = ((b >> 3) & 0xF) as u32;
        let m = (b & 7) as u32;
        let bits = if e == 15 && m == 7 {
            0x7FC0_0000
        } else if e == 0 {
            // m · 2^-9, exact: the f32 of the integer m scaled by a power of two.
            if m == 0 {
                0
            } else {
                // Normalise m = 2^k · (1 + f): k = floor(log2 m).
                let k = 31 - m.leading_zeros();
                let frac = (m << (23 - k)) & 0x7F_FFFF;
                ((127 + k - 9) << 23) | frac
            }
        } else {
            // (1 + m/8) · 2^(e-7): f32 exponent field e - 7 + 127.
            ((e + 120) << 23) | (m << 20)
        };
        t[b] = f32::from_bits(sign | bits);
        b += 1;
    }
    t
}

/// The exact value of an e4m3fn byte.
#[inline(always)]
pub fn e4m3_to_f32(b: u8) -> f32 {
    E4M3_TO_F32[b as usize]
}

/// f32 → e4m3fn: round to nearest, ties to even, saturating to ±448 (see the module docs).
#[inline(always)]
pub fn e4m3_from_f32(v: f32) -> u8 {
    let bits = v.to_bits();
    let sign = (bits >> 24) & 0x80;
    let abs = bits & 0x7FFF_FFFF;
    // Normal range [2^-6, 448): keep 3 of the 23 mantissa bits, rounding to nearest even by
    // adding 0x7FFFF plus the lowest kept bit; a carry correctly bumps the exponent. Then
    // rebias the exponent from 127 to 7 (120 << 3 = 960).
    let normal = (abs.wrapping_add(0x7_FFFF + ((abs >> 20) & 1)) >> 20).wrapping_sub(960);
    // Subnormal range [0, 2^-6): a · 2^9 is exact (a power-of-two scaling up), and adding 2^23
    // rounds it to an integer (ties to even) in one step; that integer 0..=8 is the code.
    let t = f32::from_bits(abs) * 512.0 + 8_388_608.0;
    let sub = t.to_bits().wrapping_sub(0x4B00_0000);
    let mag = if abs >= 0x43E0_0000 {
        // >= 448.0, infinity included: saturate.
        0x7E
    } else if abs < 0x3C80_0000 {
        // < 2^-6
        sub
    } else {
        normal
    };
    let mag = if abs > 0x7F80_0000 { 0x7F } else { mag };
    (sign | mag) as u8
}

/// `e4m3_to_f32(e4m3_from_f32(v))` for any non-NaN `v`, computed without the code (for the
/// in-place round trip): the same rounding, applied to the f32 bits directly.
#[inline(always)]
pub fn e4m3_round(v: f32) -> f32 {
    let bits = v.to_bits();
    let sign = bits & 0x8000_0000;
    let abs = bits & 0x7FFF_FFFF;
    // Normal range: round the mantissa to 3 bits (nearest even) and clear the rest.
    let normal = f32::from_bits(abs.wrapping_add(0x7_FFFF + ((abs >> 20) & 1)) & 0xFFF0_0000);
    // Subnormal range: round a · 2^9 to an integer, scale back (both steps exact but the one).
    let a = f32::from_bits(abs);
    let sub = ((a * 512.0 + 8_388_608.0) - 8_388_608.0) * (1.0 / 512.0);
    let r = if abs < 0x3C80_0000 { sub } else { normal };
    let r = if abs >= 0x43E0_0000 { E4M3_MAX } else { r };
    f32::from_bits(r.to_bits() | sign)
}

/// Smallest scale: the smallest positive FP16 (a subnormal), 2^-24.
pub const SCALE_MIN: f32 = 5.960_464_5e-8;
/// Largest scale: the largest finite FP16.
pub const SCALE_MAX: f32 = 65504.0;

/// One vector as stored: e4m3fn codes and the FP16 scale.
#[derive(Clone, Debug, PartialEq)]
pub struct Encoded {
    pub codes: Vec<u8>,
    pub scale: f16,
}

impl Encoded {
    /// The stored bytes: codes, then the scale (little endian).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.codes.len() + 2);
        v.extend_from_slice(&self.codes);
        v.extend_from_slice(&self.scale.to_le_bytes());
        v
    }
}

/// Bytes to store one vector of `n` values: `n` codes + one FP16 scale.
pub const fn bytes_per_vector(n: usize) -> usize {
    n + 2
}

/// The row scale: `fp16(clamp(amax / 448, 2^-24, 65504))`, or `+0` for an all-zero row.
#[inline]
pub fn scale_of(x: &[f32]) -> f16 {
    let a = amax(x);
    if a == 0.0 {
        f16::ZERO
    } else {
        f16::from_f32((a / E4M3_MAX).clamp(SCALE_MIN, SCALE_MAX))
    }
}

/// Encodes one vector.
pub fn encode(x: &[f32]) -> Encoded {
    let scale = scale_of(x);
    let s = scale.to_f32();
    let codes = if s == 0.0 {
        vec![0u8; x.len()]
    } else {
        let r = 1.0 / s;
        x.iter().map(|&v| e4m3_from_f32(v * r)).collect()
    };
    Encoded { codes, scale }
}

/// Decodes one vector into `out` (`out.len() == e.codes.len()`).
pub fn decode(e: &Encoded, out: &mut [f32]) {
    let s = e.scale.to_f32();
    for (o, &q) in out.iter_mut().zip(&e.codes) {
        *o = e4m3_to_f32(q) * s;
    }
}

/// Encodes then decodes in place, without allocating; for finite input bit for bit
/// `decode(encode(x))`.
pub fn roundtrip(x: &mut [f32]) {
    let s = scale_of(x).to_f32();
    if s == 0.0 {
        x.iter_mut().for_each(|v| *v = 0.0);
        return;
    }
    let r = 1.0 / s;
    for v in x.iter_mut() {
        *v = e4m3_round(*v * r) * s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_matches_definition() {
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            let e = (b >> 3) & 0xF;
            let m = (b & 7) as f64;
            let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
            if b & 0x7F == 0x7F {
                assert!(v.is_nan());
                continue;
            }
            let want = if e == 0 {
                m * 2f64.powi(-9)
            } else {
                (1.0 + m / 8.0) * 2f64.powi(e as i32 - 7)
            };
            assert_eq!(v as f64, s * want, "byte {b:#04x}");
            assert_eq!(v.is_sign_negative(), s < 0.0);
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
    }

    #[test]
    fn every_code_round_trips() {
        for b in 0..=255u8 {
            if b & 0x7F == 0x7F {
                continue;
            }
            assert_eq!(e4m3_from_f32(e4m3_to_f32(b)), b);
        }
    }

    #[test]
    fn round_matches_codes() {
        let check = |v: f32| {
            let want = e4m3_to_f32(e4m3_from_f32(v));
            assert_eq!(
                e4m3_round(v).to_bits(),
                want.to_bits(),
                "{v:e} ({:#x})",
                v.to_bits()
            );
        };
        // Every f32 whose low 12 mantissa bits are in a small set (covers every rounding
        // case of every exponent), both signs.
        for hi in 0..(1u32 << 20) {
            for lo in [0u32, 1, 0x7FF, 0x800, 0x801, 0xFFF] {
                let bits = (hi << 12) | lo;
                let v = f32::from_bits(bits);
                if !v.is_nan() {
                    check(v);
                }
            }
        }
    }

    #[test]
    fn specials() {
        assert_eq!(e4m3_from_f32(f32::INFINITY), 0x7E);
        assert_eq!(e4m3_from_f32(f32::NEG_INFINITY), 0xFE);
        assert_eq!(e4m3_from_f32(f32::NAN) & 0x7F, 0x7F);
        assert_eq!(e4m3_from_f32(1e30), 0x7E);
        assert_eq!(e4m3_from_f32(464.0), 0x7E);
        assert_eq!(e4m3_from_f32(-0.0), 0x80);
        assert_eq!(e4m3_from_f32(2f32.powi(-10)), 0x00);
        assert_eq!(e4m3_from_f32(-(2f32.powi(-10))), 0x80);
        assert_eq!(e4m3_from_f32(3.0 * 2f32.powi(-10)), 0x02);
        assert_eq!(e4m3_from_f32(f32::from_bits(1)), 0x00);
        // 15.5 · 2^-10 is the tie between 7·2^-9 (odd) and 2^-6 (even).
        assert_eq!(e4m3_from_f32(15.0 * 2f32.powi(-10)), 0x08);
    }

    #[test]
    fn zero_vector() {
        let mut x = [0.0f32, -0.0, 0.0, 0.0];
        let e = encode(&x);
        assert_eq!(e.scale, f16::ZERO);
        assert_eq!(e.codes, vec![0; 4]);
        roundtrip(&mut x);
        assert!(x.iter().all(|v| v.to_bits() == 0));
    }

    /// Hand-computed: amax 448 gives scale 1; a value past 448 · scale saturates; the scale
    /// is rounded to fp16 and clamped at both ends.
    #[test]
    fn one_fp16_scale_per_row() {
        let x = [448.0f32, -1.0, 0.3, -0.0];
        let e = encode(&x);
        assert_eq!(e.scale, f16::ONE);
        assert_eq!(e.codes, vec![0x7E, 0xB8, e4m3_from_f32(0.3), 0x80]);
        assert_eq!(e.to_bytes().len(), bytes_per_vector(4));
        assert_eq!(bytes_per_vector(256), 258);
        // amax 997: scale fp16(997/448) rounds down (1139 · 2^-9 < 2.22545), so
        // 997 · (1/scale) = 448.17 passes 448 and saturates.
        let s = f16::from_f32(997.0 / 448.0);
        assert!(s.to_f32() < 997.0 / 448.0);
        assert!(997.0 * (1.0 / s.to_f32()) > 448.0);
        let e = encode(&[997.0, 1.0]);
        assert_eq!(e.scale, s);
        assert_eq!(e.codes[0], 0x7E, "saturates at 448");
        // Tiny rows clamp at the smallest fp16 subnormal, huge ones at 65504.
        assert_eq!(scale_of(&[1e-30]).to_f32(), SCALE_MIN);
        assert_eq!(SCALE_MIN, 2f32.powi(-24));
        assert_eq!(scale_of(&[1e30]).to_f32(), SCALE_MAX);
        let mut big = [1e30f32, -1e30];
        roundtrip(&mut big);
        assert_eq!(big, [448.0 * 65504.0, -448.0 * 65504.0]);
        let mut y = [997.0f32, 1.0];
        roundtrip(&mut y);
        let mut z = [0.0; 2];
        decode(&e, &mut z);
        assert_eq!(y, z);
    }
}
