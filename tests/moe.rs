//! Mixture-of-experts models end to end: what a run reports about the experts, and every way
//! a MoE checkpoint can contradict its config (one line naming the file and tensor, no
//! artifact written).

mod common;

use serde_json::Value;
use std::path::{Path, PathBuf};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A copy of a committed tiny MoE checkpoint with `config.json` edited by `edit`.
fn checkpoint(family: &str, edit: impl Fn(&mut Value)) -> (tempfile::TempDir, PathBuf) {
    let tmp = common::tempdir();
    let dir = tmp.path().join(family);
    std::fs::create_dir(&dir).unwrap();
    let src = common::repo().join(format!("eval/fixtures/tiny-{family}"));
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let mut c: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    edit(&mut c);
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    (tmp, dir)
}

/// `ninfer-pack hf dir --weights w -o out`.
fn pack_as(dir: &Path, w: &str, out: &Path) -> std::process::Output {
    let tok = common::cache_file("qwen3-tokenizer.json");
    common::run_bin(
        "ninfer-pack",
        &[
            "hf",
            s(dir),
            "--tokenizer",
            s(&tok),
            "--weights",
            w,
            "-o",
            s(out),
        ],
    )
}

fn pack(dir: &Path, out: &Path) -> std::process::Output {
    pack_as(dir, "f32", out)
}

/// Scores `text` with `art` at context 32, stride 16 into `out`.
fn score(art: &Path, text: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    let mut a = vec![
        s(art),
        "--text",
        s(text),
        "--context",
        "32",
        "--stride",
        "16",
        "--output",
        s(out),
    ];
    a.extend_from_slice(extra);
    common::run_bin("ninfer-perplexity", &a)
}

fn report(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap()
}

fn contradicting_checkpoints_are_refused() {
    let experts_key = |c: &Value| {
        if c.get("num_experts").is_some() {
            "num_experts"
        } else {
            "num_local_experts"
        }
    };
    for (family, what, edit, needles) in [
        (
            "qwen3_moe",
            "top-k above the expert count",
            Box::new(|c: &mut Value| c["num_experts_per_tok"] = 9.into())
                as Box<dyn Fn(&mut Value)>,
            vec!["num_experts_per_tok is 9, outside 1..=num_experts (8)"],
        ),
        (
            "qwen3_moe",
            "an expert the checkpoint lacks",
            Box::new(move |c: &mut Value| {
                let k = experts_key(c);
                c[k] = 9.into();
            }),
            vec![
                "tensor `model.layers.0.mlp.experts.8.gate_proj.weight` is missing",
                "model.safetensors",
            ],
        ),
        (
            "qwen3_moe",
            "a router of the wrong width",
            Box::new(move |c: &mut Value| {
                let k = experts_key(c);
                c[k] = 7.into();
            }),
            vec![
                "model.safetensors: tensor `model.layers.0.mlp.gate.weight` has shape [8, 16], the config implies [7, 16]",
            ],
        ),
        (
            "qwen3_5_moe",
            "fused experts of another count",
            Box::new(move |c: &mut Value| {
                let k = experts_key(c);
                c[k] = 4.into();
            }),
            vec!["model.safetensors: tensor `model.layers.0.mlp.gate.weight` has shape [8, 16], the config implies [4, 16]"],
        ),
        (
            "qwen3_5_moe",
            "experts of another width",
            Box::new(|c: &mut Value| c["moe_intermediate_size"] = 10.into()),
            vec!["model.safetensors: tensor `model.layers.0.mlp.experts.0.gate_proj.weight` has shape [12, 16], the config implies [10, 16]"],
        ),
    ] {
        let (tmp, dir) = checkpoint(family, edit);
        let out = tmp.path().join("out.ninfer");
        let o = pack(&dir, &out);
        let e = common::error_line(&o);
        for n in needles {
            assert!(e.contains(n), "{family}, {what}: `{n}` not in {e}");
        }
        assert!(!out.exists(), "{family}, {what}: no artifact written");
    }
}

/// A run of the tiny hybrid MoE reports the experts, the active parameters and the routing
/// balance; its shards merge with the same counts; CUDA is refused by name.
fn a_moe_run_reports_its_routing() {
    let (tmp, dir) = checkpoint("qwen3_5_moe", |_| {});
    let art = tmp.path().join("moe.ninfer");
    assert!(pack(&dir, &art).status.success());
    let text = tmp.path().join("t.txt");
    std::fs::write(
        &text,
        "Experts share the work; the router decides who does what. ".repeat(8),
    )
    .unwrap();
    let run = |out: &Path, extra: &[&str]| score(&art, &text, out, extra);
    let full = tmp.path().join("full");
    let o = run(&full, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("experts    8 per sparse layer (4 of 4 layers), top-2 renormalised, a gated shared expert 20 wide"),
        "{err}"
    );
    let r = report(&full);
    let cfg = &r["artifact"]["config"]["moe"];
    assert_eq!(cfg["num_experts"], 8);
    assert_eq!(cfg["num_experts_per_tok"], 2);
    let active = r["artifact"]["active_params"].as_u64().unwrap();
    let total = r["artifact"]["params"].as_u64().unwrap();
    // 4 sparse layers × 6 unused experts × 3 matrices of 12 × 16.
    assert_eq!(total - active, 4 * 6 * 3 * 12 * 16);
    let routing = &r["streams"][0]["routing"];
    let per: Vec<u64> = routing["tokens_per_expert"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(per.len(), 8);
    assert_eq!(
        routing["assignments"].as_u64().unwrap(),
        per.iter().sum::<u64>()
    );
    assert_eq!(
        routing["tokens_per_expert_max"].as_u64(),
        per.iter().max().copied()
    );
    // Every routed row picks 2 experts in each of the 4 layers: rows of every window, the last
    // layer only those that predict targets.
    let windows = r["streams"][0]["windows"].as_array().unwrap();
    let rows: u64 = windows
        .iter()
        .map(|w| {
            let (b, st, e) = (
                w["begin"].as_u64().unwrap(),
                w["start"].as_u64().unwrap(),
                w["end"].as_u64().unwrap(),
            );
            3 * (e - b) + (e - (st - 1).max(b))
        })
        .sum();
    assert_eq!(routing["assignments"].as_u64().unwrap(), 2 * rows);

    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    assert!(run(&a, &["--shard", "1/2"]).status.success());
    assert!(run(&b, &["--shard", "2/2"]).status.success());
    let m = tmp.path().join("m");
    let o = common::run_bin(
        "ninfer-perplexity",
        &["merge", s(&a), s(&b), "--output", s(&m)],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mr = report(&m);
    assert_eq!(mr["streams"][0]["routing"], r["streams"][0]["routing"]);

    // The CUDA model on the emulated device routes the same tokens to the same experts
    // (its grouping is built from its own router's choices) and reports the same balance.
    if cfg!(feature = "cuda") {
        let emu = tmp.path().join("emu");
        let o = run(&emu, &["--device", "emu", "--precision", "f32"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let er = report(&emu);
        assert_eq!(er["streams"][0]["routing"], r["streams"][0]["routing"]);
        let (a, b) = (
            er["streams"][0]["mean_nll"].as_f64().unwrap(),
            r["streams"][0]["mean_nll"].as_f64().unwrap(),
        );
        assert!((a - b).abs() <= 1e-5 * b.abs(), "emu {a} vs cpu {b}");
    }
}

/// A checkpoint tensor: name, dtype, shape, little-endian bytes.
type Tensor = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

fn read_safetensors(path: &Path) -> Vec<Tensor> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect()
}

fn write_safetensors(path: &Path, tensors: &[Tensor]) {
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            let v = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
            (n.clone(), v)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// How many of an inspected artifact's tensors are in format `f`.
fn format_count(info: &Value, f: &str) -> u64 {
    info["weight_formats"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["format"] == f)
        .map_or(0, |x| x["tensors"].as_u64().unwrap())
}

/// Packs `dir` with `--weights w`; when that is fp8 or nvfp4, checks that `quantized`
/// matrices took the format and at least `bf16_at_least` stayed bf16; scores
/// `text` on the CPU; returns the artifact and its report.
fn pack_quantized(
    tmp: &Path,
    dir: &Path,
    w: &str,
    (quantized, bf16_at_least): (u64, u64),
    text: &Path,
) -> (PathBuf, Value) {
    let art = tmp.join(format!("{w}.ninfer"));
    let o = pack_as(dir, w, &art);
    assert!(
        o.status.success(),
        "{w}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = common::run_bin("ninfer-pack", &["inspect", s(&art)]);
    let info: Value = serde_json::from_slice(&o.stdout).unwrap();
    let count = |f: &str| format_count(&info, f);
    let formats = &info["weight_formats"];
    if w == "fp8" || w == "nvfp4" {
        assert_eq!(count(w), quantized, "{w}: {formats:?}");
        // The routers (and shared-expert gates) stay bf16.
        assert!(count("bf16") >= bf16_at_least, "{w}: {formats:?}");
    }
    let out = tmp.join(format!("run-{w}"));
    let o = score(&art, text, &out, &[]);
    assert!(
        o.status.success(),
        "{w}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    (art, report(&out))
}

/// The quantized matrices of the tiny qwen3_5_moe (4 attention + 3 × 3 Gated DeltaNet
/// linears, 4 sparse layers × (8 experts × 3 + the shared expert's 3)) and its bf16 ones
/// at least (4 routers and 4 shared-expert gates).
const MOE_QUANTIZED: (u64, u64) = (4 + 9 + 4 * (8 * 3 + 3), 8);

fn moe_text(tmp: &Path) -> PathBuf {
    let text = tmp.join("t.txt");
    std::fs::write(
        &text,
        "Quantized experts still route the same tokens. ".repeat(6),
    )
    .unwrap();
    text
}

/// `--weights fp8` quantizes every expert and the shared expert like a dense MLP and leaves
/// the routers and the shared expert's gate in bf16; the artifact scores.
fn experts_are_packed_in_fp8() {
    let (tmp, dir) = checkpoint("qwen3_5_moe", |_| {});
    let text = moe_text(tmp.path());
    let means: Vec<f64> = ["f32", "fp8"]
        .iter()
        .map(|w| {
            let (_, r) = pack_quantized(tmp.path(), &dir, w, MOE_QUANTIZED, &text);
            r["overall"]["mean_nll"].as_f64().unwrap()
        })
        .collect();
    eprintln!("mean NLL f32 / fp8: {means:?}");
    assert!(means.iter().all(|m| m.is_finite()));
    assert!(means[0] != means[1], "{means:?}");
}

/// The tiny qwen3_5_moe reshaped so that every matrix the packer quantizes reads a multiple
/// of nvfp4's 16-value block: Gated DeltaNet value heads 2 × 8 (`out_proj` reads 16, not 36),
/// experts 16 wide (not 12), the shared expert 32 (not 20). A reshaped tensor takes the
/// fixture's own values of that tensor, strided and repeated, so its scale stays the trained
/// one; the other tensors are the fixture's.
fn nvfp4_ready_checkpoint() -> (tempfile::TempDir, PathBuf) {
    let (tmp, dir) = checkpoint("qwen3_5_moe", |c| {
        c["linear_num_value_heads"] = 2.into();
        c["linear_value_head_dim"] = 8.into();
        c["moe_intermediate_size"] = 16.into();
        c["shared_expert_intermediate_size"] = 32.into();
    });
    // q 2 × 8 + k 2 × 8 + v 2 × 8 channels.
    let shapes: &[(&str, &[usize])] = &[
        ("linear_attn.conv1d.weight", &[48, 1, 4]),
        ("linear_attn.in_proj_qkv.weight", &[48, 16]),
        ("linear_attn.in_proj_z.weight", &[16, 16]),
        ("linear_attn.in_proj_a.weight", &[2, 16]),
        ("linear_attn.in_proj_b.weight", &[2, 16]),
        ("linear_attn.A_log", &[2]),
        ("linear_attn.dt_bias", &[2]),
        ("linear_attn.norm.weight", &[8]),
        ("linear_attn.out_proj.weight", &[16, 16]),
        ("mlp.experts.gate_up_proj", &[8, 32, 16]),
        ("mlp.experts.down_proj", &[8, 16, 16]),
        ("mlp.shared_expert.gate_proj.weight", &[32, 16]),
        ("mlp.shared_expert.up_proj.weight", &[32, 16]),
        ("mlp.shared_expert.down_proj.weight", &[16, 32]),
    ];
    let n = reshape(&dir, shapes);
    assert_eq!(
        n,
        3 * 9 + 4 * 5,
        "3 Gated DeltaNet layers × 9 tensors, 4 MoE layers × 5"
    );
    (tmp, dir)
}

/// Gives the tensors of `dir`'s checkpoint whose names end in one of `shapes`' suffixes that
/// shape, filled with their own values strided and repeated; returns how many it reshaped.
fn reshape(dir: &Path, shapes: &[(&str, &[usize])]) -> usize {
    let path = dir.join("model.safetensors");
    let mut out: Vec<Tensor> = Vec::new();
    let mut reshaped = 0;
    for (name, dtype, old_shape, old) in read_safetensors(&path) {
        let new = shapes.iter().find(|(suffix, _)| name.ends_with(suffix));
        let Some((_, shape)) = new else {
            out.push((name, dtype, old_shape, old));
            continue;
        };
        let esz = dtype.bitsize() / 8;
        let (n_old, n_new) = (old.len() / esz, shape.iter().product::<usize>());
        let mut data = Vec::with_capacity(n_new * esz);
        for i in 0..n_new {
            let j = (i * 7 + 3) % n_old;
            data.extend_from_slice(&old[j * esz..(j + 1) * esz]);
        }
        out.push((name, dtype, shape.to_vec(), data));
        reshaped += 1;
    }
    write_safetensors(&path, &out);
    reshaped
}

/// `--weights nvfp4` on a MoE: every expert and the shared expert in nvfp4 (each expert's
/// gate and up sharing a global scale), the artifact scores on the CPU, and the CUDA model on
/// the emulated device (which dequantizes the experts at load) gives the CPU's routing and
/// mean NLL.
fn experts_are_packed_in_nvfp4() {
    let (tmp, dir) = nvfp4_ready_checkpoint();
    let text = moe_text(tmp.path());
    let (_, f32_report) = pack_quantized(tmp.path(), &dir, "f32", MOE_QUANTIZED, &text);
    let (art, r) = pack_quantized(tmp.path(), &dir, "nvfp4", MOE_QUANTIZED, &text);
    let means = [&f32_report, &r].map(|r| r["overall"]["mean_nll"].as_f64().unwrap());
    eprintln!("mean NLL f32 / nvfp4: {means:?}");
    assert!(means.iter().all(|m| m.is_finite()));
    assert!(means[0] != means[1], "{means:?}");
    if cfg!(feature = "cuda") {
        let emu = tmp.path().join("emu");
        let o = score(
            &art,
            &text,
            &emu,
            &["--device", "emu", "--precision", "f32"],
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let er = report(&emu);
        assert_eq!(er["streams"][0]["routing"], r["streams"][0]["routing"]);
        let (a, b) = (er["overall"]["mean_nll"].as_f64().unwrap(), means[1]);
        eprintln!("nvfp4 mean NLL emu / cpu: {a} / {b}");
        assert!((a - b).abs() <= 1e-5 * b.abs(), "emu {a} vs cpu {b}");
    }
}

/// The tiny qwen3_moe (per-expert layout) as a fine-grained FP8 export, the layout of the
/// Qwen `*-FP8` MoE releases: every matrix the packer would quantize stored as `F8_E4M3`
/// `X.weight` with its `X.weight_scale_inv` 128 × 128 block scales, quantized by the crate's
/// transformers-equivalent quantizer, and `quantization_config.quant_method = "fp8"`. `drop`
/// names a tensor to leave out. Returns the directory and how many matrices are fp8.
fn fp8_export(tmp: &Path, drop: Option<&str>) -> (PathBuf, u64) {
    use ninfer_perplexity::quant::{fp8, select};
    let (_keep, src) = checkpoint("qwen3_moe", |_| {});
    let dir = tmp.join("qwen3_moe-fp8");
    std::fs::create_dir_all(&dir).unwrap();
    let mut c: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    c["quantization_config"] = serde_json::json!({
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    });
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    let mut out: Vec<Tensor> = Vec::new();
    let mut quantized = 0;
    for (name, dtype, shape, data) in read_safetensors(&src.join("model.safetensors")) {
        if !select::selected(&name, false) {
            out.push((name, dtype, shape, data));
            continue;
        }
        assert_eq!(dtype, safetensors::Dtype::BF16, "{name}");
        let (rows, cols) = (shape[0], shape[1]);
        let w = bf16_to_f32(&data);
        let q = fp8::quantize_block(&w, rows, cols);
        let fp8::Fp8Scale::Block(scales) = &q.scale else {
            unreachable!("quantize_block scales per block")
        };
        let base = name.strip_suffix(".weight").unwrap();
        let scale_bytes: Vec<u8> = scales.iter().flat_map(|v| v.to_le_bytes()).collect();
        out.push((
            format!("{base}.weight_scale_inv"),
            safetensors::Dtype::F32,
            vec![rows.div_ceil(fp8::BLOCK), cols.div_ceil(fp8::BLOCK)],
            scale_bytes,
        ));
        out.push((name, safetensors::Dtype::F8_E4M3, vec![rows, cols], q.codes));
        quantized += 1;
    }
    out.retain(|(n, ..)| Some(n.as_str()) != drop);
    write_safetensors(&dir.join("model.safetensors"), &out);
    (dir, quantized)
}

/// A per-expert FP8 checkpoint imports with its experts' bytes as stored and scores exactly
/// as the bf16 checkpoint packed with `--weights fp8` (the same quantizer, so the same
/// bytes): the import path reads every expert's payload and block scales under its own name.
/// An expert whose scale is missing is refused naming the file and the tensor.
fn per_expert_fp8_checkpoints_import_exactly() {
    let tmp = common::tempdir();
    let (dir, quantized) = fp8_export(tmp.path(), None);
    // 3 layers × 4 attention; layer 1 dense (3), layers 0 and 2 sparse (8 experts × 3).
    assert_eq!(quantized, 3 * 4 + 3 + 2 * 8 * 3);
    let (_keep, src) = checkpoint("qwen3_moe", |_| {});
    let packed = ("fp8", (quantized, 2));
    assert_import_matches_packing(tmp.path(), &dir, "fp8 (config.json)", &src, packed);
    let bad = tmp.path().join("bad");
    let gone = "model.layers.2.mlp.experts.5.down_proj.weight_scale_inv";
    let (dir, _) = fp8_export(&bad, Some(gone));
    assert_missing_part_refused(&dir, gone, "has no scale");
}

/// Packs the quantized export `dir` (its payloads kept as stored) and the bf16 checkpoint
/// `src` with `--weights packed.0`; checks that the import holds `packed.1.0` matrices in that
/// format under `method` and that both score the same windows, routing and mean NLL bits.
fn assert_import_matches_packing(
    tmp: &Path,
    dir: &Path,
    method: &str,
    src: &Path,
    packed: (&str, (u64, u64)),
) {
    let (w, expect) = packed;
    let text = moe_text(tmp);
    let imported = tmp.join("imported");
    std::fs::create_dir(&imported).unwrap();
    let (art, ri) = pack_quantized(&imported, dir, "bf16", (0, 0), &text);
    let o = common::run_bin("ninfer-pack", &["inspect", s(&art)]);
    let info: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(format_count(&info, w), expect.0, "{info}");
    assert_eq!(info["quantization"]["method"], method, "{info}");
    let (_, rp) = pack_quantized(tmp, src, w, expect, &text);
    let windows = |r: &Value| r["streams"][0]["windows"].clone();
    assert_eq!(windows(&ri), windows(&rp));
    assert_eq!(ri["overall"]["mean_nll"], rp["overall"]["mean_nll"]);
    assert_eq!(ri["streams"][0]["routing"], rp["streams"][0]["routing"]);
    eprintln!(
        "imported {w} / packed {w} mean NLL: {} / {}",
        ri["overall"]["mean_nll"], rp["overall"]["mean_nll"]
    );
}

/// Packing the export `dir`, which lacks the part `gone`, fails with one line naming the
/// file, the weight and `problem`, and leaves no artifact.
fn assert_missing_part_refused(dir: &Path, gone: &str, problem: &str) {
    let out = dir.join("x.ninfer");
    let o = pack(dir, &out);
    assert!(!o.status.success());
    let line = common::error_line(&o);
    let weight = format!("{}.weight", gone.rsplit_once(".weight").unwrap().0);
    assert!(
        line.contains("model.safetensors") && line.contains(&weight) && line.contains(problem),
        "{line}"
    );
    assert!(!common::exists(&out), "a partial artifact was left behind");
}

fn bf16_to_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
}

/// The nvfp4-ready tiny qwen3_5_moe as a ModelOpt NVFP4 export with per-expert tensors (the
/// layout of the published NVFP4 MoE checkpoints): the fused experts split into
/// `mlp.experts.E.{gate,up,down}_proj`, every matrix the packer would quantize stored as
/// `U8` codes `[O, I/2]`, `F8_E4M3` `weight_scale [O, I/16]` and `F32` `weight_scale_2`,
/// quantized by the crate's ModelOpt-equivalent quantizer with ModelOpt's shared-input
/// groups, and `hf_quant_config.json` saying NVFP4. `drop` names a tensor to leave out.
/// Returns the directory and how many matrices are nvfp4.
fn nvfp4_export(tmp: &Path, drop: Option<&str>) -> (PathBuf, u64) {
    use ninfer_perplexity::quant::{nvfp4, select};
    let (_keep, src) = nvfp4_ready_checkpoint();
    let dir = tmp.join("qwen3_5_moe-nvfp4");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("hf_quant_config.json"),
        serde_json::json!({
            "producer": {"name": "modelopt"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16},
        })
        .to_string(),
    )
    .unwrap();
    let bf16 = safetensors::Dtype::BF16;
    let mut tensors: Vec<Tensor> = Vec::new();
    for (name, dtype, shape, data) in read_safetensors(&src.join("model.safetensors")) {
        let fused = [("gate_up_proj", true), ("down_proj", false)]
            .into_iter()
            .find_map(|(p, gu)| Some((name.strip_suffix(&format!(".mlp.experts.{p}"))?, gu)));
        let Some((prefix, gate_up)) = fused else {
            tensors.push((name, dtype, shape, data));
            continue;
        };
        assert_eq!(dtype, bf16, "{name}");
        let (e, rows, cols) = (shape[0], shape[1], shape[2]);
        let per = rows * cols * 2;
        for (x, expert) in data.chunks_exact(per).enumerate().take(e) {
            let at = |proj: &str| format!("{prefix}.mlp.experts.{x}.{proj}.weight");
            if gate_up {
                let (g, u) = expert.split_at(per / 2);
                tensors.push((at("gate_proj"), bf16, vec![rows / 2, cols], g.to_vec()));
                tensors.push((at("up_proj"), bf16, vec![rows / 2, cols], u.to_vec()));
            } else {
                tensors.push((at("down_proj"), bf16, vec![rows, cols], expert.to_vec()));
            }
        }
    }
    // The quantized matrices by scale group, in checkpoint order.
    let mut groups: std::collections::BTreeMap<String, Vec<usize>> = Default::default();
    for (i, (name, ..)) in tensors.iter().enumerate() {
        if select::selected(name, false) {
            let key = select::group(name).unwrap_or_else(|| name.clone());
            groups.entry(key).or_default().push(i);
        }
    }
    let mut quantized = std::collections::BTreeMap::new();
    for members in groups.values() {
        let cols = tensors[members[0]].2[1];
        let values: Vec<Vec<f32>> = members
            .iter()
            .map(|&i| bf16_to_f32(&tensors[i].3))
            .collect();
        let parts: Vec<&[f32]> = values.iter().map(Vec::as_slice).collect();
        for (&i, q) in members.iter().zip(nvfp4::quantize_group(&parts, cols)) {
            assert!(matches!(q.global, nvfp4::Global::Multiply(_)));
            quantized.insert(i, q);
        }
    }
    let mut out: Vec<Tensor> = Vec::new();
    let count = quantized.len() as u64;
    for (i, t) in tensors.into_iter().enumerate() {
        let Some(q) = quantized.remove(&i) else {
            out.push(t);
            continue;
        };
        let base = t.0.strip_suffix(".weight").unwrap().to_string();
        let (o, c) = (q.rows, q.cols);
        out.push((t.0, safetensors::Dtype::U8, vec![o, c / 2], q.packed));
        out.push((
            format!("{base}.weight_scale"),
            safetensors::Dtype::F8_E4M3,
            vec![o, c / nvfp4::BLOCK],
            q.block_scales,
        ));
        out.push((
            format!("{base}.weight_scale_2"),
            safetensors::Dtype::F32,
            vec![],
            q.global.value().to_le_bytes().to_vec(),
        ));
    }
    out.retain(|(n, ..)| Some(n.as_str()) != drop);
    write_safetensors(&dir.join("model.safetensors"), &out);
    (dir, count)
}

/// A per-expert ModelOpt NVFP4 checkpoint imports with its experts' codes and scales as
/// stored and scores exactly as the bf16 checkpoint packed with `--weights nvfp4` (the same
/// quantizer and groups, so the same bytes). An expert without its global scale is refused
/// naming the file and the tensor.
fn per_expert_nvfp4_checkpoints_import_exactly() {
    let tmp = common::tempdir();
    let (dir, quantized) = nvfp4_export(tmp.path(), None);
    assert_eq!(quantized, MOE_QUANTIZED.0);
    let (_keep, src) = nvfp4_ready_checkpoint();
    let method = "modelopt NVFP4 (hf_quant_config.json)";
    assert_import_matches_packing(tmp.path(), &dir, method, &src, ("nvfp4", MOE_QUANTIZED));
    let bad = tmp.path().join("bad");
    let gone = "model.layers.1.mlp.experts.6.up_proj.weight_scale_2";
    let (dir, _) = nvfp4_export(&bad, Some(gone));
    assert_missing_part_refused(&dir, gone, "no global scale");
}

/// The tiny qwen3_next with Gated DeltaNet heads of 128 (2 key heads, 2 value heads), so
/// that each key head's q, k, v and z rows in `in_proj_qkvz` are whole 128-row blocks, as in
/// Qwen3-Next-80B (16 key heads and 32 value heads, all of 128).
fn wide_next_checkpoint() -> (tempfile::TempDir, PathBuf) {
    let (tmp, dir) = checkpoint("qwen3_next", |c| {
        c["linear_key_head_dim"] = 128.into();
        c["linear_num_value_heads"] = 2.into();
        c["linear_value_head_dim"] = 128.into();
    });
    // Per key head q, k, v, z of 128; conv channels q 256 + k 256 + v 256.
    let shapes: &[(&str, &[usize])] = &[
        ("linear_attn.in_proj_qkvz.weight", &[1024, 16]),
        ("linear_attn.in_proj_ba.weight", &[4, 16]),
        ("linear_attn.conv1d.weight", &[768, 1, 4]),
        ("linear_attn.A_log", &[2]),
        ("linear_attn.dt_bias", &[2]),
        ("linear_attn.norm.weight", &[128]),
        ("linear_attn.out_proj.weight", &[16, 256]),
    ];
    assert_eq!(
        reshape(&dir, shapes),
        3 * 7,
        "3 Gated DeltaNet layers × 7 tensors"
    );
    // The strided fill puts the same extremes in every 128-row block; scale each block by its
    // own power of two (exact in bf16) so that the block scales differ and moving a row to
    // another block's scale changes values.
    let path = dir.join("model.safetensors");
    let mut tensors = read_safetensors(&path);
    for (name, _, _, data) in &mut tensors {
        if name.ends_with("in_proj_qkvz.weight") {
            for (r, row) in data.chunks_exact_mut(2 * 16).enumerate() {
                let f = [0.5f32, 1.0, 2.0, 4.0][(r / 128) % 4];
                for b in row.chunks_exact_mut(2) {
                    let v = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
                    b.copy_from_slice(&half::bf16::from_f32(v * f).to_le_bytes());
                }
            }
        }
    }
    write_safetensors(&path, &tensors);
    (tmp, dir)
}

/// The qwen3_next checkpoint `src` with its grouped Gated DeltaNet projections named in
/// `quantized` (`in_proj_qkvz`, `in_proj_ba`) stored in `format` (`"nvfp4"`: ModelOpt
/// layout; `"fp8-channel"`: a scale per row; `"fp8-block"`: 128 × 128 block scales, the Qwen
/// `*-FP8` layout), the rest bf16; and beside it the same checkpoint with those tensors
/// replaced by their dequantized values in F32. Returns both directories.
fn grouped_export(tmp: &Path, src: &Path, quantized: &[&str], format: &str) -> (PathBuf, PathBuf) {
    use ninfer_perplexity::quant::{fp8, nvfp4, QuantTensor};
    let (export, reference) = (tmp.join(format), tmp.join(format!("{format}-dequantized")));
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    for d in [&export, &reference] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("config.json"), config.to_string()).unwrap();
    }
    if format == "nvfp4" {
        let claim = serde_json::json!({"quantization": {"quant_algo": "NVFP4", "group_size": 16}});
        std::fs::write(export.join("hf_quant_config.json"), claim.to_string()).unwrap();
    } else {
        config["quantization_config"] = serde_json::json!({"quant_method": "fp8"});
        std::fs::write(export.join("config.json"), config.to_string()).unwrap();
    }
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (mut out, mut plain) = (Vec::<Tensor>::new(), Vec::<Tensor>::new());
    for (name, dtype, shape, data) in read_safetensors(&src.join("model.safetensors")) {
        let Some(base) = name.strip_suffix(".weight").filter(|b| {
            quantized
                .iter()
                .any(|q| b.ends_with(&format!("linear_attn.{q}")))
        }) else {
            out.push((name.clone(), dtype, shape.clone(), data.clone()));
            plain.push((name, dtype, shape, data));
            continue;
        };
        let (rows, cols) = (shape[0], shape[1]);
        let w = bf16_to_f32(&data);
        let q = match format {
            "nvfp4" => QuantTensor::Nvfp4(nvfp4::quantize_group(&[&w], cols).remove(0)),
            "fp8-block" => QuantTensor::Fp8(fp8::quantize_block(&w, rows, cols)),
            _ => {
                // One block per row: a per-row scale.
                let per_row: Vec<fp8::Fp8Tensor> = w
                    .chunks(cols)
                    .map(|r| fp8::quantize_block(r, 1, cols))
                    .collect();
                QuantTensor::Fp8(fp8::Fp8Tensor {
                    rows,
                    cols,
                    codes: per_row.iter().flat_map(|t| t.codes.clone()).collect(),
                    scale: fp8::Fp8Scale::Channel(
                        per_row.iter().map(|t| t.scale.values()[0]).collect(),
                    ),
                })
            }
        };
        plain.push((
            name.clone(),
            safetensors::Dtype::F32,
            shape.clone(),
            f32_bytes(&q.dequantize().unwrap()),
        ));
        let part = |suffix: &str, d, shape: Vec<usize>, bytes| {
            (format!("{base}.{suffix}"), d, shape, bytes)
        };
        match q {
            QuantTensor::Nvfp4(t) => {
                out.push(part(
                    "weight",
                    safetensors::Dtype::U8,
                    vec![rows, cols / 2],
                    t.packed,
                ));
                out.push(part(
                    "weight_scale",
                    safetensors::Dtype::F8_E4M3,
                    vec![rows, cols / nvfp4::BLOCK],
                    t.block_scales,
                ));
                let g = t.global.value().to_le_bytes().to_vec();
                out.push(part("weight_scale_2", safetensors::Dtype::F32, vec![], g));
            }
            QuantTensor::Fp8(t) => {
                let shape = match t.scale {
                    fp8::Fp8Scale::Channel(_) => vec![rows, 1],
                    _ => vec![rows.div_ceil(fp8::BLOCK), cols.div_ceil(fp8::BLOCK)],
                };
                let bytes = f32_bytes(t.scale.values());
                out.push(part(
                    "weight",
                    safetensors::Dtype::F8_E4M3,
                    vec![rows, cols],
                    t.codes,
                ));
                out.push(part(
                    "weight_scale_inv",
                    safetensors::Dtype::F32,
                    shape,
                    bytes,
                ));
            }
        }
    }
    write_safetensors(&export.join("model.safetensors"), &out);
    write_safetensors(&reference.join("model.safetensors"), &plain);
    (export, reference)
}

/// Qwen3-Next's grouped projections stored quantized are un-grouped with their scales: the
/// import scores bit for bit as the checkpoint holding their dequantized values, in nvfp4,
/// in per-row fp8, and in fp8 with 128 × 128 block scales when every key head's parts are
/// whole blocks (the Qwen3-Next-80B FP8 layout, `in_proj_ba` left in bf16 as there). Block
/// scales cannot follow the tiny model's 8-row parts: refused, naming the file and tensor.
fn grouped_quantized_projections_import_exactly() {
    let tmp = common::tempdir();
    let text = moe_text(tmp.path());
    let (_keep, tiny) = checkpoint("qwen3_next", |_| {});
    let (_keep_wide, wide) = wide_next_checkpoint();
    let both: &[&str] = &["in_proj_qkvz", "in_proj_ba"];
    // 3 Gated DeltaNet layers × in_proj_qkv, in_proj_z (and in_proj_b, in_proj_a).
    for (src, quantized, format, count) in [
        (&tiny, both, "nvfp4", 3 * 4),
        (&tiny, both, "fp8-channel", 3 * 4),
        (&wide, &both[..1], "fp8-block", 3 * 2),
    ] {
        let (export, reference) = grouped_export(tmp.path(), src, quantized, format);
        let w = format.split('-').next().unwrap();
        let (art, ri) = pack_quantized(&export, &export, "f32", (0, 0), &text);
        let o = common::run_bin("ninfer-pack", &["inspect", s(&art)]);
        let info: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(format_count(&info, w), count, "{format}: {info}");
        let (_, rd) = pack_quantized(&reference, &reference, "f32", (0, 0), &text);
        let windows = |r: &Value| r["streams"][0]["windows"].clone();
        assert_eq!(windows(&ri), windows(&rd), "{format}");
        eprintln!(
            "{format}: imported / dequantized mean NLL {} / {}",
            ri["overall"]["mean_nll"], rd["overall"]["mean_nll"]
        );
    }
    let bad = tmp.path().join("bad");
    let (export, _) = grouped_export(&bad, &tiny, both, "fp8-block");
    let out = export.join("x.ninfer");
    let o = pack(&export, &out);
    assert!(!o.status.success());
    let line = common::error_line(&o);
    assert!(
        line.contains("model.safetensors")
            && line.contains("model.layers.0.linear_attn.in_proj_ba.weight")
            && line.contains("cannot be un-grouped")
            && line.contains("not whole blocks"),
        "{line}"
    );
    assert!(!common::exists(&out), "a partial artifact was left behind");
}

test_main! {
    Prepared experts_are_packed_in_fp8,
    Prepared experts_are_packed_in_nvfp4,
    Prepared per_expert_fp8_checkpoints_import_exactly,
    Prepared per_expert_nvfp4_checkpoints_import_exactly,
    Prepared grouped_quantized_projections_import_exactly,
    Prepared contradicting_checkpoints_are_refused,
    Prepared a_moe_run_reports_its_routing,
}
