//! GGUF reader for the `llama` architecture.
//!
//! A GGUF file is a little-endian container: the magic `GGUF`, a version (2 and 3 are read
//! here; they differ from version 1 in using 64-bit counts and lengths), the number of
//! tensors and of metadata entries, the metadata (typed key/value pairs, arrays included),
//! one descriptor per tensor (name, dimensions fastest-first, ggml type, offset), padding up
//! to `general.alignment` (32 by default), then the tensor data, each tensor at its offset
//! from the start of that data section.
//!
//! [`read_gguf`] turns such a file into a [`PackSource`]:
//! - the metadata becomes a [`ModelConfig`];
//! - every tensor is dequantized to f32 with ggml's own definitions (F32, F16, BF16, Q8_0,
//!   Q4_0, Q4_1; anything else is refused by name);
//! - tensors get their Hugging Face names and shapes (GGUF lists `ne[0]`, the row length,
//!   first, so the shape is the dimension list reversed);
//! - the Q and K projections are un-permuted: llama.cpp's converter reorders their rows so
//!   that each head's rotary pairs are adjacent (interleaved RoPE); the engine uses the
//!   Hugging Face rotate-half layout, where the pair of row `j` is row `j + head_dim/2`;
//! - the tokenizer is rebuilt as a Hugging Face `tokenizer.json` (see
//!   [`super::gguf_tokenizer`]).

use super::{gguf_tokenizer, PackSource, SourceFile, SourceTensor};
use crate::model::config::{Family, ModelConfig};
use anyhow::{anyhow, bail, Context, Result};
use half::{bf16, f16};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
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

// ---------------------------------------------------------------------------------------
// Metadata values
// ---------------------------------------------------------------------------------------

/// One metadata value, with the type the file gave it.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// The GGUF name of the value's type.
    pub fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "uint8",
            GgufValue::I8(_) => "int8",
            GgufValue::U16(_) => "uint16",
            GgufValue::I16(_) => "int16",
            GgufValue::U32(_) => "uint32",
            GgufValue::I32(_) => "int32",
            GgufValue::F32(_) => "float32",
            GgufValue::Bool(_) => "bool",
            GgufValue::String(_) => "string",
            GgufValue::Array(_) => "array",
            GgufValue::U64(_) => "uint64",
            GgufValue::I64(_) => "int64",
            GgufValue::F64(_) => "float64",
        }
    }

    /// Any integer value that is not negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v as u64),
            GgufValue::U16(v) => Some(v as u64),
            GgufValue::U32(v) => Some(v as u64),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer value.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::U8(v) => Some(v as i64),
            GgufValue::U16(v) => Some(v as i64),
            GgufValue::U32(v) => Some(v as i64),
            GgufValue::U64(v) => i64::try_from(v).ok(),
            GgufValue::I8(v) => Some(v as i64),
            GgufValue::I16(v) => Some(v as i64),
            GgufValue::I32(v) => Some(v as i64),
            GgufValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Floating-point values, converted to f64. A float32 is widened through its shortest
    /// decimal form, so the 1e-5 a converter wrote as float32 reads back as 1e-5 rather
    /// than 9.999999747378752e-06 (both round to the same f32). Integers are accepted too.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(f32_to_f64_decimal(v)),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// f32 → f64 through the shortest decimal string that round-trips the f32.
fn f32_to_f64_decimal(v: f32) -> f64 {
    if !v.is_finite() {
        return v as f64;
    }
    format!("{v}").parse::<f64>().unwrap_or(v as f64)
}

/// The metadata of one GGUF file, with typed accessors whose errors name the file.
#[derive(Clone, Debug)]
pub struct GgufMetadata {
    file: String,
    entries: BTreeMap<String, GgufValue>,
}

impl GgufMetadata {
    pub fn new(file: impl Into<String>, entries: BTreeMap<String, GgufValue>) -> Self {
        GgufMetadata {
            file: file.into(),
            entries,
        }
    }

    /// The file the metadata came from, as shown in error messages.
    pub fn file(&self) -> &str {
        &self.file
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.entries.get(key)
    }

    pub fn contains(&self, key: &str) -> bool {
        self.entries.contains_key(key)
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    fn wrong_type(&self, key: &str, want: &str, got: &GgufValue) -> anyhow::Error {
        anyhow!(
            "GGUF {}: metadata key `{key}` should be {want}, found {}",
            self.file,
            got.type_name()
        )
    }

    fn missing(&self, key: &str) -> anyhow::Error {
        anyhow!(
            "GGUF {}: required metadata key `{key}` is missing",
            self.file
        )
    }

    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a non-negative integer", v)),
        }
    }

    pub fn req_u64(&self, key: &str) -> Result<u64> {
        self.opt_u64(key)?.ok_or_else(|| self.missing(key))
    }

    /// A count or size: a non-negative integer that fits a usize.
    pub fn req_usize(&self, key: &str) -> Result<usize> {
        let v = self.req_u64(key)?;
        usize::try_from(v).map_err(|_| anyhow!("GGUF {}: `{key}` = {v} is too large", self.file))
    }

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.opt_u64(key)? {
            None => Ok(None),
            Some(v) => usize::try_from(v)
                .map(Some)
                .map_err(|_| anyhow!("GGUF {}: `{key}` = {v} is too large", self.file)),
        }
    }

    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a number", v)),
        }
    }

    pub fn req_f64(&self, key: &str) -> Result<f64> {
        self.opt_f64(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a string", v)),
        }
    }

    pub fn req_str(&self, key: &str) -> Result<&str> {
        self.opt_str(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a bool", v)),
        }
    }

    /// An array of strings (e.g. `tokenizer.ggml.tokens`).
    pub fn opt_str_array(&self, key: &str) -> Result<Option<Vec<&str>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let arr = v
            .as_array()
            .ok_or_else(|| self.wrong_type(key, "an array of strings", v))?;
        arr.iter()
            .enumerate()
            .map(|(i, e)| {
                e.as_str().ok_or_else(|| {
                    anyhow!(
                        "GGUF {}: element {i} of `{key}` should be a string, found {}",
                        self.file,
                        e.type_name()
                    )
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// An array of integers (e.g. `tokenizer.ggml.token_type`).
    pub fn opt_int_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let arr = v
            .as_array()
            .ok_or_else(|| self.wrong_type(key, "an array of integers", v))?;
        arr.iter()
            .enumerate()
            .map(|(i, e)| {
                e.as_i64().ok_or_else(|| {
                    anyhow!(
                        "GGUF {}: element {i} of `{key}` should be an integer, found {}",
                        self.file,
                        e.type_name()
                    )
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

// ---------------------------------------------------------------------------------------
// ggml tensor types
// ---------------------------------------------------------------------------------------

/// A ggml tensor type id as stored in a tensor descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GgmlType(pub u32);

impl GgmlType {
    pub const F32: GgmlType = GgmlType(0);
    pub const F16: GgmlType = GgmlType(1);
    pub const Q4_0: GgmlType = GgmlType(2);
    pub const Q4_1: GgmlType = GgmlType(3);
    pub const Q8_0: GgmlType = GgmlType(8);
    pub const BF16: GgmlType = GgmlType(30);

    /// ggml's name for the type ("Q6_K", "IQ2_XS", ...); ids ggml never assigned or has
    /// retired read as `ggml type <id>`.
    pub fn name(self) -> String {
        let known = match self.0 {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            30 => "BF16",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            _ => "",
        };
        if known.is_empty() {
            format!("ggml type {}", self.0)
        } else {
            known.to_string()
        }
    }

    /// `(elements per block, bytes per block)` for the types this reader dequantizes.
    pub fn block_layout(self) -> Option<(usize, usize)> {
        match self {
            GgmlType::F32 => Some((1, 4)),
            GgmlType::F16 | GgmlType::BF16 => Some((1, 2)),
            GgmlType::Q8_0 => Some((QK, Q8_0_BLOCK_BYTES)),
            GgmlType::Q4_0 => Some((QK, Q4_0_BLOCK_BYTES)),
            GgmlType::Q4_1 => Some((QK, Q4_1_BLOCK_BYTES)),
            _ => None,
        }
    }

    pub fn is_supported(self) -> bool {
        self.block_layout().is_some()
    }

    /// Bytes taken by `n_elements` values of this type, when supported and whole blocks.
    pub fn byte_size(self, n_elements: u64) -> Option<u64> {
        let (be, bb) = self.block_layout()?;
        if !n_elements.is_multiple_of(be as u64) {
            return None;
        }
        (n_elements / be as u64).checked_mul(bb as u64)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// Elements per block of the 32-wide quantized types.
pub const QK: usize = 32;
/// Q8_0: f16 scale `d`, then 32 signed bytes; value = q·d.
pub const Q8_0_BLOCK_BYTES: usize = 2 + QK;
/// Q4_0: f16 scale `d`, then 16 bytes of nibbles; value = (q − 8)·d.
pub const Q4_0_BLOCK_BYTES: usize = 2 + QK / 2;
/// Q4_1: f16 scale `d`, f16 minimum `m`, then 16 bytes of nibbles; value = q·d + m.
pub const Q4_1_BLOCK_BYTES: usize = 2 + 2 + QK / 2;

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q8_0 blocks → f32. `out.len()` must be 32 × the number of blocks in `data`.
pub fn dequantize_q8_0(data: &[u8], out: &mut [f32]) {
    assert_eq!(data.len() / Q8_0_BLOCK_BYTES * QK, out.len());
    assert_eq!(data.len() % Q8_0_BLOCK_BYTES, 0);
    for (blk, y) in data
        .chunks_exact(Q8_0_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(QK))
    {
        let d = f16_at(blk, 0);
        for (yi, &q) in y.iter_mut().zip(&blk[2..]) {
            *yi = (q as i8) as f32 * d;
        }
    }
}

/// Q4_0 blocks → f32. In byte `j` of a block's nibbles, the low nibble is element `j` and
/// the high nibble is element `j + 16`.
pub fn dequantize_q4_0(data: &[u8], out: &mut [f32]) {
    assert_eq!(data.len() / Q4_0_BLOCK_BYTES * QK, out.len());
    assert_eq!(data.len() % Q4_0_BLOCK_BYTES, 0);
    for (blk, y) in data
        .chunks_exact(Q4_0_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(QK))
    {
        let d = f16_at(blk, 0);
        let qs = &blk[2..];
        for j in 0..QK / 2 {
            let lo = (qs[j] & 0x0F) as i32 - 8;
            let hi = (qs[j] >> 4) as i32 - 8;
            y[j] = lo as f32 * d;
            y[j + QK / 2] = hi as f32 * d;
        }
    }
}

/// Q4_1 blocks → f32 (value = q·d + m, computed as a product then a sum in f32, as ggml's
/// reference code and NumPy do).
pub fn dequantize_q4_1(data: &[u8], out: &mut [f32]) {
    assert_eq!(data.len() / Q4_1_BLOCK_BYTES * QK, out.len());
    assert_eq!(data.len() % Q4_1_BLOCK_BYTES, 0);
    for (blk, y) in data
        .chunks_exact(Q4_1_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(QK))
    {
        let d = f16_at(blk, 0);
        let m = f16_at(blk, 2);
        let qs = &blk[4..];
        for j in 0..QK / 2 {
            let lo = (qs[j] & 0x0F) as f32;
            let hi = (qs[j] >> 4) as f32;
            y[j] = lo * d + m;
            y[j + QK / 2] = hi * d + m;
        }
    }
}

/// Dequantize `data` (whole blocks of `ty`) into `out`. Errors for unsupported types and
/// for a byte count that does not match `out.len()`.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    let expect = ty
        .byte_size(out.len() as u64)
        .ok_or_else(|| anyhow!("cannot dequantize {} elements of type {ty}", out.len()))?;
    if expect != data.len() as u64 {
        bail!(
            "{ty} data for {} elements should be {expect} bytes, got {}",
            out.len(),
            data.len()
        );
    }
    match ty {
        GgmlType::F32 => {
            for (y, b) in out.iter_mut().zip(data.chunks_exact(4)) {
                *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (y, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *y = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (y, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *y = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::Q8_0 => dequantize_q8_0(data, out),
        GgmlType::Q4_0 => dequantize_q4_0(data, out),
        GgmlType::Q4_1 => dequantize_q4_1(data, out),
        _ => bail!("ggml type {ty} is not supported"),
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// RoPE row order
// ---------------------------------------------------------------------------------------

/// Undo llama.cpp's Q/K row permutation for interleaved RoPE.
///
/// `w` is a row-major `[rows, cols]` matrix with `rows = n_head · head_dim`. llama.cpp's
/// converter viewed each head's rows as `[2, head_dim/2]` and transposed that to
/// `[head_dim/2, 2]`, so Hugging Face row `h·hd + s·hd/2 + j` (s ∈ {0,1}) sits at GGUF row
/// `h·hd + 2j + s`. This puts every row back where Hugging Face had it.
pub fn unpermute_qk(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Result<Vec<f32>> {
    if rows * cols != w.len() {
        bail!("un-permute: {} values for a {rows}×{cols} matrix", w.len());
    }
    if n_head == 0 || !rows.is_multiple_of(n_head) || !(rows / n_head).is_multiple_of(2) {
        bail!("un-permute: {rows} rows do not split into {n_head} heads of even size");
    }
    let hd = rows / n_head;
    let half = hd / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..n_head {
        for j in 0..half {
            for s in 0..2 {
                let src = h * hd + 2 * j + s;
                let dst = h * hd + s * half + j;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// Container parsing
// ---------------------------------------------------------------------------------------

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
        let file = std::fs::File::open(path).with_context(|| format!("opening GGUF {shown}"))?;
        let len = file
            .metadata()
            .with_context(|| format!("reading {shown}"))?
            .len();
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
        })
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        &self.map
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

// ---------------------------------------------------------------------------------------
// llama → Hugging Face
// ---------------------------------------------------------------------------------------

/// The Hugging Face name of a llama-architecture GGUF tensor, or `None` if unknown.
pub fn hf_tensor_name(gguf_name: &str) -> Option<String> {
    let fixed = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return Some(n.to_string());
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, suffix) = rest.split_once('.')?;
    // Canonical decimal only: "07" or "+7" would alias another layer's name.
    if layer.is_empty()
        || !layer.bytes().all(|b| b.is_ascii_digit())
        || (layer.len() > 1 && layer.starts_with('0'))
    {
        return None;
    }
    let layer: usize = layer.parse().ok()?;
    let hf = match suffix {
        "attn_norm.weight" => "input_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// The [`ModelConfig`] a llama-architecture GGUF describes. `has_output` says whether the
/// file holds a separate `output.weight` (otherwise the embeddings are tied).
pub fn llama_config(md: &GgufMetadata, has_output: bool) -> Result<ModelConfig> {
    let file = md.file();
    let arch = md.req_str("general.architecture")?;
    if arch != "llama" {
        bail!("GGUF {file}: architecture `{arch}` is not supported (only `llama`)");
    }
    if let Some(kind) = md.opt_str("llama.rope.scaling.type")? {
        if kind != "none" {
            bail!(
                "GGUF {file}: RoPE scaling type `{kind}` (`llama.rope.scaling.type`) is not supported"
            );
        }
    }
    let hidden = md.req_usize("llama.embedding_length")?;
    let heads = md.req_usize("llama.attention.head_count")?;
    if heads == 0 || hidden % heads != 0 {
        bail!("GGUF {file}: embedding_length {hidden} is not a multiple of head_count {heads}");
    }
    // GGUF allows head_count_kv to be an array (one per layer); only a single value is used
    // by this engine.
    let kv_heads = match md.get("llama.attention.head_count_kv") {
        None => heads,
        Some(GgufValue::Array(_)) => {
            bail!("GGUF {file}: per-layer `llama.attention.head_count_kv` is not supported")
        }
        Some(_) => md.req_usize("llama.attention.head_count_kv")?,
    };
    let head_dim = match md.opt_usize("llama.attention.key_length")? {
        Some(k) => k,
        None => hidden / heads,
    };
    if let Some(v) = md.opt_usize("llama.attention.value_length")? {
        if v != head_dim {
            bail!(
                "GGUF {file}: value_length {v} differs from key_length {head_dim} (not supported)"
            );
        }
    }
    if let Some(rot) = md.opt_usize("llama.rope.dimension_count")? {
        if rot != head_dim {
            bail!(
                "GGUF {file}: partial rotary embeddings (rope.dimension_count {rot}, head_dim {head_dim}) are not supported"
            );
        }
    }
    let tokens_len = md.opt_str_array("tokenizer.ggml.tokens")?.map(|t| t.len());
    let vocab_key = md.opt_usize("llama.vocab_size")?;
    let vocab_size = match (tokens_len, vocab_key) {
        (Some(t), Some(v)) if t != v => bail!(
            "GGUF {file}: `llama.vocab_size` is {v} but `tokenizer.ggml.tokens` holds {t} tokens"
        ),
        (Some(t), _) => t,
        (None, Some(v)) => v,
        (None, None) => bail!("GGUF {file}: neither `tokenizer.ggml.tokens` nor `llama.vocab_size` gives the vocabulary size"),
    };
    let to_u32 = |key: &str| -> Result<Option<u32>> {
        match md.opt_u64(key)? {
            None => Ok(None),
            Some(v) => u32::try_from(v)
                .map(Some)
                .map_err(|_| anyhow!("GGUF {file}: `{key}` = {v} does not fit a token id")),
        }
    };
    let config = ModelConfig {
        family: Family::Llama,
        vocab_size,
        hidden_size: hidden,
        intermediate_size: md.req_usize("llama.feed_forward_length")?,
        num_layers: md.req_usize("llama.block_count")?,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        rms_norm_eps: md.req_f64("llama.attention.layer_norm_rms_epsilon")?,
        rope_theta: md.opt_f64("llama.rope.freq_base")?.unwrap_or(10000.0),
        rope_scaling: None,
        max_position_embeddings: md.req_usize("llama.context_length")?,
        tie_word_embeddings: !has_output,
        attention_bias: false,
        qk_norm: false,
        bos_token_id: to_u32("tokenizer.ggml.bos_token_id")?,
        eos_token_id: to_u32("tokenizer.ggml.eos_token_id")?,
    };
    config
        .validate()
        .with_context(|| format!("GGUF {file}: invalid model configuration"))?;
    Ok(config)
}

/// Read a llama-architecture GGUF file into a [`PackSource`].
pub fn read_gguf(path: &Path) -> Result<PackSource> {
    let gguf = GgufFile::open(path)?;
    let shown = gguf.path.display().to_string();
    let md = &gguf.metadata;

    // Architecture first: every later message assumes llama.
    let arch = md.req_str("general.architecture")?;
    if arch != "llama" {
        bail!("GGUF {shown}: architecture `{arch}` is not supported (only `llama`)");
    }

    // Names and types before any work, so a bad file fails fast and by name.
    let mut by_hf: HashMap<String, &GgufTensorInfo> = HashMap::new();
    for t in &gguf.tensors {
        if !t.ggml_type.is_supported() {
            bail!(
                "GGUF {shown}: tensor `{}` has ggml type {}, which is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)",
                t.name,
                t.ggml_type
            );
        }
        if t.name == "rope_freqs.weight" {
            bail!("GGUF {shown}: tensor `rope_freqs.weight` (Llama 3 RoPE frequency scaling) is not supported");
        }
        let hf = hf_tensor_name(&t.name).ok_or_else(|| {
            anyhow!(
                "GGUF {shown}: unexpected tensor `{}` for the llama architecture",
                t.name
            )
        })?;
        by_hf.insert(hf, t);
    }
    let has_output = by_hf.contains_key("lm_head.weight");
    let config = llama_config(md, has_output)?;

    // Every expected tensor present with the expected shape, nothing extra.
    let expected = config.expected_tensors();
    if by_hf.len() != expected.len() || expected.iter().any(|(n, _)| !by_hf.contains_key(n)) {
        let missing: Vec<&str> = expected
            .iter()
            .filter(|(n, _)| !by_hf.contains_key(n))
            .map(|(n, _)| n.as_str())
            .collect();
        let want: std::collections::HashSet<&str> =
            expected.iter().map(|(n, _)| n.as_str()).collect();
        let extra: Vec<&str> = gguf
            .tensors
            .iter()
            .filter(|t| !want.contains(hf_tensor_name(&t.name).unwrap().as_str()))
            .map(|t| t.name.as_str())
            .collect();
        bail!(
            "GGUF {shown}: tensors do not match the configuration ({} layers): missing {:?}, unexpected {:?}",
            config.num_layers,
            missing.iter().take(8).collect::<Vec<_>>(),
            extra.iter().take(8).collect::<Vec<_>>()
        );
    }
    for (name, shape) in &expected {
        let t = by_hf[name];
        if &t.hf_shape() != shape {
            bail!(
                "GGUF {shown}: tensor `{}` has dimensions {:?} (Hugging Face shape {:?}), but the configuration expects {:?}",
                t.name,
                t.dims,
                t.hf_shape(),
                shape
            );
        }
        let (block, _) = t.ggml_type.block_layout().unwrap();
        if !(t.dims[0] as usize).is_multiple_of(block) {
            bail!(
                "GGUF {shown}: tensor `{}` rows of {} elements are not whole {} blocks of {block}",
                t.name,
                t.dims[0],
                t.ggml_type
            );
        }
        // Range check for every tensor before dequantizing any.
        gguf.tensor_data(t)?;
    }

    // The tokenizer before the (slow) dequantization: it fails fast too.
    let tokenizer_json = gguf_tokenizer::tokenizer_json(md)?;

    let tensors: Vec<SourceTensor> = expected
        .par_iter()
        .map(|(name, shape)| -> Result<SourceTensor> {
            let t = by_hf[name];
            let raw = gguf.tensor_data(t)?;
            let mut data = vec![0f32; shape.iter().product()];
            dequantize(t.ggml_type, raw, &mut data)
                .with_context(|| format!("GGUF {shown}: tensor `{}`", t.name))?;
            let n_head = if name.ends_with("self_attn.q_proj.weight") {
                Some(config.num_heads)
            } else if name.ends_with("self_attn.k_proj.weight") {
                Some(config.num_kv_heads)
            } else {
                None
            };
            if let Some(n_head) = n_head {
                data = unpermute_qk(&data, shape[0], shape[1], n_head)
                    .with_context(|| format!("GGUF {shown}: tensor `{}`", t.name))?;
            }
            Ok(SourceTensor {
                name: name.clone(),
                shape: shape.clone(),
                data,
            })
        })
        .collect::<Result<_>>()?;

    let mut source_dtypes = BTreeMap::new();
    for t in &gguf.tensors {
        *source_dtypes.entry(t.ggml_type.name()).or_insert(0usize) += 1;
    }
    let sha256 = hex::encode(Sha256::digest(gguf.bytes()));
    Ok(PackSource {
        config,
        tokenizer_json,
        tensors,
        source_kind: "gguf".to_string(),
        source_files: vec![SourceFile {
            // The file name only: provenance (and so the digest) must not depend on where
            // the input happened to be on the packing machine.
            path: gguf
                .path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| shown.clone()),
            sha256,
            bytes: gguf.bytes().len() as u64,
        }],
        source_dtypes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_hugging_face() {
        assert_eq!(
            hf_tensor_name("token_embd.weight").unwrap(),
            "model.embed_tokens.weight"
        );
        assert_eq!(
            hf_tensor_name("blk.12.attn_q.weight").unwrap(),
            "model.layers.12.self_attn.q_proj.weight"
        );
        assert_eq!(
            hf_tensor_name("blk.0.ffn_down.weight").unwrap(),
            "model.layers.0.mlp.down_proj.weight"
        );
        assert_eq!(hf_tensor_name("output.weight").unwrap(), "lm_head.weight");
        assert!(hf_tensor_name("blk.01.attn_q.weight").is_none());
        assert!(hf_tensor_name("blk.x.attn_q.weight").is_none());
        assert!(hf_tensor_name("blk.1.attn_q.bias").is_none());
        assert!(hf_tensor_name("rope_freqs.weight").is_none());
    }

    #[test]
    fn type_names() {
        assert_eq!(GgmlType(14).name(), "Q6_K");
        assert_eq!(GgmlType(12).name(), "Q4_K");
        assert_eq!(GgmlType(4).name(), "ggml type 4");
        assert_eq!(GgmlType::Q4_1.byte_size(64), Some(40));
        assert_eq!(GgmlType::Q4_1.byte_size(33), None);
        assert_eq!(GgmlType(14).byte_size(256), None);
    }

    #[test]
    fn f32_metadata_reads_as_its_decimal() {
        assert_eq!(GgufValue::F32(1e-5).as_f64(), Some(1e-5));
        assert_eq!(GgufValue::F32(100000.0).as_f64(), Some(100000.0));
        assert_eq!(GgufValue::I32(-1).as_u64(), None);
    }

    #[test]
    fn unpermute_moves_rows_per_head() {
        // 2 heads of head_dim 4, one column: GGUF row order per head is (0,2,1,3) of HF.
        let gguf = [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0];
        let hf = unpermute_qk(&gguf, 8, 1, 2).unwrap();
        assert_eq!(hf, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
        assert!(unpermute_qk(&gguf, 8, 1, 3).is_err());
    }
}
