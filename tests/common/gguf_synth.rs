//! A synthetic GGUF file (version 3, little-endian) of a tiny llama model with a byte-level
//! BPE tokenizer, written here from the format's definition: for the packer's tests and the
//! parsers' mutation test.

use half::{bf16, f16};
use std::path::{Path, PathBuf};

pub const QK: usize = 32;

// ---------------------------------------------------------------------------------------
// A small GGUF writer (version 3, little-endian)
// ---------------------------------------------------------------------------------------

#[derive(Clone)]
pub enum Val {
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
    U64(u64),
}

pub fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

pub fn put_val(out: &mut Vec<u8>, v: &Val) {
    let ty: u32 = match v {
        Val::U32(_) => 4,
        Val::I32(_) => 5,
        Val::F32(_) => 6,
        Val::Bool(_) => 7,
        Val::Str(_) => 8,
        Val::Strs(_) | Val::I32s(_) => 9,
        Val::U64(_) => 10,
    };
    out.extend_from_slice(&ty.to_le_bytes());
    match v {
        Val::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Val::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Val::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Val::Bool(x) => out.push(*x as u8),
        Val::Str(s) => put_str(out, s),
        Val::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Val::Strs(items) => {
            out.extend_from_slice(&8u32.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for s in items {
                put_str(out, s);
            }
        }
        Val::I32s(items) => {
            out.extend_from_slice(&5u32.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for x in items {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
    }
}

pub struct RawTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: u32,
    pub bytes: Vec<u8>,
}

pub fn write_gguf(kv: &[(String, Val)], tensors: &[RawTensor], alignment: usize) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(kv.len() as u64).to_le_bytes());
    for (k, v) in kv {
        put_str(&mut out, k);
        put_val(&mut out, v);
    }
    let mut offset = 0usize;
    let mut offsets = Vec::new();
    for t in tensors {
        put_str(&mut out, &t.name);
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&t.ty.to_le_bytes());
        out.extend_from_slice(&(offset as u64).to_le_bytes());
        offsets.push(offset);
        offset += t.bytes.len().div_ceil(alignment) * alignment;
    }
    while out.len() % alignment != 0 {
        out.push(0);
    }
    let base = out.len();
    for (t, off) in tensors.iter().zip(offsets) {
        out.resize(base + off, 0);
        out.extend_from_slice(&t.bytes);
    }
    out
}

pub use super::rng::Rng;

/// Random raw bytes of `n` elements of type `ty`, with sane scales.
pub fn random_raw(rng: &mut Rng, ty: u32, n: usize) -> Vec<u8> {
    match ty {
        0 => (0..n).flat_map(|_| rng.float().to_le_bytes()).collect(),
        1 => (0..n)
            .flat_map(|_| f16::from_f32(rng.float()).to_le_bytes())
            .collect(),
        30 => (0..n)
            .flat_map(|_| bf16::from_f32(rng.float()).to_le_bytes())
            .collect(),
        8 | 2 | 3 => {
            let (scales, payload) = match ty {
                8 => (1, 32),
                2 => (1, 16),
                _ => (2, 16),
            };
            let mut out = Vec::new();
            for _ in 0..n / QK {
                for _ in 0..scales {
                    out.extend_from_slice(&rng.scale());
                }
                out.extend(rng.bytes(payload));
            }
            out
        }
        _ => panic!("no generator for type {ty}"),
    }
}

pub const D: usize = 64;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const HD: usize = D / HEADS;
pub const FF: usize = 96;
pub const LAYERS: usize = 2;

/// The synthetic tokenizer: `<|endoftext|>` (control), `<|user|>` (user-defined), the 256
/// byte-level characters, then the merge results.
pub fn synthetic_tokens() -> (Vec<String>, Vec<i32>, Vec<String>) {
    let mut tokens = vec!["<|endoftext|>".to_string(), "<|user|>".to_string()];
    let mut types = vec![3, 4];
    let mut bytes: Vec<char> = Vec::new();
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        bytes.push(if printable {
            b as char
        } else {
            next += 1;
            char::from_u32(next - 1).unwrap()
        });
    }
    for c in bytes {
        tokens.push(c.to_string());
        types.push(1);
    }
    let merges: Vec<String> = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for m in &merges {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    (tokens, types, merges)
}

pub struct Synth {
    pub kv: Vec<(String, Val)>,
    pub tensors: Vec<RawTensor>,
}

impl Synth {
    pub fn new(untied: bool) -> Synth {
        let (tokens, types, merges) = synthetic_tokens();
        let vocab = tokens.len();
        let s = |x: &str| Val::Str(x.to_string());
        let kv = vec![
            ("general.architecture".to_string(), s("llama")),
            ("general.name".to_string(), s("synthetic")),
            ("llama.block_count".to_string(), Val::U32(LAYERS as u32)),
            ("llama.context_length".to_string(), Val::U32(256)),
            ("llama.embedding_length".to_string(), Val::U32(D as u32)),
            ("llama.feed_forward_length".to_string(), Val::U32(FF as u32)),
            (
                "llama.attention.head_count".to_string(),
                Val::U32(HEADS as u32),
            ),
            (
                "llama.attention.head_count_kv".to_string(),
                Val::U32(KV_HEADS as u32),
            ),
            ("llama.rope.freq_base".to_string(), Val::F32(500000.0)),
            (
                "llama.attention.layer_norm_rms_epsilon".to_string(),
                Val::F32(1e-6),
            ),
            (
                "llama.rope.dimension_count".to_string(),
                Val::U32(HD as u32),
            ),
            ("llama.vocab_size".to_string(), Val::U64(vocab as u64)),
            ("general.file_type".to_string(), Val::I32(3)),
            ("tokenizer.ggml.model".to_string(), s("gpt2")),
            ("tokenizer.ggml.pre".to_string(), s("smollm")),
            ("tokenizer.ggml.tokens".to_string(), Val::Strs(tokens)),
            ("tokenizer.ggml.token_type".to_string(), Val::I32s(types)),
            ("tokenizer.ggml.merges".to_string(), Val::Strs(merges)),
            ("tokenizer.ggml.bos_token_id".to_string(), Val::U32(0)),
            ("tokenizer.ggml.eos_token_id".to_string(), Val::U32(0)),
            ("tokenizer.ggml.add_bos_token".to_string(), Val::Bool(false)),
        ];
        let mut rng = Rng(7);
        let mut tensors = Vec::new();
        let mut add = |name: String, dims: Vec<u64>, ty: u32, rng: &mut Rng| {
            let n: u64 = dims.iter().product();
            let bytes = random_raw(rng, ty, n as usize);
            tensors.push(RawTensor {
                name,
                dims,
                ty,
                bytes,
            });
        };
        add(
            "token_embd.weight".into(),
            vec![D as u64, vocab as u64],
            8,
            &mut rng,
        );
        for i in 0..LAYERS {
            add(
                format!("blk.{i}.attn_norm.weight"),
                vec![D as u64],
                0,
                &mut rng,
            );
            add(
                format!("blk.{i}.attn_q.weight"),
                vec![D as u64, D as u64],
                2,
                &mut rng,
            );
            add(
                format!("blk.{i}.attn_k.weight"),
                vec![D as u64, (KV_HEADS * HD) as u64],
                3,
                &mut rng,
            );
            add(
                format!("blk.{i}.attn_v.weight"),
                vec![D as u64, (KV_HEADS * HD) as u64],
                1,
                &mut rng,
            );
            add(
                format!("blk.{i}.attn_output.weight"),
                vec![D as u64, D as u64],
                30,
                &mut rng,
            );
            add(
                format!("blk.{i}.ffn_norm.weight"),
                vec![D as u64],
                0,
                &mut rng,
            );
            add(
                format!("blk.{i}.ffn_gate.weight"),
                vec![D as u64, FF as u64],
                3,
                &mut rng,
            );
            add(
                format!("blk.{i}.ffn_up.weight"),
                vec![D as u64, FF as u64],
                2,
                &mut rng,
            );
            add(
                format!("blk.{i}.ffn_down.weight"),
                vec![FF as u64, D as u64],
                8,
                &mut rng,
            );
        }
        add("output_norm.weight".into(), vec![D as u64], 0, &mut rng);
        if untied {
            add(
                "output.weight".into(),
                vec![D as u64, vocab as u64],
                0,
                &mut rng,
            );
        }
        Synth { kv, tensors }
    }

    pub fn set(&mut self, key: &str, v: Val) {
        match self.kv.iter_mut().find(|(k, _)| k == key) {
            Some(e) => e.1 = v,
            None => self.kv.push((key.to_string(), v)),
        }
    }

    pub fn bytes(&self) -> Vec<u8> {
        write_gguf(&self.kv, &self.tensors, 32)
    }

    pub fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, self.bytes()).unwrap();
        p
    }
}
