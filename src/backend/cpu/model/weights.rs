//! The CPU model's weights: the layout tree ([`crate::model::layout`]) with every part read
//! from the artifact and widened to f32. CUDA twin: `backend/cuda/model/weights.rs`, which loads
//! the same tree into device buffers.
//!
//! One leaf loader, [`read`], walks a part's tensors by its [`Kind`]: stacked matrices and
//! vectors are their parts one after another, a gated attention's q|k|v|gate is reordered,
//! a zero-centred norm becomes its scale `1 + w` once, a convolution is laid out tap-major.

use crate::artifact::Artifact;
use crate::model::layout::{self, split_query_gate, Kind, Model, Tensor};
use anyhow::Result;

/// A part of the CPU model: f32 values laid out as its [`Kind`] says.
pub type Leaf = Vec<f32>;
pub type Weights = Model<Leaf>;
pub type Layer = layout::Layer<Leaf>;
pub type Mixer = layout::Mixer<Leaf>;
pub type Attention = layout::Attention<Leaf>;
pub type DeltaNet = layout::DeltaNet<Leaf>;
pub type Ffn = layout::Ffn<Leaf>;
pub type SwiGlu = layout::SwiGlu<Leaf>;
pub type Moe = layout::Moe<Leaf>;

/// Loads every tensor of `a`; `progress` is called with (tensors done, tensors total).
pub fn load(a: &Artifact, progress: &mut dyn FnMut(usize, usize)) -> Result<Weights> {
    let total = Model::count(&a.config);
    let mut done = 0;
    Model::of(&a.config).try_map(&mut |t: &Tensor| {
        read(t, &mut |name| {
            let v = a.tensor_f32(name)?;
            done += 1;
            progress(done, total);
            Ok(v)
        })
    })
}

/// One part laid out from its tensors, each read (widened to f32) by `tensor`.
pub fn read(t: &Tensor, tensor: &mut dyn FnMut(&str) -> Result<Vec<f32>>) -> Result<Leaf> {
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
