//! A bounded mutation test of every parser a user's file reaches: the `.ninfer` reader (and
//! loading and scoring what it accepts), the GGUF reader, the corpus manifest and the
//! Hugging Face config, a run's `report.json` (as `compare` loads, compares and plots it),
//! `--kv-scales` files, the registry, a `tokenizer.json`, a Hugging Face safetensors shard
//! (packed, loaded and scored), a shard set as `merge` combines it and a saved reference. Valid inputs are flipped, truncated, extended and have header fields
//! rewritten with hostile values (huge, negative, zero, wrong types), a few thousand cases
//! from a fixed seed. Every case must end in `Ok` or in one error line, never a panic, and
//! no case may allocate more than [`ALLOC_LIMIT`] bytes at once (a size taken from a header
//! and believed would). The test prints how many inputs it tried.
//!
//! The allocation counter is the `it` binary's global allocator, so it also sees the tests
//! that run beside this one: a case's peak can only be overstated by them, never hidden, so
//! a pass is a true bound (a rare false alarm would name the case).

use crate::common;

use common::gguf_synth::{Rng, Synth, Val};
use ninfer_perplexity::corpus::Manifest;
use ninfer_perplexity::engine::{Engine, LoadOptions};
use ninfer_perplexity::kv::KvDtype;
use ninfer_perplexity::pack::{gguf, hf};
use ninfer_perplexity::score::Protocol;
use serde_json::Value;
use std::alloc::{GlobalAlloc, Layout, System};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Most bytes live at once that one case may add to what was live before it.
const ALLOC_LIMIT: usize = 256 << 20;

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; the counters are plain atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = System.alloc(l);
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Relaxed) + l.size();
            PEAK.fetch_max(now, Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l);
        LIVE.fetch_sub(l.size(), Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = System.realloc(p, l, new);
        if !q.is_null() {
            if new >= l.size() {
                let now = LIVE.fetch_add(new - l.size(), Relaxed) + new - l.size();
                PEAK.fetch_max(now, Relaxed);
            } else {
                LIVE.fetch_sub(l.size() - new, Relaxed);
            }
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// What the cases came to.
#[derive(Default)]
struct Tally {
    tried: usize,
    accepted: usize,
    failures: Vec<String>,
}

impl Tally {
    /// Runs one case: `f` must not panic, must give one error line, must stay in bounds.
    fn case(&mut self, what: &str, f: impl FnOnce() -> anyhow::Result<()>) {
        self.tried += 1;
        let before = LIVE.load(Relaxed);
        PEAK.store(before, Relaxed);
        let r = catch_unwind(AssertUnwindSafe(f));
        let grew = PEAK.load(Relaxed).saturating_sub(before);
        if grew > ALLOC_LIMIT {
            self.failures
                .push(format!("{what}: allocated {} MiB at once", grew >> 20));
        }
        match r {
            Ok(Ok(())) => self.accepted += 1,
            Ok(Err(e)) => {
                let line = format!("{e:#}");
                if line.contains('\n') || line.is_empty() {
                    self.failures
                        .push(format!("{what}: not one error line: {line:?}"));
                }
            }
            Err(_) => self.failures.push(format!("{what}: panicked")),
        }
    }
}

/// Byte-level mutations of `base`: flips (mostly in the first `hot` bytes), truncations and
/// extensions.
fn byte_mutants(base: &[u8], hot: usize, n: usize, rng: &mut Rng) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut b = base.to_vec();
        let what = match i % 4 {
            0 | 1 => {
                let flips = 1 + rng.next() as usize % 8;
                for _ in 0..flips {
                    let span = if rng.next() % 10 < 8 { hot } else { b.len() };
                    let at = rng.next() as usize % span.max(1);
                    b[at] ^= 1 << (rng.next() % 8);
                }
                format!("{flips} flipped bits")
            }
            2 => {
                let len = rng.next() as usize % b.len();
                b.truncate(len);
                format!("truncated to {len}")
            }
            _ => {
                let extra = 1 + rng.next() as usize % 1000;
                b.extend(rng.bytes(extra));
                format!("{extra} bytes appended")
            }
        };
        out.push((what, b));
    }
    out
}

/// Hostile values for a JSON field.
fn hostile(rng: &mut Rng) -> Value {
    let choices = [
        serde_json::json!(0),
        serde_json::json!(-1),
        serde_json::json!(1_000_000_000_000u64),
        serde_json::json!(u64::MAX),
        serde_json::json!(i64::MIN),
        serde_json::json!(1e308),
        serde_json::json!(0.5),
        serde_json::json!("many"),
        serde_json::json!(null),
        serde_json::json!([1, 2]),
        serde_json::json!({"a": 1}),
        serde_json::json!(true),
        serde_json::json!(100_000),
        serde_json::json!(4_294_967_296u64),
    ];
    choices[rng.next() as usize % choices.len()].clone()
}

/// Every path to a leaf or container of `v` (object keys and array indices).
fn paths(v: &Value, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                at.push(k.clone());
                out.push(at.clone());
                paths(x, at, out);
                at.pop();
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate().take(8) {
                at.push(i.to_string());
                out.push(at.clone());
                paths(x, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

fn set_at(v: &mut Value, path: &[String], new: Value) {
    let mut cur = v;
    for (i, k) in path.iter().enumerate() {
        let next = match cur {
            Value::Object(m) => m.get_mut(k),
            Value::Array(a) => k.parse::<usize>().ok().and_then(|j| a.get_mut(j)),
            _ => None,
        };
        let Some(n) = next else { return };
        if i + 1 == path.len() {
            *n = new;
            return;
        }
        cur = n;
    }
}

/// Mutants of a JSON file: `n_bytes` byte-level ones and `n_fields` field rewrites.
fn json_file_mutants(
    base: &[u8],
    n_bytes: usize,
    n_fields: usize,
    rng: &mut Rng,
) -> Vec<(String, Vec<u8>)> {
    let mut out = byte_mutants(base, base.len(), n_bytes, rng);
    let v: Value = serde_json::from_slice(base).unwrap();
    for (what, m) in json_mutants(&v, n_fields, rng) {
        out.push((what, serde_json::to_vec(&m).unwrap()));
    }
    out
}

/// Field rewrites of a JSON document: one hostile value at a random place per mutant.
fn json_mutants(base: &Value, n: usize, rng: &mut Rng) -> Vec<(String, Value)> {
    let mut all = Vec::new();
    paths(base, &mut Vec::new(), &mut all);
    (0..n)
        .map(|_| {
            let p = &all[rng.next() as usize % all.len()];
            let h = hostile(rng);
            let mut v = base.clone();
            set_at(&mut v, p, h.clone());
            (format!("{} = {h}", p.join(".")), v)
        })
        .collect()
}

/// Opens an artifact the way the evaluator does and scores a few tokens with it.
fn load_and_score(p: &Path) -> anyhow::Result<()> {
    let opts = LoadOptions {
        threads: 2,
        ..LoadOptions::default()
    };
    let e = Engine::load(p, &opts, &mut |_, _| {})?;
    let ids = e.tokenizer.encode("hello mutation")?;
    e.score(
        &ids,
        Protocol::new(8, 4)?,
        KvDtype::Int8,
        false,
        &mut |_, _| {},
    )?;
    Ok(())
}

/// The header of a safetensors file as JSON, and where the data starts.
fn header_of(b: &[u8]) -> (Value, usize) {
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    (serde_json::from_slice(&b[8..8 + n]).unwrap(), 8 + n)
}

fn with_header(h: &Value, data: &[u8]) -> Vec<u8> {
    let mut j = serde_json::to_vec(h).unwrap();
    while !j.len().is_multiple_of(8) {
        j.push(b' ');
    }
    let mut out = (j.len() as u64).to_le_bytes().to_vec();
    out.extend(j);
    out.extend_from_slice(data);
    out
}

/// A small byte-level BPE tokenizer.json with the parts real ones have: merges, an added
/// special token, a normalizer, a sequence pre-tokenizer and a BOS template. The vocabulary
/// holds only the bytes of the texts encoded here, so that field mutations reach every part.
fn small_bpe_tokenizer() -> Value {
    let mut vocab = serde_json::Map::new();
    for c in "helo mutaing,\n".chars() {
        let k = match c {
            ' ' => "Ġ".to_string(),
            '\n' => "Ċ".to_string(),
            c => c.to_string(),
        };
        let n = vocab.len();
        vocab.entry(k).or_insert(serde_json::json!(n));
    }
    let merges = [
        "h e", "l l", "he ll", "hell o", "Ġ m", "t i", "ti o", "tio n",
    ];
    for m in merges {
        let n = vocab.len();
        vocab.insert(m.replace(' ', ""), serde_json::json!(n));
    }
    let bos = vocab.len();
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{"id": bos, "content": "<s>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\s+|[a-z]+"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": merges}
    })
}

/// `dir`: the tiny qwen3 fixture cut to a 260-token vocabulary (so a case packs in
/// milliseconds) with the byte tokenizer; returns its model.safetensors bytes.
fn small_hf_dir(dir: &Path) -> Vec<u8> {
    use common::checkpoint::{read_safetensors, write_safetensors};
    std::fs::create_dir_all(dir).unwrap();
    let fixture = common::repo().join("eval/fixtures/tiny-qwen3");
    let mut config: Value =
        serde_json::from_slice(&std::fs::read(fixture.join("config.json")).unwrap()).unwrap();
    config["vocab_size"] = serde_json::json!(260);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer.json"),
        ninfer_perplexity::artifact::random::byte_tokenizer_json(),
    )
    .unwrap();
    let mut tensors = read_safetensors(&fixture.join("model.safetensors"));
    for (name, _, shape, bytes) in &mut tensors {
        if name == "model.embed_tokens.weight" {
            bytes.truncate(260 * shape[1] * 2);
            shape[0] = 260;
        }
    }
    let p = dir.join("model.safetensors");
    write_safetensors(&p, &tensors);
    std::fs::read(p).unwrap()
}

/// Paths of the sums and means in a report's JSON that are not finite numbers (serde writes
/// a non-finite f64 as null).
fn non_finite_sums(v: &Value, at: &str, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let here = format!("{at}.{k}");
                if ["nll_sum", "total_nll", "mean_nll", "nll_sq_sum"].contains(&k.as_str())
                    && !x.as_f64().is_some_and(f64::is_finite)
                {
                    out.push(format!("{here} = {x}"));
                }
                non_finite_sums(x, &here, out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                non_finite_sums(x, &format!("{at}[{i}]"), out);
            }
        }
        _ => {}
    }
}

#[test]
fn parsers_survive_mutated_inputs() {
    let dir = common::tempdir();
    let mut rng = Rng(0x5eed);
    let mut t = Tally::default();
    let case_path = dir.path().join("case");

    // .ninfer: bytes, the safetensors header, and the config inside its metadata.
    let base = std::fs::read(common::mini_artifact(dir.path())).unwrap();
    let (header, data_at) = header_of(&base);
    let mut ninfer: Vec<(String, Vec<u8>)> = byte_mutants(&base, data_at, 1200, &mut rng);
    for (what, h) in json_mutants(&header, 500, &mut rng) {
        ninfer.push((format!("header {what}"), with_header(&h, &base[data_at..])));
    }
    let config: Value =
        serde_json::from_str(header["__metadata__"]["config"].as_str().unwrap()).unwrap();
    for (what, c) in json_mutants(&config, 600, &mut rng) {
        let mut h = header.clone();
        h["__metadata__"]["config"] = Value::String(c.to_string());
        ninfer.push((format!("config {what}"), with_header(&h, &base[data_at..])));
    }
    let n_ninfer = ninfer.len();
    for (what, bytes) in ninfer {
        std::fs::write(&case_path, &bytes).unwrap();
        t.case(&format!(".ninfer {what}"), || load_and_score(&case_path));
    }

    // GGUF: bytes and metadata values.
    let synth = Synth::new(false);
    let base = synth.bytes();
    let mut ggufs = byte_mutants(&base, 4096, 1200, &mut rng);
    let keys: Vec<String> = synth.kv.iter().map(|(k, _)| k.clone()).collect();
    let values = [
        Val::U32(u32::MAX),
        Val::U64(u64::MAX),
        Val::U64(1 << 40),
        Val::U32(0),
        Val::I32(-1),
        Val::Str("x".repeat(300)),
        Val::F32(f32::NAN),
        Val::U32(100_000),
        Val::Strs(vec![]),
    ];
    for i in 0..600 {
        let mut s = Synth::new(false);
        let k = &keys[rng.next() as usize % keys.len()];
        let v = values[i % values.len()].clone();
        s.set(k, v);
        ggufs.push((format!("{k} rewritten"), s.bytes()));
    }
    let n_gguf = ggufs.len();
    for (what, bytes) in ggufs {
        std::fs::write(&case_path, &bytes).unwrap();
        t.case(&format!("GGUF {what}"), || {
            gguf::read_gguf(&case_path).map(drop)
        });
    }

    // The corpus manifest and a Hugging Face config: text bytes and fields.
    let manifest =
        std::fs::read(common::repo().join("eval/corpora/perplexity-1m/manifest.json")).unwrap();
    let hf_config =
        std::fs::read(common::repo().join("eval/fixtures/tiny-qwen3/config.json")).unwrap();
    let mut n_json = 0;
    for (name, base) in [("manifest", &manifest), ("config.json", &hf_config)] {
        let parse = |b: &[u8]| -> anyhow::Result<()> {
            let text = String::from_utf8_lossy(b);
            if name == "manifest" {
                Manifest::parse(&text).map(drop)
            } else {
                hf::parse_config(&serde_json::from_str(&text)?).map(drop)
            }
        };
        let mut cases = byte_mutants(base, base.len(), 500, &mut rng);
        let v: Value = serde_json::from_slice(base).unwrap();
        for (what, m) in json_mutants(&v, 700, &mut rng) {
            cases.push((what, serde_json::to_vec(&m).unwrap()));
        }
        n_json += cases.len();
        for (what, b) in cases {
            t.case(&format!("{name} {what}"), || parse(&b));
        }
    }

    // A run's report.json as `compare` and `merge` read it: loaded, compared with the
    // original, its table and both plots rendered (bounded by what they draw, not by what the
    // file claims); and `--kv-scales` files.
    let art = dir.path().join("mini.ninfer"); // mini_artifact's, unchanged
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "Rain fell on the quiet town all night. ".repeat(12)).unwrap();
    let run = dir.path().join("run");
    let o = common::score_text(&art, &text, &run, &["--log-level", "error"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let base_path = run.join("report.json");
    let base_bytes = std::fs::read(&base_path).unwrap();
    let base = ninfer_perplexity::compare::load::load(&base_path).unwrap();
    let reports = json_file_mutants(&base_bytes, 300, 900, &mut rng);
    let n_reports = reports.len();
    let accepted_before = t.accepted;
    let case_report = dir.path().join("case.json");
    for (what, b) in reports {
        std::fs::write(&case_report, &b).unwrap();
        t.case(&format!("report.json {what}"), || {
            use ninfer_perplexity::compare;
            let new = compare::load::load(&case_report)?;
            ninfer_perplexity::report::plot::run_plot(&new.report)?;
            let c = compare::compare(&base, &new)?;
            // An accepted comparison's statistics are finite: a report whose sums overflow
            // must have been refused (the panic counts as misbehaviour).
            for r in c.streams.iter().chain(&c.domains).chain([&c.overall]) {
                let p = &r.paired;
                let mut xs = vec![p.base_mean_nll, p.new_mean_nll, p.delta_nll];
                xs.extend(p.delta_nll_std_err);
                xs.extend(p.delta_nll_ci95.into_iter().flatten());
                xs.extend(p.window_correlation);
                assert!(
                    xs.iter().all(|x| x.is_finite()),
                    "row `{}`: a non-finite statistic was computed: {xs:?}",
                    r.id
                );
            }
            compare::table::render(&c);
            compare::plot::compare_plot(&base, &new, &c)?;
            Ok(())
        });
    }
    let reports_accepted = t.accepted - accepted_before;
    assert!(
        reports_accepted > 0 && reports_accepted < n_reports,
        "report mutants: {reports_accepted} of {n_reports} accepted (compare must run on some)"
    );
    let scales: Value = serde_json::json!({"k_scale": [0.5, 1.0], "v_scale": 2.0});
    let scale_bytes = serde_json::to_vec(&scales).unwrap();
    let mut scale_cases = byte_mutants(&scale_bytes, scale_bytes.len(), 200, &mut rng);
    for (what, m) in json_mutants(&scales, 200, &mut rng) {
        scale_cases.push((what, serde_json::to_vec(&m).unwrap()));
    }
    let n_scales = scale_cases.len();
    for (what, b) in scale_cases {
        t.case(&format!("--kv-scales {what}"), || {
            ninfer_perplexity::kv::fp8_tensor::TensorScales::parse(
                &String::from_utf8_lossy(&b),
                2,
                "case",
            )
            .map(drop)
        });
    }

    // The registry (eval/registry.json or NINFER_REGISTRY): loaded, and every gate and
    // tolerance it accepts usable (finite thresholds, a valid gate).
    let reg_base = std::fs::read(common::repo().join("eval/registry.json")).unwrap();
    let reg_cases = json_file_mutants(&reg_base, 300, 500, &mut rng);
    let n_registry = reg_cases.len();
    let reg_path = dir.path().join("registry.json");
    for (what, b) in reg_cases {
        std::fs::write(&reg_path, &b).unwrap();
        t.case(&format!("registry {what}"), || {
            let r = ninfer_perplexity::registry::Registry::load(&reg_path)?;
            for e in &r.artifacts {
                for (class, kv) in [("cpu", "fp8"), ("cuda-sm90", "nvfp4"), ("emu", "bf16")] {
                    if let Some(tol) = e.tolerance_for(class, kv) {
                        let a = tol.allowed(2.5);
                        assert!(a.is_finite() && a >= 0.0, "{}: tolerance {a}", e.name);
                    }
                    if let Some(g) = e.gate_for(class, kv) {
                        g.spec().validate()?;
                    }
                }
            }
            Ok(())
        });
    }

    // A tokenizer.json (the artifact's, or the packer's --tokenizer): a byte-level BPE with
    // merges, an added special token, a normalizer, a split pre-tokenizer and a BOS template,
    // loaded and used to encode.
    let tok_base = small_bpe_tokenizer();
    let tok_bytes = serde_json::to_vec(&tok_base).unwrap();
    ninfer_perplexity::tokenizer::Tokenizer::from_json(&String::from_utf8_lossy(&tok_bytes))
        .expect("the base tokenizer loads");
    let mut tok_cases = byte_mutants(&tok_bytes, tok_bytes.len(), 300, &mut rng);
    for (what, m) in json_mutants(&tok_base, 500, &mut rng) {
        tok_cases.push((what, serde_json::to_vec(&m).unwrap()));
    }
    let n_tokenizer = tok_cases.len();
    for (what, b) in tok_cases {
        t.case(&format!("tokenizer.json {what}"), || {
            let tok =
                ninfer_perplexity::tokenizer::Tokenizer::from_json(&String::from_utf8_lossy(&b))?;
            let text = "hello mutation, hello tail\n\nhello again ".repeat(3);
            tok.encode(&text)?;
            tok.encode_prefix(&text, 5)?;
            Ok(())
        });
    }

    // A Hugging Face safetensors shard, as `ninfer-pack hf` reads it: the directory read,
    // the artifact written, then loaded and scored.
    let hf = dir.path().join("hf");
    let shard_base = small_hf_dir(&hf);
    let (sheader, sdata_at) = header_of(&shard_base);
    let mut shard_cases = byte_mutants(&shard_base, sdata_at, 200, &mut rng);
    for (what, h) in json_mutants(&sheader, 400, &mut rng) {
        shard_cases.push((
            format!("header {what}"),
            with_header(&h, &shard_base[sdata_at..]),
        ));
    }
    let n_shard = shard_cases.len();
    let packed = dir.path().join("packed.ninfer");
    for (what, b) in shard_cases {
        std::fs::write(hf.join("model.safetensors"), &b).unwrap();
        let _ = std::fs::remove_file(&packed);
        t.case(&format!("safetensors shard {what}"), || {
            use ninfer_perplexity::artifact::{write_artifact, WeightFormat, WeightPlan};
            let src = hf::read_hf_dir(&hf, None)?;
            write_artifact(&src, WeightPlan::from(WeightFormat::F32), &packed)?;
            load_and_score(&packed)
        });
    }

    // A shard set as `merge` reads it: shard 2 of 2 mutated, both loaded and merged, the
    // merged report's table and plot drawn; what merges has finite sums and means.
    let shard_dirs = [dir.path().join("s1"), dir.path().join("s2")];
    for (i, d) in shard_dirs.iter().enumerate() {
        let shard = format!("{}/2", i + 1);
        let o = common::score_text(&art, &text, d, &["--shard", &shard, "--log-level", "error"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let s2_bytes = std::fs::read(shard_dirs[1].join("report.json")).unwrap();
    let merge_cases = json_file_mutants(&s2_bytes, 100, 400, &mut rng);
    let n_merge = merge_cases.len();
    let accepted_before = t.accepted;
    let s2_case = dir.path().join("s2-case.json");
    for (what, b) in merge_cases {
        std::fs::write(&s2_case, &b).unwrap();
        t.case(&format!("merge shard {what}"), || {
            let s1 = ninfer_perplexity::compare::load::load(&shard_dirs[0]).unwrap();
            let s2 = ninfer_perplexity::compare::load::load(&s2_case)?;
            let rep = ninfer_perplexity::merge::merge(&[s1, s2])?;
            let v = serde_json::to_value(&rep)?;
            let mut bad = Vec::new();
            non_finite_sums(&v, "", &mut bad);
            assert!(
                bad.is_empty(),
                "a merged report with non-finite sums: {bad:?}"
            );
            ninfer_perplexity::report::table::render(&rep, true);
            ninfer_perplexity::report::plot::run_plot(&rep)?;
            Ok(())
        });
    }
    let merges_accepted = t.accepted - accepted_before;
    assert!(
        merges_accepted > 0 && merges_accepted < n_merge,
        "merge mutants: {merges_accepted} of {n_merge} merged (merge must run on some)"
    );

    // A saved reference (--kld-base): its index rewritten and its bytes flipped, with the
    // checksum recomputed (so the layout checks behind it are reached), opened and every
    // window's rows read.
    let refbin = dir.path().join("ref.bin");
    let o = common::score_text(
        &art,
        &text,
        &dir.path().join("saving"),
        &[
            "--save-reference",
            refbin.to_str().unwrap(),
            "--log-level",
            "error",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ref_bytes = std::fs::read(&refbin).unwrap();
    let n = ref_bytes.len();
    let index_len = u64::from_le_bytes(ref_bytes[n - 40..n - 32].try_into().unwrap()) as usize;
    let (body, index) = (
        &ref_bytes[..n - 40 - index_len],
        &ref_bytes[n - 40 - index_len..n - 40],
    );
    let sealed = |body: &[u8], index: &[u8]| -> Vec<u8> {
        use sha2::Digest;
        let mut out = body.to_vec();
        out.extend_from_slice(index);
        out.extend_from_slice(&(index.len() as u64).to_le_bytes());
        let sum = sha2::Sha256::digest(&out);
        out.extend_from_slice(&sum);
        out
    };
    assert_eq!(sealed(body, index), ref_bytes, "the layout as documented");
    let mut ref_cases: Vec<(String, Vec<u8>)> = byte_mutants(&ref_bytes, n, 100, &mut rng);
    for (what, b) in byte_mutants(body, body.len().min(64), 100, &mut rng) {
        ref_cases.push((format!("body {what}, resealed"), sealed(&b, index)));
    }
    let iv: Value = serde_json::from_slice(index).unwrap();
    for (what, m) in json_mutants(&iv, 400, &mut rng) {
        ref_cases.push((
            format!("index {what}, resealed"),
            sealed(body, &serde_json::to_vec(&m).unwrap()),
        ));
    }
    let n_saved = ref_cases.len();
    let case_ref = dir.path().join("case.ref");
    for (what, b) in ref_cases {
        std::fs::write(&case_ref, &b).unwrap();
        t.case(&format!("saved reference {what}"), || {
            let r = ninfer_perplexity::score::saved::SavedReference::open(&case_ref)?;
            for st in &r.index.streams {
                for w in &st.windows {
                    r.rows(w)?;
                }
            }
            Ok(())
        });
    }

    println!(
        "mutation: {} inputs tried ({n_ninfer} .ninfer loaded and scored, {n_gguf} GGUF, {n_json} manifest and config.json, {n_reports} report.json ({reports_accepted} compared and plotted), {n_scales} --kv-scales, {n_registry} registry, {n_tokenizer} tokenizer.json, {n_shard} safetensors shards packed, {n_merge} merge shard sets ({merges_accepted} merged), {n_saved} saved references); {} accepted, {} refused with one error line",
        t.tried,
        t.accepted,
        t.tried - t.accepted - t.failures.len()
    );
    assert!(
        t.failures.is_empty(),
        "{} of {} cases misbehaved, first: {:#?}",
        t.failures.len(),
        t.tried,
        &t.failures[..t.failures.len().min(10)]
    );
    assert!(
        t.accepted > 0 && t.accepted < t.tried,
        "the mutants must include valid and invalid inputs"
    );
}
