//! Rotary position embedding in the rotate-half layout: element `j` of a head is paired
//! with element `j + R/2`, both rotated by `pos * inv_freq[j]`, where `R` is the rotary
//! dimension: the whole head, or (partial RoPE, qwen3_5) its first `R` elements, the rest
//! passing through unchanged.

use crate::model::config::RopeScaling;
use rayon::prelude::*;

/// Inverse frequencies `theta^(-2j/head_dim)`, with Llama-3 scaling when configured.
pub fn inv_freq(head_dim: usize, theta: f64, scaling: Option<&RopeScaling>) -> Vec<f64> {
    let half = head_dim / 2;
    (0..half)
        .map(|j| {
            let f = 1.0 / theta.powf((2 * j) as f64 / head_dim as f64);
            match scaling {
                None => f,
                Some(s) => {
                    let old = s.original_max_position_embeddings as f64;
                    let low_wavelen = old / s.low_freq_factor;
                    let high_wavelen = old / s.high_freq_factor;
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / s.factor
                    } else {
                        let smooth = (old / wavelen - s.low_freq_factor)
                            / (s.high_freq_factor - s.low_freq_factor);
                        (1.0 - smooth) * f / s.factor + smooth * f
                    }
                }
            }
        })
        .collect()
}

/// cos/sin tables `[positions, R/2]` for positions `0..n`, for heads of `head_dim`.
pub struct RopeTable {
    pub half: usize,
    pub head_dim: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeTable {
    /// A table that rotates whole heads (`head_dim = 2 · inv_freq.len()`).
    pub fn new(inv_freq: &[f64], n: usize) -> RopeTable {
        Self::partial(inv_freq, n, 2 * inv_freq.len())
    }

    /// A table that rotates the first `2 · inv_freq.len()` elements of heads of `head_dim`.
    pub fn partial(inv_freq: &[f64], n: usize, head_dim: usize) -> RopeTable {
        assert!(2 * inv_freq.len() <= head_dim, "rotary dims fit the head");
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for p in 0..n {
            for &f in inv_freq {
                // Matches the reference: the angle is formed in f32 precision.
                let a = (p as f32) * (f as f32);
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        RopeTable {
            half,
            head_dim,
            cos,
            sin,
        }
    }

    /// Rotates `x[T, heads, head_dim]` in place, token `t` at position `t`.
    pub fn apply(&self, x: &mut [f32], heads: usize) {
        self.apply_from(x, heads, 0);
    }

    /// Rotates `x[T, heads, head_dim]` in place, token `t` at position `first + t` (the
    /// rows of a window from `first` on).
    pub fn apply_from(&self, x: &mut [f32], heads: usize, first: usize) {
        let hd = self.head_dim;
        x.par_chunks_mut(heads * hd)
            .enumerate()
            .for_each(|(t, row)| {
                let t = first + t;
                let c = &self.cos[t * self.half..(t + 1) * self.half];
                let s = &self.sin[t * self.half..(t + 1) * self.half];
                for v in row.chunks_mut(hd) {
                    let (a, b) = v[..2 * self.half].split_at_mut(self.half);
                    for j in 0..self.half {
                        let (x1, x2) = (a[j], b[j]);
                        a[j] = x1 * c[j] - x2 * s[j];
                        b[j] = x2 * c[j] + x1 * s[j];
                    }
                }
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_rope_rotates_only_the_leading_dims() {
        // Heads of 8, rotary dim 4: pairs (0, 2) and (1, 3) rotate, 4..8 pass through.
        let f = inv_freq(4, 10000.0, None);
        assert_eq!(f.len(), 2);
        assert_eq!(f[1], 1.0 / 10000f64.powf(0.5)); // theta^(-2j/R), R = 4
        let t = RopeTable::partial(&f, 3, 8);
        let mut x: Vec<f32> = (0..3 * 2 * 8).map(|i| i as f32 + 1.0).collect();
        let orig = x.clone();
        t.apply(&mut x, 2);
        for pos in 0..3 {
            for h in 0..2 {
                let (o, v) = (&orig[(pos * 2 + h) * 8..], &x[(pos * 2 + h) * 8..]);
                assert_eq!(&v[4..8], &o[4..8], "untouched tail");
                for j in 0..2 {
                    let a = (pos as f32) * (f[j] as f32);
                    assert_eq!(v[j], o[j] * a.cos() - o[j + 2] * a.sin());
                    assert_eq!(v[j + 2], o[j + 2] * a.cos() + o[j] * a.sin());
                }
            }
        }
    }
}
