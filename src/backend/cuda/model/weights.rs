//! The CUDA model's weights: the layout tree ([`crate::model::layout`]) with every part in a
//! device buffer. CPU twin: `backend/cpu/model/weights.rs`, which reads the same tree into f32 and whose
//! leaf reader this one reuses for everything but the matrices.

use crate::artifact::Artifact;
use crate::backend::cuda::device::{DevBuf, Gpu};
use crate::backend::cuda::launch::{self, Any, Ptr};
use crate::backend::cuda::plan::{self, Precision};
use crate::model::config::ModelConfig;
use crate::model::layout::{self, Kind, Model, Tensor};
use crate::quant::fp8::Fp8Scale;
use crate::quant::nvfp4::Global;
use crate::quant::QuantTensor;
use anyhow::{anyhow, Result};
use rayon::prelude::*;

/// Where the weights come from: an artifact, or random values generated in memory (the
/// GPU benchmark's large shapes, never written to disk).
pub enum Source<'a> {
    Artifact(&'a Artifact),
    Random {
        config: &'a ModelConfig,
        seed: u64,
        /// Every tensor's shape by name (a MoE model has tens of thousands).
        shapes: std::collections::HashMap<String, Vec<usize>>,
    },
}

impl<'a> Source<'a> {
    /// Random weights of `config` for `seed`.
    pub fn random(config: &'a ModelConfig, seed: u64) -> Source<'a> {
        Source::Random {
            config,
            seed,
            shapes: config.expected_tensors().into_iter().collect(),
        }
    }
}

impl Source<'_> {
    pub fn config(&self) -> &ModelConfig {
        match self {
            Source::Artifact(a) => &a.config,
            Source::Random { config, .. } => config,
        }
    }

    /// A quantized matrix as stored, when the source has one under `name`.
    fn quantized(&self, name: &str) -> Option<Result<QuantTensor>> {
        match self {
            Source::Artifact(a) => a.quantized(name),
            Source::Random { .. } => None,
        }
    }

    /// What error messages name as the file.
    fn label(&self) -> String {
        match self {
            Source::Artifact(a) => a.path().display().to_string(),
            Source::Random { .. } => "random weights".to_string(),
        }
    }

    /// One tensor widened to f32 (random ones: the values `write_random_artifact` stores).
    fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        match self {
            Source::Artifact(a) => a.tensor_f32(name),
            Source::Random { seed, shapes, .. } => {
                let shape = shapes
                    .get(name)
                    .cloned()
                    .ok_or_else(|| anyhow!("random weights: no tensor {name}"))?;
                let (dtype, bytes) = crate::artifact::random::tensor_bytes(name, &shape, *seed);
                Ok(match dtype {
                    "F32" => bytes
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                    _ => bytes
                        .chunks_exact(2)
                        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect(),
                })
            }
        }
    }
}

/// A part of the CUDA model: a device buffer laid out as its [`Kind`] says (matrices in the
/// compute precision, vectors and norms in f32).
pub type Leaf = DevBuf;
pub(super) type DevWeights = Model<Leaf>;
pub(super) type Moe = layout::Moe<Leaf>;

/// Uploads every tensor, one part at a time (host memory holds at most one widened
/// tensor). `progress` sees (tensors done, tensors total).
pub(super) fn upload(
    a: &Source,
    gpu: &Gpu,
    precision: Precision,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<DevWeights> {
    let total = Model::count(a.config());
    let mut done = 0usize;
    let mut tick = |n: usize| {
        done += n;
        progress(done, total);
    };
    Model::of(a.config()).try_map(&mut |t: &Tensor| {
        let buf = upload_part(a, gpu, precision, t)?;
        tick(t.parts.len());
        Ok(buf)
    })
}

/// One part on the device. Quantized matrices cross to the device as stored and are
/// dequantized there; everything else is widened on the host (the CPU loader's values,
/// `model::weights::read`) and converted to the buffer's element type.
fn upload_part(a: &Source, gpu: &Gpu, precision: Precision, t: &Tensor) -> Result<DevBuf> {
    let widened =
        |t: &Tensor| crate::backend::cpu::model::weights::read(t, &mut |n| a.tensor_f32(n));
    match t.kind {
        Kind::Matrix => {
            let e = precision.elem_bytes();
            let buf = gpu.alloc(t.elements() * e)?;
            let mut off = 0;
            for n in t.names() {
                off += match a.quantized(n) {
                    Some(q) => dequantize_into(gpu, &q?, precision, &buf, off, n, a.label())?,
                    None => {
                        let bytes = to_device_elems(&a.tensor_f32(n)?, precision);
                        gpu.write(&buf, off, &bytes)?;
                        bytes.len()
                    }
                };
            }
            debug_assert_eq!(off, buf.bytes);
            Ok(buf)
        }
        // q_proj interleaves each head's query and gate rows: widened on the host and
        // reordered (k and v with it, the same values a quantized k or v dequantizes to).
        Kind::GatedQkv { .. } => {
            let buf = gpu.alloc(t.elements() * precision.elem_bytes())?;
            gpu.write(&buf, 0, &to_device_elems(&widened(t)?, precision))?;
            Ok(buf)
        }
        Kind::Vector | Kind::Norm { .. } | Kind::ConvTaps { .. } => gpu.upload(&widened(t)?),
    }
}

/// Dequantizes `q` on the device into `dst` at byte `offset`, in the precision's element
/// type; returns the bytes written. A non-finite weight is the CPU loader's error.
pub fn dequantize_into(
    gpu: &Gpu,
    q: &QuantTensor,
    precision: Precision,
    dst: &DevBuf,
    offset: usize,
    name: &str,
    file: String,
) -> Result<usize> {
    let n = q.rows() * q.cols();
    let e = precision.elem_bytes();
    if offset + n * e > dst.bytes {
        anyhow::bail!("{file}: tensor `{name}` does not fit its stacked matrix");
    }
    let out_bf16 = (precision == Precision::Bf16) as i32;
    let err = gpu.upload(&[u64::MAX])?;
    let out = Ptr::<Any>::new(dst.at(offset));
    let grid = (plan::blocks_for(n, 256), 1, 1);
    match q {
        QuantTensor::Nvfp4(t) => {
            let (packed, bscale) = (gpu.upload(&t.packed)?, gpu.upload(&t.block_scales)?);
            let (g, divide) = match t.global {
                Global::Multiply(g) => (g, 0),
                Global::Divide(g) => (g, 1),
            };
            gpu.launch(
                "dequant_nvfp4",
                grid,
                256,
                0,
                &launch::DequantNvfp4 {
                    packed: Ptr::new(packed.ptr),
                    bscale: Ptr::new(bscale.ptr),
                    g,
                    divide,
                    n: n as i64,
                    out,
                    out_bf16,
                    err: Ptr::new(err.ptr),
                },
            )?;
        }
        QuantTensor::Fp8(t) => {
            let (kind, scales): (i32, &[f32]) = match &t.scale {
                Fp8Scale::Tensor(s) => (0, std::slice::from_ref(s)),
                Fp8Scale::Channel(v) => (1, v),
                Fp8Scale::Block(v) => (2, v),
            };
            let (codes, scale) = (gpu.upload(&t.codes)?, gpu.upload(scales)?);
            gpu.launch(
                "dequant_fp8",
                grid,
                256,
                0,
                &launch::DequantFp8 {
                    codes: Ptr::new(codes.ptr),
                    scale: Ptr::new(scale.ptr),
                    kind,
                    rows: t.rows as i64,
                    cols: t.cols as i32,
                    out,
                    out_bf16,
                    err: Ptr::new(err.ptr),
                },
            )?;
        }
    }
    let first = gpu.read::<u64>(&err, 0, 1)?[0];
    if first != u64::MAX {
        anyhow::bail!("{file}: tensor `{name}` holds a non-finite value at flat index {first}");
    }
    Ok(n * e)
}

fn to_device_elems(v: &[f32], p: Precision) -> Vec<u8> {
    match p {
        Precision::F32 => bytemuck::cast_slice::<f32, u8>(v).to_vec(),
        Precision::Bf16 => {
            let b: Vec<u16> = v
                .par_iter()
                .map(|&x| half::bf16::from_f32(x).to_bits())
                .collect();
            bytemuck::cast_slice::<u16, u8>(&b).to_vec()
        }
    }
}
