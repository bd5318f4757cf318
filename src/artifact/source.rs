//! What the artifact writer takes: a model as a packer read it (a normalized config, a
//! Hugging Face `tokenizer.json`, and tensors under Hugging Face names, f32 or quantized as
//! the checkpoint holds them), and the dtype widening the readers and the artifact reader
//! share. The packers (`crate::pack`) produce it; the writer (`super::writer`) stores it.
//!
//! A reader does not hold the model in memory: a tensor is a byte range of its input file
//! ([`TensorData::Mapped`]) or a recipe that makes it ([`TensorData::Deferred`]), and the
//! writer resolves one tensor (one nvfp4 scale group) at a time as it streams the artifact,
//! so packing a model needs memory for its largest tensors, not for the model.

use crate::model::config::ModelConfig;
use crate::quant::QuantTensor;
use anyhow::{anyhow, bail, Context, Result};
use safetensors::tensor::Dtype;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// `len` bytes at `offset` of an input file, read (with `pread`, not a mapping, so that a
/// pack's resident memory is what it holds, not what it has read) when needed.
#[derive(Clone, Debug)]
pub struct FileRange {
    file: Arc<std::fs::File>,
    path: Arc<Path>,
    offset: u64,
    len: usize,
}

impl PartialEq for FileRange {
    fn eq(&self, other: &Self) -> bool {
        self.path == other.path && self.offset == other.offset && self.len == other.len
    }
}

impl FileRange {
    /// The range `offset .. offset + len` of `file` (at `path`, for errors).
    pub fn new(file: Arc<std::fs::File>, path: Arc<Path>, offset: u64, len: usize) -> FileRange {
        FileRange {
            file,
            path,
            offset,
            len,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len` bytes from byte `start` of this range.
    pub fn sub(&self, start: usize, len: usize) -> Result<FileRange> {
        match start.checked_add(len) {
            Some(end) if end <= self.len => Ok(FileRange {
                offset: self.offset + start as u64,
                len,
                ..self.clone()
            }),
            _ => bail!(
                "{}: bytes {start}..+{len} are past a {}-byte tensor",
                self.path.display(),
                self.len
            ),
        }
    }

    /// The bytes. The allocation is the range's length, which the reader bounded by the
    /// file's size when it made the range.
    pub fn read(&self) -> Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let mut buf = Vec::new();
        buf.try_reserve_exact(self.len).map_err(|_| {
            anyhow!(
                "{}: cannot allocate {} bytes for a tensor",
                self.path.display(),
                self.len
            )
        })?;
        buf.resize(self.len, 0);
        self.file
            .read_exact_at(&mut buf, self.offset)
            .with_context(|| {
                format!(
                    "{}: cannot read bytes {}..{}",
                    self.path.display(),
                    self.offset,
                    self.offset + self.len as u64
                )
            })?;
        Ok(buf)
    }
}

/// The stored parts (name, dtype, shape) of a quantized matrix, known before its bytes.
pub type PartShapes = Vec<(String, Dtype, Vec<usize>)>;

/// What a deferred tensor makes, known without making it: the writer lays out the file's
/// header before it reads any weight.
#[derive(Clone, Debug, PartialEq)]
pub enum Kind {
    /// Values, stored in the pack's weight format (or quantized by the pack).
    Values,
    /// A matrix already quantized, stored as these parts (names relative to nothing: the
    /// full stored names).
    Quantized(PartShapes),
}

type Make = dyn Fn() -> Result<TensorData> + Send + Sync;

/// A tensor made when the writer reaches it (dequantized from a GGUF block format, assembled
/// from a quantized checkpoint's parts, rows regrouped, ...).
#[derive(Clone)]
pub struct Deferred {
    kind: Kind,
    make: Arc<Make>,
}

impl std::fmt::Debug for Deferred {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Deferred({:?})", self.kind)
    }
}

impl PartialEq for Deferred {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.make, &other.make)
    }
}

impl Deferred {
    /// A tensor of a known kind made by `make`.
    pub fn new(
        kind: Kind,
        make: impl Fn() -> Result<TensorData> + Send + Sync + 'static,
    ) -> Deferred {
        Deferred {
            kind,
            make: Arc::new(make),
        }
    }

    /// Values made by `make` (which must return values).
    pub fn values(make: impl Fn() -> Result<TensorData> + Send + Sync + 'static) -> Deferred {
        Deferred {
            kind: Kind::Values,
            make: Arc::new(make),
        }
    }

    /// A tensor `name` whose kind is only known by making it: `make` runs once now (so a bad
    /// input fails while reading, with the memory of one tensor, freed at once) and again when
    /// the writer reaches it.
    pub fn checked(
        name: &str,
        make: impl Fn() -> Result<TensorData> + Send + Sync + 'static,
    ) -> Result<Deferred> {
        let kind = match make()?.resolve()?.as_ref() {
            TensorData::Quantized(q) => {
                Kind::Quantized(crate::artifact::quantized::layout(name, q))
            }
            _ => Kind::Values,
        };
        Ok(Deferred {
            kind,
            make: Arc::new(make),
        })
    }

    pub fn kind(&self) -> &Kind {
        &self.kind
    }
}

/// A source tensor's contents.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    /// Row-major values, to store in the pack's weight format (or quantize).
    Values(Vec<f32>),
    /// A matrix the source already holds quantized: stored as it is, never requantized.
    Quantized(QuantTensor),
    /// Row-major F32, BF16 or F16 values still in the input file.
    Mapped { dtype: Dtype, bytes: FileRange },
    /// Row-major F32, BF16 or F16 values as little-endian bytes in memory (what a deferred
    /// tensor may make: the writer stores them as they are when the dtype is the stored one).
    Raw { dtype: Dtype, bytes: Vec<u8> },
    /// Made on demand.
    Deferred(Deferred),
}

impl TensorData {
    /// The values of a resolved tensor that is not quantized.
    pub fn values(&self) -> Option<&[f32]> {
        match self {
            TensorData::Values(v) => Some(v),
            _ => None,
        }
    }

    /// The values, read or made if need be (an error for a quantized matrix).
    pub fn read_values(&self) -> Result<Vec<f32>> {
        match self.resolve()?.into_owned() {
            TensorData::Values(v) => Ok(v),
            _ => bail!("a quantized matrix has no plain values"),
        }
    }

    /// Values or a quantized matrix: reads a mapped range, makes a deferred tensor, widens
    /// raw bytes.
    pub fn resolve(&self) -> Result<Cow<'_, TensorData>> {
        match self.resolve_raw()? {
            Cow::Borrowed(TensorData::Raw { dtype, bytes }) => {
                Ok(Cow::Owned(TensorData::Values(widened(*dtype, bytes)?)))
            }
            Cow::Owned(TensorData::Raw { dtype, bytes }) => {
                Ok(Cow::Owned(TensorData::Values(widened(dtype, &bytes)?)))
            }
            other => Ok(other),
        }
    }

    /// Values, a quantized matrix or raw bytes: reads a mapped range (as bytes), makes a
    /// deferred tensor; never widens.
    pub fn resolve_raw(&self) -> Result<Cow<'_, TensorData>> {
        match self {
            TensorData::Values(_) | TensorData::Quantized(_) | TensorData::Raw { .. } => {
                Ok(Cow::Borrowed(self))
            }
            TensorData::Mapped { dtype, bytes } => Ok(Cow::Owned(TensorData::Raw {
                dtype: *dtype,
                bytes: bytes.read()?,
            })),
            TensorData::Deferred(d) => {
                let made = (d.make)()?;
                Ok(Cow::Owned(made.resolve_raw()?.into_owned()))
            }
        }
    }

    /// What the writer will find here, without reading it.
    pub fn kind(&self, name: &str) -> Kind {
        match self {
            TensorData::Values(_) | TensorData::Mapped { .. } | TensorData::Raw { .. } => {
                Kind::Values
            }
            TensorData::Quantized(q) => {
                Kind::Quantized(crate::artifact::quantized::layout(name, q))
            }
            TensorData::Deferred(d) => d.kind.clone(),
        }
    }
}

/// One tensor under its Hugging Face name; `shape` is the logical (dequantized) shape.
pub struct SourceTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: TensorData,
    /// The file it was read from, for errors.
    pub origin: PathBuf,
}

/// One input file of a pack, recorded in the artifact's provenance.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SourceFile {
    pub path: String,
    pub sha256: String,
    pub bytes: u64,
}

/// Everything a reader extracts from its input.
pub struct PackSource {
    pub config: ModelConfig,
    /// A Hugging Face `tokenizer.json`, verbatim (HF input) or rebuilt (GGUF input).
    pub tokenizer_json: String,
    pub tensors: Vec<SourceTensor>,
    /// Where the weights came from: "gguf" or "huggingface".
    pub source_kind: String,
    pub source_files: Vec<SourceFile>,
    /// The original tensor types seen in the input, e.g. {"Q4_1": 211, "F32": 61}.
    pub source_dtypes: std::collections::BTreeMap<String, usize>,
    /// What the reader left out or changed, for the packer to say on stderr
    /// (e.g. "dropped 15 tensors of mtp.* (the multi-token-prediction head)").
    pub notes: Vec<String>,
    /// For a quantized checkpoint: what it says it is and the activation scales it holds
    /// (recorded, not applied: scoring is weight-only).
    pub quantization: Option<crate::quant::Imported>,
    /// What the packer was asked, after its name and version in the provenance (e.g.
    /// "random (seed 7)"); None for a plain conversion.
    pub packer_args: Option<String>,
}

/// [`widen`], or an error naming the dtype.
pub(crate) fn widened(dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>> {
    widen(dtype, bytes).ok_or_else(|| anyhow!("dtype {dtype:?} is not F32, F16 or BF16"))
}

/// Little-endian F32/BF16/F16 safetensors bytes widened to f32 (`None` for other dtypes).
pub fn widen(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        _ => return None,
    })
}
