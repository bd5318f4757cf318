//! A branch-free f32 `exp` for softmax-style loops, and the slice loops built on it.
//!
//! libm's `expf` is an opaque call per element; this version is plain arithmetic that the
//! compiler vectorizes, and being pure arithmetic it gives the same bits on every run and
//! thread. Range reduction `x = n·ln2 + r` with a two-part ln2, then a degree-6 polynomial
//! for `e^r` on `[-ln2/2, ln2/2]` and an exponent-bit scale. Relative error is below 3e-7
//! (about 2.5 ulp, checked against f64 in the tests); inputs below -87 return 0, as a
//! softmax wants, and inputs above 88 return `e^88`.
//!
//! The slice loops are compiled twice, for baseline x86-64 and for AVX2+FMA, and pick one
//! at run time (`multiversion`). Rust never contracts `a * b + c` into a fused multiply-add
//! on its own, so both versions compute exactly the same bits; the wide one is just faster.

use multiversion::multiversion;

/// 1.5 · 2^23: adding it to a float of magnitude below 2^22 rounds it to an integer, which
/// then sits in the low mantissa bits.
const ROUND: f32 = 12_582_912.0;

#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let xc = x.clamp(-87.0, 88.0);
    let shifted = xc * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    // Taylor/minimax-quality coefficients for e^r, |r| <= 0.35.
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (0.166_666_67
                    + r * (0.041_666_668 + r * (0.008_333_558 + r * 0.001_388_942_9)))));
    // n is an integer in [-126, 127] held in the low mantissa bits of `shifted`; moving it
    // into the exponent field with integer arithmetic keeps the loop vectorizable (a float
    // to int cast would not be).
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    let scale = f32::from_bits(n_bits.wrapping_add(127) << 23);
    let y = p * scale;
    if x < -87.0 {
        0.0
    } else {
        y
    }
}

/// `x[i] = exp(x[i] - max)` in place; returns the sum (accumulated in order).
#[multiversion(targets("x86_64+avx2+fma"))]
pub fn exp_sub_sum(x: &mut [f32], max: f32) -> f32 {
    for v in x.iter_mut() {
        *v = exp(*v - max);
    }
    // Eight lanes summed in a fixed order keep the reduction vectorizable and deterministic.
    let mut acc = [0.0f32; 8];
    let chunks = x.chunks_exact(8);
    let rem = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for &v in rem {
        s += v;
    }
    s
}

/// Maximum of a slice (NEG_INFINITY when empty), vectorizable.
#[multiversion(targets("x86_64+avx2+fma"))]
pub fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = x.chunks_exact(8);
    let rem = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            acc[i] = acc[i].max(c[i]);
        }
    }
    let mut m = acc.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    for &v in rem {
        m = m.max(v);
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn close_to_f64_exp() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.000_731;
        }
        assert!(worst < 3e-7, "max relative error {worst:e}");
        assert_eq!(exp(-1000.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn exponent_bits_match_an_integer_conversion() {
        // The integer trick in `exp` must build the same power of two as converting n.
        let mut x = -87.0f32;
        while x <= 88.0 {
            let shifted = x * std::f32::consts::LOG2_E + ROUND;
            let n = shifted - ROUND;
            let via_cast = f32::from_bits(((n as i32 + 127) as u32) << 23);
            let via_bits = f32::from_bits(
                shifted
                    .to_bits()
                    .wrapping_sub(ROUND.to_bits())
                    .wrapping_add(127)
                    << 23,
            );
            assert_eq!(via_cast.to_bits(), via_bits.to_bits(), "x = {x}");
            x += 0.0137;
        }
    }

    #[test]
    fn sum_and_max() {
        let mut v: Vec<f32> = (0..37).map(|i| i as f32 * 0.1).collect();
        let m = max(&v);
        assert_eq!(m, 36.0f32 * 0.1);
        let s = exp_sub_sum(&mut v, m);
        let want: f64 = (0..37)
            .map(|i| ((i as f32 * 0.1) as f64 - m as f64).exp())
            .sum();
        assert!((s as f64 - want).abs() < 1e-5);
    }
}
