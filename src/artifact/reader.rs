//! Memory-mapped artifact reader with full validation.
//!
//! Opening checks the container, the magic and version, the config, the tokenizer's
//! presence and every tensor's name, dtype and shape against the config, so a broken file
//! fails at startup with a message that names it, never halfway through a run. The digest
//! recorded at pack time is trusted unless [`Artifact::verify_digest`] is called.

use super::digest::DigestBuilder;
use super::{is_vector_tensor, Provenance, WeightFormat, FORMAT_VERSION, MAGIC};
use crate::model::config::ModelConfig;
use crate::model::tensors::ModelTensors;
use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensorError};
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

#[derive(Clone, Debug)]
struct TensorEntry {
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range in the file.
    start: usize,
    end: usize,
}

pub struct Artifact {
    path: PathBuf,
    mmap: Mmap,
    meta: BTreeMap<String, String>,
    tensors: BTreeMap<String, TensorEntry>,
    pub config: ModelConfig,
    pub weight_format: WeightFormat,
    pub provenance: Provenance,
    pub digest: String,
    pub file_bytes: u64,
}

fn explain(e: SafeTensorError) -> anyhow::Error {
    match e {
        SafeTensorError::HeaderTooSmall
        | SafeTensorError::InvalidHeaderLength
        | SafeTensorError::HeaderTooLarge => {
            anyhow!("not a .ninfer artifact (file too short or header length invalid)")
        }
        SafeTensorError::MetadataIncompleteBuffer => {
            anyhow!(
                "file is truncated or has trailing bytes (tensor data does not match the header)"
            )
        }
        SafeTensorError::InvalidHeader(_) | SafeTensorError::InvalidHeaderDeserialization(_) => {
            anyhow!("not a .ninfer artifact (header is not valid safetensors JSON)")
        }
        other => anyhow!("invalid safetensors container: {other}"),
    }
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}")
}

impl Artifact {
    /// Opens and validates an artifact. Errors name the file.
    pub fn open(path: &Path) -> Result<Artifact> {
        Self::open_inner(path).with_context(|| path.display().to_string())
    }

    fn open_inner(path: &Path) -> Result<Artifact> {
        // Look before opening: opening a FIFO blocks until a writer appears.
        crate::corpus::require_regular_file(path, "artifact")?;
        let file = std::fs::File::open(path).map_err(|e| anyhow!("cannot open artifact: {e}"))?;
        let file_bytes = file.metadata()?.len();
        if file_bytes == 0 {
            bail!("artifact file is empty");
        }
        // SAFETY: the file is opened read-only; the engine assumes nobody rewrites an
        // artifact in place while it is being scored (the writer always renames a new file
        // into place, which leaves this mapping intact).
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| anyhow!("cannot map artifact: {e}"))?;
        let (n, md) = SafeTensors::read_metadata(&mmap).map_err(explain)?;
        let data_start = 8 + n;
        let meta: BTreeMap<String, String> = md
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        match meta.get("format") {
            Some(m) if m == MAGIC => {}
            Some(m) => bail!("not a .ninfer artifact (wrong magic: metadata `format` is `{m}`, expected `{MAGIC}`)"),
            None => bail!("not a .ninfer artifact: safetensors file without the `format` metadata key"),
        }
        let version = field(&meta, "format_version")?;
        if version != FORMAT_VERSION.to_string() {
            bail!(
                "unsupported format version {version} (this build reads version {FORMAT_VERSION})"
            );
        }
        let config: ModelConfig = serde_json::from_str(field(&meta, "config")?)
            .map_err(|e| anyhow!("metadata `config` is invalid: {e}"))?;
        config.validate().context("metadata `config`")?;
        let weight_format = WeightFormat::parse(field(&meta, "weight_format")?)
            .context("metadata `weight_format`")?;
        let provenance: Provenance = serde_json::from_str(field(&meta, "provenance")?)
            .map_err(|e| anyhow!("metadata `provenance` is invalid: {e}"))?;
        let digest = field(&meta, "digest")?.to_string();
        if !digest.starts_with("sha256:") || digest.len() != 7 + 64 {
            bail!("metadata `digest` is malformed: `{digest}`");
        }
        if field(&meta, "tokenizer")?.is_empty() {
            bail!("metadata `tokenizer` is empty");
        }

        let infos: HashMap<String, &safetensors::tensor::TensorInfo> = md.tensors();
        let mut tensors = BTreeMap::new();
        for (name, info) in &infos {
            tensors.insert(
                name.clone(),
                TensorEntry {
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: data_start + info.data_offsets.0,
                    end: data_start + info.data_offsets.1,
                },
            );
        }
        // Counted before any name is built (the config is bounded, this is cheaper still).
        let count = ModelTensors::count(&config);
        if tensors.len() > count {
            bail!(
                "holds {} tensors, but a {} model with this config has {count}",
                tensors.len(),
                config.family.name()
            );
        }
        let expected = ModelTensors::expected(&config);
        for (name, shape) in &expected {
            let t = tensors
                .get(name)
                .with_context(|| format!("tensor `{name}` is missing"))?;
            if &t.shape != shape {
                bail!(
                    "tensor `{name}` has shape {:?} but the config implies {:?}",
                    t.shape,
                    shape
                );
            }
            let want = if weight_format == WeightFormat::F32 || is_vector_tensor(name, shape) {
                Dtype::F32
            } else {
                Dtype::BF16
            };
            if t.dtype != want {
                bail!(
                    "tensor `{name}` has dtype {} but weight format `{}` stores it as {}",
                    dtype_name(t.dtype),
                    weight_format.name(),
                    dtype_name(want)
                );
            }
        }
        if tensors.len() != expected.len() {
            let known: std::collections::HashSet<&str> =
                expected.iter().map(|(n, _)| n.as_str()).collect();
            let extra = tensors
                .keys()
                .find(|k| !known.contains(k.as_str()))
                .cloned()
                .unwrap_or_default();
            bail!(
                "tensor `{extra}` is not part of a {} model with this config",
                config.family.name()
            );
        }
        Ok(Artifact {
            path: path.to_path_buf(),
            mmap,
            meta,
            tensors,
            config,
            weight_format,
            provenance,
            digest,
            file_bytes,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The Hugging Face tokenizer.json stored in the artifact.
    pub fn tokenizer_json(&self) -> &str {
        &self.meta["tokenizer"]
    }

    /// Tensor names in sorted order.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(|s| s.as_str())
    }

    /// One tensor widened to f32 (row-major). A NaN or infinity in it is an error naming the
    /// tensor: a broken weight must fail at load, not turn into a wrong score.
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        let t = self
            .tensors
            .get(name)
            .with_context(|| format!("{}: tensor `{name}` is missing", self.path.display()))?;
        let bytes = &self.mmap[t.start..t.end];
        // Open already checked every dtype against the weight format (F32 or BF16).
        let v = crate::pack::hf::widen(t.dtype, bytes).ok_or_else(|| {
            anyhow!(
                "{}: tensor `{name}` has unsupported dtype {:?}",
                self.path.display(),
                t.dtype
            )
        })?;
        if let Some(i) = crate::kv::find_non_finite(&v) {
            bail!(
                "{}: tensor `{name}` holds a non-finite value ({}) at flat index {i}",
                self.path.display(),
                v[i]
            );
        }
        Ok(v)
    }

    /// Recomputes the digest from the file's contents and compares it with the recorded one.
    pub fn verify_digest(&self) -> Result<()> {
        let mut d = DigestBuilder::new();
        for (k, v) in &self.meta {
            if k != "digest" {
                d.metadata(k, v);
            }
        }
        for (name, t) in &self.tensors {
            d.tensor(
                name,
                &dtype_name(t.dtype).to_uppercase(),
                &t.shape,
                &self.mmap[t.start..t.end],
            );
        }
        let actual = d.finish();
        if actual != self.digest {
            bail!(
                "{}: digest mismatch: recorded {}, contents hash to {} (the file was modified or corrupted)",
                self.path.display(),
                self.digest,
                actual
            );
        }
        Ok(())
    }
}

fn field<'a>(meta: &'a BTreeMap<String, String>, key: &str) -> Result<&'a str> {
    meta.get(key)
        .map(|s| s.as_str())
        .with_context(|| format!("metadata key `{key}` is missing"))
}
