//! fp8 and nvfp4 weights against the libraries that define them.
//!
//! The fixtures under `eval/fixtures/quantized/` come from `eval/generators/make_weight_fixtures.py`
//! (ModelOpt 0.47, compressed-tensors 0.20.1, transformers 5.24 on CPU): checkpoints of the tiny
//! qwen3 model (the quantized linears only, byte for byte as exported) with transformers float32
//! log-probabilities on their dequantized weights, and sha256 lists of ModelOpt's and
//! transformers' exports of SmolLM2-135M. Checked here:
//! - the packer's `--weights nvfp4` / `fp8` bytes equal the libraries' exports of the same
//!   source weights, every payload and scale byte;
//! - an imported checkpoint dequantizes to the fixture's independent dequantization, bit for
//!   bit, and scores like transformers (max |Δ logprob| ≤ 2e-4, mean NLL within 1e-5 relative);
//! - broken quantized checkpoints and artifacts fail with one line naming the tensor.

use crate::common;

use common::logprobs::compare;
use ninfer_perplexity::artifact::{write_artifact, Artifact, WeightFormat, WeightPlan};
use ninfer_perplexity::engine::{Engine, LoadOptions};
use ninfer_perplexity::pack::{gguf::read_gguf, hf::read_hf_dir, PackSource};
use ninfer_perplexity::quant::Scheme;
use safetensors::SafeTensors;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const KINDS: [&str; 4] = ["modelopt-nvfp4", "modelopt-mixed", "ct-nvfp4", "fp8-block"];

fn hex(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

fn f32_sha(v: &[f32]) -> String {
    let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    hex(&b)
}

fn fixture_dir(kind: &str) -> PathBuf {
    common::repo().join(format!("eval/fixtures/quantized/tiny-qwen3-{kind}"))
}

/// A complete Hugging Face directory for a quantized tiny fixture: its config (with the
/// quantization config), its quantized linears, and the tiny model's other tensors in a
/// second shard.
fn assemble(kind: &str, dir: &Path) {
    let fx = fixture_dir(kind);
    std::fs::create_dir_all(dir).unwrap();
    for f in ["config.json", "hf_quant_config.json"] {
        if fx.join(f).exists() {
            std::fs::copy(fx.join(f), dir.join(f)).unwrap();
        }
    }
    let q = std::fs::read(fx.join("quantized.safetensors")).unwrap();
    let modules: BTreeSet<String> = SafeTensors::deserialize(&q)
        .unwrap()
        .names()
        .iter()
        .map(|n| n.rsplit_once('.').unwrap().0.to_string())
        .collect();
    std::fs::write(dir.join("model-00002-of-00002.safetensors"), &q).unwrap();
    let base =
        std::fs::read(common::repo().join("eval/fixtures/tiny-qwen3/model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&base).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| !modules.contains(n.rsplit_once('.').unwrap().0))
        .collect();
    safetensors::serialize_to_file(kept, None, &dir.join("model-00001-of-00002.safetensors"))
        .unwrap();
}

fn tokenizer() -> PathBuf {
    common::cache_file("qwen3-tokenizer.json")
}

/// Imports a tiny fixture with f32 dense tensors.
fn import(kind: &str, tmp: &Path) -> PathBuf {
    let dir = tmp.join(kind);
    assemble(kind, &dir);
    let src = read_hf_dir(&dir, Some(&tokenizer())).unwrap();
    let art = tmp.join(format!("{kind}.ninfer"));
    write_artifact(&src, WeightFormat::F32, &art).unwrap();
    art
}

#[test(prepared)]
fn imported_checkpoints_dequantize_exactly() {
    let tmp = common::tempdir();
    for kind in KINDS {
        let a = Artifact::open(&import(kind, tmp.path())).unwrap();
        a.verify_digest().unwrap();
        let fx = common::read_json(&format!("eval/fixtures/quantized/tiny-qwen3-{kind}.json"));
        let weights = fx["dequantized"]["weights"].as_object().unwrap();
        assert_eq!(weights.len(), 14, "{kind}: the fixture's quantized linears");
        let mut formats = BTreeMap::new();
        for (name, w) in weights {
            let got = f32_sha(&a.tensor_f32(name).unwrap());
            assert_eq!(got, w["sha256"].as_str().unwrap(), "{kind}: {name}");
            let f = a.tensor_format(name).unwrap();
            // The fixture says `nvfp4`, `fp8-tensor` or `fp8-block`.
            let want = w["format"].as_str().unwrap();
            assert_eq!(f, want.split('-').next().unwrap(), "{kind}: {name}");
            *formats.entry(f).or_insert(0) += 1;
        }
        eprintln!(
            "{kind}: 14/14 dequantized bit-exact {formats:?}; weights {}",
            a.weight_summary()
        );
        let q = a.quantization.as_ref().unwrap();
        // The ModelOpt and compressed-tensors exports carry activation scales: recorded only.
        let act = q.activation_scales.len();
        assert_eq!(act, if kind == "fp8-block" { 0 } else { 14 }, "{kind}");
    }
}

#[test(prepared)]
fn imported_checkpoints_score_like_transformers() {
    let tmp = common::tempdir();
    for kind in KINDS {
        let art = import(kind, tmp.path());
        let e = Engine::load(&art, &LoadOptions::default(), &mut |_, _| {}).unwrap();
        let fx = common::read_json(&format!("eval/fixtures/quantized/tiny-qwen3-{kind}.json"));
        let d = compare(&e, &fx);
        eprintln!("{kind}: {d:?}");
        assert!(d.tokens > 50);
        assert!(
            d.max_abs_logprob <= 2e-4,
            "{kind}: max |Δ logprob| {:.3e}",
            d.max_abs_logprob
        );
        assert!(
            d.max_rel_mean_nll <= 1e-5,
            "{kind}: Δ mean NLL {:.3e}",
            d.max_rel_mean_nll
        );
    }
}

/// The stored tensors of `a` that stand for the library tensor `name` (the artifact keeps
/// ModelOpt's names; FP8-block's `weight_scale_inv` is the artifact's `weight_scale`).
fn artifact_name(name: &str) -> String {
    name.replace(".weight_scale_inv", ".weight_scale")
}

/// Every weight byte of a library export equals the packer's.
fn assert_same_bytes(
    a: &Artifact,
    want: impl Iterator<Item = (String, String, Vec<usize>, String)>,
) -> usize {
    let mut n = 0;
    for (name, dtype, shape, sha) in want {
        if name.ends_with("input_scale") {
            continue; // activation scales depend on calibration data, not on the weights
        }
        let (d, s, bytes) = a
            .tensor_raw(&artifact_name(&name))
            .unwrap_or_else(|| panic!("the packer did not write `{name}`"));
        assert_eq!((d.as_str(), s), (dtype.as_str(), &shape[..]), "{name}");
        assert_eq!(
            hex(bytes),
            sha,
            "{name}: bytes differ from the library's export"
        );
        n += 1;
    }
    n
}

fn pack_plan(src: &PackSource, scheme: Scheme, out: &Path) -> Artifact {
    let plan = WeightPlan {
        dense: WeightFormat::Bf16,
        quantize: Some(scheme),
        head: false,
    };
    write_artifact(src, plan, out).unwrap();
    Artifact::open(out).unwrap()
}

fn library_tensors(kind: &str) -> Vec<(String, String, Vec<usize>, String)> {
    let q = std::fs::read(fixture_dir(kind).join("quantized.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&q).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                format!("{:?}", v.dtype()),
                v.shape().to_vec(),
                hex(v.data()),
            )
        })
        .collect()
}

#[test(prepared)]
fn packer_bytes_equal_the_libraries_on_the_tiny_model() {
    let src = read_hf_dir(
        &common::repo().join("eval/fixtures/tiny-qwen3"),
        Some(&tokenizer()),
    )
    .unwrap();
    let tmp = common::tempdir();
    for (kind, scheme) in [
        ("modelopt-nvfp4", Scheme::Nvfp4),
        ("fp8-block", Scheme::Fp8Block),
    ] {
        let a = pack_plan(&src, scheme, &tmp.path().join(format!("{kind}.ninfer")));
        let n = assert_same_bytes(&a, library_tensors(kind).into_iter());
        eprintln!("{kind}: {n} tensors byte-identical to the library's export");
        assert_eq!(n, if scheme == Scheme::Nvfp4 { 42 } else { 28 });
    }
}

#[test(prepared)]
fn packer_bytes_equal_the_libraries_on_smollm2() {
    let gguf = common::cache_file("SmolLM2-135M-Instruct.Q4_1.gguf");
    let src = read_gguf(&gguf).unwrap();
    let tmp = common::tempdir();
    for (file, scheme) in [
        ("smollm2-modelopt-nvfp4-sha256.json", Scheme::Nvfp4),
        ("smollm2-fp8-block-sha256.json", Scheme::Fp8Block),
    ] {
        let fx = common::read_json(&format!("eval/fixtures/quantized/{file}"));
        // Same source weights as the library quantized (transformers' GGUF dequantization).
        let sources = fx["source_weight_sha256"].as_object().unwrap();
        for (name, sha) in sources {
            let t = src.tensors.iter().find(|t| &t.name == name).unwrap();
            let v = &t.data.read_values().unwrap();
            assert_eq!(
                &f32_sha(v),
                sha.as_str().unwrap(),
                "source weights of {name}"
            );
        }
        let a = pack_plan(&src, scheme, &tmp.path().join("s.ninfer"));
        let want = fx["tensors"]
            .as_object()
            .unwrap()
            .iter()
            .filter_map(|(n, t)| {
                let dtype = t["dtype"].as_str().unwrap().to_string();
                // The library also lists the unquantized tensors, in its own dtype.
                (dtype == "U8" || dtype == "F8_E4M3" || n.contains("_scale")).then(|| {
                    let shape = t["shape"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|d| d.as_u64().unwrap() as usize)
                        .collect();
                    (
                        n.clone(),
                        dtype,
                        shape,
                        t["sha256"].as_str().unwrap().to_string(),
                    )
                })
            });
        let n = assert_same_bytes(&a, want);
        eprintln!(
            "{file}: {n} tensors byte-identical ({} source linears)",
            sources.len()
        );
        assert_eq!(
            n,
            sources.len() * if scheme == Scheme::Nvfp4 { 3 } else { 2 }
        );
    }
}

/// A Qwen3.5 hybrid with fp8 weights (attention, Gated DeltaNet and MLP linears) scores
/// exactly as an f32 artifact holding its dequantized weights: the quantized path adds no
/// arithmetic of its own. nvfp4 is refused by name on this tiny geometry, whose
/// `out_proj` reads 36 values per row (not a multiple of 16).
#[test(prepared)]
fn hybrid_quantized_scores_as_its_dequantized_weights() {
    use ninfer_perplexity::kv::KvDtype;
    use ninfer_perplexity::pack::TensorData;
    use ninfer_perplexity::score::Protocol;
    let tmp = common::tempdir();
    let dir = common::repo().join("eval/fixtures/tiny-qwen3_5");
    let src = read_hf_dir(&dir, Some(&tokenizer())).unwrap();
    let q = pack_plan(&src, Scheme::Fp8Block, &tmp.path().join("fp8.ninfer"));
    let summary = q.weight_summary();
    for class in ["attention", "deltanet", "mlp"] {
        let fp8 = summary.split("), ").next().unwrap();
        assert!(fp8.starts_with("fp8 (") && fp8.contains(class), "{summary}");
    }
    let mut plain = read_hf_dir(&dir, Some(&tokenizer())).unwrap();
    let mut quantized = 0;
    for t in &mut plain.tensors {
        if q.tensor_format(&t.name) == Some("fp8") {
            quantized += 1;
        }
        t.data = TensorData::Values(q.tensor_f32(&t.name).unwrap());
    }
    assert!(quantized >= 12, "{quantized} fp8 matrices");
    let deq = tmp.path().join("dequantized.ninfer");
    write_artifact(&plain, WeightFormat::F32, &deq).unwrap();
    let text = "The capital of France is Paris. It is known for the Eiffel Tower. ".repeat(12);
    let score = |art: &Path| {
        let e = Engine::load(art, &LoadOptions::default(), &mut |_, _| {}).unwrap();
        let ids = e.tokenizer.encode(&text).unwrap();
        let s = e
            .score(
                &ids,
                Protocol::new(64, 32).unwrap(),
                KvDtype::F32,
                false,
                &mut |_, _| {},
            )
            .unwrap();
        (s.totals.scored, s.totals.nll_sum.to_bits())
    };
    let (a, b) = (score(&tmp.path().join("fp8.ninfer")), score(&deq));
    eprintln!(
        "hybrid fp8: {quantized} fp8 matrices; {summary}; {} targets, same NLL bits: {}",
        a.0,
        a == b
    );
    assert!(a.0 > 100);
    assert_eq!(a, b, "fp8 artifact vs its dequantized f32 twin");
    let plan = WeightPlan {
        dense: WeightFormat::Bf16,
        quantize: Some(Scheme::Nvfp4),
        head: false,
    };
    let e = format!(
        "{:#}",
        write_artifact(&src, plan, &tmp.path().join("nvfp4.ninfer")).unwrap_err()
    );
    assert!(
        e.contains("out_proj.weight") && e.contains("multiple of 16"),
        "{e}"
    );
    assert!(!tmp.path().join("nvfp4.ninfer").exists());
}

// ---- bad input -------------------------------------------------------------------------

type Tensor = (safetensors::Dtype, Vec<usize>, Vec<u8>);

/// Rewrites a safetensors file tensor by tensor (`None` drops one), keeping its metadata.
fn rewrite(path: &Path, mut f: impl FnMut(&str, Tensor) -> Option<Tensor>) {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Tensor)> = vec![];
    for (n, v) in st.tensors() {
        let t = (v.dtype(), v.shape().to_vec(), v.data().to_vec());
        if let Some(t) = f(&n, t) {
            out.push((n, t));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = out
        .iter()
        .map(|(n, (d, s, b))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, meta, path).unwrap();
}

const SHARD: &str = "model-00002-of-00002.safetensors";
const UP: &str = "model.layers.0.mlp.up_proj";

#[test(prepared)]
fn broken_quantized_checkpoints_are_refused_by_name() {
    let tmp = common::tempdir();
    let fresh = |kind: &str, case: &str| {
        let dir = tmp.path().join(case);
        assemble(kind, &dir);
        dir
    };
    let edit = |dir: &Path, name: String, f: &dyn Fn(Tensor) -> Option<Tensor>| {
        rewrite(
            &dir.join(SHARD),
            |n, t| if n == name { f(t) } else { Some(t) },
        );
    };
    let nan = f32::NAN.to_le_bytes().to_vec();
    // Block scales that do not match the payload ([O, I/16] vs [O, I/2]).
    let d = fresh("modelopt-nvfp4", "scale-shape");
    edit(&d, format!("{UP}.weight_scale"), &|(t, s, b)| {
        Some((t, vec![s[0], 2], [b.clone(), b].concat()))
    });
    common::pack_fails(
        &d,
        &[
            SHARD,
            &format!("{UP}.weight_scale"),
            "needs F8_E4M3 [32, 1]",
        ],
    );
    // A truncated payload.
    let d = fresh("modelopt-nvfp4", "short-payload");
    edit(&d, format!("{UP}.weight"), &|(t, s, b)| {
        Some((t, vec![s[0], 7], b[..s[0] * 7].to_vec()))
    });
    common::pack_fails(&d, &[SHARD, UP]);
    // NaN and zero global scales, an e4m3 NaN code among the block scales.
    let d = fresh("modelopt-nvfp4", "nan-global");
    edit(&d, format!("{UP}.weight_scale_2"), &|(t, s, _)| {
        Some((t, s, nan.clone()))
    });
    common::pack_fails(&d, &[&format!("{UP}.weight"), "global scale is NaN"]);
    let d = fresh("modelopt-nvfp4", "zero-global");
    edit(&d, format!("{UP}.weight_scale_2"), &|(t, s, _)| {
        Some((t, s, 0f32.to_le_bytes().to_vec()))
    });
    common::pack_fails(&d, &[&format!("{UP}.weight"), "global scale is 0"]);
    // A finite global scale whose largest weight (6 · 448 times it) is past f32.
    let d = fresh("modelopt-nvfp4", "huge-global");
    edit(&d, format!("{UP}.weight_scale_2"), &|(t, s, _)| {
        Some((t, s, 1e36f32.to_le_bytes().to_vec()))
    });
    common::pack_fails(&d, &[&format!("{UP}.weight"), "overflows f32"]);
    let d = fresh("modelopt-nvfp4", "nan-block-scale");
    edit(&d, format!("{UP}.weight_scale"), &|(t, s, mut b)| {
        b[3] = 0x7F;
        Some((t, s, b))
    });
    common::pack_fails(&d, &[&format!("{UP}.weight"), "e4m3 NaN code"]);
    let d = fresh("modelopt-nvfp4", "no-global");
    edit(&d, format!("{UP}.weight_scale_2"), &|_| None);
    common::pack_fails(&d, &[SHARD, &format!("{UP}.weight"), "no global scale"]);
    // An fp8 payload with a NaN code.
    let d = fresh("fp8-block", "fp8-nan");
    edit(&d, format!("{UP}.weight"), &|(t, s, mut b)| {
        b[5] = 0xFF;
        Some((t, s, b))
    });
    common::pack_fails(&d, &[&format!("{UP}.weight"), "NaN code"]);
    // AWQ's pre-quantization scale: a scheme this build does not dequantize.
    let d = fresh("modelopt-nvfp4", "awq");
    rewrite(&d.join(SHARD), |_, t| Some(t));
    let extra = d.join("model-00003-of-00003.safetensors");
    let v = vec![0u8; 64];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![16], &v).unwrap();
    safetensors::serialize_to_file(vec![(format!("{UP}.pre_quant_scale"), view)], None, &extra)
        .unwrap();
    common::pack_fails(&d, &["pre_quant_scale", "AWQ"]);
    // The config claims one scheme, the tensors hold another.
    let d = fresh("modelopt-nvfp4", "claims-fp8");
    let hq = d.join("hf_quant_config.json");
    let text = std::fs::read_to_string(&hq)
        .unwrap()
        .replace("\"NVFP4\"", "\"FP8\"");
    std::fs::write(&hq, text).unwrap();
    common::pack_fails(
        &d,
        &["is nvfp4, but the checkpoint's config says modelopt FP8"],
    );
    // Quantized tensors and no quantization config at all.
    let d = fresh("fp8-block", "no-config");
    let cfg = d.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    c.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(&cfg, c.to_string()).unwrap();
    common::pack_fails(
        &d,
        &["is fp8, but the checkpoint has no quantization config"],
    );
    // A claim no tensor backs: the plain model with a ModelOpt config beside it.
    let d = tmp.path().join("claim-only");
    std::fs::create_dir_all(&d).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(
            common::repo().join("eval/fixtures/tiny-qwen3").join(f),
            d.join(f),
        )
        .unwrap();
    }
    std::fs::copy(
        fixture_dir("modelopt-nvfp4").join("hf_quant_config.json"),
        d.join("hf_quant_config.json"),
    )
    .unwrap();
    common::pack_fails(
        &d,
        &[
            "config.json",
            "says the checkpoint is modelopt NVFP4",
            "none of its tensors is quantized",
        ],
    );
}

/// A packed nvfp4 artifact with one part removed or its metadata changed fails at open,
/// naming the artifact and the tensor, before any output is written.
#[test(prepared)]
fn broken_quantized_artifacts_fail_at_open() {
    let tmp = common::tempdir();
    let src = read_hf_dir(
        &common::repo().join("eval/fixtures/tiny-qwen3"),
        Some(&tokenizer()),
    )
    .unwrap();
    let good = tmp.path().join("good.ninfer");
    pack_plan(&src, Scheme::Nvfp4, &good);
    let text = tmp.path().join("t.txt");
    std::fs::write(&text, "Hello there, a few words to score.").unwrap();
    let score_fails = |art: &Path, needles: &[&str]| {
        let out = tmp.path().join("out");
        let o = common::run_bin(
            "ninfer-perplexity",
            &[
                art.to_str().unwrap(),
                "--text",
                text.to_str().unwrap(),
                "--output",
                out.to_str().unwrap(),
            ],
        );
        let line = common::error_line(&o);
        for n in needles {
            assert!(line.contains(n), "`{n}` not in: {line}");
        }
        assert!(!out.exists(), "no output directory on failure");
    };
    let q = "model.layers.1.self_attn.v_proj.weight";
    type Edit = Box<dyn Fn(&str, Tensor) -> Option<Tensor>>;
    let cases: Vec<(&str, Edit, String)> = vec![
        (
            "no-global",
            Box::new(move |n, t| (n != format!("{q}_scale_2")).then_some(t)),
            format!("tensor `{q}_scale_2` is missing"),
        ),
        (
            "scale-dtype",
            Box::new(move |n, (d, s, b)| {
                if n == format!("{q}_scale") {
                    Some((safetensors::Dtype::U8, s, b))
                } else {
                    Some((d, s, b))
                }
            }),
            format!("tensor `{q}_scale` is U8"),
        ),
    ];
    for (case, f, want) in cases {
        let art = tmp.path().join(format!("{case}.ninfer"));
        std::fs::copy(&good, &art).unwrap();
        rewrite(&art, |n, t| f(n, t));
        score_fails(&art, &[art.to_str().unwrap(), &want]);
    }
    // The metadata must say how the quantized matrices came to be.
    let art = tmp.path().join("no-meta.ninfer");
    std::fs::copy(&good, &art).unwrap();
    let bytes = std::fs::read(&art).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let mut meta = meta.metadata().clone().unwrap();
    meta.remove("quantization");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    safetensors::serialize_to_file(st.tensors(), Some(meta), &art).unwrap();
    score_fails(
        &art,
        &["is quantized, but the metadata has no `quantization` key"],
    );
}

/// A matrix read in place (`Artifact::matrix`, what the CPU model holds) decodes row by row
/// to exactly the values of the matrix widened whole (`Artifact::tensor_f32`), for every
/// storage format: bf16, fp8 with 128 × 128 block scales, nvfp4 with its two scale levels.
#[test(prepared)]
fn stored_matrices_decode_to_the_widened_values() {
    use ninfer_perplexity::artifact::Artifact;
    let mut formats = std::collections::BTreeSet::new();
    for name in [
        "smollm2-135m-bf16",
        "smollm2-135m-fp8",
        "smollm2-135m-nvfp4",
    ] {
        let a = Artifact::open(&common::artifact(&format!("{name}.ninfer"))).unwrap();
        for t in [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.29.mlp.down_proj.weight",
        ] {
            let m = a.matrix(t).unwrap();
            formats.insert(m.format());
            let want = a.tensor_f32(t).unwrap();
            let mut row = vec![0f32; m.cols];
            for r in 0..m.rows {
                m.decode_row(r, &mut row);
                let w = &want[r * m.cols..(r + 1) * m.cols];
                assert!(
                    row.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{name} {t} row {r}"
                );
            }
        }
    }
    assert_eq!(
        formats.into_iter().collect::<Vec<_>>(),
        ["bf16", "fp8", "nvfp4"]
    );
}
