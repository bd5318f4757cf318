//! Rotary position embedding in the rotate-half layout: element `j` of a head is paired
//! with element `j + head_dim/2`, both rotated by `pos * inv_freq[j]`.

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

/// cos/sin tables `[positions, head_dim/2]` for positions `0..n`.
pub struct RopeTable {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(inv_freq: &[f64], n: usize) -> RopeTable {
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
        RopeTable { half, cos, sin }
    }

    /// Rotates `x[T, heads, head_dim]` in place, token `t` at position `t`.
    pub fn apply(&self, x: &mut [f32], heads: usize) {
        self.apply_from(x, heads, 0);
    }

    /// Rotates `x[T, heads, head_dim]` in place, token `t` at position `first + t` (the
    /// rows of a window from `first` on).
    pub fn apply_from(&self, x: &mut [f32], heads: usize, first: usize) {
        let hd = 2 * self.half;
        x.par_chunks_mut(heads * hd)
            .enumerate()
            .for_each(|(t, row)| {
                let t = first + t;
                let c = &self.cos[t * self.half..(t + 1) * self.half];
                let s = &self.sin[t * self.half..(t + 1) * self.half];
                for v in row.chunks_mut(hd) {
                    let (a, b) = v.split_at_mut(self.half);
                    for j in 0..self.half {
                        let (x1, x2) = (a[j], b[j]);
                        a[j] = x1 * c[j] - x2 * s[j];
                        b[j] = x2 * c[j] + x1 * s[j];
                    }
                }
            });
    }
}
