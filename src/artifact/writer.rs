//! Writes a [`PackSource`] as a `.ninfer` file, streamed ([`super::stream`]): the layout is
//! planned from the config and each source tensor's [`Kind`] before any weight is read, then
//! each tensor (each nvfp4 scale group: the matrices that share a global scale) is read,
//! checked, encoded and written, and dropped before the next. Peak memory is a few times the
//! largest tensor or group, not the model.

use super::source::{Kind, PackSource, SourceTensor, TensorData};
use super::stream::{self, Entry};
use super::{is_vector_tensor, quantized, Provenance, WeightFormat, FORMAT_VERSION, MAGIC};
use crate::quant::{select, Imported, QuantTensor, Scheme};
use anyhow::{bail, Context, Result};
use safetensors::tensor::Dtype;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

/// How the packer stores the weights: dense tensors in `dense`, and with `quantize` the
/// selected matrices (see [`crate::quant::select`]) in that scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightPlan {
    pub dense: WeightFormat,
    pub quantize: Option<Scheme>,
    /// Quantize the output head too (`--quantize-head`).
    pub head: bool,
}

impl From<WeightFormat> for WeightPlan {
    fn from(dense: WeightFormat) -> Self {
        WeightPlan {
            dense,
            quantize: None,
            head: false,
        }
    }
}

/// What makes a stored tensor.
#[derive(Clone)]
enum Unit {
    /// A dense tensor: the source tensor of that name, in the pack's dense format.
    Dense(String),
    /// A matrix the source holds quantized: its parts, as they are.
    Imported(String),
    /// The matrices of one scale group, quantized together by the pack.
    Group(String),
}

/// `data` (resolved, of source tensor `t` named `name`) as values: as many as its shape, all
/// finite.
fn checked_values(t: &SourceTensor, name: &str, data: Cow<'_, TensorData>) -> Result<Vec<f32>> {
    let from = t.origin.display();
    let v = match data.into_owned() {
        TensorData::Values(v) => v,
        TensorData::Raw { dtype, bytes } => super::source::widened(dtype, &bytes)
            .with_context(|| format!("{from}: tensor `{name}`"))?,
        _ => bail!("{from}: tensor `{name}` turned out quantized, which its reader did not say"),
    };
    if v.len() != t.shape.iter().product::<usize>() {
        bail!(
            "{from}: tensor `{name}`: {} values for shape {:?}",
            v.len(),
            t.shape
        );
    }
    if let Some(i) = v.iter().position(|v| !v.is_finite()) {
        bail!("{from}: tensor `{name}` holds a non-finite value at flat index {i}");
    }
    Ok(v)
}

/// Makes the stored tensors in name order, keeping the parts made but not yet written (a
/// group's other matrices come later in name order).
struct Maker<'a> {
    src: BTreeMap<&'a str, &'a SourceTensor>,
    unit_of: BTreeMap<String, Unit>,
    /// Each group's matrices (name, rows, cols), in the config's order.
    groups: BTreeMap<String, Vec<(String, usize, usize)>>,
    plan: WeightPlan,
    ready: BTreeMap<String, Vec<u8>>,
}

impl Maker<'_> {
    /// The values of source tensor `name`, checked: as many as its shape, all finite.
    fn values(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.src[name];
        let data = t
            .data
            .resolve()
            .with_context(|| format!("tensor `{name}`"))?;
        checked_values(t, name, data)
    }

    /// The stored bytes of the dense source tensor `name` as `dtype`: the source's own bytes
    /// when it holds them in that dtype (a bf16 checkpoint packed as bf16: copied, never
    /// widened; the bits are those of widening and narrowing back), else its values encoded.
    /// Either way checked like [`Maker::values`].
    fn dense(&self, name: &str, dtype: Dtype) -> Result<Vec<u8>> {
        let t = self.src[name];
        let from = t.origin.display();
        let data = t
            .data
            .resolve_raw()
            .with_context(|| format!("tensor `{name}`"))?;
        if let TensorData::Raw { dtype: d, bytes } = data.as_ref() {
            let finite: Option<fn(&[u8]) -> bool> = match (*d, dtype) {
                (Dtype::BF16, Dtype::BF16) => {
                    Some(|b| half::bf16::from_le_bytes([b[0], b[1]]).is_finite())
                }
                (Dtype::F32, Dtype::F32) => {
                    Some(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite())
                }
                _ => None,
            };
            if let Some(finite) = finite {
                let size = dtype.bitsize() / 8;
                if bytes.len() != t.shape.iter().product::<usize>() * size {
                    bail!(
                        "{from}: tensor `{name}`: {} bytes for shape {:?}",
                        bytes.len(),
                        t.shape
                    );
                }
                if let Some(i) = bytes.chunks_exact(size).position(|b| !finite(b)) {
                    bail!("{from}: tensor `{name}` holds a non-finite value at flat index {i}");
                }
                return Ok(match data {
                    Cow::Owned(TensorData::Raw { bytes, .. }) => bytes,
                    borrowed => match borrowed.as_ref() {
                        TensorData::Raw { bytes, .. } => bytes.clone(),
                        _ => unreachable!("matched above"),
                    },
                });
            }
        }
        let v = checked_values(t, name, data)?;
        Ok(match dtype {
            Dtype::F32 => bytemuck::cast_slice::<f32, u8>(&v).to_vec(),
            _ => v
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
        })
    }

    fn keep(&mut self, name: &str, q: &QuantTensor) {
        for p in quantized::parts(name, q) {
            self.ready.insert(p.name, p.bytes);
        }
    }

    fn bytes(&mut self, e: &Entry) -> Result<Vec<u8>> {
        if let Some(b) = self.ready.remove(&e.0) {
            return Ok(b);
        }
        match self.unit_of.get(&e.0).cloned() {
            Some(Unit::Dense(name)) => self.dense(&name, e.1),
            Some(Unit::Imported(name)) => {
                let t = self.src[name.as_str()];
                let from = t.origin.display();
                let data = t
                    .data
                    .resolve()
                    .with_context(|| format!("tensor `{name}`"))?;
                let TensorData::Quantized(q) = data.as_ref() else {
                    bail!("{from}: tensor `{name}` turned out not quantized, which its reader did not say");
                };
                if t.shape.len() != 2 || [q.rows(), q.cols()] != t.shape[..] {
                    bail!(
                        "{from}: tensor `{name}` is a quantized [{}, {}], the config implies {:?}",
                        q.rows(),
                        q.cols(),
                        t.shape
                    );
                }
                q.dequantize()
                    .with_context(|| format!("{from}: tensor `{name}`"))?;
                let q = q.clone();
                self.keep(&name, &q);
                self.take(&e.0)
            }
            Some(Unit::Group(key)) => {
                let members = self.groups[&key].clone();
                let cols = members[0].2;
                if members.iter().any(|m| m.2 != cols) {
                    bail!("the matrices of scale group `{key}` read inputs of different widths");
                }
                let values = members
                    .iter()
                    .map(|(n, ..)| self.values(n))
                    .collect::<Result<Vec<_>>>()?;
                let qs: Vec<QuantTensor> = match self.plan.quantize {
                    Some(Scheme::Nvfp4) => {
                        let parts: Vec<&[f32]> = values.iter().map(|v| &v[..]).collect();
                        crate::quant::nvfp4::quantize_group(&parts, cols)
                            .into_iter()
                            .map(QuantTensor::Nvfp4)
                            .collect()
                    }
                    _ => members
                        .iter()
                        .zip(&values)
                        .map(|((_, o, i), v)| {
                            QuantTensor::Fp8(crate::quant::fp8::quantize_block(v, *o, *i))
                        })
                        .collect(),
                };
                drop(values);
                for ((n, ..), q) in members.iter().zip(&qs) {
                    self.keep(n, q);
                }
                self.take(&e.0)
            }
            None => bail!("internal: nothing makes stored tensor `{}`", e.0),
        }
    }

    fn take(&mut self, name: &str) -> Result<Vec<u8>> {
        self.ready
            .remove(name)
            .with_context(|| format!("internal: no stored part `{name}`"))
    }
}

/// Checks the source against its config, lays the artifact out, and writes it tensor by
/// tensor; returns its digest.
pub fn write_artifact(src: &PackSource, plan: impl Into<WeightPlan>, out: &Path) -> Result<String> {
    write_artifact_with(src, plan, out, &mut |_, _| {})
}

/// [`write_artifact`], with `progress(done, total)` counting stored tensors.
pub fn write_artifact_with(
    src: &PackSource,
    plan: impl Into<WeightPlan>,
    out: &Path,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<String> {
    let plan = plan.into();
    let format = plan.dense;
    src.config.validate()?;
    // The evaluator refuses a tokenizer with ids past the vocabulary; so does the packer.
    let tok =
        crate::tokenizer::Tokenizer::from_json(&src.tokenizer_json).context("the tokenizer")?;
    if tok.vocab_size() > src.config.vocab_size {
        bail!(
            "the tokenizer has {} tokens but the model's vocabulary has {} (config `vocab_size`)",
            tok.vocab_size(),
            src.config.vocab_size
        );
    }
    let mut given: BTreeMap<&str, &SourceTensor> = BTreeMap::new();
    for t in &src.tensors {
        if given.insert(t.name.as_str(), t).is_some() {
            bail!("tensor `{}` appears twice in the source", t.name);
        }
    }
    if plan.head && plan.quantize.is_some() && src.config.tie_word_embeddings {
        bail!("--quantize-head: the head is tied to the embeddings (there is no separate `lm_head.weight` to quantize)");
    }
    let mut maker = Maker {
        src: BTreeMap::new(),
        unit_of: BTreeMap::new(),
        groups: BTreeMap::new(),
        plan,
        ready: BTreeMap::new(),
    };
    let mut layout: Vec<Entry> = Vec::new();
    let mut imported = 0usize;
    for (name, shape) in src.config.expected_tensors() {
        let t = given.remove(name.as_str()).with_context(|| {
            let files: Vec<String> = src.source_files.iter().map(|f| f.path.clone()).collect();
            format!("tensor `{name}` is missing from {}", files.join(", "))
        })?;
        let from = t.origin.display();
        if t.shape != shape {
            bail!(
                "{from}: tensor `{name}` has shape {:?}, the config implies {:?}",
                t.shape,
                shape
            );
        }
        maker.src.insert(t.name.as_str(), t);
        match t.data.kind(&name) {
            Kind::Quantized(parts) => {
                if let (Some(_), Some((_, dtype, _))) = (plan.quantize, parts.first()) {
                    let format = if *dtype == Dtype::U8 { "nvfp4" } else { "fp8" };
                    bail!(
                        "{from}: tensor `{name}` is already {format}; the checkpoint is stored as it is (pack it with --weights bf16 or f32, which apply to its other tensors)"
                    );
                }
                imported += 1;
                for p in parts {
                    maker
                        .unit_of
                        .insert(p.0.clone(), Unit::Imported(name.clone()));
                    layout.push(p);
                }
            }
            Kind::Values => match plan.quantize {
                Some(scheme) if shape.len() == 2 && select::selected(&name, plan.head) => {
                    crate::quant::check_shape(scheme, &name, shape[0], shape[1])
                        .with_context(|| format!("--weights {}", scheme.name()))?;
                    let key = match scheme {
                        Scheme::Nvfp4 => select::group(&name).unwrap_or_else(|| name.clone()),
                        Scheme::Fp8Block => name.clone(),
                    };
                    for p in quantized::part_shapes(&name, scheme, shape[0], shape[1]) {
                        maker.unit_of.insert(p.0.clone(), Unit::Group(key.clone()));
                        layout.push(p);
                    }
                    maker
                        .groups
                        .entry(key)
                        .or_default()
                        .push((name, shape[0], shape[1]));
                }
                _ => {
                    let dtype = if format == WeightFormat::F32 || is_vector_tensor(&name, &shape) {
                        Dtype::F32
                    } else {
                        Dtype::BF16
                    };
                    maker
                        .unit_of
                        .insert(name.clone(), Unit::Dense(name.clone()));
                    layout.push((name, dtype, shape));
                }
            },
        }
    }
    if let Some((extra, t)) = given.iter().next() {
        bail!(
            "{}: tensor `{extra}` is not used by a {} model with this config",
            t.origin.display(),
            src.config.family.name()
        );
    }
    layout.sort_by(|a, b| a.0.cmp(&b.0));
    if let Some(w) = layout.windows(2).find(|w| w[0].0 == w[1].0) {
        bail!("two tensors would be stored as `{}`", w[0].0);
    }
    let quantization = match (&plan.quantize, &src.quantization) {
        (Some(scheme), _) => Some(Imported {
            method: format!("ninfer-pack --weights {}", scheme.name()),
            activation_scales: Default::default(),
        }),
        (None, Some(q)) if imported > 0 => Some(q.clone()),
        (None, Some(q)) => bail!(
            "the checkpoint says it is quantized ({}), but none of its tensors is",
            q.method
        ),
        (None, None) if imported > 0 => {
            bail!("the checkpoint holds quantized tensors but no quantization config")
        }
        (None, None) => None,
    };

    let provenance = Provenance {
        packer: match &src.packer_args {
            Some(args) => format!("ninfer-pack {} {args}", env!("CARGO_PKG_VERSION")),
            None => format!("ninfer-pack {}", env!("CARGO_PKG_VERSION")),
        },
        source_kind: src.source_kind.clone(),
        source_files: src.source_files.clone(),
        source_dtypes: src.source_dtypes.clone(),
    };
    let mut meta: BTreeMap<String, String> = BTreeMap::new();
    meta.insert("format".into(), MAGIC.into());
    meta.insert("format_version".into(), FORMAT_VERSION.to_string());
    meta.insert("config".into(), serde_json::to_string(&src.config)?);
    meta.insert("tokenizer".into(), src.tokenizer_json.clone());
    meta.insert("weight_format".into(), format.name().into());
    meta.insert("provenance".into(), serde_json::to_string(&provenance)?);
    if let Some(q) = &quantization {
        meta.insert("quantization".into(), serde_json::to_string(q)?);
    }
    stream::write(meta, &layout, out, &mut |e| maker.bytes(e), progress)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::{Family, ModelConfig};

    #[test]
    fn a_tokenizer_larger_than_the_vocabulary_is_refused() {
        let src = PackSource {
            config: ModelConfig::for_test(Family::Llama, 1, 8, 2, 1, 4, 8, 100),
            tokenizer_json: crate::artifact::random::byte_tokenizer_json(),
            tensors: vec![],
            source_kind: "test".into(),
            source_files: vec![],
            source_dtypes: BTreeMap::new(),
            notes: vec![],
            quantization: None,
            packer_args: None,
        };
        let out = tempfile::tempdir().unwrap();
        let e = write_artifact(&src, WeightFormat::Bf16, &out.path().join("x.ninfer"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "the tokenizer has 256 tokens but the model's vocabulary has 100 (config `vocab_size`)"
        );
    }
}
