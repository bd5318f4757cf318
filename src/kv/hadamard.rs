//! The normalized Walsh–Hadamard rotation that the seed engine (NInfer) applies to keys and
//! queries, and in `nvfp4`/`k8v4` also to values, before they are quantized.
//!
//! A rotation spreads an outlier channel over every element of the head vector, so one
//! large value no longer decides the scale of its whole group; the dot product of a rotated
//! query with a rotated key is the original one (the matrix is orthonormal), so only the
//! quantization error changes.
//!
//! The matrix is the Sylvester Hadamard matrix of size `n` (a power of two) divided by
//! `sqrt(n)`: entry `(r, c)` is `±1/sqrt(n)`, negative when `r & c` has an odd number of set
//! bits. It is symmetric and its own inverse. It is applied as the in-place butterfly: for
//! strides `s = 1, 2, 4, …, n/2` in that order, every pair `(i, i + s)` with bit `s` of `i`
//! clear becomes `(x_i + x_{i+s}, x_i − x_{i+s})` (each one f32 operation, rounded to nearest
//! even); then every element is multiplied once by [`norm`]. The CUDA store step
//! (`hadamard_warp` in `kernels/common.cuh`) performs the same operations in the same order,
//! so both give the same bits.
//!
//! NInfer defines it for head_dim 256 only. This project uses the same rule for every
//! power-of-two head_dim (64 and 128 are common) and rotates nothing for other head dims;
//! `report.json` records which (`kv_format.key_rotation`, `kv_format.value_rotation`).

/// Whether vectors of `n` values are rotated: `n` is a power of two of at least 2.
pub fn applies(n: usize) -> bool {
    n >= 2 && n.is_power_of_two()
}

/// `1 / sqrt(n)` as an f32, for `n = 2^l`: `2^(-l/2)` when `l` is even (exact), else
/// `2^(-(l-1)/2)` times the f32 nearest `1/sqrt(2)`, which is the f32 nearest `1/sqrt(n)`
/// (scaling by a power of two commutes with rounding). The device computes the same.
pub fn norm(n: usize) -> f32 {
    debug_assert!(applies(n));
    let l = n.trailing_zeros();
    let pow = f32::from_bits((127 - l / 2) << 23);
    if l % 2 == 1 {
        pow * std::f32::consts::FRAC_1_SQRT_2
    } else {
        pow
    }
}

/// Rotates `x` in place (`x.len()` a power of two of at least 2; other lengths are left as
/// they are, which is this project's rule for head dims NInfer does not define).
pub fn rotate(x: &mut [f32]) {
    let n = x.len();
    if !applies(n) {
        return;
    }
    let mut s = 1;
    while s < n {
        for base in (0..n).step_by(2 * s) {
            let (lo, hi) = x[base..base + 2 * s].split_at_mut(s);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (u, v) = (*a, *b);
                *a = u + v;
                *b = u - v;
            }
        }
        s *= 2;
    }
    let c = norm(n);
    for v in x.iter_mut() {
        *v *= c;
    }
}

/// Rotates each of the `x.len() / n` consecutive vectors of `n` values.
pub fn rotate_each(x: &mut [f32], n: usize) {
    if applies(n) {
        x.chunks_exact_mut(n).for_each(rotate);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The matrix entry, from its definition.
    fn entry(n: usize, r: usize, c: usize) -> f64 {
        let sign = if (r & c).count_ones() % 2 == 1 {
            -1.0
        } else {
            1.0
        };
        sign / (n as f64).sqrt()
    }

    #[test]
    fn columns_are_the_sylvester_matrix() {
        for n in [2usize, 4, 8, 64, 128, 256] {
            for c in 0..n {
                let mut e = vec![0.0f32; n];
                e[c] = 1.0;
                rotate(&mut e);
                for (r, &v) in e.iter().enumerate() {
                    let want = entry(n, r, c);
                    assert!((v as f64 - want).abs() <= 1e-7, "n={n} ({r},{c}) {v}");
                }
            }
        }
    }

    #[test]
    fn norm_is_the_nearest_f32() {
        for l in 1..20 {
            let n = 1usize << l;
            assert_eq!(norm(n), (1.0 / (n as f64).sqrt()) as f32, "n={n}");
        }
        assert_eq!(norm(256), 1.0 / 16.0);
        assert_eq!(norm(64), 1.0 / 8.0);
    }

    /// For n = 4^k the norm is a power of two, so integer vectors go through two rotations
    /// without a rounding: the rotation is exactly its own inverse.
    #[test]
    fn twice_is_the_identity() {
        for n in [4usize, 16, 64, 256] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 37) % 19) as f32 - 9.0).collect();
            let mut y = x.clone();
            rotate(&mut y);
            assert_ne!(x, y);
            rotate(&mut y);
            assert_eq!(x, y, "n={n}");
        }
        // Other powers of two: within rounding.
        let x: Vec<f32> = (0..128).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut y = x.clone();
        rotate(&mut y);
        rotate(&mut y);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= 1e-6, "{a} {b}");
        }
    }

    #[test]
    fn an_outlier_is_spread_over_every_element() {
        let mut x = vec![0.0f32; 256];
        x[17] = 16.0;
        rotate(&mut x);
        assert!(x.iter().all(|v| v.abs() == 1.0));
    }

    #[test]
    fn other_lengths_are_not_rotated() {
        for n in [1usize, 3, 80, 96] {
            let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let mut y = x.clone();
            rotate(&mut y);
            assert_eq!(x, y);
            assert!(!applies(n));
        }
    }
}
