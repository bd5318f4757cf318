//! The artifact digest: a sha256 over the metadata (except the digest itself) and every
//! tensor's name, dtype, shape and bytes, in name order.
//!
//! It is independent of how the safetensors header happens to be serialized (key order,
//! padding), so two packs of the same inputs give the same digest, and any change to a
//! weight, the config or the tokenizer changes it.

use sha2::{Digest, Sha256};

/// Incremental digest builder; feed metadata then tensors, both in sorted order.
pub struct DigestBuilder {
    h: Sha256,
}

impl Default for DigestBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl DigestBuilder {
    pub fn new() -> Self {
        let mut h = Sha256::new();
        h.update(b"ninfer-digest-v1\0");
        DigestBuilder { h }
    }

    fn field(&mut self, bytes: &[u8]) {
        self.h.update((bytes.len() as u64).to_le_bytes());
        self.h.update(bytes);
    }

    pub fn metadata(&mut self, key: &str, value: &str) {
        self.field(b"meta");
        self.field(key.as_bytes());
        self.field(value.as_bytes());
    }

    pub fn tensor(&mut self, name: &str, dtype: &str, shape: &[usize], data: &[u8]) {
        self.field(b"tensor");
        self.field(name.as_bytes());
        self.field(dtype.as_bytes());
        let dims: Vec<u8> = shape
            .iter()
            .flat_map(|d| (*d as u64).to_le_bytes())
            .collect();
        self.field(&dims);
        self.field(data);
    }

    /// `sha256:<hex>`.
    pub fn finish(self) -> String {
        format!("sha256:{}", hex::encode(self.h.finalize()))
    }
}
