//! Quantized Hugging Face checkpoints: ModelOpt NVFP4 / FP8 / MIXED_PRECISION,
//! compressed-tensors `nvfp4-pack-quantized` and `float-quantized`, and FP8-block
//! (`weight_scale_inv`) exports, recognised per tensor from names and dtypes.
//!
//! The payloads are kept as they are (no requantization), so an imported artifact scores the
//! very bytes a serving stack would load. The checkpoint's own quantization config is only a
//! cross-check: a tensor in a format the config does not claim, or a claim no tensor backs, is
//! an error, as is any scheme this build cannot dequantize exactly (AWQ, int4 packs, MXFP8,
//! ...), named with the tensor that shows it.

use super::{SourceTensor, TensorData};
use crate::artifact::source::{Deferred, Kind};
use crate::quant::fp8::{self, Fp8Scale, Fp8Tensor};
use crate::quant::nvfp4::{self, Global, Nvfp4Tensor};
use crate::quant::{Imported, QuantTensor};
use anyhow::{anyhow, bail, Context, Result};
use safetensors::tensor::Dtype;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One raw checkpoint tensor that belongs to a quantized linear, still in its file.
#[derive(Clone)]
pub struct Raw {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: crate::artifact::source::FileRange,
    pub origin: PathBuf,
}

/// Suffixes of the tensors a quantized linear `X` may have besides `X.weight`.
const PARTS: &[&str] = &[
    "weight_packed",
    "weight_scale",
    "weight_scale_2",
    "weight_scale_inv",
    "weight_global_scale",
    "input_scale",
    "input_global_scale",
    "k_scale",
    "v_scale",
    // Schemes this build refuses (named so that the refusal can say which).
    "pre_quant_scale",
    "weight_zero_point",
    "weight_shape",
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
];

fn split(name: &str) -> Option<(&str, &str)> {
    let (base, suffix) = name.rsplit_once('.')?;
    Some((base, suffix))
}

/// Whether a checkpoint tensor is part of a quantized linear (and so not a plain tensor).
pub fn is_part(name: &str, dtype: Dtype) -> bool {
    let Some((_, suffix)) = split(name) else {
        return false;
    };
    if suffix == "weight" {
        return !matches!(dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16);
    }
    PARTS.contains(&suffix)
}

/// The formats a checkpoint's config says it holds, and how it says so.
#[derive(Debug, Default)]
pub struct Claim {
    pub method: String,
    pub formats: BTreeSet<&'static str>,
}

fn algo_formats(algo: &str, source: &str) -> Result<BTreeSet<&'static str>> {
    Ok(match algo {
        "NVFP4" | "W4A16_NVFP4" => ["nvfp4"].into(),
        "FP8" | "FP8_PER_CHANNEL_PER_TOKEN" | "FP8_PB_WO" => ["fp8"].into(),
        "MIXED_PRECISION" => ["nvfp4", "fp8"].into(),
        other => bail!("{source}: quant_algo `{other}` is not supported (supported: NVFP4, W4A16_NVFP4, FP8, MIXED_PRECISION)"),
    })
}

/// Reads what `config.json`'s `quantization_config` and `hf_quant_config.json` claim.
pub fn read_claim(dir: &Path, config: &Value) -> Result<Option<Claim>> {
    let hf_quant = dir.join("hf_quant_config.json");
    if hf_quant.exists() {
        let bytes = crate::corpus::read_bounded(&hf_quant, "hf_quant_config.json", 16 << 20)
            .with_context(|| hf_quant.display().to_string())?;
        let v: Value = serde_json::from_slice(&bytes)
            .map_err(|e| anyhow!("{}: invalid JSON: {e}", hf_quant.display()))?;
        let shown = hf_quant.display().to_string();
        let algo = v
            .pointer("/quantization/quant_algo")
            .and_then(Value::as_str)
            .ok_or_else(|| anyhow!("{shown}: `quantization.quant_algo` is missing"))?;
        return Ok(Some(Claim {
            method: format!("modelopt {algo} (hf_quant_config.json)"),
            formats: algo_formats(algo, &shown)?,
        }));
    }
    let Some(q) = config.get("quantization_config") else {
        return Ok(None);
    };
    let shown = format!(
        "{}: `quantization_config`",
        dir.join("config.json").display()
    );
    let method = q
        .get("quant_method")
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("{shown}: `quant_method` is missing"))?;
    match method {
        "modelopt" => {
            let algo = q
                .get("quant_algo")
                .and_then(Value::as_str)
                .ok_or_else(|| anyhow!("{shown}: `quant_algo` is missing"))?;
            Ok(Some(Claim {
                method: format!("modelopt {algo} (config.json)"),
                formats: algo_formats(algo, &shown)?,
            }))
        }
        "compressed-tensors" => {
            let mut names: BTreeSet<String> = BTreeSet::new();
            if let Some(f) = q.get("format").and_then(Value::as_str) {
                names.insert(f.to_string());
            }
            if let Some(groups) = q.get("config_groups").and_then(Value::as_object) {
                for g in groups.values() {
                    if let Some(f) = g.get("format").and_then(Value::as_str) {
                        names.insert(f.to_string());
                    }
                }
            }
            names.remove("mixed-precision");
            if names.is_empty() {
                bail!("{shown}: no `format` names the compressed-tensors scheme");
            }
            let mut formats = BTreeSet::new();
            for f in &names {
                formats.insert(match f.as_str() {
                    "nvfp4-pack-quantized" => "nvfp4",
                    "float-quantized" => "fp8",
                    other => bail!("{shown}: compressed-tensors format `{other}` is not supported (supported: nvfp4-pack-quantized, float-quantized)"),
                });
            }
            let list: Vec<&str> = names.iter().map(String::as_str).collect();
            Ok(Some(Claim {
                method: format!("compressed-tensors {} (config.json)", list.join(", ")),
                formats,
            }))
        }
        "fp8" => {
            if let Some(b) = q.get("weight_block_size") {
                if b != &serde_json::json!([128, 128]) {
                    bail!("{shown}: weight_block_size {b} is not supported (only [128, 128])");
                }
            }
            Ok(Some(Claim {
                method: "fp8 (config.json)".into(),
                formats: ["fp8"].into(),
            }))
        }
        other => bail!("{shown}: quant_method `{other}` is not supported (supported: modelopt, compressed-tensors, fp8)"),
    }
}

fn f32s(r: &Raw, name: &str) -> Result<Vec<f32>> {
    crate::artifact::source::widen(r.dtype, &r.bytes.read()?).ok_or_else(|| {
        anyhow!(
            "{}: tensor `{name}` has dtype {:?}; scales must be F32, BF16 or F16",
            r.origin.display(),
            r.dtype
        )
    })
}

fn scalar(r: &Raw, name: &str) -> Result<f32> {
    let v = f32s(r, name)?;
    if v.len() != 1 || r.shape.iter().product::<usize>() != 1 {
        bail!(
            "{}: tensor `{name}` has shape {:?}; a global scale is one value",
            r.origin.display(),
            r.shape
        );
    }
    Ok(v[0])
}

/// One quantized linear from its parts.
fn linear(base: &str, parts: &mut BTreeMap<String, Raw>) -> Result<(String, QuantTensor)> {
    let key = |s: &str| format!("{base}.{s}");
    let refuse = |suffix: &str, scheme: &str| -> Result<()> {
        if parts.contains_key(&key(suffix)) {
            let r = &parts[&key(suffix)];
            bail!(
                "{}: tensor `{}` is {scheme}, which this build cannot dequantize exactly (supported: nvfp4, fp8)",
                r.origin.display(),
                key(suffix)
            );
        }
        Ok(())
    };
    refuse(
        "pre_quant_scale",
        "AWQ (a pre-quantization activation scale)",
    )?;
    refuse("weight_zero_point", "an integer scheme with zero points")?;
    refuse(
        "weight_shape",
        "a compressed-tensors integer pack (pack-quantized)",
    )?;
    for s in ["qweight", "qzeros", "scales", "g_idx"] {
        refuse(s, "a GPTQ/AWQ integer pack")?;
    }
    let name = key("weight");
    let payload_name = if parts.contains_key(&key("weight_packed")) {
        key("weight_packed")
    } else {
        name.clone()
    };
    let payload = parts.remove(&payload_name).ok_or_else(|| {
        let (n, r) = parts.iter().next().expect("called with at least one part");
        anyhow!(
            "{}: tensor `{n}` belongs to a quantized `{name}`, which the checkpoint does not have",
            r.origin.display()
        )
    })?;
    let from = payload.origin.display().to_string();
    let scale = parts.remove(&key("weight_scale"));
    let q = match (payload.dtype, payload.shape.as_slice()) {
        (Dtype::U8, &[o, half]) => {
            let scale = scale.ok_or_else(|| {
                anyhow!("{from}: tensor `{payload_name}` is U8 but has no `{base}.weight_scale`")
            })?;
            if scale.dtype == Dtype::U8 {
                bail!("{from}: tensor `{payload_name}` has U8 (e8m0) block scales: MXFP4 is not supported (supported: nvfp4, fp8)");
            }
            let i = 2 * half;
            if scale.dtype != Dtype::F8_E4M3 || scale.shape != [o, i / nvfp4::BLOCK] {
                bail!(
                    "{from}: tensor `{base}.weight_scale` is {:?} {:?}, but nvfp4 `{payload_name}` [{o}, {half}] needs F8_E4M3 [{o}, {}]",
                    scale.dtype,
                    scale.shape,
                    i / nvfp4::BLOCK
                );
            }
            let global = match (
                parts.remove(&key("weight_scale_2")),
                parts.remove(&key("weight_global_scale")),
            ) {
                (Some(g), None) => Global::Multiply(scalar(&g, &key("weight_scale_2"))?),
                (None, Some(g)) => Global::Divide(scalar(&g, &key("weight_global_scale"))?),
                (Some(_), Some(_)) => bail!(
                    "{from}: `{base}` has both weight_scale_2 and weight_global_scale; an nvfp4 matrix has one global scale"
                ),
                (None, None) => bail!(
                    "{from}: nvfp4 `{payload_name}` has no global scale (`{base}.weight_scale_2` or `{base}.weight_global_scale`)"
                ),
            };
            QuantTensor::Nvfp4(Nvfp4Tensor {
                rows: o,
                cols: i,
                packed: payload.bytes.read()?,
                block_scales: scale.bytes.read()?,
                global,
            })
        }
        (Dtype::F8_E4M3, &[o, i]) => {
            let (sname, s) = match (scale, parts.remove(&key("weight_scale_inv"))) {
                (Some(s), None) => (key("weight_scale"), s),
                (None, Some(s)) => (key("weight_scale_inv"), s),
                (Some(_), Some(_)) => bail!(
                    "{from}: `{base}` has both weight_scale and weight_scale_inv"
                ),
                (None, None) => bail!(
                    "{from}: fp8 `{name}` has no scale (`{base}.weight_scale` or `{base}.weight_scale_inv`)"
                ),
            };
            if s.dtype == Dtype::U8 || s.dtype == Dtype::F8_E8M0 {
                bail!("{from}: tensor `{sname}` holds e8m0 block scales: MXFP8 is not supported (supported: nvfp4, fp8)");
            }
            let v = f32s(&s, &sname)?;
            let block = [o.div_ceil(fp8::BLOCK), i.div_ceil(fp8::BLOCK)];
            let scale = match s.shape.as_slice() {
                [] | [1] => Fp8Scale::Tensor(v[0]),
                [n] | [n, 1] if *n == o => Fp8Scale::Channel(v),
                sh if sh == block => Fp8Scale::Block(v),
                sh => bail!(
                    "{from}: tensor `{sname}` has shape {sh:?}; fp8 scales of [{o}, {i}] are [], [1], [{o}], [{o}, 1] or {block:?} (128 x 128 blocks)"
                ),
            };
            QuantTensor::Fp8(Fp8Tensor {
                rows: o,
                cols: i,
                codes: payload.bytes.read()?,
                scale,
            })
        }
        (dtype, shape) => bail!(
            "{from}: tensor `{payload_name}` is {dtype:?} {shape:?}, which is not a weight format this build reads (nvfp4: U8 [O, I/2]; fp8: F8_E4M3 [O, I])"
        ),
    };
    q.dequantize()
        .with_context(|| format!("{from}: tensor `{name}`"))?;
    Ok((name, q))
}

/// A linear's parts must all have been used.
fn rest_is_empty(rest: &BTreeMap<String, Raw>, q: &QuantTensor, name: &str) -> Result<()> {
    if let Some((extra, r)) = rest.iter().next() {
        bail!(
            "{}: tensor `{extra}` does not belong to a {} `{name}`",
            r.origin.display(),
            q.format()
        );
    }
    Ok(())
}

/// Turns the collected parts into quantized source tensors; activation scales go to the
/// returned record. `claim` is what the config says.
pub fn assemble(
    mut parts: BTreeMap<String, Raw>,
    claim: Option<Claim>,
    config_path: &Path,
) -> Result<(Vec<SourceTensor>, Option<Imported>)> {
    let mut activation_scales = BTreeMap::new();
    let act: Vec<String> = parts
        .keys()
        .filter(|n| {
            split(n).is_some_and(|(_, s)| {
                matches!(
                    s,
                    "input_scale" | "input_global_scale" | "k_scale" | "v_scale"
                )
            })
        })
        .cloned()
        .collect();
    for n in act {
        let r = parts.remove(&n).expect("listed above");
        activation_scales.insert(n.clone(), scalar(&r, &n)?);
    }
    let mut by_base: BTreeMap<String, BTreeMap<String, Raw>> = BTreeMap::new();
    for (n, r) in parts {
        let base = split(&n).map(|(b, _)| b.to_string()).unwrap_or_default();
        by_base.entry(base).or_default().insert(n, r);
    }
    let mut out = Vec::new();
    let mut seen: BTreeSet<&'static str> = BTreeSet::new();
    for (base, group) in by_base {
        let origin = group.values().next().expect("non-empty").origin.clone();
        // Assembled (and checked) once now, with the memory of this one matrix, and again
        // when the writer reaches it.
        let mut rest = group.clone();
        let (name, q) = linear(&base, &mut rest)?;
        let group = rest_is_empty(&rest, &q, &name).map(|()| group)?;
        match &claim {
            None => bail!(
                "{}: tensor `{name}` is {}, but the checkpoint has no quantization config (config.json `quantization_config` or hf_quant_config.json)",
                origin.display(),
                q.format()
            ),
            Some(c) if !c.formats.contains(q.format()) => bail!(
                "{}: tensor `{name}` is {}, but the checkpoint's config says {}",
                origin.display(),
                q.format(),
                c.method
            ),
            Some(_) => {}
        }
        seen.insert(q.format());
        let kind = Kind::Quantized(crate::artifact::quantized::layout(&name, &q));
        let shape = vec![q.rows(), q.cols()];
        drop(q);
        out.push(SourceTensor {
            name,
            shape,
            data: TensorData::Deferred(Deferred::new(kind, move || {
                let (_, q) = linear(&base, &mut group.clone())?;
                Ok(TensorData::Quantized(q))
            })),
            origin,
        });
    }
    let Some(claim) = claim else {
        return Ok((out, None));
    };
    if seen.is_empty() {
        bail!(
            "{}: the config says the checkpoint is {}, but none of its tensors is quantized",
            config_path.display(),
            claim.method
        );
    }
    Ok((
        out,
        Some(Imported {
            method: claim.method,
            activation_scales,
        }),
    ))
}
