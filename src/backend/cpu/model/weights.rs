//! The CPU model's weights: the layout tree ([`crate::model::layout`]) with every matrix
//! read in place from the mapped artifact in its stored format, and every vector (norms,
//! biases, decay parameters, convolution taps) in f32. CUDA twin:
//! `backend/cuda/model/weights.rs`, which loads the same tree into device buffers.
//!
//! A matrix leaf is a list of row ranges of stored matrices ([`StoredRows`]): a stacked group
//! (q|k|v, gate|up, a Gated DeltaNet's projections, a MoE block's experts) is its parts one
//! after another, a gated attention's q|k|v|gate its query heads' rows, k, v, then the gate
//! rows, all without a copy. The products widen a row at a time while they pack it
//! (`backend/cpu/operand.rs`), so the model holds about its artifact's bytes. A vector leaf is
//! read whole by [`read`], which the CUDA loader shares.

use crate::artifact::Artifact;
use crate::backend::cpu::operand::{Operand, Segment, StoredRows, WeightRows};
use crate::model::layout::{self, split_query_gate, Kind, Model, Tensor};
use anyhow::Result;

/// A part of the CPU model.
#[derive(Clone, Debug)]
pub enum Leaf {
    /// f32 values in memory: the vectors, and the matrices of models built in memory.
    Values(Vec<f32>),
    /// A matrix's rows as the artifact stores them.
    Stored(StoredRows),
}

impl From<Vec<f32>> for Leaf {
    fn from(v: Vec<f32>) -> Leaf {
        Leaf::Values(v)
    }
}

impl FromIterator<f32> for Leaf {
    fn from_iter<I: IntoIterator<Item = f32>>(it: I) -> Leaf {
        Leaf::Values(it.into_iter().collect())
    }
}

impl Operand for Leaf {
    fn rows(&self, k: usize) -> WeightRows<'_> {
        match self {
            Leaf::Values(v) => v.rows(k),
            Leaf::Stored(s) => s.rows(k),
        }
    }
}

/// A vector leaf's values. Vectors ([`Kind::Vector`], [`Kind::Norm`], [`Kind::ConvTaps`])
/// are always read whole into f32 by [`load`]: reading a stored matrix as a vector is a bug
/// in the model code, not an input error.
impl std::ops::Deref for Leaf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            Leaf::Values(v) => v,
            Leaf::Stored(_) => unreachable!("a stored matrix read as a vector"),
        }
    }
}

impl std::ops::DerefMut for Leaf {
    fn deref_mut(&mut self) -> &mut [f32] {
        match self {
            Leaf::Values(v) => v,
            Leaf::Stored(_) => unreachable!("a stored matrix read as a vector"),
        }
    }
}

impl Leaf {
    /// Bytes the leaf holds in memory (a stored matrix: none of its own; the map is the
    /// artifact's).
    pub fn resident_bytes(&self) -> usize {
        match self {
            Leaf::Values(v) => 4 * v.len(),
            Leaf::Stored(_) => 0,
        }
    }
}

pub type Weights = Model<Leaf>;
pub type Layer = layout::Layer<Leaf>;
pub type Mixer = layout::Mixer<Leaf>;
pub type Attention = layout::Attention<Leaf>;
pub type DeltaNet = layout::DeltaNet<Leaf>;
pub type Ffn = layout::Ffn<Leaf>;
pub type SwiGlu = layout::SwiGlu<Leaf>;
pub type Moe = layout::Moe<Leaf>;

/// Loads every tensor of `a` (matrices in place, vectors in f32); `progress` is called with
/// (tensors done, tensors total). A matrix is checked as it would be widened whole: a NaN or
/// infinity in it fails the load, naming it.
pub fn load(a: &Artifact, progress: &mut dyn FnMut(usize, usize)) -> Result<Weights> {
    let total = Model::count(&a.config);
    let mut done = 0;
    let mut tick = |n: usize| {
        done += n;
        progress(done, total);
    };
    Model::of(&a.config).try_map(&mut |t: &Tensor| {
        let leaf = match t.kind {
            Kind::Matrix => {
                let mut segments = Vec::with_capacity(t.parts.len());
                for name in t.names() {
                    let m = a.matrix(name)?;
                    segments.push(Segment {
                        first: 0,
                        rows: m.rows,
                        matrix: m,
                    });
                }
                Leaf::Stored(StoredRows::new(segments))
            }
            Kind::GatedQkv { heads, head_dim } => {
                let mut names = t.names();
                let mut next = || a.matrix(names.next().expect("q, k and v"));
                let q = next()?;
                let (k, v) = (next()?, next()?);
                let seg = |m: &crate::artifact::stored::StoredMatrix, first, rows| Segment {
                    matrix: m.clone(),
                    first,
                    rows,
                };
                // q_proj holds each head's query rows followed by its gate rows.
                let mut segments: Vec<Segment> = (0..heads)
                    .map(|h| seg(&q, 2 * h * head_dim, head_dim))
                    .collect();
                segments.push(seg(&k, 0, k.rows));
                segments.push(seg(&v, 0, v.rows));
                segments.extend((0..heads).map(|h| seg(&q, (2 * h + 1) * head_dim, head_dim)));
                Leaf::Stored(StoredRows::new(segments))
            }
            Kind::Vector | Kind::Norm { .. } | Kind::ConvTaps { .. } => {
                Leaf::Values(read(t, &mut |name| a.tensor_f32(name))?)
            }
        };
        tick(t.parts.len());
        Ok(leaf)
    })
}

/// One part laid out in f32 from its tensors, each read (widened to f32) by `tensor`.
pub fn read(t: &Tensor, tensor: &mut dyn FnMut(&str) -> Result<Vec<f32>>) -> Result<Vec<f32>> {
    let mut names = t.names();
    let mut next = || tensor(names.next().expect("a part has its tensors"));
    Ok(match t.kind {
        Kind::Matrix | Kind::Vector => {
            let mut m = Vec::with_capacity(t.elements());
            for _ in 0..t.parts.len() {
                m.extend(next()?);
            }
            m
        }
        Kind::GatedQkv { heads, head_dim } => {
            let (mut w, gate) = split_query_gate(&next()?, heads, head_dim);
            w.extend(next()?);
            w.extend(next()?);
            w.extend(gate);
            w
        }
        Kind::Norm { zero_centred } => {
            let mut w = next()?;
            if zero_centred {
                w.iter_mut().for_each(|x| *x += 1.0);
            }
            w
        }
        Kind::ConvTaps { channels, taps } => {
            let w = next()?; // [channels, 1, taps]
            (0..taps)
                .flat_map(|j| (0..channels).map(move |i| (i, j)))
                .map(|(i, j)| w[i * taps + j])
                .collect()
        }
    })
}
