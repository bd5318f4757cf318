//! A branch-free f32 `exp` for softmax-style loops, and the slice loops built on it.
//!
//! libm's `expf` is an opaque call per element; this version is plain arithmetic, so it
//! vectorizes and gives the same bits on every run and thread. Range reduction
//! `x = n·ln2 + r` with a two-part ln2, then a degree-6 polynomial for `e^r` on
//! `[-ln2/2, ln2/2]` and an exponent-bit scale. Relative error is below 3e-7 (about 2.5 ulp,
//! checked against f64 in the tests); inputs below -87 return 0, as a softmax wants, and
//! inputs above 88 return `e^88`.
//!
//! Every multiply-add is a fused one (`mul_add`), written out in the scalar code, so the
//! AVX2+FMA loop (eight lanes, explicit intrinsics) computes exactly the scalar bits and a
//! test holds the two together. On an x86-64 CPU without FMA the scalar code still gives
//! those bits, through libm's correctly rounded `fmaf`, only slowly.

use super::isa::Isa;
use multiversion::multiversion;

/// 1.5 · 2^23: adding it to a float of magnitude below 2^22 rounds it to an integer, which
/// then sits in the low mantissa bits.
const ROUND: f32 = 12_582_912.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// Taylor/minimax-quality coefficients for e^r, |r| <= 0.35, highest degree first.
const POLY: [f32; 7] = [
    0.001_388_942_9,
    0.008_333_558,
    0.041_666_668,
    0.166_666_67,
    0.5,
    1.0,
    1.0,
];
const LO: f32 = -87.0;
const HI: f32 = 88.0;

#[inline(always)]
#[allow(clippy::manual_clamp)]
pub fn exp(x: f32) -> f32 {
    // max/min rather than clamp: the same NaN handling as the vector instructions.
    let xc = x.max(LO).min(HI);
    let shifted = xc.mul_add(LOG2E, ROUND);
    let n = shifted - ROUND;
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, xc));
    let mut p = POLY[0];
    for c in &POLY[1..] {
        p = p.mul_add(r, *c);
    }
    // n is an integer in [-126, 127] held in the low mantissa bits of `shifted`; moving it
    // into the exponent field with integer arithmetic keeps the loop vectorizable (a float
    // to int cast would not be).
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    let scale = f32::from_bits(n_bits.wrapping_add(127) << 23);
    let y = p * scale;
    if x < LO {
        0.0
    } else {
        y
    }
}

/// Near-minimax coefficients for 2^r, |r| <= 1/2, highest degree first, the constant held
/// at exactly 1 so that `2^0 = 1` (relative error of the f32 evaluation below 1.7e-7,
/// sampled; a little better than [`exp`]'s).
// The linear coefficient is a fitted value that happens to lie next to ln 2.
#[allow(clippy::approx_constant)]
const POLY2: [f32; 6] = [
    0.001_326_472_7,
    0.009_671_513,
    0.055_507_336,
    0.240_222_42,
    0.693_147,
    1.0,
];
const LO2: f32 = -126.0;
const HI2: f32 = 127.0;
/// `127 - ROUND.to_bits()` (wrapping): added to `shifted`'s bits it gives the biased exponent.
const EXP2_BIAS: u32 = 127u32.wrapping_sub(ROUND.to_bits());

/// `2^x`, the same construction as [`exp`] without the change of base: `x = n + r` with
/// `n` the nearest integer (exact) and `r` in `[-1/2, 1/2]`, a degree-5 polynomial for
/// `2^r`, and `2^n` built in the exponent bits. Inputs below -126 return 0. Attention keeps
/// its scores in log2 units (the score scale absorbs `log2 e`), so its softmax needs this
/// cheaper form: no two-part `ln 2` reduction.
#[inline(always)]
#[allow(clippy::manual_clamp)]
pub fn exp2(x: f32) -> f32 {
    let xc = x.max(LO2).min(HI2);
    let shifted = xc + ROUND;
    let n = shifted - ROUND;
    let r = xc - n;
    let mut p = POLY2[0];
    for c in &POLY2[1..] {
        p = p.mul_add(r, *c);
    }
    let scale = f32::from_bits(shifted.to_bits().wrapping_add(EXP2_BIAS) << 23);
    let y = p * scale;
    if x < LO2 {
        0.0
    } else {
        y
    }
}

/// `x[i] = 2^(x[i] - max)` in place; returns the sum, accumulated exactly like
/// [`exp_sub_sum`]'s.
pub fn exp2_sub_sum(x: &mut [f32], max: f32) -> f32 {
    sub_sum::<true>(x, max)
}

/// [`exp2_sub_sum`] one element at a time: the specification of the vector loop.
pub fn exp2_sub_sum_scalar(x: &mut [f32], max: f32) -> f32 {
    sub_sum_scalar::<true>(x, max)
}

/// `x[i] = exp(x[i] - max)` in place; returns the sum, accumulated in eight lanes (element
/// `i` into lane `i % 8` for the whole multiple-of-eight prefix, in order), the lanes added
/// as `((l0+l4)+(l1+l5))+((l2+l6)+(l3+l7))`, then the tail in order.
pub fn exp_sub_sum(x: &mut [f32], max: f32) -> f32 {
    sub_sum::<false>(x, max)
}

/// [`exp_sub_sum`] one element at a time: the specification of the vector loop.
pub fn exp_sub_sum_scalar(x: &mut [f32], max: f32) -> f32 {
    sub_sum_scalar::<false>(x, max)
}

/// The shared loop of [`exp_sub_sum`] (`BASE2 = false`) and [`exp2_sub_sum`] (`true`).
fn sub_sum<const BASE2: bool>(x: &mut [f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if Isa::has_avx512() {
            // SAFETY: the CPU has AVX-512F, AVX2 and FMA.
            return unsafe { avx512::sub_sum::<BASE2>(x, max) };
        }
        if Isa::has_avx2() {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { avx2::sub_sum::<BASE2>(x, max) };
        }
    }
    sub_sum_scalar::<BASE2>(x, max)
}

#[inline(always)]
fn exp_or_exp2<const BASE2: bool>(x: f32) -> f32 {
    if BASE2 {
        exp2(x)
    } else {
        exp(x)
    }
}

fn sub_sum_scalar<const BASE2: bool>(x: &mut [f32], max: f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        for i in 0..8 {
            c[i] = exp_or_exp2::<BASE2>(c[i] - max);
            acc[i] += c[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for v in chunks.into_remainder() {
        *v = exp_or_exp2::<BASE2>(*v - max);
        s += *v;
    }
    s
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// Eight lanes of [`exp`], operation for operation.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp8(x: __m256) -> __m256 {
        let xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(LO)), _mm256_set1_ps(HI));
        let round = _mm256_set1_ps(ROUND);
        let shifted = _mm256_fmadd_ps(xc, _mm256_set1_ps(LOG2E), round);
        let n = _mm256_sub_ps(shifted, round);
        let neg_n = _mm256_xor_ps(n, _mm256_set1_ps(-0.0));
        let r = _mm256_fmadd_ps(neg_n, _mm256_set1_ps(LN2_HI), xc);
        let r = _mm256_fmadd_ps(neg_n, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(POLY[0]);
        for c in &POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        let n_bits = _mm256_sub_epi32(_mm256_castps_si256(shifted), _mm256_castps_si256(round));
        let scale = _mm256_slli_epi32::<23>(_mm256_add_epi32(n_bits, _mm256_set1_epi32(127)));
        let y = _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
        let below = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(LO));
        _mm256_andnot_ps(below, y)
    }

    /// Eight lanes of [`exp2`], operation for operation.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp2_8(x: __m256) -> __m256 {
        let xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(LO2)), _mm256_set1_ps(HI2));
        let round = _mm256_set1_ps(ROUND);
        let shifted = _mm256_add_ps(xc, round);
        let n = _mm256_sub_ps(shifted, round);
        let r = _mm256_sub_ps(xc, n);
        let mut p = _mm256_set1_ps(POLY2[0]);
        for c in &POLY2[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        let bits = _mm256_add_epi32(
            _mm256_castps_si256(shifted),
            _mm256_set1_epi32(EXP2_BIAS as i32),
        );
        let scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(bits));
        let y = _mm256_mul_ps(p, scale);
        let below = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(LO2));
        _mm256_andnot_ps(below, y)
    }

    /// [`super::sub_sum_scalar`] eight lanes at a time, operation for operation.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn sub_sum<const BASE2: bool>(x: &mut [f32], max: f32) -> f32 {
        sub_sum_from::<BASE2>(x, max, _mm256_setzero_ps())
    }

    /// [`sub_sum`] with the eight lane sums starting at `acc` (the AVX-512 loop hands over
    /// its running sums and the elements it left).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn sub_sum_from<const BASE2: bool>(x: &mut [f32], max: f32, acc: __m256) -> f32 {
        let m = _mm256_set1_ps(max);
        let mut acc = acc;
        let mut chunks = x.chunks_exact_mut(8);
        for c in &mut chunks {
            // SAFETY: `c` is exactly eight floats.
            let d = _mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m);
            let y = if BASE2 { exp2_8(d) } else { exp8(d) };
            _mm256_storeu_ps(c.as_mut_ptr(), y);
            acc = _mm256_add_ps(acc, y);
        }
        let mut l = [0.0f32; 8];
        _mm256_storeu_ps(l.as_mut_ptr(), acc);
        let mut s = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
        for v in chunks.into_remainder() {
            *v = exp_or_exp2::<BASE2>(*v - max);
            s += *v;
        }
        s
    }
}

/// Sixteen lanes of [`exp`] and [`exp2`], operation for operation, and the slice loop. The sum
/// keeps the eight-lane order of the specification: each 16-wide result is added to the
/// eight running sums as its low half, then its high half, which is what two eight-wide
/// steps do.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// Zero where `x < lo`, else `y` (the AVX2 code's `andnot` with a compare mask).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn zero_below(x: __m512, lo: f32, y: __m512) -> __m512 {
        let below = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(lo));
        _mm512_maskz_mov_ps(!below, y)
    }

    /// Sixteen lanes of [`exp`].
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn exp16(x: __m512) -> __m512 {
        let xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(LO)), _mm512_set1_ps(HI));
        let round = _mm512_set1_ps(ROUND);
        let shifted = _mm512_fmadd_ps(xc, _mm512_set1_ps(LOG2E), round);
        let n = _mm512_sub_ps(shifted, round);
        let sign = _mm512_set1_epi32(i32::MIN);
        let neg_n = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(n), sign));
        let r = _mm512_fmadd_ps(neg_n, _mm512_set1_ps(LN2_HI), xc);
        let r = _mm512_fmadd_ps(neg_n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(POLY[0]);
        for c in &POLY[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        let n_bits = _mm512_sub_epi32(_mm512_castps_si512(shifted), _mm512_castps_si512(round));
        let scale = _mm512_slli_epi32::<23>(_mm512_add_epi32(n_bits, _mm512_set1_epi32(127)));
        zero_below(x, LO, _mm512_mul_ps(p, _mm512_castsi512_ps(scale)))
    }

    /// Sixteen lanes of [`exp2`].
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn exp2_16(x: __m512) -> __m512 {
        let xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(LO2)), _mm512_set1_ps(HI2));
        let round = _mm512_set1_ps(ROUND);
        let shifted = _mm512_add_ps(xc, round);
        let n = _mm512_sub_ps(shifted, round);
        let r = _mm512_sub_ps(xc, n);
        let mut p = _mm512_set1_ps(POLY2[0]);
        for c in &POLY2[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        let bits = _mm512_add_epi32(
            _mm512_castps_si512(shifted),
            _mm512_set1_epi32(EXP2_BIAS as i32),
        );
        let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(bits));
        zero_below(x, LO2, _mm512_mul_ps(p, scale))
    }

    /// [`super::sub_sum_scalar`] sixteen lanes at a time, the same bits.
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX2 and FMA.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn sub_sum<const BASE2: bool>(x: &mut [f32], max: f32) -> f32 {
        let m = _mm512_set1_ps(max);
        let mut acc = _mm256_setzero_ps();
        let mut chunks = x.chunks_exact_mut(16);
        for c in &mut chunks {
            // SAFETY: `c` is exactly sixteen floats.
            let d = _mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), m);
            let y = if BASE2 { exp2_16(d) } else { exp16(d) };
            _mm512_storeu_ps(c.as_mut_ptr(), y);
            let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(y)));
            acc = _mm256_add_ps(acc, _mm512_castps512_ps256(y));
            acc = _mm256_add_ps(acc, high);
        }
        super::avx2::sub_sum_from::<BASE2>(chunks.into_remainder(), max, acc)
    }
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
            let shifted = x.mul_add(LOG2E, ROUND);
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
    fn vector_loops_match_the_scalar_bits() {
        type SubSum = fn(&mut [f32], f32) -> f32;
        // The dispatching loops (AVX-512 where the CPU has it), and the AVX2 loops directly.
        #[allow(unused_mut)]
        let mut pairs: Vec<(&str, SubSum, SubSum)> = vec![
            ("exp", exp_sub_sum, exp_sub_sum_scalar),
            ("exp2", exp2_sub_sum, exp2_sub_sum_scalar),
        ];
        #[cfg(target_arch = "x86_64")]
        if Isa::has_avx2() {
            // SAFETY (both closures): the CPU has AVX2 and FMA.
            pairs.push((
                "exp avx2",
                |x, m| unsafe { avx2::sub_sum::<false>(x, m) },
                exp_sub_sum_scalar,
            ));
            pairs.push((
                "exp2 avx2",
                |x, m| unsafe { avx2::sub_sum::<true>(x, m) },
                exp2_sub_sum_scalar,
            ));
        }
        for (name, vector, scalar) in pairs {
            for n in [0, 1, 7, 8, 9, 15, 16, 17, 24, 25, 64, 515, 2048] {
                // Inputs from -200 to 100: below both underflow limits, above both clamps; and,
                // for n >= 64, a softmax-like row in [-12, 3] whose sum depends on the order
                // of every addition (a reordered sum or an unfused multiply-add shows).
                let x: Vec<f32> = (0..n)
                    .map(|i| {
                        let u = ((i * 2_654_435_761usize) % 30_001) as f32;
                        if n >= 64 {
                            u * 0.0005 - 12.0
                        } else {
                            u * 0.01 - 200.0
                        }
                    })
                    .collect();
                let (mut a, mut b) = (x.clone(), x);
                let sa = vector(&mut a, 3.0);
                let sb = scalar(&mut b, 3.0);
                assert_eq!(sa.to_bits(), sb.to_bits(), "{name}, n = {n}");
                assert!(
                    a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()),
                    "{name}, n = {n}"
                );
            }
        }
    }

    #[test]
    fn exp2_close_to_f64() {
        let mut worst = 0.0f64;
        let mut x = -126.0f32;
        while x < 127.0 {
            let want = (x as f64).exp2();
            let got = exp2(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.000_917;
        }
        assert!(worst < 2e-7, "max relative error {worst:e}");
        assert_eq!(exp2(-126.5), 0.0);
        assert_eq!(exp2(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp2(0.0), 1.0);
        assert_eq!(exp2(-3.0), 0.125);
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
