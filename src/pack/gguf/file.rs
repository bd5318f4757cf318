//! The GGUF container: header, metadata, tensor descriptors and the data section, parsed
//! with every count and offset checked against the file's size.

use super::metadata::{GgufMetadata, GgufValue};
use super::types::GgmlType;
use anyhow::{anyhow, bail, Context, Result};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of every tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's maximum number of tensor dimensions.
const MAX_DIMS: u32 = 4;
/// Nesting limit for array values (the format allows arrays of arrays).
const MAX_ARRAY_DEPTH: usize = 4;

/// One tensor descriptor as the file states it.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dimensions fastest-first: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    pub fn n_elements(&self) -> Option<u64> {
        self.dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
    }

    /// The row-major (Hugging Face) shape: the dimensions slowest-first.
    pub fn hf_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed, memory-mapped GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: GgufMetadata,
    pub tensors: Vec<GgufTensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    map: memmap2::Mmap,
    file: std::sync::Arc<std::fs::File>,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    file: &'a str,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.buf.len() => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            _ => bail!(
                "GGUF {}: file is truncated: reading {what} at byte {} needs {n} bytes, but the file has {} bytes",
                self.file,
                self.pos,
                self.buf.len()
            ),
        }
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into().unwrap()))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        let n = usize::try_from(n).ok().filter(|&n| n <= self.remaining()).ok_or_else(|| {
            anyhow!(
                "GGUF {}: file is truncated or corrupt: {what} at byte {} claims {n} bytes, but only {} remain",
                self.file,
                self.pos,
                self.remaining()
            )
        })?;
        let at = self.pos;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| anyhow!("GGUF {}: {what} at byte {at} is not valid UTF-8", self.file))
    }

    fn value(&mut self, ty: u32, depth: usize, key: &str) -> Result<GgufValue> {
        let what = &format!("value of `{key}`");
        Ok(match ty {
            0 => GgufValue::U8(self.u8(what)?),
            1 => GgufValue::I8(self.u8(what)? as i8),
            2 => GgufValue::U16(self.u16(what)?),
            3 => GgufValue::I16(self.u16(what)? as i16),
            4 => GgufValue::U32(self.u32(what)?),
            5 => GgufValue::I32(self.u32(what)? as i32),
            6 => GgufValue::F32(f32::from_bits(self.u32(what)?)),
            7 => match self.u8(what)? {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => bail!(
                    "GGUF {}: `{key}` holds the bool byte {b} (must be 0 or 1)",
                    self.file
                ),
            },
            8 => GgufValue::String(self.string(what)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    bail!(
                        "GGUF {}: `{key}` nests arrays deeper than {MAX_ARRAY_DEPTH}",
                        self.file
                    );
                }
                let elem = self.u32(what)?;
                let n = self.u64(what)?;
                // Every element takes at least one byte, so a count beyond the bytes left is
                // corruption; checking first keeps a bad count from allocating wildly.
                let min = min_value_bytes(elem).ok_or_else(|| {
                    anyhow!(
                        "GGUF {}: `{key}` is an array of unknown value type {elem}",
                        self.file
                    )
                })?;
                let fits = n
                    .checked_mul(min as u64)
                    .is_some_and(|b| b <= self.remaining() as u64);
                if !fits {
                    bail!(
                        "GGUF {}: file is truncated or corrupt: array `{key}` claims {n} elements, but only {} bytes remain",
                        self.file,
                        self.remaining()
                    );
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1, key)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64(what)?),
            11 => GgufValue::I64(self.u64(what)? as i64),
            12 => GgufValue::F64(f64::from_bits(self.u64(what)?)),
            other => bail!("GGUF {}: `{key}` has unknown value type {other}", self.file),
        })
    }
}

/// The fewest bytes one value of a GGUF value type can occupy.
fn min_value_bytes(ty: u32) -> Option<usize> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,
        9 => 12,
        10..=12 => 8,
        _ => return None,
    })
}

impl GgufFile {
    /// Memory-map and parse a GGUF file. Tensor data ranges are checked against the file
    /// size here; the data itself is only read by [`GgufFile::tensor_data`].
    pub fn open(path: &Path) -> Result<GgufFile> {
        let shown = path.display().to_string();
        let (file, len) = crate::input::open_regular(path, "the GGUF file")
            .with_context(|| format!("GGUF {shown}"))?;
        if len < 24 {
            bail!("GGUF {shown}: file is truncated ({len} bytes is too short for a GGUF header)");
        }
        // SAFETY: the file is opened read-only; like every mmap-based reader we rely on it
        // not being modified while the map is alive.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("memory-mapping {shown}"))?;
        let (version, metadata, tensors, alignment, data_offset) = parse(&map, &shown)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
            map,
            file: std::sync::Arc::new(file),
        })
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Where one tensor's raw bytes are, to read when needed (checked like
    /// [`GgufFile::tensor_data`]).
    pub fn tensor_range(&self, t: &GgufTensorInfo) -> Result<crate::artifact::source::FileRange> {
        let data = self.tensor_data(t)?;
        Ok(crate::artifact::source::FileRange::new(
            self.file.clone(),
            self.path.as_path().into(),
            (data.as_ptr() as usize - self.map.as_ptr() as usize) as u64,
            data.len(),
        ))
    }

    /// The raw bytes of one tensor (its type must be supported).
    pub fn tensor_data(&self, t: &GgufTensorInfo) -> Result<&[u8]> {
        let shown = self.path.display();
        let n = t
            .n_elements()
            .ok_or_else(|| anyhow!("GGUF {shown}: tensor `{}` is too large", t.name))?;
        let size = t.ggml_type.byte_size(n).ok_or_else(|| {
            anyhow!(
                "GGUF {shown}: tensor `{}` has type {} with {n} elements, which this reader cannot size",
                t.name,
                t.ggml_type
            )
        })?;
        let start = self.data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(size));
        match (start, end) {
            (Some(s), Some(e)) if e <= self.map.len() as u64 => Ok(&self.map[s as usize..e as usize]),
            _ => bail!(
                "GGUF {shown}: file is truncated: tensor `{}` needs bytes {}..{} but the file has {} bytes",
                t.name,
                self.data_offset as u128 + t.offset as u128,
                self.data_offset as u128 + t.offset as u128 + size as u128,
                self.map.len()
            ),
        }
    }
}

type Parsed = (u32, GgufMetadata, Vec<GgufTensorInfo>, u64, u64);

fn parse(buf: &[u8], shown: &str) -> Result<Parsed> {
    if buf[..4] != GGUF_MAGIC {
        bail!(
            "{shown} is not a GGUF file: it starts with bytes {:02x?}, not the magic \"GGUF\"",
            &buf[..4]
        );
    }
    let mut c = Cursor {
        buf,
        pos: 4,
        file: shown,
    };
    let version = c.u32("the version")?;
    match version {
        2 | 3 => {}
        1 => bail!("GGUF {shown}: version 1 files are not supported (only versions 2 and 3)"),
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
            bail!("GGUF {shown}: big-endian GGUF files are not supported")
        }
        v => bail!("GGUF {shown}: unknown GGUF version {v} (only versions 2 and 3 are supported)"),
    }
    let n_tensors = c.u64("the tensor count")?;
    let n_kv = c.u64("the metadata count")?;
    // Each metadata entry takes at least 8+1+4+1 bytes and each tensor descriptor 8+4+4+8.
    if n_kv.saturating_mul(14) > c.remaining() as u64
        || n_tensors.saturating_mul(24) > c.remaining() as u64
    {
        bail!(
            "GGUF {shown}: file is truncated or corrupt: header claims {n_kv} metadata entries and {n_tensors} tensors, but the file has {} bytes",
            buf.len()
        );
    }

    let mut entries = BTreeMap::new();
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key #{i}"))?;
        let ty = c.u32(&format!("the value type of `{key}`"))?;
        let value = c.value(ty, 0, &key)?;
        if entries.insert(key.clone(), value).is_some() {
            bail!("GGUF {shown}: metadata key `{key}` appears twice");
        }
    }
    let metadata = GgufMetadata::new(shown, entries);

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a % 8 == 0 => a,
            _ => bail!(
                "GGUF {shown}: `general.alignment` must be a positive multiple of 8, found {v:?}"
            ),
        },
    };

    let mut tensors = Vec::with_capacity(n_tensors.min(1 << 16) as usize);
    let mut seen = HashMap::new();
    for i in 0..n_tensors {
        let name = c.string(&format!("the name of tensor #{i}"))?;
        let n_dims = c.u32(&format!("the rank of tensor `{name}`"))?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            bail!("GGUF {shown}: tensor `{name}` has {n_dims} dimensions (ggml allows 1 to {MAX_DIMS})");
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&format!("the dimensions of tensor `{name}`"))?);
        }
        let ggml_type = GgmlType(c.u32(&format!("the type of tensor `{name}`"))?);
        let offset = c.u64(&format!("the offset of tensor `{name}`"))?;
        if dims.contains(&0) {
            bail!("GGUF {shown}: tensor `{name}` has a zero dimension {dims:?}");
        }
        if offset % alignment != 0 {
            bail!("GGUF {shown}: tensor `{name}` starts at offset {offset}, not a multiple of the alignment {alignment}");
        }
        if seen.insert(name.clone(), i).is_some() {
            bail!("GGUF {shown}: tensor `{name}` appears twice");
        }
        tensors.push(GgufTensorInfo {
            name,
            dims,
            ggml_type,
            offset,
        });
    }
    let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
    if !tensors.is_empty() && data_offset > buf.len() as u64 {
        bail!(
            "GGUF {shown}: file is truncated: the data section should start at byte {data_offset}, but the file has {} bytes",
            buf.len()
        );
    }
    Ok((version, metadata, tensors, alignment, data_offset))
}
