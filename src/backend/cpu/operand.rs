//! The weight operand of the CPU's matrix products, `[n, k]` row-major (one output column
//! per row): f32 rows in memory, or rows of matrices as the artifact stores them (f32, bf16,
//! fp8, nvfp4), widened a row at a time while the GEMM packs its weight panels
//! (`sgemm16`) or the embedding gathers a row. A stacked matrix (q|k|v, gate|up, every expert
//! of a MoE block) is a list of row ranges of stored matrices ([`StoredRows`]), so it needs
//! no stacked copy either: the CPU model holds about its artifact's bytes.
//!
//! Widening gives exactly `Artifact::tensor_f32`'s values, so the products have the same bits
//! whichever way the weights are held.

use crate::artifact::stored::StoredMatrix;

/// Rows `first..first + rows` of a stored matrix.
#[derive(Clone, Debug)]
pub struct Segment {
    pub matrix: StoredMatrix,
    pub first: usize,
    pub rows: usize,
}

/// A matrix whose rows are the rows of [`Segment`]s, one after another.
#[derive(Clone, Debug)]
pub struct StoredRows {
    segments: Vec<Segment>,
    /// The logical row after each segment's last.
    ends: Vec<usize>,
    cols: usize,
}

impl StoredRows {
    /// Segments of matrices with the same number of columns (at least one segment).
    pub fn new(segments: Vec<Segment>) -> StoredRows {
        let cols = segments.first().map_or(0, |s| s.matrix.cols);
        assert!(
            segments
                .iter()
                .all(|s| s.matrix.cols == cols && s.first + s.rows <= s.matrix.rows),
            "stacked segments must share their width and lie inside their matrices"
        );
        let ends = segments
            .iter()
            .scan(0, |end, s| {
                *end += s.rows;
                Some(*end)
            })
            .collect();
        StoredRows {
            segments,
            ends,
            cols,
        }
    }

    pub fn row_count(&self) -> usize {
        self.ends.last().copied().unwrap_or(0)
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Row `r` in f32 into `out` (`cols` values).
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        let s = self.ends.partition_point(|&end| end <= r);
        let seg = &self.segments[s];
        let start = self.ends[s] - seg.rows;
        seg.matrix.decode_row(seg.first + r - start, out);
    }

    /// Bytes the rows take in the artifact (each segment's share of its matrix's bytes).
    pub fn stored_bytes(&self) -> usize {
        self.segments
            .iter()
            .map(|s| s.matrix.stored_bytes() / s.matrix.rows.max(1) * s.rows)
            .sum()
    }
}

/// Where [`WeightRows`] reads.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// A whole `[_, k]` f32 matrix.
    F32(&'a [f32]),
    Stored(&'a StoredRows),
}

/// Rows `first..first + n` of a `[_, k]` weight matrix, as a product reads them.
#[derive(Clone, Copy)]
pub struct WeightRows<'a> {
    source: Source<'a>,
    first: usize,
    n: usize,
    k: usize,
}

impl<'a> WeightRows<'a> {
    /// An f32 matrix `[w.len() / k, k]` (`k > 0` divides its length).
    pub fn f32(w: &'a [f32], k: usize) -> WeightRows<'a> {
        assert!(
            k > 0 && w.len().is_multiple_of(k),
            "{} weights are not rows of {k}",
            w.len()
        );
        WeightRows {
            source: Source::F32(w),
            first: 0,
            n: w.len() / k,
            k,
        }
    }

    /// An f32 matrix `[n, k]` (`w` holds exactly `n · k` values; `k` may be 0).
    pub fn f32_shape(w: &'a [f32], n: usize, k: usize) -> WeightRows<'a> {
        assert_eq!(w.len(), n * k, "{} weights are not [{n}, {k}]", w.len());
        WeightRows {
            source: Source::F32(w),
            first: 0,
            n,
            k,
        }
    }

    pub fn stored(s: &'a StoredRows) -> WeightRows<'a> {
        WeightRows {
            source: Source::Stored(s),
            first: 0,
            n: s.row_count(),
            k: s.cols(),
        }
    }

    /// Rows.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Columns (the products' depth).
    pub fn k(&self) -> usize {
        self.k
    }

    /// Rows `first..first + n` of these.
    pub fn slice(&self, first: usize, n: usize) -> WeightRows<'a> {
        assert!(
            first + n <= self.n,
            "rows {first}..{} of {}",
            first + n,
            self.n
        );
        WeightRows {
            first: self.first + first,
            n,
            ..*self
        }
    }

    /// The rows as one f32 slice, when they are f32 in memory.
    pub fn as_f32(&self) -> Option<&'a [f32]> {
        match self.source {
            Source::F32(w) => Some(&w[self.first * self.k..(self.first + self.n) * self.k]),
            Source::Stored(_) => None,
        }
    }

    /// Row `r` (of these rows) in f32 into `out` (`k` values).
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        debug_assert!(r < self.n && out.len() == self.k);
        let row = self.first + r;
        match self.source {
            Source::F32(w) => out.copy_from_slice(&w[row * self.k..(row + 1) * self.k]),
            Source::Stored(s) => s.decode_row(row, out),
        }
    }
}

/// A weight matrix a product takes: anything that lends its rows of `k` columns.
pub trait Operand {
    fn rows(&self, k: usize) -> WeightRows<'_>;
}

impl Operand for [f32] {
    fn rows(&self, k: usize) -> WeightRows<'_> {
        WeightRows::f32(self, k)
    }
}

impl Operand for Vec<f32> {
    fn rows(&self, k: usize) -> WeightRows<'_> {
        WeightRows::f32(self, k)
    }
}

impl Operand for StoredRows {
    fn rows(&self, k: usize) -> WeightRows<'_> {
        assert_eq!(
            self.cols, k,
            "a stored matrix of {} columns read as {k}",
            self.cols
        );
        WeightRows::stored(self)
    }
}

impl Operand for WeightRows<'_> {
    fn rows(&self, k: usize) -> WeightRows<'_> {
        assert_eq!(self.k, k, "weight rows of {} columns read as {k}", self.k);
        *self
    }
}
