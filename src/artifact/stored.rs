//! A matrix as the artifact stores it, read in place from the mapped file: f32, bf16, fp8
//! with its scales, or nvfp4 with its two scale levels. [`StoredMatrix::decode_row`] gives
//! one row in f32, exactly the values [`super::Artifact::tensor_f32`] gives, so a backend
//! can keep the weights in their stored size and widen a row where its kernel reads it (the
//! CPU GEMM while it packs its weight panels, the embedding per row gathered): a model takes
//! about its artifact's bytes of memory, not four bytes per parameter.

use crate::quant::fp8::{self, Fp8Scale};
use crate::quant::nvfp4::{self, Global};
use memmap2::Mmap;
use std::ops::Range;
use std::sync::Arc;

/// How a stored matrix encodes its values.
#[derive(Clone, Debug)]
enum Encoding {
    F32,
    Bf16,
    /// e4m3 codes and their scales (small: one per tensor, row or 128 × 128 block).
    Fp8(Fp8Scale),
    /// e2m1 codes two per byte, e4m3 block scales at `scales` in the file, a global scale.
    Nvfp4 {
        scales: Range<usize>,
        global: Global,
    },
}

/// A `[rows, cols]` matrix in the mapped artifact (cheap to clone: the map is shared).
#[derive(Clone, Debug)]
pub struct StoredMatrix {
    map: Arc<Mmap>,
    pub rows: usize,
    pub cols: usize,
    /// The payload's byte range in the file (values, or codes).
    data: Range<usize>,
    encoding: Encoding,
}

impl StoredMatrix {
    pub(super) fn f32(map: Arc<Mmap>, rows: usize, cols: usize, data: Range<usize>) -> Self {
        Self::new(map, rows, cols, data, Encoding::F32)
    }

    pub(super) fn bf16(map: Arc<Mmap>, rows: usize, cols: usize, data: Range<usize>) -> Self {
        Self::new(map, rows, cols, data, Encoding::Bf16)
    }

    pub(super) fn fp8(
        map: Arc<Mmap>,
        rows: usize,
        cols: usize,
        codes: Range<usize>,
        scale: Fp8Scale,
    ) -> Self {
        Self::new(map, rows, cols, codes, Encoding::Fp8(scale))
    }

    pub(super) fn nvfp4(
        map: Arc<Mmap>,
        rows: usize,
        cols: usize,
        packed: Range<usize>,
        scales: Range<usize>,
        global: Global,
    ) -> Self {
        Self::new(map, rows, cols, packed, Encoding::Nvfp4 { scales, global })
    }

    fn new(map: Arc<Mmap>, rows: usize, cols: usize, data: Range<usize>, e: Encoding) -> Self {
        StoredMatrix {
            map,
            rows,
            cols,
            data,
            encoding: e,
        }
    }

    /// The storage format: `f32`, `bf16`, `fp8` or `nvfp4`.
    pub fn format(&self) -> &'static str {
        match self.encoding {
            Encoding::F32 => "f32",
            Encoding::Bf16 => "bf16",
            Encoding::Fp8(_) => "fp8",
            Encoding::Nvfp4 { .. } => "nvfp4",
        }
    }

    /// Bytes the matrix takes in the file (scales included).
    pub fn stored_bytes(&self) -> usize {
        self.data.len()
            + match &self.encoding {
                Encoding::Nvfp4 { scales, .. } => scales.len() + 4,
                Encoding::Fp8(s) => 4 * s.values().len(),
                _ => 0,
            }
    }

    fn bytes(&self, r: &Range<usize>) -> &[u8] {
        &self.map[r.clone()]
    }

    /// Checks the parts (sizes, scale values, no NaN code), as loading the matrix whole does.
    pub(super) fn validate(&self) -> anyhow::Result<()> {
        let (r, c) = (self.rows, self.cols);
        match &self.encoding {
            Encoding::F32 | Encoding::Bf16 => {
                let want = r
                    * c
                    * if matches!(self.encoding, Encoding::F32) {
                        4
                    } else {
                        2
                    };
                if self.data.len() != want {
                    anyhow::bail!("{} bytes do not hold [{r}, {c}]", self.data.len());
                }
                Ok(())
            }
            Encoding::Fp8(scale) => fp8::validate(r, c, self.bytes(&self.data), scale),
            Encoding::Nvfp4 { scales, global } => {
                nvfp4::validate(r, c, self.bytes(&self.data), self.bytes(scales), *global)
            }
        }
    }

    /// Row `r` in f32 into `out` (`cols` values): exactly `Artifact::tensor_f32`'s values.
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        let c = self.cols;
        debug_assert!(r < self.rows && out.len() == c);
        let data = self.bytes(&self.data);
        match &self.encoding {
            Encoding::F32 => {
                for (o, b) in out
                    .iter_mut()
                    .zip(data[4 * r * c..4 * (r + 1) * c].chunks_exact(4))
                {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Encoding::Bf16 => {
                for (o, b) in out
                    .iter_mut()
                    .zip(data[2 * r * c..2 * (r + 1) * c].chunks_exact(2))
                {
                    *o = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
            Encoding::Fp8(scale) => fp8::decode_row(data, scale, c, r, out),
            Encoding::Nvfp4 { scales, global } => {
                nvfp4::decode_row(data, self.bytes(scales), *global, c, r, out)
            }
        }
    }

    /// The first non-finite value, as (flat index, value), reading the matrix a row at a time.
    pub(super) fn find_non_finite(&self) -> Option<(usize, f32)> {
        use rayon::prelude::*;
        let rows_per_task = (1 << 16) / self.cols.max(1) + 1;
        (0..self.rows.div_ceil(rows_per_task))
            .into_par_iter()
            .find_map_first(|t| {
                let mut row = vec![0f32; self.cols];
                for r in t * rows_per_task..((t + 1) * rows_per_task).min(self.rows) {
                    self.decode_row(r, &mut row);
                    if let Some(c) = row.iter().position(|v| !v.is_finite()) {
                        return Some((r * self.cols + c, row[c]));
                    }
                }
                None
            })
    }
}
