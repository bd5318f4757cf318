//! Mixture-of-experts models with quantized weights, end to end through `ninfer-pack` and
//! `ninfer-perplexity`: experts quantized at pack time (`--weights fp8|nvfp4`), per-expert
//! exports imported as stored, and Qwen3-Next's grouped projections un-grouped with their
//! scales.
//!
//! Each check is an exact one. The test builds, from the same bf16 checkpoint and with the
//! crate's quantizers (transformers' fine-grained FP8, ModelOpt's NVFP4, the packer's own
//! selection and nvfp4 scale groups), both the checkpoint an exporter would write and one that
//! holds the dequantized values in F32; packing the bf16 checkpoint with `--weights W`,
//! importing the export and packing the dequantized copy must then score the same bits. A
//! matrix quantized that should not be, or left alone that should be, a wrong scale group, an
//! expert read under another expert's name or a scale moved with the wrong rows changes them.

use crate::common;

use common::checkpoint::{
    bf16_to_f32, f32_bytes, fixture_copy, fp8_per_row, quantized_parts, read_config,
    read_safetensors, reshape, write_safetensors, Tensor,
};
use common::{pack_hf, report, score_text};
use ninfer_perplexity::artifact::Artifact;
use ninfer_perplexity::quant::{fp8, nvfp4, select, QuantTensor};
use safetensors::Dtype;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn text(tmp: &Path) -> PathBuf {
    let text = tmp.join("t.txt");
    let words = "Quantized experts still route the same tokens. ".repeat(6);
    std::fs::write(&text, words).unwrap();
    text
}

/// Packs `dir` with `--weights w` into `tmp/name.ninfer` and scores `text` on the CPU;
/// returns the artifact, its `ninfer-pack inspect` and the report.
fn pack_and_score(tmp: &Path, name: &str, dir: &Path, w: &str, text: &Path) -> Packed {
    let art = tmp.join(format!("{name}.ninfer"));
    let o = pack_hf(dir, w, &art);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{name}: {err}");
    let o = common::run_bin("ninfer-pack", &["inspect", s(&art)]);
    let info: Value = serde_json::from_slice(&o.stdout).unwrap();
    let out = tmp.join(format!("run-{name}"));
    let o = score_text(&art, text, &out, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{name}: {err}");
    Packed {
        art,
        info,
        report: report(&out),
    }
}

struct Packed {
    art: PathBuf,
    info: Value,
    report: Value,
}

impl Packed {
    /// How many tensors are stored in format `f`.
    fn count(&self, f: &str) -> u64 {
        self.info["weight_formats"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["format"] == f)
            .map_or(0, |x| x["tensors"].as_u64().unwrap())
    }

    /// Asserts that `other` scored the same bits: every window's sums, the routing counts.
    fn assert_same_scores(&self, other: &Packed, what: &str) {
        let (a, b) = (&self.report["streams"][0], &other.report["streams"][0]);
        // Every window's numbers (not its wall time).
        let untimed = |v: &serde_json::Value| {
            let mut v = v.clone();
            for w in v.as_array_mut().unwrap() {
                w.as_object_mut().unwrap().remove("seconds");
            }
            v
        };
        assert_eq!(
            untimed(&a["windows"]),
            untimed(&b["windows"]),
            "{what}: windows"
        );
        assert_eq!(a["routing"], b["routing"], "{what}: routing");
        assert_eq!(
            self.report["overall"]["mean_nll"], other.report["overall"]["mean_nll"],
            "{what}"
        );
    }
}

/// The tensors of `dir`'s checkpoint with fused experts (`mlp.experts.gate_up_proj [E, 2I,
/// H]`, `down_proj [E, H, I]`) split per expert, the layout exporters write.
fn per_expert_tensors(dir: &Path) -> Vec<Tensor> {
    let mut out = Vec::new();
    for (name, dtype, shape, data) in read_safetensors(&dir.join("model.safetensors")) {
        let fused = [("gate_up_proj", true), ("down_proj", false)]
            .into_iter()
            .find_map(|(p, gu)| Some((name.strip_suffix(&format!(".mlp.experts.{p}"))?, gu)));
        let Some((prefix, gate_up)) = fused else {
            out.push((name, dtype, shape, data));
            continue;
        };
        let (rows, cols) = (shape[1], shape[2]);
        let per = rows * cols * dtype.bitsize() / 8;
        for (x, expert) in data.chunks_exact(per).enumerate() {
            let at = |proj: &str| format!("{prefix}.mlp.experts.{x}.{proj}.weight");
            if gate_up {
                // Each expert's gate rows, then its up rows.
                let (g, u) = expert.split_at(per / 2);
                out.push((at("gate_proj"), dtype, vec![rows / 2, cols], g.to_vec()));
                out.push((at("up_proj"), dtype, vec![rows / 2, cols], u.to_vec()));
            } else {
                out.push((at("down_proj"), dtype, vec![rows, cols], expert.to_vec()));
            }
        }
    }
    out
}

/// The matrices of `tensors` that the packer quantizes, by index, quantized as `--weights w`
/// would: fp8 per 128 × 128 block, nvfp4 with one global scale per scale group.
fn quantize_selected(tensors: &[Tensor], w: &str) -> BTreeMap<usize, QuantTensor> {
    let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, (name, dtype, ..)) in tensors.iter().enumerate() {
        if select::selected(name, false) {
            assert_eq!(*dtype, Dtype::BF16, "{name}");
            let key = select::group(name).unwrap_or_else(|| name.clone());
            groups.entry(key).or_default().push(i);
        }
    }
    let mut out = BTreeMap::new();
    for members in groups.values() {
        let cols = tensors[members[0]].2[1];
        let values: Vec<Vec<f32>> = members
            .iter()
            .map(|&i| bf16_to_f32(&tensors[i].3))
            .collect();
        let parts: Vec<&[f32]> = values.iter().map(Vec::as_slice).collect();
        let qs: Vec<QuantTensor> = match w {
            "nvfp4" => nvfp4::quantize_group(&parts, cols)
                .into_iter()
                .map(QuantTensor::Nvfp4)
                .collect(),
            _ => parts
                .iter()
                .map(|p| QuantTensor::Fp8(fp8::quantize_block(p, p.len() / cols, cols)))
                .collect(),
        };
        out.extend(members.iter().copied().zip(qs));
    }
    out
}

/// Writes `tensors` into `dir` with `config`, the quantized ones (`q`) replaced by what
/// `replace` makes of them.
fn write_checkpoint(
    dir: &Path,
    config: &Value,
    tensors: &[Tensor],
    q: &BTreeMap<usize, QuantTensor>,
    replace: impl Fn(&Tensor, &QuantTensor) -> Vec<Tensor>,
) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut out = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        match q.get(&i) {
            Some(qt) => out.extend(replace(t, qt)),
            None => out.push(t.clone()),
        }
    }
    write_safetensors(&dir.join("model.safetensors"), &out);
}

/// A tensor replaced by its dequantized values in F32.
fn dequantized(t: &Tensor, q: &QuantTensor) -> Vec<Tensor> {
    let v = q.dequantize().unwrap();
    vec![(t.0.clone(), Dtype::F32, t.2.clone(), f32_bytes(&v))]
}

/// A tensor replaced by its quantized parts, as an exporter writes them.
fn exported(t: &Tensor, q: &QuantTensor) -> Vec<Tensor> {
    quantized_parts(t.0.strip_suffix(".weight").unwrap(), q.clone())
}

/// The export of `src` quantized as `--weights w` (per-expert tensors, the quantization
/// config an exporter writes: `quant_method: fp8` with 128 × 128 blocks, or ModelOpt's
/// `hf_quant_config.json` for NVFP4) and its dequantized F32 copy, under `tmp`; returns both
/// directories and how many matrices are quantized. `drop` names an export tensor to leave
/// out.
fn exports(tmp: &Path, src: &Path, w: &str, drop: Option<&str>) -> (PathBuf, PathBuf, u64) {
    let tensors = per_expert_tensors(src);
    let q = quantize_selected(&tensors, w);
    let (export, reference) = (
        tmp.join(format!("{w}-export")),
        tmp.join(format!("{w}-f32")),
    );
    let config = read_config(src);
    write_checkpoint(&reference, &config, &tensors, &q, dequantized);
    let mut claimed = config.clone();
    if w == "fp8" {
        claimed["quantization_config"] = serde_json::json!({
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        });
    }
    write_checkpoint(&export, &claimed, &tensors, &q, |t, qt| {
        let mut parts = exported(t, qt);
        parts.retain(|(n, ..)| Some(n.as_str()) != drop);
        parts
    });
    if w == "nvfp4" {
        let claim = serde_json::json!({
            "producer": {"name": "modelopt"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16},
        });
        std::fs::write(export.join("hf_quant_config.json"), claim.to_string()).unwrap();
    }
    (export, reference, q.len() as u64)
}

/// The tiny qwen3_5_moe reshaped so that every matrix the packer quantizes reads a multiple
/// of nvfp4's 16-value block: Gated DeltaNet value heads 2 × 8 (`out_proj` reads 16, not 36),
/// experts 16 wide (not 12), the shared expert 32 wide (not 20). The reshaped tensors take the
/// fixture's own values; the other tensors are the fixture's.
fn nvfp4_ready_checkpoint() -> (tempfile::TempDir, PathBuf) {
    let (tmp, dir) = fixture_copy("qwen3_5_moe", |c| {
        c["linear_num_value_heads"] = 2.into();
        c["linear_value_head_dim"] = 8.into();
        c["moe_intermediate_size"] = 16.into();
        c["shared_expert_intermediate_size"] = 32.into();
    });
    // Conv channels: q 2 × 8 + k 2 × 8 + v 2 × 8.
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
        "3 Gated DeltaNet layers × 9, 4 MoE layers × 5"
    );
    (tmp, dir)
}

/// The quantized matrices of the tiny qwen3_5_moe: 4 attention + 3 × 3 Gated DeltaNet
/// linears, 4 sparse layers × (8 experts × 3 + the shared expert's 3).
const QWEN3_5_MOE_QUANTIZED: u64 = 4 + 9 + 4 * (8 * 3 + 3);

/// Packing with `--weights fp8|nvfp4` quantizes exactly the matrices a ModelOpt or FP8
/// export holds quantized (every expert, the shared expert, attention and the Gated DeltaNet
/// linears; the routers and the shared expert's gate stay bf16), with the same quantizer and
/// nvfp4 scale groups (each expert's gate and up sharing a global scale); and a per-expert
/// export of the same checkpoint imports as stored: the three artifacts score the same bits.
#[test(prepared)]
fn quantized_experts_pack_and_import_exactly() {
    let tmp = common::tempdir();
    let text = text(tmp.path());
    let (_a, qwen3_moe) = fixture_copy("qwen3_moe", |_| {});
    let (_b, qwen3_5_moe) = fixture_copy("qwen3_5_moe", |_| {});
    let (_c, nvfp4_ready) = nvfp4_ready_checkpoint();
    // qwen3_moe: 3 layers × 4 attention, layer 1 dense (3), layers 0 and 2 sparse (8 × 3).
    for (family, src, w, count) in [
        ("qwen3_moe", &qwen3_moe, "fp8", 3 * 4 + 3 + 2 * 8 * 3),
        ("qwen3_5_moe", &qwen3_5_moe, "fp8", QWEN3_5_MOE_QUANTIZED),
        ("qwen3_5_moe", &nvfp4_ready, "nvfp4", QWEN3_5_MOE_QUANTIZED),
    ] {
        let what = format!("{family} {w}");
        let t = tmp.path().join(what.replace(' ', "-"));
        let (export, reference, quantized) = exports(&t, src, w, None);
        assert_eq!(quantized, count, "{what}");
        let packed = pack_and_score(&t, "packed", src, w, &text);
        assert_eq!(packed.count(w), count, "{what}: {}", packed.info);
        let a = Artifact::open(&packed.art).unwrap();
        let gates: Vec<String> = a
            .tensor_names()
            .filter(|n| n.ends_with("mlp.gate.weight") || n.ends_with("shared_expert_gate.weight"))
            .map(String::from)
            .collect();
        assert!(!gates.is_empty());
        for g in &gates {
            assert_eq!(a.tensor_format(g), Some("bf16"), "{what}: {g}");
        }
        if w == "nvfp4" {
            assert_gate_and_up_share_a_global(&a);
        }
        let imported = pack_and_score(&t, "imported", &export, "bf16", &text);
        assert_eq!(imported.count(w), count, "{what}: {}", imported.info);
        let method = match w {
            "fp8" => "fp8 (config.json)",
            _ => "modelopt NVFP4 (hf_quant_config.json)",
        };
        assert_eq!(imported.info["quantization"]["method"], method, "{what}");
        let plain = pack_and_score(&t, "dequantized", &reference, "f32", &text);
        packed.assert_same_scores(&plain, &format!("{what}: packed vs dequantized"));
        imported.assert_same_scores(&plain, &format!("{what}: imported vs dequantized"));
        eprintln!(
            "{what}: mean NLL {} (packed, imported and dequantized alike)",
            plain.report["overall"]["mean_nll"]
        );
    }
}

/// In an nvfp4 artifact, each expert's gate and up (one input) share their global scale,
/// and the experts do not all share one.
fn assert_gate_and_up_share_a_global(a: &Artifact) {
    let global = |n: &str| match a.quantized(n).unwrap().unwrap() {
        QuantTensor::Nvfp4(t) => t.global.value().to_bits(),
        QuantTensor::Fp8(_) => panic!("{n} is fp8"),
    };
    let mut per_expert = std::collections::BTreeSet::new();
    for n in a
        .tensor_names()
        .filter(|n| n.ends_with(".gate_proj.weight"))
    {
        if !n.contains(".experts.") {
            continue;
        }
        let g = global(n);
        assert_eq!(g, global(&n.replace(".gate_proj.", ".up_proj.")), "{n}");
        per_expert.insert(g);
    }
    assert!(per_expert.len() > 1, "one global scale for every expert");
}

/// The nvfp4 artifact on the emulated CUDA device, which dequantizes the experts at load:
/// the CPU's routing counts, and its mean NLL within 1e-5 relative.
#[test(prepared)]
fn nvfp4_experts_score_alike_on_the_emulated_device() {
    if !cfg!(feature = "cuda") {
        return;
    }
    let tmp = common::tempdir();
    let text = text(tmp.path());
    let (_keep, src) = nvfp4_ready_checkpoint();
    let cpu = pack_and_score(tmp.path(), "nvfp4", &src, "nvfp4", &text);
    let emu = tmp.path().join("emu");
    let o = score_text(
        &cpu.art,
        &text,
        &emu,
        &["--device", "emu", "--precision", "f32"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let er = report(&emu);
    assert_eq!(
        er["streams"][0]["routing"],
        cpu.report["streams"][0]["routing"]
    );
    let a = er["overall"]["mean_nll"].as_f64().unwrap();
    let b = cpu.report["overall"]["mean_nll"].as_f64().unwrap();
    eprintln!(
        "nvfp4 mean NLL emu / cpu: {a} / {b} (relative {:.1e})",
        (a - b).abs() / b
    );
    assert!((a - b).abs() <= 1e-5 * b.abs(), "emu {a} vs cpu {b}");
}

/// An export missing one expert's scale is refused, naming the file and the expert.
#[test(prepared)]
fn an_expert_without_its_scale_is_refused() {
    let tmp = common::tempdir();
    let (_a, qwen3_moe) = fixture_copy("qwen3_moe", |_| {});
    let (_b, nvfp4_ready) = nvfp4_ready_checkpoint();
    for (src, w, gone, problem) in [
        (
            &qwen3_moe,
            "fp8",
            "model.layers.2.mlp.experts.5.down_proj.weight_scale_inv",
            "has no scale",
        ),
        (
            &nvfp4_ready,
            "nvfp4",
            "model.layers.1.mlp.experts.6.up_proj.weight_scale_2",
            "has no global scale",
        ),
    ] {
        let (export, ..) = exports(&tmp.path().join(w), src, w, Some(gone));
        let weight = format!("{}.weight", gone.rsplit_once(".weight").unwrap().0);
        common::pack_fails(&export, &["model.safetensors", &weight, problem]);
    }
}

/// The tiny qwen3_next with Gated DeltaNet heads of `dim` (2 key heads, 2 value heads):
/// with 128, each key head's q, k, v and z rows in `in_proj_qkvz` are whole 128-row blocks,
/// as in Qwen3-Next-80B (16 key and 32 value heads, all of 128); with 64, two key heads'
/// parts share a block.
fn wide_next_checkpoint(dim: usize) -> (tempfile::TempDir, PathBuf) {
    let (tmp, dir) = fixture_copy("qwen3_next", |c| {
        c["linear_key_head_dim"] = dim.into();
        c["linear_num_value_heads"] = 2.into();
        c["linear_value_head_dim"] = dim.into();
    });
    // Per key head q, k, v, z of `dim` rows; conv channels q 2·dim + k 2·dim + v 2·dim.
    let (qkvz, conv, out) = ([8 * dim, 16], [6 * dim, 1, 4], [16, 2 * dim]);
    let shapes: &[(&str, &[usize])] = &[
        ("linear_attn.in_proj_qkvz.weight", &qkvz),
        ("linear_attn.in_proj_ba.weight", &[4, 16]),
        ("linear_attn.conv1d.weight", &conv),
        ("linear_attn.A_log", &[2]),
        ("linear_attn.dt_bias", &[2]),
        ("linear_attn.norm.weight", &[dim]),
        ("linear_attn.out_proj.weight", &out),
    ];
    assert_eq!(reshape(&dir, shapes), 3 * 7, "3 Gated DeltaNet layers × 7");
    // The strided fill puts the same extremes in every 128-row block; scale each of the
    // (at most 8) blocks by its own power of two, exact in bf16, so that their fp8 block
    // scales all differ and a row moved under another block's scale changes value.
    let path = dir.join("model.safetensors");
    let mut tensors = read_safetensors(&path);
    for (name, _, _, data) in &mut tensors {
        if name.ends_with("in_proj_qkvz.weight") {
            for (r, row) in data.chunks_exact_mut(2 * 16).enumerate() {
                let f = 2f32.powi((r / 128) as i32 - 3);
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

/// The qwen3_next checkpoint `src` with the grouped Gated DeltaNet projections named in
/// `quantized` (`in_proj_qkvz`, `in_proj_ba`) stored in `format` (`"nvfp4"`: the ModelOpt
/// layout; `"fp8-channel"`: a scale per row; `"fp8-block"`: 128 × 128 block scales, the Qwen
/// `*-FP8` layout), the rest bf16; and beside it the same checkpoint with those tensors
/// replaced by their dequantized values in F32. Returns both directories.
fn grouped_export(tmp: &Path, src: &Path, quantized: &[&str], format: &str) -> (PathBuf, PathBuf) {
    let (export, reference) = (tmp.join(format), tmp.join(format!("{format}-f32")));
    let tensors = read_safetensors(&src.join("model.safetensors"));
    let mut q = BTreeMap::new();
    for (i, (name, _, shape, data)) in tensors.iter().enumerate() {
        let grouped = quantized
            .iter()
            .any(|p| name.ends_with(&format!("linear_attn.{p}.weight")));
        if !grouped {
            continue;
        }
        let (rows, cols) = (shape[0], shape[1]);
        let w = bf16_to_f32(data);
        q.insert(
            i,
            match format {
                "nvfp4" => QuantTensor::Nvfp4(nvfp4::quantize_group(&[&w], cols).remove(0)),
                "fp8-block" => QuantTensor::Fp8(fp8::quantize_block(&w, rows, cols)),
                _ => QuantTensor::Fp8(fp8_per_row(&w, rows, cols)),
            },
        );
    }
    let config = read_config(src);
    write_checkpoint(&reference, &config, &tensors, &q, dequantized);
    let mut claimed = config.clone();
    if format == "nvfp4" {
        let claim = serde_json::json!({"quantization": {"quant_algo": "NVFP4", "group_size": 16}});
        std::fs::create_dir_all(&export).unwrap();
        std::fs::write(export.join("hf_quant_config.json"), claim.to_string()).unwrap();
    } else {
        claimed["quantization_config"] = serde_json::json!({"quant_method": "fp8"});
    }
    write_checkpoint(&export, &claimed, &tensors, &q, exported);
    (export, reference)
}

/// Qwen3-Next's grouped projections stored quantized are un-grouped with their scales: the
/// import scores bit for bit as the checkpoint holding their dequantized values, in nvfp4,
/// in per-row fp8, and in fp8 with 128 × 128 block scales both where every result block takes
/// its rows from one source block (the tiny model's matrices of at most 128 rows; heads of
/// 128, the Qwen3-Next-80B FP8 layout, `in_proj_ba` left in bf16 as there). Heads of 64 put
/// two key heads' parts in one result block: refused, naming the file and tensor.
#[test(prepared)]
fn grouped_quantized_projections_import_exactly() {
    let tmp = common::tempdir();
    let text = text(tmp.path());
    let (_a, tiny) = fixture_copy("qwen3_next", |_| {});
    let (_b, wide) = wide_next_checkpoint(128);
    let both: &[&str] = &["in_proj_qkvz", "in_proj_ba"];
    // 3 Gated DeltaNet layers × in_proj_qkv, in_proj_z (and in_proj_b, in_proj_a).
    for (name, src, quantized, format, count) in [
        ("tiny", &tiny, both, "nvfp4", 3 * 4),
        ("tiny", &tiny, both, "fp8-channel", 3 * 4),
        ("tiny", &tiny, both, "fp8-block", 3 * 4),
        ("wide", &wide, &both[..1], "fp8-block", 3 * 2),
    ] {
        let what = format!("{name} {format}");
        let t = tmp.path().join(what.replace(' ', "-"));
        let (export, reference) = grouped_export(&t, src, quantized, format);
        let w = format.split('-').next().unwrap();
        let imported = pack_and_score(&t, "imported", &export, "f32", &text);
        assert_eq!(imported.count(w), count, "{what}: {}", imported.info);
        let plain = pack_and_score(&t, "dequantized", &reference, "f32", &text);
        imported.assert_same_scores(&plain, &what);
        eprintln!(
            "{what}: mean NLL {} (imported and dequantized alike)",
            plain.report["overall"]["mean_nll"]
        );
    }
    let (_c, narrow) = wide_next_checkpoint(64);
    let (export, _) = grouped_export(&tmp.path().join("narrow"), &narrow, &both[..1], "fp8-block");
    common::pack_fails(
        &export,
        &[
            "model.safetensors",
            "`model.layers.0.linear_attn.in_proj_qkvz.weight` cannot be un-grouped",
            "rows 0..128 would share one block scale while coming from source blocks 0 and 2",
        ],
    );
}
