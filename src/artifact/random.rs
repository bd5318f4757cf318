//! What a random-weight artifact holds (`ninfer-pack random`, and the CUDA benchmark's
//! weights generated in memory): every tensor's values a pure function of (seed, tensor
//! name, index), uniform with the standard deviation 1/sqrt(fan in) for matrices (1 for the
//! embedding), 1 for norm weights, 0 for biases; and a byte-level tokenizer that fits any
//! vocabulary of 256 or more.

use crate::artifact::is_vector_tensor;
use rayon::prelude::*;

/// GPT-2's byte-to-character map of byte-level BPE.
fn byte_chars() -> Vec<char> {
    let mut out = vec!['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        out[b as usize] = if printable {
            char::from_u32(b).unwrap()
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap()
        };
    }
    out
}

/// A byte-level BPE tokenizer with the 256 byte tokens and no merges: every UTF-8 byte is
/// one token, so any text tokenizes inside any vocabulary of 256 or more.
pub fn byte_tokenizer_json() -> String {
    let vocab: serde_json::Map<String, serde_json::Value> = byte_chars()
        .into_iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), serde_json::json!(i)))
        .collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": []
        }
    })
    .to_string()
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn name_seed(seed: u64, name: &str) -> u64 {
    name.bytes()
        .fold(splitmix(seed), |h, b| splitmix(h ^ b as u64))
}

/// Value `i` of a tensor: uniform on [-a, a) with a = sqrt(3)·std.
fn uniform(tseed: u64, i: u64, amp: f32) -> f32 {
    let u = (splitmix(tseed ^ i.wrapping_mul(0xD6E8_FEB8_6659_FD93)) >> 40) as f32
        / (1u64 << 24) as f32;
    (2.0 * u - 1.0) * amp
}

/// The bytes and dtype name of one tensor.
pub fn tensor_bytes(name: &str, shape: &[usize], seed: u64) -> (&'static str, Vec<u8>) {
    let n: usize = shape.iter().product();
    let tseed = name_seed(seed, name);
    if is_vector_tensor(name, shape) {
        let v = if name.ends_with(".bias") { 0.0f32 } else { 1.0 };
        let data = vec![v; n];
        return ("F32", bytemuck::cast_slice::<f32, u8>(&data).to_vec());
    }
    // Fan in: every dim after the first (a depthwise conv's `[channels, 1, K]`: K).
    let std = if name == crate::model::layout::EMBED {
        1.0
    } else {
        1.0 / (shape[1..].iter().product::<usize>() as f32).sqrt()
    };
    let amp = 3f32.sqrt() * std;
    let mut out = vec![0u16; n];
    out.par_chunks_mut(1 << 16)
        .enumerate()
        .for_each(|(ci, chunk)| {
            let base = (ci << 16) as u64;
            for (j, o) in chunk.iter_mut().enumerate() {
                *o = half::bf16::from_f32(uniform(tseed, base + j as u64, amp)).to_bits();
            }
        });
    ("BF16", bytemuck::cast_slice::<u16, u8>(&out).to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokenizer_maps_every_byte_to_one_token() {
        let t = crate::tokenizer::Tokenizer::from_json(&byte_tokenizer_json()).unwrap();
        assert_eq!(t.vocab_size(), 256);
        let text = "Hé, 世界!\n\t ok";
        let ids = t.encode(text).unwrap();
        assert_eq!(ids.len(), text.len());
        // Token ids follow byte order.
        assert_eq!(ids, text.bytes().map(u32::from).collect::<Vec<_>>());
    }
}
