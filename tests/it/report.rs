//! report.json round-trips through its schema, and the stdout table renders as reviewed.

use crate::common;
use ninfer_perplexity::model::config::{Family, ModelConfig};
use ninfer_perplexity::report::*;
use ninfer_perplexity::score::{Calibration, NllSum, WindowScore};

fn stream(id: &str, domain: &str, nlls: &[f32], bytes: u64) -> StreamReport {
    let mut s = NllSum::default();
    for &n in nlls {
        s.push(-n);
    }
    StreamReport {
        id: id.into(),
        domain: domain.into(),
        path: format!("streams/{id}.txt"),
        sha256: "ab".repeat(32),
        tokens: Some(nlls.len() + 1),
        input_tokens: nlls.len() + 1,
        unscored_tokens: 1,
        processed_tokens: nlls.len() + 1,
        totals: Totals::new(&s, bytes),
        seconds: 1.5,
        processed_tokens_per_s: (nlls.len() + 1) as f64 / 1.5,
        // Each row's entropy is its NLL; the top-1 is right when the NLL is below 1.
        calibration: CalibrationReport::new(&{
            let mut c = Calibration::default();
            for &n in nlls {
                c.push(n, -n.min(1.0), n < 1.0);
            }
            c
        }),
        reference: None,
        reference_acc: None,
        routing: None,
        windows: vec![WindowScore {
            index: 0,
            seconds: 1.5,
            begin: 0,
            first_target: 1,
            end: nlls.len() + 1,
            scored: s.scored,
            nll_sum: s.nll_sum,
            nll_sq_sum: s.nll_sq_sum,
            logprobs: None,
            calibration: None,
        }],
    }
}

fn fixed_report() -> Report {
    let streams = vec![
        stream("en-1", "en", &[2.0, 3.0, 1.5, 2.5], 40),
        stream("en-2", "en", &[1.0, 4.0], 20),
        stream("code-1", "code", &[0.5, 0.25, 1.25, 0.75, 0.5, 1.0], 30),
    ];
    let domain = |id: &str, title: &str| {
        let mut a = aggregate(id, title, streams.iter().filter(|s| s.domain == id));
        a.domain = Some(id.into());
        a
    };
    let domains = vec![domain("en", "English"), domain("code", "Code")];
    let overall = aggregate("overall", "overall", streams.iter());
    Report {
        schema: SCHEMA.into(),
        schema_version: SCHEMA_VERSION,
        metric: Metric::default(),
        execution: Execution {
            purpose: "causal_scoring".into(),
            device: None,
            context_tokens: 8,
            stride_tokens: 4,
            window_plan: Default::default(),
            prefill_chunk_tokens: 8,
            score_tile_tokens: 8,
            kv_dtype: "bf16".into(),
        },
        timing: Timing {
            load_seconds: 0.1,
            read_and_tokenize_seconds: 0.2,
            score_seconds: 0.3,
            total_seconds: 0.6,
            scored_tokens_per_second: 40.0,
        },
        run_id: "20261130T000000Z-00000000-bf16".into(),
        tool: Tool {
            name: "ninfer-perplexity".into(),
            version: "0.0.0".into(),
            commit: "0123456789ab".into(),
            profile: "release".into(),
            features: "cuda".into(),
        },
        invocation: Some(ninfer_perplexity::build_info::Invocation {
            command_line: vec!["ninfer-perplexity".into(), "m.ninfer".into()],
            host: "h".into(),
            cpu_model: "c".into(),
            os: "linux x86_64".into(),
        }),
        started_unix_s: 0.0,
        settings: Settings {
            mode: "corpus".into(),
            context: 8,
            stride: 4,
            window_plan: Default::default(),
            kv_dtype: "bf16".into(),
            kv_format: None,
            kv_tensor_scales: None,
            kv_bytes_per_token_per_layer: 768,
            kv_layers: 30,
            kv_bytes_per_token: 30 * 768,
            state_bytes_per_window: 0,
            quick: false,
            max_tokens: None,
            device: "cpu (2 threads)".into(),
            device_class: "cpu".into(),
            precision: "f32".into(),
            threads: 2,
            test_fault: None,
            reference: None,
        },
        artifact: ArtifactInfo {
            path: "/m.ninfer".into(),
            target: "cpu".into(),
            model_id: "m".into(),
            weights_id: "bf16".into(),
            digest: format!("sha256:{}", "0".repeat(64)),
            digest_verified: false,
            file_bytes: 1,
            family: "llama".into(),
            params: 1,
            weight_format: "bf16".into(),
            quantization: None,
            config: ModelConfig {
                family: Family::Llama,
                vocab_size: 10,
                hidden_size: 4,
                intermediate_size: 8,
                num_layers: 1,
                num_heads: 2,
                num_kv_heads: 1,
                head_dim: 2,
                rms_norm_eps: 1e-5,
                rope_theta: 10000.0,
                rope_scaling: None,
                max_position_embeddings: 64,
                tie_word_embeddings: true,
                attention_bias: false,
                qk_norm: false,
                bos_token_id: None,
                eos_token_id: None,
                hybrid: None,
                moe: None,
            },
            active_params: None,
        },
        tokenizer: TokenizerInfo {
            sha256: "cd".repeat(32),
            vocab_size: 10,
        },
        corpus: Some(CorpusInfo {
            id: "t".into(),
            mode: "full".into(),
            source: "/m.json".into(),
            stream_count: 3,
            name: "t".into(),
            manifest: Some("m.json".into()),
            manifest_sha256: Some("ef".repeat(32)),
        }),
        streams,
        domains,
        overall,
        timings: Timings {
            load_s: 0.1,
            tokenize_s: 0.2,
            score_s: 0.3,
            total_s: 0.6,
        },
        throughput: Throughput {
            processed_tokens: 15,
            processed_tokens_per_s: 50.0,
            scored_tokens_per_s: 40.0,
        },
        peak_rss_bytes: Some(1 << 20),
        warnings: Vec::new(),
        cuda_memory: None,
        cuda_versions: None,
        cpu_memory: None,
        shard: None,
        merged_from: None,
    }
}

#[test]
fn report_round_trips_exactly() {
    let r = fixed_report();
    let json = serde_json::to_string_pretty(&r).unwrap();
    let back: Report = serde_json::from_str(&json).unwrap();
    assert_eq!(back, r);
    // Unrounded floats survive: 1/3-style values come back bit for bit.
    assert_eq!(
        back.overall.totals.mean_nll.to_bits(),
        r.overall.totals.mean_nll.to_bits()
    );
}

/// Every window in the JSON carries its unrounded mean NLL and PPL beside the sums.
#[test]
fn windows_carry_their_mean_nll_and_ppl() {
    let r = fixed_report();
    let v: serde_json::Value = serde_json::to_value(&r).unwrap();
    for (s, sv) in r.streams.iter().zip(v["streams"].as_array().unwrap()) {
        let (w, wv) = (&s.windows[0], &sv["windows"][0]);
        let mean = w.nll_sum / w.scored as f64;
        assert_eq!(wv["mean_nll"].as_f64().unwrap().to_bits(), mean.to_bits());
        assert_eq!(wv["ppl"].as_f64().unwrap().to_bits(), mean.exp().to_bits());
        assert_eq!(wv["start"].as_u64(), Some(w.first_target as u64));
    }
}

#[test]
fn aggregates_are_token_weighted() {
    let r = fixed_report();
    // English: (2+3+1.5+2.5+1+4)/6, not the mean of the two stream means.
    assert!((r.domains[0].totals.mean_nll - 14.0 / 6.0).abs() < 1e-12);
    assert_eq!(r.overall.totals.scored, 12);
    assert_eq!(r.overall.totals.bytes, 90);
    // Calibration adds the same way: 4 of the 12 rows have NLL below 1 (all in code).
    let c = r.overall.calibration.as_ref().unwrap();
    assert_eq!((c.sums.rows, c.sums.top1_correct), (12, 4));
    assert!((c.mean_entropy - r.overall.totals.mean_nll).abs() < 1e-6);
    assert_eq!(
        r.domains[0].calibration.as_ref().unwrap().top1_accuracy,
        0.0
    );
    // A stream without it (a CUDA run) leaves its domain and the overall row without it.
    let mut streams = r.streams.clone();
    streams[0].calibration = None;
    assert!(aggregate("all", "all", streams.iter())
        .calibration
        .is_none());
}

#[test]
fn table_renders_as_reviewed() {
    insta::assert_snapshot!("domain_table", table::render(&fixed_report(), false));
    insta::assert_snapshot!(
        "domain_table_calibration",
        table::render(&fixed_report(), true)
    );
}

/// The run plot draws what it can show, not what a file claims: a report with 300,000
/// domains, 300,000 streams and a stream of 100,000 windows plots into a bounded SVG
/// (unbounded, it allocated per claimed domain until the allocator aborted).
#[test]
fn the_run_plot_is_bounded_by_what_it_draws() {
    let base = fixed_report();
    let mut r = base.clone();
    let d = base.domains[0].clone();
    r.domains = (0..300_000)
        .map(|i| ninfer_perplexity::report::Aggregate {
            id: format!("d{i}"),
            ..d.clone()
        })
        .collect();
    r.domains[0].id = "en".into();
    let s = base.streams[0].clone();
    r.streams = (0..300_000)
        .map(|i| StreamReport {
            id: format!("s{i}"),
            ..s.clone()
        })
        .collect();
    let w = s.windows[0].clone();
    r.streams[0].windows = (0..100_000).map(|_| w.clone()).collect();
    let svg = ninfer_perplexity::report::plot::run_plot(&r).unwrap();
    assert!(svg.len() < 8 << 20, "{} bytes", svg.len());
    // 16 panels of at most 32 lines, the long stream decimated to at most 2048 points.
    assert!(svg.matches("<polyline").count() <= 16 * 32, "lines drawn");
}

/// The seed engine's report schema 1 (`docs/report-seed-schema.json`).
pub fn seed_schema() -> serde_json::Value {
    let p = common::repo().join("docs/report-seed-schema.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// Where `v` breaks `schema`: the JSON Schema keywords that file uses (`$ref` into `$defs`,
/// `allOf`, `type`, `required`, `properties`, `items`, `const`, `enum`, `minimum`).
pub fn schema_errors(
    root: &serde_json::Value,
    schema: &serde_json::Value,
    v: &serde_json::Value,
    at: &str,
    out: &mut Vec<String>,
) {
    use serde_json::Value;
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        let name = r.strip_prefix("#/$defs/").expect("a local $ref");
        return schema_errors(root, &root["$defs"][name], v, at, out);
    }
    for s in schema
        .get("allOf")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        schema_errors(root, s, v, at, out);
    }
    if let Some(t) = schema.get("type") {
        let types: Vec<&str> = match t {
            Value::String(s) => vec![s.as_str()],
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            _ => panic!("bad type"),
        };
        let is = |t: &str| match t {
            "object" => v.is_object(),
            "array" => v.is_array(),
            "string" => v.is_string(),
            "number" => v.is_number(),
            "integer" => v.is_u64() || v.is_i64(),
            "null" => v.is_null(),
            "boolean" => v.is_boolean(),
            _ => panic!("type {t}"),
        };
        if !types.iter().any(|t| is(t)) {
            out.push(format!("{at}: {v} is not {types:?}"));
            return;
        }
    }
    if let Some(c) = schema.get("const") {
        if c != v {
            out.push(format!("{at}: {v} is not {c}"));
        }
    }
    if let Some(e) = schema.get("enum").and_then(Value::as_array) {
        if !e.contains(v) {
            out.push(format!("{at}: {v} is not one of {e:?}"));
        }
    }
    if let (Some(m), Some(x)) = (schema.get("minimum").and_then(Value::as_f64), v.as_f64()) {
        if x < m {
            out.push(format!("{at}: {x} < {m}"));
        }
    }
    if let Some(obj) = v.as_object() {
        for k in schema
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let k = k.as_str().unwrap();
            if !obj.contains_key(k) {
                out.push(format!("{at}: `{k}` missing"));
            }
        }
        if let Some(props) = schema.get("properties").and_then(Value::as_object) {
            for (k, s) in props {
                if let Some(x) = obj.get(k) {
                    schema_errors(root, s, x, &format!("{at}.{k}"), out);
                }
            }
        }
    }
    if let (Some(items), Some(arr)) = (schema.get("items"), v.as_array()) {
        for (i, x) in arr.iter().enumerate() {
            schema_errors(root, items, x, &format!("{at}[{i}]"), out);
        }
    }
}

/// The errors of a report against the seed's schema 1.
pub fn seed_schema_errors(report: &serde_json::Value) -> Vec<String> {
    let schema = seed_schema();
    let mut out = Vec::new();
    schema_errors(&schema, &schema, report, "report", &mut out);
    out
}

/// A report carries the seed engine's schema-1 fields, and the check notices each kind of
/// break: a missing block, a renamed window field, a wrong constant, a wrong type.
#[test]
fn a_report_validates_against_the_seed_schema() {
    let v = serde_json::to_value(fixed_report()).unwrap();
    assert_eq!(seed_schema_errors(&v), Vec::<String>::new());
    let broken = |f: &dyn Fn(&mut serde_json::Value), needle: &str| {
        let mut b = v.clone();
        f(&mut b);
        let e = seed_schema_errors(&b);
        assert!(
            e.iter().any(|e| e.contains(needle)),
            "`{needle}` not in {e:?}"
        );
    };
    broken(
        &|b| drop(b.as_object_mut().unwrap().remove("timing")),
        "`timing` missing",
    );
    broken(
        &|b| {
            let w = b["streams"][1]["windows"][0].as_object_mut().unwrap();
            let x = w.remove("input_begin").unwrap();
            w.insert("begin_input".into(), x);
        },
        "report.streams[1].windows[0]: `input_begin` missing",
    );
    broken(
        &|b| b["metric"]["log_base"] = "2".into(),
        "report.metric.log_base",
    );
    broken(
        &|b| b["execution"]["device"] = "cpu".into(),
        "report.execution.device",
    );
    broken(
        &|b| b["domains"][0]["scored_tokens"] = (-1).into(),
        "report.domains[0].scored_tokens",
    );
    broken(
        &|b| drop(b["domains"][1].as_object_mut().unwrap().remove("domain")),
        "report.domains[1]: `domain` missing",
    );
}
