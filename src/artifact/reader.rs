//! Memory-mapped artifact reader with full validation.
//!
//! Opening checks the container, the magic and version, the config, the tokenizer's
//! presence and every tensor's name, dtype and shape against the config, so a broken file
//! fails at startup with a message that names it, never halfway through a run. The digest
//! recorded at pack time is trusted unless [`Artifact::verify_digest`] is called.

use super::digest::DigestBuilder;
use super::quantized::{self, Layout, Stored};
use super::{is_vector_tensor, Provenance, WeightFormat, FORMAT_VERSION, MAGIC};
use crate::model::config::ModelConfig;
use crate::model::layout::Model;
use crate::quant::{select, Imported};
use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensorError};
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

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
    mmap: Arc<Mmap>,
    meta: BTreeMap<String, String>,
    tensors: BTreeMap<String, TensorEntry>,
    /// Matrices stored quantized, with their logical `[rows, cols]`.
    layouts: BTreeMap<String, (Layout, usize, usize)>,
    pub config: ModelConfig,
    /// How the dense (not quantized) matrices are stored.
    pub weight_format: WeightFormat,
    /// Present when some matrices are quantized.
    pub quantization: Option<Imported>,
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
        // Opened so that a FIFO cannot block and anything but a regular file is refused.
        let (file, file_bytes) = crate::input::open_regular(path, "artifact")?;
        if file_bytes == 0 {
            bail!("artifact file is empty");
        }
        // SAFETY: the file is opened read-only; the engine assumes nobody rewrites an
        // artifact in place while it is being scored (the writer always renames a new file
        // into place, which leaves this mapping intact).
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| {
            let size = file.metadata().map(|m| m.len()).unwrap_or(0);
            let limit = match crate::host::address_space_available() {
                Some(l) => format!(
                    " (the {:.2} GiB file does not fit {})",
                    size as f64 / (1u64 << 30) as f64,
                    l.source
                ),
                None => String::new(),
            };
            anyhow!("cannot map artifact: {e}{limit}")
        })?;
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
        // Counted before any name is built (the config is bounded, this is cheaper still);
        // a quantized matrix has at most three tensors.
        let count = Model::count(&config);
        if tensors.len() > 3 * count {
            bail!(
                "holds {} tensors, but a {} model with this config has at most {}",
                tensors.len(),
                config.family.name(),
                3 * count
            );
        }
        // Every expected tensor is stored as at least one tensor: a config that claims more
        // (a thousand layers of four thousand experts in a small file) is refused before
        // millions of names are built.
        if tensors.len() < count && count <= 1 << 20 {
            // Few enough names to build: say which tensor is missing.
            if let Some((name, _)) = Model::expected(&config)
                .into_iter()
                .find(|(n, _)| !tensors.contains_key(n))
            {
                bail!(
                    "tensor `{name}` is missing (it holds {} tensors; a {} model with this config has {count})",
                    tensors.len(),
                    config.family.name()
                );
            }
        }
        if tensors.len() < count {
            bail!(
                "holds {} tensors, but a {} model with this config has {count}",
                tensors.len(),
                config.family.name(),
            );
        }
        let expected = Model::expected(&config);
        let mut layouts = BTreeMap::new();
        let mut known: std::collections::HashSet<String> = std::collections::HashSet::new();
        for (name, shape) in &expected {
            let t = tensors
                .get(name)
                .with_context(|| format!("tensor `{name}` is missing"))?;
            known.insert(name.clone());
            if shape.len() == 2 && !is_vector_tensor(name, shape) {
                let stored = |n: &str| {
                    tensors.get(n).map(|e| Stored {
                        dtype: e.dtype,
                        shape: &e.shape,
                    })
                };
                let payload = Stored {
                    dtype: t.dtype,
                    shape: &t.shape,
                };
                if let Some(layout) = quantized::detect(name, shape[0], shape[1], payload, stored)?
                {
                    known.extend(layout.companions(name));
                    layouts.insert(name.clone(), (layout, shape[0], shape[1]));
                    continue;
                }
            }
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
        if let Some(extra) = tensors.keys().find(|k| !known.contains(k.as_str())) {
            bail!(
                "tensor `{extra}` is not part of a {} model with this config",
                config.family.name()
            );
        }
        let quantization: Option<Imported> = match meta.get("quantization") {
            Some(q) => Some(
                serde_json::from_str(q)
                    .map_err(|e| anyhow!("metadata `quantization` is invalid: {e}"))?,
            ),
            None => None,
        };
        match (&quantization, layouts.keys().next()) {
            (Some(_), None) => {
                bail!("metadata `quantization` is present, but no tensor is quantized")
            }
            (None, Some(n)) => {
                bail!("tensor `{n}` is quantized, but the metadata has no `quantization` key")
            }
            _ => {}
        }
        Ok(Artifact {
            path: path.to_path_buf(),
            mmap: Arc::new(mmap),
            meta,
            tensors,
            layouts,
            config,
            weight_format,
            quantization,
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

    /// A stored tensor as it is in the file: dtype name (safetensors spelling), shape, bytes.
    pub fn tensor_raw(&self, name: &str) -> Option<(String, &[usize], &[u8])> {
        self.tensors.get(name).map(|t| {
            (
                dtype_name(t.dtype).to_uppercase(),
                &t.shape[..],
                &self.mmap[t.start..t.end],
            )
        })
    }

    /// A quantized matrix as stored (payload and scales), validated; `None` for a dense
    /// tensor. The CUDA loader dequantizes these on the device.
    pub fn quantized(&self, name: &str) -> Option<Result<crate::quant::QuantTensor>> {
        let (layout, o, i) = self.layouts.get(name)?;
        let part = |n: &str| {
            let e = &self.tensors[n];
            (&e.shape[..], &self.mmap[e.start..e.end])
        };
        let q = quantized::assemble(name, layout, *o, *i, part);
        Some(
            q.validate()
                .map(|()| q)
                .with_context(|| format!("{}: tensor `{name}`", self.path.display())),
        )
    }

    /// Matrix `name` as the file stores it, read in place (`[rows, cols]`; a vector is one
    /// column). Checked as [`Artifact::tensor_f32`] checks it (its parts, and no NaN or
    /// infinity in its values, read a row at a time), with the same errors; its rows decode
    /// to the same values.
    pub fn matrix(&self, name: &str) -> Result<super::stored::StoredMatrix> {
        use super::stored::StoredMatrix;
        let t = self
            .tensors
            .get(name)
            .with_context(|| format!("{}: tensor `{name}` is missing", self.path.display()))?;
        let range = |n: &str| {
            let e = &self.tensors[n];
            e.start..e.end
        };
        let f32_of = |n: &str| -> Vec<f32> {
            self.mmap[range(n)]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        };
        let map = self.mmap.clone();
        let m = match self.layouts.get(name) {
            Some((layout @ Layout::Nvfp4 { divide }, o, i)) => {
                let [scales, global] = <[String; 2]>::try_from(layout.companions(name))
                    .expect("nvfp4 has two companions");
                let g = f32_of(&global)[0];
                let global = if *divide {
                    crate::quant::nvfp4::Global::Divide(g)
                } else {
                    crate::quant::nvfp4::Global::Multiply(g)
                };
                StoredMatrix::nvfp4(map, *o, *i, range(name), range(&scales), global)
            }
            Some((layout @ Layout::Fp8, o, i)) => {
                let scale_name = &layout.companions(name)[0];
                let v = f32_of(scale_name);
                let scale = match self.tensors[scale_name].shape.len() {
                    0 => crate::quant::fp8::Fp8Scale::Tensor(v[0]),
                    1 => crate::quant::fp8::Fp8Scale::Channel(v),
                    _ => crate::quant::fp8::Fp8Scale::Block(v),
                };
                StoredMatrix::fp8(map, *o, *i, range(name), scale)
            }
            None => {
                let (rows, cols) = match t.shape[..] {
                    [r, c] => (r, c),
                    [n] => (n, 1),
                    _ => (t.shape.iter().product(), 1),
                };
                match t.dtype {
                    Dtype::F32 => StoredMatrix::f32(map, rows, cols, range(name)),
                    Dtype::BF16 => StoredMatrix::bf16(map, rows, cols, range(name)),
                    other => bail!(
                        "{}: tensor `{name}` has unsupported dtype {other:?}",
                        self.path.display()
                    ),
                }
            }
        };
        m.validate()
            .with_context(|| format!("{}: tensor `{name}`", self.path.display()))?;
        if let Some((i, v)) = m.find_non_finite() {
            bail!(
                "{}: tensor `{name}` holds a non-finite value ({v}) at flat index {i}",
                self.path.display()
            );
        }
        Ok(m)
    }

    /// One tensor widened to f32 (row-major). A NaN or infinity in it is an error naming the
    /// tensor: a broken weight must fail at load, not turn into a wrong score.
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        let t = self
            .tensors
            .get(name)
            .with_context(|| format!("{}: tensor `{name}` is missing", self.path.display()))?;
        let v = if let Some((layout, o, i)) = self.layouts.get(name) {
            let part = |n: &str| {
                let e = &self.tensors[n];
                (&e.shape[..], &self.mmap[e.start..e.end])
            };
            quantized::assemble(name, layout, *o, *i, part)
                .dequantize()
                .with_context(|| format!("{}: tensor `{name}`", self.path.display()))?
        } else {
            // Open already checked every dtype against the weight format (F32 or BF16).
            super::source::widen(t.dtype, &self.mmap[t.start..t.end]).ok_or_else(|| {
                anyhow!(
                    "{}: tensor `{name}` has unsupported dtype {:?}",
                    self.path.display(),
                    t.dtype
                )
            })?
        };
        if let Some(i) = crate::kv::find_non_finite(&v) {
            bail!(
                "{}: tensor `{name}` holds a non-finite value ({}) at flat index {i}",
                self.path.display(),
                v[i]
            );
        }
        Ok(v)
    }

    /// The storage format of every matrix and vector: `f32`, `bf16`, `fp8` or `nvfp4`.
    pub fn tensor_format(&self, name: &str) -> Option<&'static str> {
        if let Some((l, ..)) = self.layouts.get(name) {
            return Some(l.format());
        }
        self.tensors.get(name).map(|t| match t.dtype {
            Dtype::BF16 => "bf16",
            _ => "f32",
        })
    }

    /// Per storage format, the tensor classes ([`select::class`]) stored in it, their tensor
    /// count and bytes (scales included). Norms are left out: they are always f32.
    pub fn weight_formats(&self) -> Vec<FormatUse> {
        let mut by: BTreeMap<&'static str, FormatUse> = BTreeMap::new();
        for (name, _) in Model::expected(&self.config) {
            let class = select::class(&name);
            if class == "norms" {
                continue;
            }
            let format = self.tensor_format(&name).unwrap_or("f32");
            let mut bytes = self.tensors[&name].bytes();
            if let Some((l, ..)) = self.layouts.get(&name) {
                bytes += l
                    .companions(&name)
                    .iter()
                    .map(|c| self.tensors[c].bytes())
                    .sum::<u64>();
            }
            let u = by.entry(format).or_insert_with(|| FormatUse {
                format,
                classes: vec![],
                tensors: 0,
                bytes: 0,
            });
            if !u.classes.contains(&class) {
                u.classes.push(class);
            }
            if class == "embeddings" && self.config.tie_word_embeddings {
                u.classes.push("head"); // the tied head is the embedding matrix
            }
            u.tensors += 1;
            u.bytes += bytes;
        }
        let mut v: Vec<FormatUse> = by.into_values().collect();
        // The most compact format first: it is the one the artifact is named after.
        let rank = |f: &str| ["nvfp4", "fp8", "bf16", "f32"].iter().position(|x| *x == f);
        v.sort_by_key(|u| rank(u.format));
        // Classes in the model's order, whatever tensor was met first.
        let order = [
            "embeddings",
            "attention",
            "deltanet",
            "mlp",
            "head",
            "other",
        ];
        for u in &mut v {
            u.classes.sort_by_key(|c| order.iter().position(|o| o == c));
        }
        v
    }

    /// The weight formats in words, e.g. `nvfp4 (attention, mlp), bf16 (embeddings, head)`;
    /// just `bf16` when every matrix is stored one way.
    pub fn weight_summary(&self) -> String {
        let uses = self.weight_formats();
        if uses.len() == 1 {
            return uses[0].format.to_string();
        }
        uses.iter()
            .map(|u| format!("{} ({})", u.format, u.classes.join(", ")))
            .collect::<Vec<_>>()
            .join(", ")
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

/// How much of an artifact one storage format holds.
#[derive(Clone, Debug, PartialEq)]
pub struct FormatUse {
    pub format: &'static str,
    /// Tensor classes in model order (`embeddings`, `attention`, `mlp`, ...).
    pub classes: Vec<&'static str>,
    pub tensors: usize,
    pub bytes: u64,
}

impl TensorEntry {
    fn bytes(&self) -> u64 {
        (self.end - self.start) as u64
    }
}

fn field<'a>(meta: &'a BTreeMap<String, String>, key: &str) -> Result<&'a str> {
    meta.get(key)
        .map(|s| s.as_str())
        .with_context(|| format!("metadata key `{key}` is missing"))
}
