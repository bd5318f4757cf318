//! Tests of the GGUF packer input: dequantization, the Q/K un-permute, a synthetic GGUF file
//! written here (parsing, renaming, tied/untied, error messages), and the real SmolLM2 GGUF
//! (tests named `real_*`; ignored with the reason before `bash ci/prepare.sh` fetches it).

use crate::common;

use common::gguf_synth::*;

use half::f16;
use ninfer_perplexity::pack::gguf::{
    dequantize, dequantize_q4_0, dequantize_q4_1, dequantize_q8_0, read_gguf, unpermute_qk,
    GgmlType, GgufFile,
};
use ninfer_perplexity::pack::PackSource;
use std::path::{Path, PathBuf};
use std::str::FromStr;

// ---------------------------------------------------------------------------------------
// Reference decoders and the llama.cpp permute, written from the format definitions
// ---------------------------------------------------------------------------------------

const QK: usize = 32;

fn ref_decode(ty: u32, bytes: &[u8]) -> Vec<f32> {
    let h = |b: &[u8], at: usize| f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32();
    let mut out = Vec::new();
    match ty {
        0 => {
            for c in bytes.chunks(4) {
                out.push(f32::from_le_bytes(c.try_into().unwrap()));
            }
        }
        1 => {
            for c in bytes.chunks(2) {
                out.push(h(c, 0));
            }
        }
        30 => {
            for c in bytes.chunks(2) {
                // bf16 is the top half of an f32.
                out.push(f32::from_bits(
                    (u16::from_le_bytes([c[0], c[1]]) as u32) << 16,
                ));
            }
        }
        8 => {
            for b in bytes.chunks(34) {
                let d = h(b, 0);
                for i in 0..QK {
                    out.push(d * (b[2 + i] as i8) as f32);
                }
            }
        }
        2 => {
            for b in bytes.chunks(18) {
                let d = h(b, 0);
                let mut block = [0f32; QK];
                for i in 0..QK {
                    let byte = b[2 + i % 16];
                    let q = if i < 16 { byte & 15 } else { byte >> 4 };
                    block[i] = (q as f32 - 8.0) * d;
                }
                out.extend_from_slice(&block);
            }
        }
        3 => {
            for b in bytes.chunks(20) {
                let (d, m) = (h(b, 0), h(b, 2));
                for i in 0..QK {
                    let byte = b[4 + i % 16];
                    let q = if i < 16 { byte & 15 } else { byte >> 4 };
                    out.push(q as f32 * d + m);
                }
            }
        }
        _ => panic!("no reference decoder for type {ty}"),
    }
    out
}

/// llama.cpp's permute of HF q/k rows: view each head as [2, hd/2], swap to [hd/2, 2].
fn permute_rows(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    let hd = rows / n_head;
    let mut out = vec![0f32; w.len()];
    for h in 0..n_head {
        for s in 0..2 {
            for j in 0..hd / 2 {
                let hf_row = h * hd + s * (hd / 2) + j;
                let gguf_row = h * hd + j * 2 + s;
                out[gguf_row * cols..(gguf_row + 1) * cols]
                    .copy_from_slice(&w[hf_row * cols..(hf_row + 1) * cols]);
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// Dequantization on hand-built blocks
// ---------------------------------------------------------------------------------------

#[test]
fn q8_0_block() {
    let mut block = f16::from_f32(0.125).to_le_bytes().to_vec();
    let qs: Vec<i8> = (0..32).map(|i| (i as i8 - 16) * 7).collect();
    block.extend(qs.iter().map(|&q| q as u8));
    let mut out = [0f32; 32];
    dequantize_q8_0(&block, &mut out);
    for (i, &v) in out.iter().enumerate() {
        assert_eq!(v, ((i as f32) - 16.0) * 7.0 * 0.125, "element {i}");
    }
    assert_eq!(out[0], -14.0);
    assert_eq!(out[31], 13.125);
}

#[test]
fn q4_0_block() {
    // d = 0.5; byte j holds low nibble j (element j) and high nibble 15 - j (element j + 16).
    let mut block = f16::from_f32(0.5).to_le_bytes().to_vec();
    block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let mut out = [0f32; 32];
    dequantize_q4_0(&block, &mut out);
    for j in 0..16 {
        assert_eq!(out[j], (j as f32 - 8.0) * 0.5, "element {j}");
        assert_eq!(
            out[j + 16],
            ((15 - j) as f32 - 8.0) * 0.5,
            "element {}",
            j + 16
        );
    }
    assert_eq!(out[0], -4.0);
    assert_eq!(out[16], 3.5);
}

#[test]
fn q4_1_block() {
    // d = 0.25, m = -1.5: value = q·d + m.
    let mut block = f16::from_f32(0.25).to_le_bytes().to_vec();
    block.extend(f16::from_f32(-1.5).to_le_bytes());
    block.extend((0..16u8).map(|j| ((j * 3) % 16) | (j << 4)));
    let mut out = [0f32; 32];
    dequantize_q4_1(&block, &mut out);
    for j in 0..16 {
        assert_eq!(out[j], ((j * 3) % 16) as f32 * 0.25 - 1.5, "element {j}");
        assert_eq!(out[j + 16], j as f32 * 0.25 - 1.5, "element {}", j + 16);
    }
    assert_eq!(out[16], -1.5);
    assert_eq!(out[31], 2.25);
}

#[test]
fn float_types_and_random_blocks_match_reference() {
    let mut rng = Rng(0x9E3779B97F4A7C15);
    for ty in [0u32, 1, 30, 8, 2, 3] {
        let n = 32 * 17;
        let raw = random_raw(&mut rng, ty, n);
        let mut out = vec![0f32; n];
        dequantize(GgmlType(ty), &raw, &mut out).unwrap();
        let want = ref_decode(ty, &raw);
        assert_eq!(out.len(), want.len());
        for (i, (a, b)) in out.iter().zip(&want).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "type {ty} element {i}: {a} vs {b}"
            );
        }
    }
    // Specific float encodings.
    let mut out = [0f32; 2];
    dequantize(GgmlType::F16, &[0x00, 0x3C, 0x00, 0xC0], &mut out).unwrap();
    assert_eq!(out, [1.0, -2.0]);
    dequantize(GgmlType::BF16, &[0x80, 0x3F, 0x40, 0xC0], &mut out).unwrap();
    assert_eq!(out, [1.0, -3.0]);
    // Wrong byte count and unsupported type are errors.
    assert!(dequantize(GgmlType::Q4_0, &[0u8; 17], &mut [0f32; 32]).is_err());
    let err = dequantize(GgmlType(14), &[0u8; 210], &mut [0f32; 256]).unwrap_err();
    assert!(err.to_string().contains("Q6_K"), "{err}");
}

// ---------------------------------------------------------------------------------------
// Q/K un-permute
// ---------------------------------------------------------------------------------------

#[test]
fn unpermute_inverts_llama_cpp_permute() {
    let mut rng = Rng(42);
    for (n_head, hd, cols) in [(9usize, 64usize, 5usize), (3, 64, 3), (2, 4, 1), (1, 2, 7)] {
        let rows = n_head * hd;
        let hf: Vec<f32> = (0..rows * cols).map(|_| rng.float()).collect();
        let gguf = permute_rows(&hf, rows, cols, n_head);
        if hd > 2 {
            assert_ne!(gguf, hf);
        }
        assert_eq!(unpermute_qk(&gguf, rows, cols, n_head).unwrap(), hf);
    }
    // A head's rotate-half pair (j, j + hd/2) is adjacent in the GGUF order.
    let hf: Vec<f32> = (0..8).map(|i| i as f32).collect();
    assert_eq!(
        permute_rows(&hf, 8, 1, 2),
        vec![0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]
    );
}

// ---------------------------------------------------------------------------------------
// A synthetic llama GGUF
// ---------------------------------------------------------------------------------------

/// The Hugging Face name the packer should give a GGUF tensor (written out here, not
/// taken from the crate).
fn expected_hf_name(gguf: &str) -> String {
    match gguf {
        "token_embd.weight" => return "model.embed_tokens.weight".into(),
        "output_norm.weight" => return "model.norm.weight".into(),
        "output.weight" => return "lm_head.weight".into(),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.").unwrap();
    let (layer, part) = rest.split_once('.').unwrap();
    let part = match part {
        "attn_norm.weight" => "input_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        other => panic!("no mapping for {other}"),
    };
    format!("model.layers.{layer}.{part}")
}

fn err_of(r: anyhow::Result<PackSource>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn synthetic_parse_rename_and_values() {
    let dir = tempfile::tempdir().unwrap();
    for untied in [false, true] {
        let synth = Synth::new(untied);
        let path = synth.write(dir.path(), &format!("synth-{untied}.gguf"));
        let src = read_gguf(&path).unwrap();
        let c = &src.config;
        assert_eq!(c.family.name(), "llama");
        assert_eq!(
            (c.num_layers, c.hidden_size, c.intermediate_size),
            (LAYERS, D, FF)
        );
        assert_eq!(
            (c.num_heads, c.num_kv_heads, c.head_dim),
            (HEADS, KV_HEADS, HD)
        );
        assert_eq!(c.vocab_size, 2 + 256 + 7);
        assert_eq!(c.rope_theta, 500000.0);
        assert_eq!(c.rms_norm_eps, 1e-6);
        assert_eq!(c.max_position_embeddings, 256);
        assert_eq!(c.tie_word_embeddings, !untied);
        assert_eq!((c.bos_token_id, c.eos_token_id), (Some(0), Some(0)));
        assert!(c.rope_scaling.is_none() && !c.attention_bias && !c.qk_norm);
        assert_eq!(src.source_kind, "gguf");

        // Names, order and shapes follow the config's expectation.
        let names: Vec<(String, Vec<usize>)> = src
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect();
        assert_eq!(names, c.expected_tensors());
        assert_eq!(
            src.tensors.iter().any(|t| t.name == "lm_head.weight"),
            untied
        );

        // Values: every tensor equals the reference decode of what was written, Q and K
        // after the test's own permute.
        for raw in &synth.tensors {
            let hf = expected_hf_name(&raw.name);
            let t = src
                .tensors
                .iter()
                .find(|t| t.name == hf)
                .unwrap_or_else(|| panic!("{hf} missing"));
            let want_shape: Vec<usize> = raw.dims.iter().rev().map(|&d| d as usize).collect();
            assert_eq!(t.shape, want_shape, "{hf}");
            let decoded = ref_decode(raw.ty, &raw.bytes);
            let got = if hf.ends_with("q_proj.weight") {
                permute_rows(
                    &t.data.read_values().unwrap(),
                    t.shape[0],
                    t.shape[1],
                    HEADS,
                )
            } else if hf.ends_with("k_proj.weight") {
                permute_rows(
                    &t.data.read_values().unwrap(),
                    t.shape[0],
                    t.shape[1],
                    KV_HEADS,
                )
            } else {
                t.data.read_values().unwrap()
            };
            assert_eq!(got.len(), decoded.len(), "{hf}");
            assert!(
                got.iter()
                    .zip(&decoded)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{hf} values differ"
            );
            if hf.contains("_proj") && (hf.contains("q_proj") || hf.contains("k_proj")) {
                assert_ne!(
                    &t.data.read_values().unwrap(),
                    &decoded[..],
                    "{hf} should have been un-permuted"
                );
            }
        }

        // Provenance.
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(src.source_files.len(), 1);
        assert_eq!(src.source_files[0].bytes, bytes.len() as u64);
        use sha2::Digest;
        assert_eq!(
            src.source_files[0].sha256,
            hex::encode(sha2::Sha256::digest(&bytes))
        );
        // Provenance keeps the file name only, so digests do not depend on the input's location.
        assert_eq!(
            src.source_files[0].path,
            path.file_name().unwrap().to_string_lossy()
        );
        let mut want = std::collections::BTreeMap::new();
        want.insert("F32".to_string(), 2 * LAYERS + 1 + untied as usize);
        want.insert("Q4_0".to_string(), 2 * LAYERS);
        want.insert("Q4_1".to_string(), 2 * LAYERS);
        want.insert("F16".to_string(), LAYERS);
        want.insert("BF16".to_string(), LAYERS);
        want.insert("Q8_0".to_string(), 1 + LAYERS);
        assert_eq!(src.source_dtypes, want);
    }
}

#[test]
fn synthetic_metadata_and_alignment() {
    let dir = tempfile::tempdir().unwrap();
    let mut synth = Synth::new(false);
    synth.set("general.alignment", Val::U32(64));
    let bytes = write_gguf(&synth.kv, &synth.tensors, 64);
    let path = dir.path().join("aligned.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.alignment, 64);
    assert_eq!(g.data_offset % 64, 0);
    assert_eq!(g.tensors.len(), 2 + 9 * LAYERS);
    assert_eq!(g.tensors[0].name, "token_embd.weight");
    assert_eq!(g.tensors[0].ggml_type, GgmlType::Q8_0);
    assert_eq!(g.metadata.req_str("general.name").unwrap(), "synthetic");
    assert_eq!(
        g.metadata
            .opt_int_array("tokenizer.ggml.token_type")
            .unwrap()
            .unwrap()[..3],
        [3, 4, 1]
    );
    assert_eq!(
        g.metadata.opt_bool("tokenizer.ggml.add_bos_token").unwrap(),
        Some(false)
    );
    assert!(read_gguf(&path).is_ok());

    // rope freq_base defaults to 10000 when absent.
    let mut synth = Synth::new(false);
    synth.kv.retain(|(k, _)| k != "llama.rope.freq_base");
    let src = read_gguf(&synth.write(dir.path(), "nobase.gguf")).unwrap();
    assert_eq!(src.config.rope_theta, 10000.0);
}

#[test]
fn synthetic_tokenizer_loads_and_encodes() {
    let dir = tempfile::tempdir().unwrap();
    let mut synth = Synth::new(false);
    let src = read_gguf(&synth.write(dir.path(), "tok.gguf")).unwrap();
    let tok = tokenizers::Tokenizer::from_str(&src.tokenizer_json).unwrap();
    assert_eq!(tok.get_vocab_size(true), 2 + 256 + 7);
    let id = |t: &str| tok.token_to_id(t).unwrap();
    let enc = tok
        .encode("hello world<|endoftext|> <|user|>", true)
        .unwrap();
    let want = [id("hello"), id("Ġwor"), id("l"), id("d"), 0, id("Ġ"), 1];
    assert_eq!(enc.get_ids(), &want[..]);
    assert_eq!(id("hello"), 2 + 256 + 3);
    assert_eq!(
        tok.decode(enc.get_ids(), false).unwrap(),
        "hello world<|endoftext|> <|user|>"
    );
    let json: serde_json::Value = serde_json::from_str(&src.tokenizer_json).unwrap();
    let added = json["added_tokens"].as_array().unwrap();
    assert_eq!(added.len(), 2);
    assert_eq!(added[0]["special"], true);
    assert_eq!(added[1]["special"], false);
    assert!(json["normalizer"].is_null());
    assert_eq!(json["model"]["byte_fallback"], false);

    // With add_bos_token, BOS is prepended.
    synth.set("tokenizer.ggml.add_bos_token", Val::Bool(true));
    let src = read_gguf(&synth.write(dir.path(), "bos.gguf")).unwrap();
    let tok = tokenizers::Tokenizer::from_str(&src.tokenizer_json).unwrap();
    let enc = tok.encode("hello", true).unwrap();
    assert_eq!(enc.get_ids(), &[0, id("hello")]);
    let enc = tok.encode(("hello", "hello"), true).unwrap();
    assert_eq!(enc.get_ids(), &[0, id("hello"), 0, id("hello")]);
    assert_eq!(
        tok.encode("hello", false).unwrap().get_ids(),
        &[id("hello")]
    );

    // With add_eos_token too, EOS is appended (here EOS is id 0 as well).
    synth.set("tokenizer.ggml.add_eos_token", Val::Bool(true));
    let src = read_gguf(&synth.write(dir.path(), "eos.gguf")).unwrap();
    let tok = tokenizers::Tokenizer::from_str(&src.tokenizer_json).unwrap();
    assert_eq!(
        tok.encode("hello", true).unwrap().get_ids(),
        &[0, id("hello"), 0]
    );
    synth.set("tokenizer.ggml.add_eos_token", Val::Bool(false));

    // A llama-3 style pre-tokenizer keeps digit triples together.
    synth.set("tokenizer.ggml.add_bos_token", Val::Bool(false));
    synth.set("tokenizer.ggml.pre", Val::Str("llama-bpe".into()));
    let src = read_gguf(&synth.write(dir.path(), "l3.gguf")).unwrap();
    let tok = tokenizers::Tokenizer::from_str(&src.tokenizer_json).unwrap();
    let enc = tok.encode("hello world", true).unwrap();
    assert_eq!(enc.get_ids(), &[id("hello"), id("Ġwor"), id("l"), id("d")]);
    let pre = tok.get_pre_tokenizer().unwrap();
    use tokenizers::PreTokenizer;
    let mut s = tokenizers::PreTokenizedString::from("a12345");
    pre.pre_tokenize(&mut s).unwrap();
    let pieces: Vec<String> = s
        .get_splits(
            tokenizers::OffsetReferential::Original,
            tokenizers::OffsetType::Byte,
        )
        .iter()
        .map(|(p, _, _)| p.to_string())
        .collect();
    assert_eq!(pieces, vec!["a", "123", "45"]);
}

#[test]
fn synthetic_errors_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();

    // Unsupported tensor type: named by ggml name, with the tensor and the file.
    let mut synth = Synth::new(false);
    let t = synth
        .tensors
        .iter_mut()
        .find(|t| t.name == "blk.1.attn_q.weight")
        .unwrap();
    t.ty = 14; // Q6_K
    t.bytes = vec![0u8; 210 * (D * D / 256)];
    let path = synth.write(dir.path(), "q6k.gguf");
    let e = err_of(read_gguf(&path));
    assert!(
        e.contains("Q6_K") && e.contains("blk.1.attn_q.weight") && e.contains("q6k.gguf"),
        "{e}"
    );

    // Wrong architecture.
    let mut synth = Synth::new(false);
    synth.set("general.architecture", Val::Str("qwen2".into()));
    let e = err_of(read_gguf(&synth.write(dir.path(), "arch.gguf")));
    assert!(e.contains("qwen2") && e.contains("arch.gguf"), "{e}");

    // Bad magic.
    let mut bytes = Synth::new(false).bytes();
    bytes[..4].copy_from_slice(b"GGML");
    let path = dir.path().join("magic.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let e = err_of(read_gguf(&path));
    assert!(
        e.contains("not a GGUF file") && e.contains("magic.gguf"),
        "{e}"
    );

    // Truncated in the tensor data.
    let bytes = Synth::new(true).bytes();
    let path = dir.path().join("cut.gguf");
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let e = err_of(read_gguf(&path));
    assert!(
        e.contains("truncated") && e.contains("cut.gguf") && e.contains("output.weight"),
        "{e}"
    );

    // Truncated in the header (inside the token list).
    std::fs::write(&path, &bytes[..2000]).unwrap();
    let e = err_of(read_gguf(&path));
    assert!(e.contains("truncated") && e.contains("cut.gguf"), "{e}");

    // Empty file.
    std::fs::write(&path, b"").unwrap();
    let e = err_of(read_gguf(&path));
    assert!(e.contains("truncated") && e.contains("cut.gguf"), "{e}");

    // Unsupported version.
    let mut bytes = Synth::new(false).bytes();
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    let path = dir.path().join("v1.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let e = err_of(read_gguf(&path));
    assert!(e.contains("version 1"), "{e}");

    // RoPE scaling.
    let mut synth = Synth::new(false);
    synth.set("llama.rope.scaling.type", Val::Str("linear".into()));
    let e = err_of(read_gguf(&synth.write(dir.path(), "rope.gguf")));
    assert!(e.contains("linear") && e.contains("rope.gguf"), "{e}");
    synth.set("llama.rope.scaling.type", Val::Str("none".into()));
    assert!(read_gguf(&synth.write(dir.path(), "rope-none.gguf")).is_ok());

    // Unknown pre-tokenizer and tokenizer model.
    let mut synth = Synth::new(false);
    synth.set("tokenizer.ggml.pre", Val::Str("mystery-bpe".into()));
    let e = err_of(read_gguf(&synth.write(dir.path(), "pre.gguf")));
    assert!(e.contains("mystery-bpe") && e.contains("pre.gguf"), "{e}");
    let mut synth = Synth::new(false);
    synth.set("tokenizer.ggml.model", Val::Str("llama".into()));
    let e = err_of(read_gguf(&synth.write(dir.path(), "spm.gguf")));
    assert!(
        e.contains("`llama`") && e.contains("tokenizer model"),
        "{e}"
    );

    // A missing tensor and a wrong shape.
    let mut synth = Synth::new(false);
    synth.tensors.retain(|t| t.name != "blk.1.ffn_up.weight");
    let e = err_of(read_gguf(&synth.write(dir.path(), "missing.gguf")));
    assert!(e.contains("model.layers.1.mlp.up_proj.weight"), "{e}");
    let mut synth = Synth::new(false);
    synth.set("llama.feed_forward_length", Val::U32(128));
    let e = err_of(read_gguf(&synth.write(dir.path(), "shape.gguf")));
    assert!(
        e.contains("blk.0.ffn_gate.weight") && e.contains("[128, 64]"),
        "{e}"
    );

    // An unknown tensor.
    let mut synth = Synth::new(false);
    synth.tensors.push(RawTensor {
        name: "blk.0.attn_q.bias".into(),
        dims: vec![D as u64],
        ty: 0,
        bytes: vec![0; 4 * D],
    });
    let e = err_of(read_gguf(&synth.write(dir.path(), "bias.gguf")));
    assert!(e.contains("blk.0.attn_q.bias"), "{e}");
}

// ---------------------------------------------------------------------------------------
// The real SmolLM2 GGUF
// ---------------------------------------------------------------------------------------

const SMOLLM2_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

fn smollm2_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/cache/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The packed SmolLM2 source, read once (the tests that call this are `Needs::Prepared`).
fn smollm2() -> &'static PackSource {
    static CELL: std::sync::OnceLock<PackSource> = std::sync::OnceLock::new();
    CELL.get_or_init(|| read_gguf(&common::cache_file("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap())
}

#[test(prepared)]
fn real_smollm2_config_and_tensors() {
    let src = smollm2();
    let c = &src.config;
    assert_eq!(c.num_layers, 30);
    assert_eq!(c.hidden_size, 576);
    assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (9, 3, 64));
    assert_eq!(c.intermediate_size, 1536);
    assert_eq!(c.rope_theta, 100000.0);
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert_eq!(c.vocab_size, 49152);
    assert_eq!(c.max_position_embeddings, 8192);
    assert!(c.tie_word_embeddings);
    assert_eq!((c.bos_token_id, c.eos_token_id), (Some(1), Some(2)));
    assert_eq!(c.num_params(), 134_515_008);
    assert_eq!(src.source_files[0].sha256, SMOLLM2_SHA256);
    assert_eq!(src.source_files[0].bytes, 98_362_432);
    let dtypes: Vec<(&str, usize)> = src
        .source_dtypes
        .iter()
        .map(|(k, v)| (k.as_str(), *v))
        .collect();
    assert_eq!(dtypes, vec![("F32", 61), ("Q4_1", 210), ("Q8_0", 1)]);
    let shapes: Vec<(String, Vec<usize>)> = src
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect();
    assert_eq!(shapes, c.expected_tensors());
    for t in &src.tensors {
        assert!(
            t.data.read_values().unwrap().iter().all(|v| v.is_finite()),
            "{} has non-finite values",
            t.name
        );
    }
    // The embedding row of `<|im_start|>` is not all zeros, and norms look like norms.
    let emb = &src.tensors[0];
    assert!(emb.data.read_values().unwrap()[576..1152]
        .iter()
        .any(|&v| v != 0.0));
    let norm = src
        .tensors
        .iter()
        .find(|t| t.name == "model.norm.weight")
        .unwrap();
    let mean = norm
        .data
        .read_values()
        .unwrap()
        .iter()
        .map(|&v| v as f64)
        .sum::<f64>()
        / 576.0;
    assert!(mean > 0.1 && mean < 10.0, "final norm mean {mean}");
}

#[test(prepared)]
fn real_smollm2_q_k_match_an_independent_decode() {
    let src = smollm2();
    // Read the raw bytes through the container parser, decode with the reference decoder
    // here, and check the packed Q/K equal the permuted-back decode (and V is untouched).
    let g = GgufFile::open(&smollm2_path()).unwrap();
    for (gguf_name, hf_name, heads) in [
        (
            "blk.7.attn_q.weight",
            "model.layers.7.self_attn.q_proj.weight",
            9,
        ),
        (
            "blk.7.attn_k.weight",
            "model.layers.7.self_attn.k_proj.weight",
            3,
        ),
        (
            "blk.7.attn_v.weight",
            "model.layers.7.self_attn.v_proj.weight",
            0,
        ),
        ("token_embd.weight", "model.embed_tokens.weight", 0),
    ] {
        let info = g.tensors.iter().find(|t| t.name == gguf_name).unwrap();
        let decoded = ref_decode(info.ggml_type.0, g.tensor_data(info).unwrap());
        let t = src.tensors.iter().find(|t| t.name == hf_name).unwrap();
        let got = if heads > 0 {
            permute_rows(
                &t.data.read_values().unwrap(),
                t.shape[0],
                t.shape[1],
                heads,
            )
        } else {
            t.data.read_values().unwrap()
        };
        assert!(
            got.iter()
                .zip(&decoded)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{hf_name}"
        );
    }
}

/// sha256 of the little-endian f32 bytes of tensors as `transformers` 5.24.0 dequantizes
/// (and, for Q/K, reverse-permutes) them when loading this GGUF in float32; computed once
/// with the eval venv on 2026-11-30.
const SMOLLM2_TRANSFORMERS_SHA256: [(&str, &str); 6] = [
    (
        "model.layers.3.self_attn.q_proj.weight",
        "104838da8b4afb8d4d2032db69cd49cd12b9558520cbca07b47095a03dec7691",
    ),
    (
        "model.layers.3.self_attn.k_proj.weight",
        "64d260baa4d5478cd91053172dc60f6cb429f1860d6882920f4f8c18b846464a",
    ),
    (
        "model.layers.3.self_attn.v_proj.weight",
        "c2d8d499cbdf3269e87c7ef9783a87ece7f9c03ff91bbbbceb3e6be7329b4a31",
    ),
    (
        "model.embed_tokens.weight",
        "3fd491c8066dd9dc1a2bf6796701526c82817d95c0ecabacdef3013c2b8bbbaa",
    ),
    (
        "model.layers.29.mlp.down_proj.weight",
        "c19605745425a11e704e305ce3d27b632c406195d39eb3377e9cfb140ac643d1",
    ),
    (
        "model.norm.weight",
        "3b87f8e27335e67fc08f159cabfd2d18f205d6c5b225a6f978153552bf01d559",
    ),
];

#[test(prepared)]
fn real_smollm2_weights_match_transformers_bit_for_bit() {
    let src = smollm2();
    use sha2::Digest;
    for (name, want) in SMOLLM2_TRANSFORMERS_SHA256 {
        let t = src.tensors.iter().find(|t| t.name == name).unwrap();
        let mut h = sha2::Sha256::new();
        for v in t.data.read_values().unwrap() {
            h.update(v.to_le_bytes());
        }
        assert_eq!(
            hex::encode(h.finalize()),
            want,
            "{name} differs from transformers' dequantization"
        );
    }
}

#[test(prepared)]
fn real_smollm2_tokenizer_hello_world() {
    let src = smollm2();
    let tok = tokenizers::Tokenizer::from_str(&src.tokenizer_json).unwrap();
    assert_eq!(tok.get_vocab_size(true), 49152);
    let json: serde_json::Value = serde_json::from_str(&src.tokenizer_json).unwrap();
    assert_eq!(json["model"]["merges"].as_array().unwrap().len(), 48900);
    let added = json["added_tokens"].as_array().unwrap();
    assert_eq!(added.len(), 17);
    assert!(added.iter().all(|a| a["special"] == true));
    let first: Vec<&str> = added[..3]
        .iter()
        .map(|a| a["content"].as_str().unwrap())
        .collect();
    assert_eq!(first, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]);
    let enc = tok.encode("Hello world 12345 你好", true).unwrap();
    assert_eq!(
        enc.get_ids(),
        &[19556, 905, 216, 33, 34, 35, 36, 37, 216, 18645, 250, 48392, 138]
    );
    // No BOS is added for SmolLM2 (add_bos_token is false in the file).
    let enc = tok.encode("<|im_start|>user\nHi<|im_end|>", true).unwrap();
    assert_eq!(enc.get_ids()[0], 1);
    assert_eq!(enc.get_ids().last(), Some(&2));
    assert_eq!(
        tok.decode(enc.get_ids(), false).unwrap(),
        "<|im_start|>user\nHi<|im_end|>"
    );
}

#[test(prepared)]
fn real_smollm2_tokenizer_matches_transformers_fixture() {
    let src = smollm2();
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("eval/fixtures/smollm2_tokenizer.json");
    if !fixture.exists() {
        eprintln!("SKIPPED: {} is absent", fixture.display());
        return;
    }
    let f: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&fixture).unwrap()).unwrap();
    let tok = tokenizers::Tokenizer::from_str(&src.tokenizer_json).unwrap();
    let cases = f["cases"].as_array().expect("fixture has `cases`");
    assert!(!cases.is_empty());
    let mut failures = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = tok.encode(text, true).unwrap().get_ids().to_vec();
        if got != want {
            let at = got
                .iter()
                .zip(&want)
                .position(|(a, b)| a != b)
                .unwrap_or(got.len().min(want.len()));
            failures.push(format!(
                "{name}: first difference at token {at} (got {} tokens, want {})",
                got.len(),
                want.len()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    eprintln!("{} fixture cases agree", cases.len());
}
