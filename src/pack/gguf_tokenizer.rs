//! Rebuild a Hugging Face `tokenizer.json` from a GGUF file's tokenizer metadata.
//!
//! Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is handled. The result is meant to
//! tokenize exactly as the tokenizer `transformers` builds from the same GGUF file, which is
//! the project's reference:
//!
//! - model: BPE over `tokenizer.ggml.tokens` (id = position) and `tokenizer.ggml.merges`
//!   (rank = position), no unknown token, no byte fallback, merges never skipped
//!   (`ignore_merges` false), no subword prefix/suffix;
//! - vocabulary keys in GPT-2's byte-level spelling: a token holding characters outside
//!   that alphabet is respelled byte by byte (its merges are written that way);
//! - control tokens (`token_type` 3) become special added tokens, user-defined tokens
//!   (`token_type` 4) plain added tokens, both matched verbatim before BPE;
//! - no normalizer; a `ByteLevel` pre-tokenizer with GPT-2's regex, or, for vocabularies
//!   whose `tokenizer.ggml.pre` names a different split, that `Split` followed by a
//!   regex-free `ByteLevel`;
//! - a `ByteLevel` decoder; a `TemplateProcessing` post-processor that prepends BOS only
//!   when the file says `tokenizer.ggml.add_bos_token` is true (and appends EOS only when
//!   `tokenizer.ggml.add_eos_token` is), adding nothing otherwise;
//! - no prefix space (`tokenizer.ggml.add_space_prefix` is a sentencepiece setting the
//!   reference ignores for byte-level vocabularies).

use super::gguf::GgufMetadata;
use anyhow::{anyhow, bail, Result};
use serde_json::{json, Map, Value};
use std::collections::HashSet;

/// llama.cpp's token type for control tokens (`<|endoftext|>`, `<|im_start|>`, ...).
pub const TOKEN_TYPE_CONTROL: i64 = 3;
/// llama.cpp's token type for user-defined tokens.
pub const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// The split the Llama 3 tokenizer applies before byte-level BPE: case-insensitive
/// contractions, letters with one optional leading non-letter, numbers in groups of at
/// most three digits, punctuation runs, newlines, whitespace.
pub const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's split: the Llama 3 one with every digit on its own.
pub const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a `tokenizer.ggml.pre` value cuts text before BPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreSplit {
    /// The regex built into the `ByteLevel` pre-tokenizer (GPT-2's).
    Gpt2,
    /// A `Split` with the given regex, then `ByteLevel` without its own regex.
    Regex(&'static str),
}

/// The pre-tokenizer a `tokenizer.ggml.pre` name stands for; `None` for names not known here.
pub fn pre_split(pre: &str) -> Option<PreSplit> {
    Some(match pre {
        "default" | "gpt2" | "gpt-2" | "smollm" => PreSplit::Gpt2,
        "llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe" | "dbrx" => PreSplit::Regex(LLAMA3_SPLIT),
        "qwen2" | "deepseek-r1-qwen" => PreSplit::Regex(QWEN2_SPLIT),
        _ => return None,
    })
}

/// GPT-2's byte → character table: printable Latin-1 bytes stand for themselves, the other
/// 68 bytes (controls, space, DEL, NBSP, soft hyphen...) take code points from U+0100 on,
/// in byte order.
pub fn byte_level_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            b as char
        } else {
            let c = char::from_u32(next).unwrap();
            next += 1;
            c
        };
    }
    table
}

/// Build the `tokenizer.json` text for the tokenizer described by `md`.
pub fn tokenizer_json(md: &GgufMetadata) -> Result<String> {
    let value = tokenizer_value(md)?;
    Ok(serde_json::to_string(&value)?)
}

/// [`tokenizer_json`] as a JSON value.
pub fn tokenizer_value(md: &GgufMetadata) -> Result<Value> {
    let file = md.file();
    let model = md.req_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        bail!(
            "GGUF {file}: tokenizer model `{model}` is not supported (only byte-level BPE, `gpt2`)"
        );
    }
    let pre_name = md.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
    let split = pre_split(pre_name).ok_or_else(|| {
        anyhow!("GGUF {file}: pre-tokenizer `{pre_name}` (`tokenizer.ggml.pre`) is not supported")
    })?;

    let tokens = md.opt_str_array("tokenizer.ggml.tokens")?.ok_or_else(|| {
        anyhow!("GGUF {file}: required metadata key `tokenizer.ggml.tokens` is missing")
    })?;
    let merges = md.opt_str_array("tokenizer.ggml.merges")?.ok_or_else(|| {
        anyhow!("GGUF {file}: byte-level BPE needs `tokenizer.ggml.merges`, which is missing")
    })?;
    let types = md.opt_int_array("tokenizer.ggml.token_type")?;
    if let Some(t) = &types {
        if t.len() != tokens.len() {
            bail!(
                "GGUF {file}: `tokenizer.ggml.token_type` has {} entries for {} tokens",
                t.len(),
                tokens.len()
            );
        }
    }

    // Vocabulary, keyed in byte-level spelling.
    let table = byte_level_chars();
    let alphabet: HashSet<char> = table.iter().copied().collect();
    let in_alphabet = |t: &str| t.chars().all(|c| alphabet.contains(&c));
    let mut vocab = Map::new();
    for (id, &tok) in tokens.iter().enumerate() {
        let key = if in_alphabet(tok) {
            tok.to_string()
        } else {
            tok.bytes().map(|b| table[b as usize]).collect()
        };
        if vocab.insert(key.clone(), json!(id)).is_some() {
            bail!("GGUF {file}: token {id} ({key:?}) appears twice in the vocabulary");
        }
    }

    let mut merge_pairs = Vec::with_capacity(merges.len());
    for (i, m) in merges.iter().enumerate() {
        let mut parts = m.split(' ');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(a), Some(b), None) if !a.is_empty() && !b.is_empty() => {
                for piece in [a, b] {
                    if !vocab.contains_key(piece) {
                        bail!("GGUF {file}: merge {i} ({m:?}) names {piece:?}, which is not in the vocabulary");
                    }
                }
                merge_pairs.push(json!([a, b]));
            }
            _ => bail!("GGUF {file}: merge {i} ({m:?}) is not two tokens separated by one space"),
        }
    }

    // Added tokens: control (special) and user-defined (not special), in id order. A token
    // outside the byte-level alphabet is left to the merges: no real byte-level token is
    // spelled that way, so it is a byte sequence llama.cpp labelled, not a marker (the
    // reference skips these too).
    let mut added = Vec::new();
    if let Some(types) = &types {
        for (id, (&tok, &ty)) in tokens.iter().zip(types).enumerate() {
            let special = match ty {
                TOKEN_TYPE_CONTROL if in_alphabet(tok) => true,
                TOKEN_TYPE_USER_DEFINED if in_alphabet(tok) => false,
                _ => continue,
            };
            added.push(json!({
                "id": id,
                "content": tok,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": special,
            }));
        }
    }

    // `tokenizer.ggml.add_space_prefix` is a sentencepiece notion; the reference builds every
    // byte-level tokenizer without a prefix space, whatever the file says.
    let add_prefix_space = false;
    let pre_tokenizer = match split {
        PreSplit::Gpt2 => json!({
            "type": "ByteLevel",
            "add_prefix_space": add_prefix_space,
            "trim_offsets": true,
            "use_regex": true,
        }),
        PreSplit::Regex(re) => json!({
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": { "Regex": re },
                    "behavior": "Isolated",
                    "invert": false,
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": add_prefix_space,
                    "trim_offsets": true,
                    "use_regex": false,
                },
            ],
        }),
    };

    let post_processor = template_processor(md, &tokens)?;

    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": true,
            "trim_offsets": true,
            "use_regex": true,
        },
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merge_pairs,
        },
    }))
}

/// The post-processor: BOS before and EOS after each sequence when the file's
/// `tokenizer.ggml.add_bos_token` / `add_eos_token` say so, nothing otherwise. A flag whose
/// token id is absent is ignored, as the reference does.
fn template_processor(md: &GgufMetadata, tokens: &[&str]) -> Result<Value> {
    let file = md.file();
    let flagged = |flag: &str, id_key: &str| -> Result<Option<(String, u64)>> {
        if !md.opt_bool(flag)?.unwrap_or(false) {
            return Ok(None);
        }
        let Some(id) = md.opt_u64(id_key)? else {
            return Ok(None);
        };
        let tok = usize::try_from(id)
            .ok()
            .and_then(|i| tokens.get(i))
            .ok_or_else(|| anyhow!("GGUF {file}: `{id_key}` = {id} is outside the vocabulary"))?;
        Ok(Some((tok.to_string(), id)))
    };
    let bos = flagged(
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.bos_token_id",
    )?;
    let eos = flagged(
        "tokenizer.ggml.add_eos_token",
        "tokenizer.ggml.eos_token_id",
    )?;

    let special =
        |t: &str, type_id: u32| json!({ "SpecialToken": { "id": t, "type_id": type_id } });
    let seq = |id: &str, type_id: u32| json!({ "Sequence": { "id": id, "type_id": type_id } });
    let piece = |name: &str, type_id: u32| {
        let mut out = Vec::new();
        if let Some((b, _)) = &bos {
            out.push(special(b, type_id));
        }
        out.push(seq(name, type_id));
        if let Some((e, _)) = &eos {
            out.push(special(e, type_id));
        }
        out
    };
    let single = piece("A", 0);
    let mut pair = single.clone();
    pair.extend(piece("B", 1));
    let mut specials = Map::new();
    for (t, id) in bos.iter().chain(eos.iter()) {
        specials.insert(t.clone(), json!({ "id": t, "ids": [id], "tokens": [t] }));
    }
    Ok(json!({
        "type": "TemplateProcessing",
        "single": single,
        "pair": pair,
        "special_tokens": specials,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_matches_gpt2() {
        let t = byte_level_chars();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[0xAD], 'Ń');
        assert_eq!(t[0], 'Ā');
        let distinct: HashSet<char> = t.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }

    #[test]
    fn pre_names() {
        assert_eq!(pre_split("smollm"), Some(PreSplit::Gpt2));
        assert_eq!(pre_split("llama-bpe"), Some(PreSplit::Regex(LLAMA3_SPLIT)));
        assert_eq!(pre_split("qwen2"), Some(PreSplit::Regex(QWEN2_SPLIT)));
        assert_eq!(pre_split("made-up"), None);
    }
}
