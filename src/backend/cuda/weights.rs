//! The model's weights on the device: the artifact's tensors widened to f32 and stored in
//! the compute precision, the stacked matrices built from [`crate::model::tensors`]'s groups
//! exactly as the CPU path stacks them.

use super::device::{DevBuf, Gpu};
use super::launch::{self, Any, Ptr};
use super::plan::{self, Precision};
use crate::artifact::Artifact;
use crate::model::config::ModelConfig;
use crate::model::tensors::{split_query_gate, FfnTensors, Fused, MixerTensors, ModelTensors};
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
                let (dtype, bytes) = super::random::tensor_bytes(name, &shape, *seed);
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

/// A softmax attention block's weights.
pub(super) struct AttnW {
    /// `[q + 2kv, d]`, or `[q + 2kv + q, d]` with the output gate's rows last (as the CPU).
    pub(super) wqkv: DevBuf,
    pub(super) bqkv: Option<DevBuf>,
    pub(super) q_norm: Option<DevBuf>,
    pub(super) k_norm: Option<DevBuf>,
    pub(super) wo: DevBuf, // [d, q]
    /// Attention's output is multiplied by `sigmoid(gate)`.
    pub(super) gated: bool,
}

/// A Gated DeltaNet block's weights (f32 vectors, matrices in the precision).
pub(super) struct DeltaW {
    pub(super) w_in: DevBuf, // [conv_dim + Hv·Dv + 2·Hv, d]: q|k|v, z, b, a
    /// `[K, conv_dim]` f32, tap-major (tap K − 1 multiplies the current token).
    pub(super) conv: DevBuf,
    pub(super) dt_bias: DevBuf, // [Hv]
    pub(super) a_log: DevBuf,   // [Hv]
    pub(super) norm: DevBuf,    // [Dv], plain
    pub(super) w_out: DevBuf,   // [d, Hv·Dv]
}

pub(super) enum MixerW {
    Attention(AttnW),
    DeltaNet(DeltaW),
}

/// A SwiGLU MLP's matrices in the precision.
pub(super) struct SwiGluW {
    pub(super) wgu: DevBuf,   // [2F, d]: gate rows, then up rows
    pub(super) wdown: DevBuf, // [d, F]
}

/// A sparse MoE block's weights, each expert's matrices one after another in one buffer so
/// a GEMM addresses expert `e` at an offset.
pub(super) struct MoeW {
    pub(super) router: DevBuf, // [E, d]
    pub(super) wgu: DevBuf,    // [E, 2I, d]
    pub(super) wdown: DevBuf,  // [E, d, I]
    /// The shared expert (width `Is`) and its gate `[1, d]`.
    pub(super) shared: Option<(SwiGluW, DevBuf)>,
}

pub(super) enum FfnW {
    Dense(SwiGluW),
    Moe(MoeW),
}

pub(super) struct LayerW {
    pub(super) attn_norm: DevBuf,
    pub(super) mixer: MixerW,
    pub(super) mlp_norm: DevBuf,
    pub(super) ffn: FfnW,
}

pub(super) struct DevWeights {
    pub(super) embed: DevBuf,
    pub(super) layers: Vec<LayerW>,
    pub(super) final_norm: DevBuf,
    pub(super) lm_head: Option<DevBuf>,
}

impl DevWeights {
    /// Uploads every tensor, one at a time (host memory holds at most one widened tensor).
    /// `progress` sees (tensors done, tensors total). Zero-centred norm weights (qwen3_5)
    /// become their scale `1 + w` in f32, exactly as the CPU loader computes it.
    pub(super) fn upload(
        a: &Source,
        gpu: &Gpu,
        precision: Precision,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<DevWeights> {
        let c = a.config();
        let names = ModelTensors::of(c);
        let total = ModelTensors::count(c);
        let zero_centred = c.zero_centred_norms();
        let mut done = 0usize;
        let e = precision.elem_bytes();
        let mut tick = |n: usize| {
            done += n;
            progress(done, total);
        };
        // Writes tensor `n` into `buf` at byte `off` in the precision's element type;
        // returns the bytes written. Quantized tensors cross to the device as stored and are
        // dequantized there.
        let part = |buf: &DevBuf, off: usize, n: &str| -> Result<usize> {
            if let Some(q) = a.quantized(n) {
                dequantize_into(gpu, &q?, precision, buf, off, n, a.label())
            } else {
                let bytes = to_device_elems(&a.tensor_f32(n)?, precision);
                gpu.write(buf, off, &bytes)?;
                Ok(bytes.len())
            }
        };
        // A stacked matrix: its parts' rows concatenated.
        let matrix = |f: &Fused, tick: &mut dyn FnMut(usize)| -> Result<DevBuf> {
            let buf = gpu.alloc(f.rows * f.cols * e)?;
            let mut off = 0;
            for n in &f.parts {
                off += part(&buf, off, n)?;
                tick(1);
            }
            debug_assert_eq!(off, buf.bytes);
            Ok(buf)
        };
        // A gated attention's q|k|v|gate: q_proj interleaves each head's query and gate
        // rows, so it is widened on the host (the CPU loader's values), split, and written
        // around k and v.
        let gated_qkv = |f: &Fused, tick: &mut dyn FnMut(usize)| -> Result<DevBuf> {
            let buf = gpu.alloc(f.rows * f.cols * e)?;
            let (q, gate) = split_query_gate(&a.tensor_f32(&f.parts[0])?, c.num_heads, c.head_dim);
            tick(1);
            let mut off = 0;
            let q = to_device_elems(&q, precision);
            gpu.write(&buf, off, &q)?;
            off += q.len();
            for n in &f.parts[1..] {
                off += part(&buf, off, n)?;
                tick(1);
            }
            gpu.write(&buf, off, &to_device_elems(&gate, precision))?;
            Ok(buf)
        };
        // A vector (or stacked vectors) in f32; `norm`: an RMSNorm scale.
        let vector =
            |parts: &[String], norm: bool, tick: &mut dyn FnMut(usize)| -> Result<DevBuf> {
                let mut v = Vec::new();
                for n in parts {
                    v.extend(a.tensor_f32(n)?);
                    tick(1);
                }
                if norm && zero_centred {
                    v.iter_mut().for_each(|x| *x += 1.0);
                }
                gpu.upload(&v)
            };
        let one =
            |n: &String, tick: &mut dyn FnMut(usize)| vector(std::slice::from_ref(n), false, tick);
        let norm =
            |n: &String, tick: &mut dyn FnMut(usize)| vector(std::slice::from_ref(n), true, tick);
        let embed = matrix(&names.embed, &mut tick)?;
        let mut layers = Vec::with_capacity(names.layers.len());
        for l in &names.layers {
            let attn_norm = norm(&l.norm, &mut tick)?;
            let mixer = match &l.mixer {
                MixerTensors::Attention(at) => MixerW::Attention(AttnW {
                    wqkv: if at.gated {
                        gated_qkv(&at.qkv, &mut tick)?
                    } else {
                        matrix(&at.qkv, &mut tick)?
                    },
                    bqkv: at
                        .qkv_bias
                        .as_ref()
                        .map(|b| vector(&b.parts, false, &mut tick))
                        .transpose()?,
                    q_norm: at.q_norm.as_ref().map(|n| norm(n, &mut tick)).transpose()?,
                    k_norm: at.k_norm.as_ref().map(|n| norm(n, &mut tick)).transpose()?,
                    wo: matrix(&at.o_proj, &mut tick)?,
                    gated: at.gated,
                }),
                MixerTensors::DeltaNet(g) => {
                    let h = c.hybrid.as_ref().expect("a Gated DeltaNet layer is hybrid");
                    let (ch, kw) = (h.conv_dim(), h.linear_conv_kernel_dim);
                    let w = a.tensor_f32(&g.conv)?; // [conv_dim, 1, K]
                    tick(1);
                    let taps: Vec<f32> = (0..kw)
                        .flat_map(|j| (0..ch).map(move |i| (i, j)))
                        .map(|(i, j)| w[i * kw + j])
                        .collect();
                    MixerW::DeltaNet(DeltaW {
                        w_in: matrix(&g.in_proj, &mut tick)?,
                        conv: gpu.upload(&taps)?,
                        dt_bias: one(&g.dt_bias, &mut tick)?,
                        a_log: one(&g.a_log, &mut tick)?,
                        norm: one(&g.norm, &mut tick)?, // the gated norm is plain
                        w_out: matrix(&g.out_proj, &mut tick)?,
                    })
                }
            };
            let mlp_norm = norm(&l.mlp.norm().to_string(), &mut tick)?;
            let swiglu = |gate_up: &Fused, down: &Fused, tick: &mut dyn FnMut(usize)| {
                Ok::<_, anyhow::Error>(SwiGluW {
                    wgu: matrix(gate_up, tick)?,
                    wdown: matrix(down, tick)?,
                })
            };
            let ffn = match &l.mlp {
                FfnTensors::Dense(mlp) => FfnW::Dense(swiglu(&mlp.gate_up, &mlp.down, &mut tick)?),
                FfnTensors::Moe(moe) => {
                    // Experts' matrices stacked: expert e's rows follow expert e - 1's.
                    let stacked = |parts: Vec<&Fused>, tick: &mut dyn FnMut(usize)| {
                        let (rows, cols) = (parts[0].rows, parts[0].cols);
                        let buf = gpu.alloc(parts.len() * rows * cols * e)?;
                        let mut off = 0;
                        for f in parts {
                            if (f.rows, f.cols) != (rows, cols) {
                                anyhow::bail!(
                                    "{}: expert matrix {} is [{}, {}], not [{rows}, {cols}] like the others",
                                    a.label(),
                                    f.parts[0],
                                    f.rows,
                                    f.cols
                                );
                            }
                            for n in &f.parts {
                                off += part(&buf, off, n)?;
                                tick(1);
                            }
                        }
                        debug_assert_eq!(off, buf.bytes);
                        Ok::<_, anyhow::Error>(buf)
                    };
                    let (experts, d) = (moe.experts.len(), c.hidden_size);
                    let router = matrix(&Fused::one(moe.router.clone(), experts, d), &mut tick)?;
                    let wgu = stacked(moe.experts.iter().map(|x| &x.gate_up).collect(), &mut tick)?;
                    let wdown = stacked(moe.experts.iter().map(|x| &x.down).collect(), &mut tick)?;
                    let shared = match &moe.shared {
                        Some((x, gate)) => Some((
                            swiglu(&x.gate_up, &x.down, &mut tick)?,
                            matrix(&Fused::one(gate.clone(), 1, d), &mut tick)?,
                        )),
                        None => None,
                    };
                    FfnW::Moe(MoeW {
                        router,
                        wgu,
                        wdown,
                        shared,
                    })
                }
            };
            layers.push(LayerW {
                attn_norm,
                mixer,
                mlp_norm,
                ffn,
            });
        }
        let final_norm = norm(&names.final_norm, &mut tick)?;
        let lm_head = names
            .lm_head
            .as_ref()
            .map(|h| matrix(h, &mut tick))
            .transpose()?;
        Ok(DevWeights {
            embed,
            layers,
            final_norm,
            lm_head,
        })
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
