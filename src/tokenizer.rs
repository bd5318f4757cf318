//! The artifact's own tokenizer (a Hugging Face `tokenizer.json` stored in the artifact).
//!
//! Special tokens (a BOS, say) are added exactly as the tokenizer's post-processor says,
//! which is also what `transformers` does by default, so token counts agree with it.

use anyhow::{anyhow, Result};
use sha2::{Digest, Sha256};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    sha256: String,
}

impl Tokenizer {
    pub fn from_json(json: &str) -> Result<Tokenizer> {
        let inner: tokenizers::Tokenizer = json
            .parse()
            .map_err(|e| anyhow!("tokenizer.json does not load: {e}"))?;
        let sha256 = hex::encode(Sha256::digest(json.as_bytes()));
        Ok(Tokenizer { inner, sha256 })
    }

    /// sha256 of the tokenizer JSON, the tokenizer's identity in reports.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Token ids of `text`, special tokens added as the tokenizer's post-processor says.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| anyhow!("tokenization failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// UTF-8 bytes of `text` covered by its first `n` tokens (for bits per byte of a
    /// capped stream).
    pub fn byte_len_of_prefix(&self, text: &str, n: usize) -> Result<u64> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| anyhow!("tokenization failed: {e}"))?;
        Ok(enc
            .get_offsets()
            .iter()
            .take(n)
            .map(|o| o.1)
            .max()
            .unwrap_or(0) as u64)
    }
}
