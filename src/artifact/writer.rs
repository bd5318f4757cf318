//! Writes a [`PackSource`] as a `.ninfer` file, atomically (temp file, then rename).

use super::digest::DigestBuilder;
use super::source::{PackSource, TensorData};
use super::{is_vector_tensor, quantized, Provenance, WeightFormat, FORMAT_VERSION, MAGIC};
use crate::quant::{select, Imported, QuantTensor, Scheme};
use anyhow::{bail, Context, Result};
use safetensors::tensor::{Dtype, View};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

struct OwnedTensor {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &OwnedTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}")
}

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

fn owned(dtype: Dtype, shape: Vec<usize>, bytes: Vec<u8>) -> OwnedTensor {
    OwnedTensor {
        dtype,
        shape,
        bytes,
    }
}

/// A matrix waiting for its scale group: name, rows, columns, values `[rows, cols]`.
type Pending<'a> = (String, usize, usize, &'a [f32]);

/// Encodes, checks and writes the artifact; returns its digest.
pub fn write_artifact(src: &PackSource, plan: impl Into<WeightPlan>, out: &Path) -> Result<String> {
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
    let mut given: BTreeMap<&str, &super::source::SourceTensor> = BTreeMap::new();
    for t in &src.tensors {
        if given.insert(t.name.as_str(), t).is_some() {
            bail!("tensor `{}` appears twice in the source", t.name);
        }
    }
    if plan.head && plan.quantize.is_some() && src.config.tie_word_embeddings {
        bail!("--quantize-head: the head is tied to the embeddings (there is no separate `lm_head.weight` to quantize)");
    }
    let mut tensors: BTreeMap<String, OwnedTensor> = BTreeMap::new();
    // Matrices to quantize, by nvfp4 scale group (a lone matrix is its own group).
    let mut pending: BTreeMap<String, Vec<Pending>> = BTreeMap::new();
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
        let data = match &t.data {
            TensorData::Quantized(q) => {
                if plan.quantize.is_some() {
                    bail!(
                        "{from}: tensor `{name}` is already {}; the checkpoint is stored as it is (pack it with --weights bf16 or f32, which apply to its other tensors)",
                        q.format()
                    );
                }
                if shape.len() != 2 || [q.rows(), q.cols()] != shape[..] {
                    bail!(
                        "{from}: tensor `{name}` is a quantized [{}, {}], the config implies {shape:?}",
                        q.rows(),
                        q.cols()
                    );
                }
                q.dequantize()
                    .with_context(|| format!("{from}: tensor `{name}`"))?;
                imported += 1;
                for p in quantized::parts(&name, q) {
                    tensors.insert(p.name, owned(p.dtype, p.shape, p.bytes));
                }
                continue;
            }
            TensorData::Values(v) => v,
        };
        if data.len() != shape.iter().product::<usize>() {
            bail!(
                "{from}: tensor `{name}`: {} values for shape {:?}",
                data.len(),
                shape
            );
        }
        if let Some(i) = data.iter().position(|v| !v.is_finite()) {
            bail!("{from}: tensor `{name}` holds a non-finite value at flat index {i}");
        }
        if let Some(scheme) = plan.quantize {
            if shape.len() == 2 && select::selected(&name, plan.head) {
                crate::quant::check_shape(scheme, &name, shape[0], shape[1])
                    .with_context(|| format!("--weights {}", scheme.name()))?;
                let key = match scheme {
                    Scheme::Nvfp4 => select::group(&name).unwrap_or_else(|| name.clone()),
                    Scheme::Fp8Block => name.clone(),
                };
                pending
                    .entry(key)
                    .or_default()
                    .push((name, shape[0], shape[1], data));
                continue;
            }
        }
        let (dtype, bytes) = if format == WeightFormat::F32 || is_vector_tensor(&name, &shape) {
            (Dtype::F32, bytemuck::cast_slice::<f32, u8>(data).to_vec())
        } else {
            let b: Vec<half::bf16> = data.iter().map(|&v| half::bf16::from_f32(v)).collect();
            (
                Dtype::BF16,
                bytemuck::cast_slice::<half::bf16, u8>(&b).to_vec(),
            )
        };
        tensors.insert(name, owned(dtype, shape, bytes));
    }
    if let Some((extra, t)) = given.iter().next() {
        bail!(
            "{}: tensor `{extra}` is not used by a {} model with this config",
            t.origin.display(),
            src.config.family.name()
        );
    }
    for (key, group) in &pending {
        let cols = group[0].2;
        if group.iter().any(|m| m.2 != cols) {
            bail!("the matrices of scale group `{key}` read inputs of different widths");
        }
        let quantized: Vec<QuantTensor> = match plan.quantize {
            Some(Scheme::Nvfp4) => {
                let parts: Vec<&[f32]> = group.iter().map(|m| m.3).collect();
                crate::quant::nvfp4::quantize_group(&parts, cols)
                    .into_iter()
                    .map(QuantTensor::Nvfp4)
                    .collect()
            }
            _ => group
                .iter()
                .map(|m| QuantTensor::Fp8(crate::quant::fp8::quantize_block(m.3, m.1, m.2)))
                .collect(),
        };
        for ((name, ..), q) in group.iter().zip(&quantized) {
            for p in quantized::parts(name, q) {
                tensors.insert(p.name, owned(p.dtype, p.shape, p.bytes));
            }
        }
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
        packer: format!("ninfer-pack {}", env!("CARGO_PKG_VERSION")),
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

    let mut d = DigestBuilder::new();
    for (k, v) in &meta {
        d.metadata(k, v);
    }
    for (name, t) in &tensors {
        d.tensor(name, &dtype_name(t.dtype), &t.shape, &t.bytes);
    }
    let digest = d.finish();
    meta.insert("digest".into(), digest.clone());

    let meta: HashMap<String, String> = meta.into_iter().collect();
    let views: Vec<(&str, &OwnedTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    if let Some(dir) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| anyhow::anyhow!("{}: cannot create directory: {e}", dir.display()))?;
    }
    // serialize_to_file writes a sibling temp file and renames it into place.
    safetensors::serialize_to_file(views, Some(meta), out)
        .map_err(|e| anyhow::anyhow!("{}: cannot write artifact: {e}", out.display()))?;
    crate::outfile::set_default_mode(out)?;
    Ok(digest)
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
