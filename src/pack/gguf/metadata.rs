//! GGUF metadata: typed key/value pairs (arrays included) and the lookups the packer needs.

use anyhow::{anyhow, Result};
use std::collections::BTreeMap;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_metadata_reads_as_its_decimal() {
        assert_eq!(GgufValue::F32(1e-5).as_f64(), Some(1e-5));
        assert_eq!(GgufValue::F32(100000.0).as_f64(), Some(100000.0));
        assert_eq!(GgufValue::I32(-1).as_u64(), None);
    }
}
