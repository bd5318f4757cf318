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
        serde_json::from_str::<serde_json::Value>(json)
            .map_err(|e| anyhow!("tokenizer.json is not valid JSON: {e}"))?;
        // The `tokenizers` crate panics on some malformed parts (a decoder it cannot read);
        // that is bad input, so it is caught and reported as such.
        let inner: tokenizers::Tokenizer = quietly(|| json.parse())
            .map_err(|_| anyhow!("tokenizer.json does not load: a malformed part made the tokenizers library give up"))?
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

    /// The text of `ids` decoded in sequence, special tokens kept, for diagnostics ("" when
    /// the decoder cannot).
    pub fn decode(&self, ids: &[u32]) -> String {
        quietly(|| self.inner.decode(ids, false))
            .ok()
            .and_then(|r| r.ok())
            .unwrap_or_default()
    }

    /// Token ids of `text`, special tokens added as the tokenizer's post-processor says.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.encode_with_offsets(text)?.get_ids().to_vec())
    }

    /// The first `n` tokens of `text` (all of them when it has fewer), and the UTF-8 bytes
    /// they cover, without tokenizing more of a long text than that needs.
    ///
    /// A prefix of the text is cut where a run of newlines ends before a non-space
    /// character: pre-tokenizers of the byte-level BPE kind (GPT-2, Llama 3, Qwen) always
    /// split there, so no token spans the cut and the prefix's tokens are the text's. As a
    /// check that does not rely on that, the first `n` tokens must come out the same from
    /// two prefixes, the second twice as long; otherwise (and for short texts) the whole text
    /// is tokenized.
    pub fn encode_prefix(&self, text: &str, n: usize) -> Result<Prefix> {
        let mut cut = (n.saturating_mul(16)).max(1 << 16);
        while cut < text.len() / 2 {
            let a = boundary_at_or_after(text, cut);
            let b = boundary_at_or_after(text, a.saturating_mul(2));
            if b >= text.len() {
                break;
            }
            let (ea, eb) = (
                self.encode_with_offsets(&text[..a])?,
                self.encode_with_offsets(&text[..b])?,
            );
            // Enough tokens that whatever the cut does to the last few cannot reach `n`.
            if ea.get_ids().len() >= n + PREFIX_MARGIN {
                if ea.get_ids()[..n] == eb.get_ids()[..n] {
                    return Ok(Prefix::of(&ea, n, None));
                }
                break; // this tokenizer's tokens depend on the cut: tokenize everything
            }
            cut = a.saturating_mul(2);
        }
        self.prefix_of_whole(text, n)
    }

    /// [`Tokenizer::encode_prefix`] by tokenizing the whole text: the reference it must equal.
    pub fn prefix_of_whole(&self, text: &str, n: usize) -> Result<Prefix> {
        Ok(self.prefixes_of_whole(text, &[n])?.remove(0))
    }

    /// [`Tokenizer::prefix_of_whole`] for several lengths, tokenizing the text once.
    pub fn prefixes_of_whole(&self, text: &str, ns: &[usize]) -> Result<Vec<Prefix>> {
        let all = self.encode_with_offsets(text)?;
        let whole = all.get_ids().len();
        Ok(ns
            .iter()
            .map(|&n| Prefix::of(&all, n, Some(whole)))
            .collect())
    }

    /// Every call into the `tokenizers` library that encodes: some malformed parts load and
    /// only panic here (a template naming a special token it does not define), which is bad
    /// input, reported as one error.
    fn encode_with_offsets(&self, text: &str) -> Result<tokenizers::Encoding> {
        quietly(|| self.inner.encode(text, true))
            .map_err(|_| anyhow!("tokenization failed: a malformed part of tokenizer.json made the tokenizers library give up"))?
            .map_err(|e| anyhow!("tokenization failed: {e}"))
    }
}

thread_local! {
    /// Set while [`quietly`] runs: the panic hook then prints nothing.
    static QUIET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, turning a panic into an `Err` without the panic message on stderr (the caller
/// reports the failure as one error line).
fn quietly<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(|q| q.get()) {
                previous(info)
            }
        }));
    });
    QUIET.with(|q| q.set(true));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    QUIET.with(|q| q.set(false));
    r
}

/// Tokens past `n` that a prefix must also hold before its first `n` are trusted.
const PREFIX_MARGIN: usize = 64;

/// The first tokens of a text.
#[derive(Clone, Debug, PartialEq)]
pub struct Prefix {
    pub ids: Vec<u32>,
    /// UTF-8 bytes of the text the ids cover.
    pub bytes: u64,
    /// The whole text's token count, when the whole text was tokenized.
    pub whole: Option<usize>,
}

impl Prefix {
    fn of(e: &tokenizers::Encoding, n: usize, whole: Option<usize>) -> Prefix {
        let ids: Vec<u32> = e.get_ids().iter().take(n).copied().collect();
        let bytes = e
            .get_offsets()
            .iter()
            .take(ids.len())
            .map(|o| o.1)
            .max()
            .unwrap_or(0) as u64;
        Prefix { ids, bytes, whole }
    }
}

/// The first position at or after `from` where a run of newlines ends before a character
/// that is not white space (or the end of the text).
fn boundary_at_or_after(text: &str, from: usize) -> usize {
    let b = text.as_bytes();
    let mut i = from.max(1);
    while i < b.len() {
        if b[i - 1] == b'\n' && !b[i].is_ascii_whitespace() && text.is_char_boundary(i) {
            return i;
        }
        i += 1;
    }
    b.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boundaries_end_a_newline_run_before_text() {
        let t = "ab\n\n cd\n\nef\nç\n";
        // Not after "ab\n\n" (a space follows), but after "cd\n\n".
        assert_eq!(boundary_at_or_after(t, 0), 9);
        assert_eq!(&t[9..11], "ef");
        assert_eq!(boundary_at_or_after(t, 10), 12); // before the two-byte 'ç'
        assert_eq!(boundary_at_or_after(t, 13), t.len());
    }
}
