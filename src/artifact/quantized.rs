//! How a quantized matrix is laid out in an artifact: its payload under the matrix's own
//! name and its scales beside it, named as ModelOpt exports them, so that `safetensors`
//! tools and the checkpoints people download agree on what each tensor is.
//!
//! | format | `N` (the matrix `[O, I]`) | `N_scale` | global |
//! |---|---|---|---|
//! | nvfp4 | U8 `[O, I/2]`, column `2i` in the low nibble | F8_E4M3 `[O, I/16]` | F32 `[]`: `N_scale_2` (multiplies) or `N_global_scale` (divides) |
//! | fp8 | F8_E4M3 `[O, I]` | F32 `[]`, `[O]` or `[ceil(O/128), ceil(I/128)]` | - |
//!
//! Dense matrices are F32 or BF16 under `N` with no companions. Which format a matrix has is
//! read from its dtype, and every companion must be present with the shape the format
//! implies; a stray companion is an error like any unknown tensor.

use crate::quant::fp8::{self, Fp8Scale, Fp8Tensor};
use crate::quant::nvfp4::{self, Global, Nvfp4Tensor};
use crate::quant::QuantTensor;
use anyhow::{bail, Result};
use safetensors::tensor::Dtype;

/// Suffix of the block or fp8 scales.
pub const SCALE: &str = "_scale";
/// Suffix of a multiplying nvfp4 global scale.
pub const GLOBAL_MULTIPLY: &str = "_scale_2";
/// Suffix of a dividing nvfp4 global scale.
pub const GLOBAL_DIVIDE: &str = "_global_scale";

/// One stored tensor of a quantized matrix.
pub struct Part {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The tensors (name, dtype, shape) that store a `[o, i]` matrix `name` quantized with
/// `scheme` by the packer: [`parts`]'s names and shapes, known before any value is (a
/// streamed writer lays out its header first).
pub fn part_shapes(
    name: &str,
    scheme: crate::quant::Scheme,
    o: usize,
    i: usize,
) -> Vec<(String, Dtype, Vec<usize>)> {
    match scheme {
        crate::quant::Scheme::Nvfp4 => vec![
            (name.to_string(), Dtype::U8, vec![o, i / 2]),
            (
                format!("{name}{SCALE}"),
                Dtype::F8_E4M3,
                vec![o, i / nvfp4::BLOCK],
            ),
            (format!("{name}{GLOBAL_MULTIPLY}"), Dtype::F32, vec![]),
        ],
        crate::quant::Scheme::Fp8Block => vec![
            (name.to_string(), Dtype::F8_E4M3, vec![o, i]),
            (
                format!("{name}{SCALE}"),
                Dtype::F32,
                vec![o.div_ceil(fp8::BLOCK), i.div_ceil(fp8::BLOCK)],
            ),
        ],
    }
}

/// The tensors (name, dtype, shape) that store `q` as the matrix `name`: [`parts`] without
/// the bytes.
pub fn layout(name: &str, q: &QuantTensor) -> Vec<(String, Dtype, Vec<usize>)> {
    let (o, i) = (q.rows(), q.cols());
    match q {
        QuantTensor::Nvfp4(t) => {
            let suffix = match t.global {
                Global::Multiply(_) => GLOBAL_MULTIPLY,
                Global::Divide(_) => GLOBAL_DIVIDE,
            };
            vec![
                (name.to_string(), Dtype::U8, vec![o, i / 2]),
                (
                    format!("{name}{SCALE}"),
                    Dtype::F8_E4M3,
                    vec![o, i / nvfp4::BLOCK],
                ),
                (format!("{name}{suffix}"), Dtype::F32, vec![]),
            ]
        }
        QuantTensor::Fp8(t) => {
            let shape = match &t.scale {
                Fp8Scale::Tensor(_) => vec![],
                Fp8Scale::Channel(_) => vec![o],
                Fp8Scale::Block(_) => vec![o.div_ceil(fp8::BLOCK), i.div_ceil(fp8::BLOCK)],
            };
            vec![
                (name.to_string(), Dtype::F8_E4M3, vec![o, i]),
                (format!("{name}{SCALE}"), Dtype::F32, shape),
            ]
        }
    }
}

/// The tensors that store `q` as the matrix `name`, in [`layout`]'s order.
pub fn parts(name: &str, q: &QuantTensor) -> Vec<Part> {
    let bytes: Vec<Vec<u8>> = match q {
        QuantTensor::Nvfp4(t) => vec![
            t.packed.clone(),
            t.block_scales.clone(),
            t.global.value().to_le_bytes().to_vec(),
        ],
        QuantTensor::Fp8(t) => vec![t.codes.clone(), f32_bytes(t.scale.values())],
    };
    layout(name, q)
        .into_iter()
        .zip(bytes)
        .map(|((name, dtype, shape), bytes)| Part {
            name,
            dtype,
            shape,
            bytes,
        })
        .collect()
}

/// Where a quantized matrix's parts are, once [`detect`] has checked them.
#[derive(Clone, Debug, PartialEq)]
pub enum Layout {
    Nvfp4 { divide: bool },
    Fp8,
}

impl Layout {
    pub fn format(&self) -> &'static str {
        match self {
            Layout::Nvfp4 { .. } => "nvfp4",
            Layout::Fp8 => "fp8",
        }
    }

    /// Every companion tensor's name.
    pub fn companions(&self, name: &str) -> Vec<String> {
        match self {
            Layout::Nvfp4 { divide } => vec![
                format!("{name}{SCALE}"),
                format!(
                    "{name}{}",
                    if *divide {
                        GLOBAL_DIVIDE
                    } else {
                        GLOBAL_MULTIPLY
                    }
                ),
            ],
            Layout::Fp8 => vec![format!("{name}{SCALE}")],
        }
    }
}

/// What the reader knows of a stored tensor.
pub struct Stored<'a> {
    pub dtype: Dtype,
    pub shape: &'a [usize],
}

/// The layout of matrix `name` (`[o, i]` by the config) whose payload has `payload`'s dtype
/// and shape; `lookup` finds a companion. `Ok(None)`: a dense matrix.
pub fn detect<'a>(
    name: &str,
    o: usize,
    i: usize,
    payload: Stored<'_>,
    lookup: impl Fn(&str) -> Option<Stored<'a>>,
) -> Result<Option<Layout>> {
    let need = |suffix: &str, dtype: Dtype, shape: &[usize]| -> Result<()> {
        let full = format!("{name}{suffix}");
        match lookup(&full) {
            None => bail!("tensor `{full}` is missing (the scales of a quantized `{name}`)"),
            Some(s) if s.dtype != dtype || s.shape != shape => bail!(
                "tensor `{full}` is {:?} {:?}, but the scales of `{name}` must be {dtype:?} {shape:?}",
                s.dtype,
                s.shape
            ),
            Some(_) => Ok(()),
        }
    };
    match payload.dtype {
        Dtype::U8 => {
            if !i.is_multiple_of(nvfp4::BLOCK) {
                bail!(
                    "tensor `{name}` is nvfp4, but its input dimension {i} is not a multiple of {}",
                    nvfp4::BLOCK
                );
            }
            if payload.shape != [o, i / 2] {
                bail!(
                    "tensor `{name}` is nvfp4 (U8) with shape {:?}, but [{o}, {i}] packs to [{o}, {}]",
                    payload.shape,
                    i / 2
                );
            }
            need(SCALE, Dtype::F8_E4M3, &[o, i / nvfp4::BLOCK])?;
            let (m, d) = (
                lookup(&format!("{name}{GLOBAL_MULTIPLY}")).is_some(),
                lookup(&format!("{name}{GLOBAL_DIVIDE}")).is_some(),
            );
            let divide = match (m, d) {
                (true, false) => false,
                (false, true) => true,
                (true, true) => bail!(
                    "tensor `{name}` has both `{name}{GLOBAL_MULTIPLY}` and `{name}{GLOBAL_DIVIDE}`; an nvfp4 matrix has one global scale"
                ),
                (false, false) => bail!(
                    "tensor `{name}{GLOBAL_MULTIPLY}` is missing (the global scale of a quantized `{name}`)"
                ),
            };
            need(
                if divide {
                    GLOBAL_DIVIDE
                } else {
                    GLOBAL_MULTIPLY
                },
                Dtype::F32,
                &[],
            )?;
            Ok(Some(Layout::Nvfp4 { divide }))
        }
        Dtype::F8_E4M3 => {
            if payload.shape != [o, i] {
                bail!(
                    "tensor `{name}` has shape {:?}, but the config implies [{o}, {i}]",
                    payload.shape
                );
            }
            let full = format!("{name}{SCALE}");
            let s = lookup(&full).ok_or_else(|| {
                anyhow::anyhow!("tensor `{full}` is missing (the scales of an fp8 `{name}`)")
            })?;
            let block = [o.div_ceil(fp8::BLOCK), i.div_ceil(fp8::BLOCK)];
            let ok = s.shape.is_empty() || s.shape == [o] || s.shape == block;
            if s.dtype != Dtype::F32 || !ok {
                bail!(
                    "tensor `{full}` is {:?} {:?}; fp8 scales of `{name}` are F32 [], [{o}] or {block:?}",
                    s.dtype,
                    s.shape
                );
            }
            Ok(Some(Layout::Fp8))
        }
        _ => Ok(None),
    }
}

fn f32_values(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Rebuilds the matrix from its parts (checked by [`detect`]); `part` returns a part's shape
/// and bytes.
pub fn assemble<'a>(
    name: &str,
    layout: &Layout,
    o: usize,
    i: usize,
    part: impl Fn(&str) -> (&'a [usize], &'a [u8]),
) -> QuantTensor {
    match layout {
        Layout::Nvfp4 { divide } => {
            let g = f32_values(part(&layout.companions(name)[1]).1)[0];
            QuantTensor::Nvfp4(Nvfp4Tensor {
                rows: o,
                cols: i,
                packed: part(name).1.to_vec(),
                block_scales: part(&format!("{name}{SCALE}")).1.to_vec(),
                global: if *divide {
                    Global::Divide(g)
                } else {
                    Global::Multiply(g)
                },
            })
        }
        Layout::Fp8 => {
            let (shape, bytes) = part(&format!("{name}{SCALE}"));
            let v = f32_values(bytes);
            let scale = match shape.len() {
                0 => Fp8Scale::Tensor(v[0]),
                1 => Fp8Scale::Channel(v),
                _ => Fp8Scale::Block(v),
            };
            QuantTensor::Fp8(Fp8Tensor {
                rows: o,
                cols: i,
                codes: part(name).1.to_vec(),
                scale,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn round_trip(q: QuantTensor) {
        let name = "model.layers.0.mlp.up_proj.weight";
        let parts: BTreeMap<String, Part> = parts(name, &q)
            .into_iter()
            .map(|p| (p.name.clone(), p))
            .collect();
        let stored = |n: &str| {
            parts.get(n).map(|p| Stored {
                dtype: p.dtype,
                shape: &p.shape,
            })
        };
        let (o, i) = (q.rows(), q.cols());
        let layout = detect(name, o, i, stored(name).unwrap(), stored)
            .unwrap()
            .unwrap();
        let back = assemble(name, &layout, o, i, |n| {
            let p = &parts[n];
            (&p.shape[..], &p.bytes[..])
        });
        assert_eq!(back, q);
        // A missing companion is named.
        let scale = format!("{name}{SCALE}");
        let e = detect(name, o, i, stored(name).unwrap(), |n| {
            if n == scale {
                None
            } else {
                stored(n)
            }
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains(&scale) && e.contains("missing"), "{e}");
    }

    #[test]
    fn parts_and_detection_round_trip() {
        let w: Vec<f32> = (0..256 * 48)
            .map(|k| ((k % 37) as f32 - 18.0) / 7.0)
            .collect();
        round_trip(QuantTensor::Nvfp4(
            nvfp4::quantize_group(&[&w], 48).remove(0),
        ));
        // 256 rows and 16384 columns would make a block grid as long as the rows: shapes,
        // not lengths, tell block from channel scales.
        round_trip(QuantTensor::Fp8(fp8::quantize_block(&w, 256, 48)));
        let mut ch = fp8::quantize_block(&w, 256, 48);
        ch.scale = Fp8Scale::Channel(vec![0.5; 256]);
        round_trip(QuantTensor::Fp8(ch));
    }

    #[test]
    fn a_payload_that_does_not_pack_the_config_shape_is_refused() {
        let e = detect(
            "m.weight",
            4,
            32,
            Stored {
                dtype: Dtype::U8,
                shape: &[4, 32],
            },
            |_| None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("packs to [4, 16]"), "{e}");
        let e = detect(
            "m.weight",
            4,
            24,
            Stored {
                dtype: Dtype::U8,
                shape: &[4, 12],
            },
            |_| None,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("not a multiple of 16"), "{e}");
    }
}
