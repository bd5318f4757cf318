//! `report.json`: the full-precision, versioned record of a run, and the stdout table.
//!
//! Every value is unrounded (serde_json writes the shortest representation that parses
//! back to the same f64). The schema is documented in `docs/report-schema.md`; bump
//! [`SCHEMA_VERSION`] on any incompatible change.

pub mod plot;
pub mod table;
pub mod write;

use crate::score::{Calibration, NllSum, ReferenceAcc, ReferenceSummary, WindowScore};
use serde::{Deserialize, Serialize};

pub const SCHEMA: &str = "ninfer-perplexity.report";
pub const SCHEMA_VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub schema: String,
    /// The seed engine's `schema_version` (1): its fields below keep its names and meanings;
    /// this project's own fields sit beside them.
    pub schema_version: u32,
    /// What is measured (the seed engine's `metric`).
    #[serde(default)]
    pub metric: Metric,
    /// How the run executed (the seed engine's `execution`).
    #[serde(default)]
    pub execution: Execution,
    /// The seed engine's `timing` (the same clocks as `timings`, in its names).
    #[serde(default)]
    pub timing: Timing,
    pub run_id: String,
    pub tool: Tool,
    /// The command line, host, CPU and OS of the run; absent from a merged report (its
    /// shards' are in their own reports) and from reports older than this field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub invocation: Option<crate::build_info::Invocation>,
    pub started_unix_s: f64,
    pub settings: Settings,
    pub artifact: ArtifactInfo,
    pub tokenizer: TokenizerInfo,
    pub corpus: Option<CorpusInfo>,
    pub streams: Vec<StreamReport>,
    pub domains: Vec<Aggregate>,
    pub overall: Aggregate,
    pub timings: Timings,
    pub throughput: Throughput,
    pub peak_rss_bytes: Option<u64>,
    /// What the run warned about on stderr (e.g. windows longer than the trained context).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// Device memory of a CUDA run (planned and peak), absent on the CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_memory: Option<crate::backend::MemoryReport>,
    /// The driver, NVRTC and cuBLAS versions of a run on a GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_versions: Option<crate::backend::CudaVersions>,
    /// A CPU run's memory plan: the artifact read in place, vectors, working memory per
    /// window and thread, the windows in flight, and what the machine allowed (compare with
    /// `peak_rss_bytes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_memory: Option<crate::backend::cpu::model::memory::MemoryPlan>,
    /// A `--shard I/N` run: its place in the whole run (its own rows cover its windows only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<crate::shard::ShardInfo>,
    /// A report `merge` assembled: the shard runs it came from, in shard order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merged_from: Option<Vec<MergedShard>>,
}

/// The seed engine's `metric`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Metric {
    pub name: String,
    pub log_base: String,
}

impl Default for Metric {
    fn default() -> Metric {
        Metric::of(crate::score::WindowPlan::Sliding)
    }
}

impl Metric {
    /// The metric a window plan measures: the seed's name for its own plan, the seed
    /// engine's later name for the llama.cpp chunk plan.
    pub fn of(plan: crate::score::WindowPlan) -> Metric {
        use crate::score::WindowPlan;
        let name = match plan {
            WindowPlan::Sliding => "fixed-window truncated-context causal perplexity",
            WindowPlan::Disjoint => "disjoint-window causal perplexity",
            WindowPlan::KldChunks => "llama.cpp KLD-chunk causal perplexity",
        };
        Metric {
            name: name.into(),
            log_base: "natural".into(),
        }
    }
}

/// The seed engine's `execution`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Execution {
    /// Always `causal_scoring`.
    pub purpose: String,
    /// The CUDA device ordinal; `null` on the CPU and the emulated device (the seed engine
    /// runs on GPUs only).
    pub device: Option<usize>,
    pub context_tokens: usize,
    pub stride_tokens: usize,
    /// How streams were cut into windows (the seed engine's later `window_plan`:
    /// `sliding`, `disjoint`, `kld-chunks`).
    #[serde(default)]
    pub window_plan: crate::score::WindowPlan,
    /// Tokens fed to the model in one pass: a whole window (this engine does not split a
    /// window's prefill), so `context_tokens`.
    pub prefill_chunk_tokens: usize,
    /// Positions whose scores one head pass produces: a whole window, as above (the CUDA
    /// head may cut the vocabulary into chunks; that changes no position's inputs).
    pub score_tile_tokens: usize,
    /// NInfer's report name of the Main KV format (`settings.kv_format.name`).
    pub kv_dtype: String,
}

/// The seed engine's `timing`, in seconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    pub load_seconds: f64,
    pub read_and_tokenize_seconds: f64,
    pub score_seconds: f64,
    pub total_seconds: f64,
    pub scored_tokens_per_second: f64,
}

/// One shard run of a merged report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MergedShard {
    pub index: usize,
    pub run_id: String,
    pub report: String,
    pub device: String,
    pub threads: usize,
    pub processed_tokens: usize,
    pub score_s: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    pub name: String,
    pub version: String,
    /// The build ([`crate::build_info`]): git commit (`-dirty`, `unknown`), cargo profile,
    /// features. Absent from reports older than these fields.
    #[serde(default)]
    pub commit: String,
    #[serde(default)]
    pub profile: String,
    #[serde(default)]
    pub features: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    /// "corpus" or "text".
    pub mode: String,
    pub context: usize,
    pub stride: usize,
    /// How streams were cut into windows (`sliding` in reports older than this field).
    #[serde(default)]
    pub window_plan: crate::score::WindowPlan,
    pub kv_dtype: String,
    /// How that representation stores keys and values for this model's head_dim: NInfer's
    /// name for it and the rotations. Absent from reports older than this field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_format: Option<KvFormat>,
    /// `fp8-tensor`'s f32 scales, per layer (keys, values) and where they came from
    /// (`null`: vLLM's default, 1.0); absent for every other format.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_tensor_scales: Option<crate::kv::fp8_tensor::TensorScales>,
    pub kv_bytes_per_token_per_layer: usize,
    /// Layers with a Main KV (all of them, except a hybrid model's Gated DeltaNet layers).
    #[serde(default)]
    pub kv_layers: usize,
    /// Main KV bytes per token over those layers.
    #[serde(default)]
    pub kv_bytes_per_token: usize,
    /// Recurrent State a window holds (f32, every Gated DeltaNet layer); 0 without any.
    #[serde(default)]
    pub state_bytes_per_window: usize,
    pub quick: bool,
    /// Per-stream token cap (smoke runs); `null` when every token is scored.
    pub max_tokens: Option<usize>,
    pub device: String,
    pub device_class: String,
    /// The forward pass's arithmetic: `f32` on the CPU, `bf16` (default) or `f32` on CUDA.
    #[serde(default = "default_precision")]
    pub precision: String,
    pub threads: usize,
    /// The test-only perturbation the run had (`fault-injection` builds only); absent normally.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_fault: Option<String>,
    /// The reference pass every position was compared with (`--reference-*`); absent without.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<ReferenceSettings>,
}

/// The Main KV representation as stored ([`crate::kv::KvDtype::format_name`],
/// [`crate::kv::KvDtype::rotation`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvFormat {
    /// NInfer's report name: `bf16`, `int8-g64`, `fp8-e4m3-r<head_dim>`, `nvfp4`, `k8v4`
    /// (`f32`: this project's exact reference).
    pub name: String,
    /// Element formats of keys and values (`bf16`, `f16`, `int8`, `fp8`, `nvfp4`, `f32`).
    pub key_elem: String,
    pub value_elem: String,
    /// The rotation applied before quantizing (queries turn with keys; the attention output
    /// turns back where values were rotated): `hadamard-<head_dim>` or `none`.
    pub key_rotation: String,
    pub value_rotation: String,
}

impl KvFormat {
    pub fn of(kv: crate::kv::KvDtype, head_dim: usize) -> KvFormat {
        let r = kv.rotation(head_dim);
        let name = |on: bool| {
            if on {
                format!("hadamard-{head_dim}")
            } else {
                "none".to_string()
            }
        };
        KvFormat {
            name: kv.format_name(head_dim),
            key_elem: kv.key_elem().name().into(),
            value_elem: kv.value_elem().name().into(),
            key_rotation: name(r.keys),
            value_rotation: name(r.values),
        }
    }
}

/// What the reference pass ran.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReferenceSettings {
    pub kv_dtype: String,
    pub artifact_path: String,
    pub artifact_digest: String,
    pub weight_format: String,
    /// `--kld-base`: the saved reference file (absolute path, its size) and the device and
    /// build that saved it; absent for an in-process reference pass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saved: Option<SavedReferenceInfo>,
}

/// Where a `--kld-base` reference came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedReferenceInfo {
    pub path: String,
    pub bytes: u64,
    pub device: String,
    pub build: String,
}

/// Reports written before `precision` was recorded came from the CPU path (f32).
fn default_precision() -> String {
    "f32".into()
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ArtifactInfo {
    /// Absolute.
    pub path: String,
    /// What the run's code targeted (NInfer's artifacts are built for one GPU target; this
    /// project's are portable): the device class, `cpu`, `emu` or `cuda-smXY`.
    #[serde(default)]
    pub target: String,
    /// The artifact's file name without `.ninfer`.
    #[serde(default)]
    pub model_id: String,
    /// The storage formats of its matrices, most bytes first, joined by `+` (`bf16`,
    /// `nvfp4+bf16`).
    #[serde(default)]
    pub weights_id: String,
    pub digest: String,
    pub digest_verified: bool,
    pub file_bytes: u64,
    pub family: String,
    pub params: usize,
    /// The storage formats of the matrices, e.g. `bf16`, or
    /// `nvfp4 (attention, mlp), bf16 (embeddings, head)`.
    pub weight_format: String,
    /// Present for an artifact with quantized matrices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<Quantization>,
    pub config: crate::model::config::ModelConfig,
    /// A mixture-of-experts model's parameters used per token (the experts it is not routed
    /// to left out); absent for a dense model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_params: Option<usize>,
}

/// How a quantized artifact was scored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Quantization {
    /// Where the quantized bytes came from (`ninfer-pack --weights nvfp4`, `modelopt NVFP4`, ...).
    pub method: String,
    /// Always true: weights are dequantized exactly, activations stay in the compute precision.
    pub weight_only: bool,
    /// Activation scales the checkpoint holds (recorded in the artifact, not applied).
    pub activation_scales: usize,
    /// Per storage format: tensor classes, tensor count and bytes (scales included).
    pub formats: Vec<FormatBytes>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FormatBytes {
    pub format: String,
    pub classes: Vec<String>,
    pub tensors: usize,
    pub bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenizerInfo {
    pub sha256: String,
    pub vocab_size: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CorpusInfo {
    /// The seed engine's fields: the manifest's `corpus_id` (`custom-<file name>` for
    /// `--text`), `quick`/`full` (`custom`), the absolute manifest or text path, and the
    /// streams scored.
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub mode: String,
    #[serde(default)]
    pub source: String,
    #[serde(default)]
    pub stream_count: usize,
    /// The corpus id again (this project's name for it); the manifest as given and its
    /// sha256, absent for `--text`.
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_sha256: Option<String>,
}

/// Totals for a stream, a domain or the whole run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Totals {
    /// The seed engine's aggregate: `scored_tokens`, `total_nll`, `mean_nll` (below),
    /// `perplexity` (`null` past f64's range).
    #[serde(default)]
    pub scored_tokens: u64,
    #[serde(default)]
    pub total_nll: f64,
    #[serde(default)]
    pub perplexity: Option<f64>,
    pub scored: u64,
    pub nll_sum: f64,
    pub nll_sq_sum: f64,
    pub mean_nll: f64,
    pub ppl: f64,
    /// Standard error of the mean NLL, treating tokens as independent.
    pub mean_nll_std_err: f64,
    /// exp(mean_nll ± 1.96·std_err).
    pub ppl_ci95: [f64; 2],
    pub bytes: u64,
    pub bits_per_byte: f64,
}

impl Totals {
    pub fn new(s: &NllSum, bytes: u64) -> Totals {
        let (lo, hi) = s.ppl_interval();
        Totals {
            scored_tokens: s.scored,
            total_nll: s.nll_sum,
            perplexity: Some(s.ppl()).filter(|p| p.is_finite()),
            scored: s.scored,
            nll_sum: s.nll_sum,
            nll_sq_sum: s.nll_sq_sum,
            mean_nll: s.mean_nll(),
            ppl: s.ppl(),
            mean_nll_std_err: s.std_err(),
            ppl_ci95: [lo, hi],
            bytes,
            bits_per_byte: s.bits_per_byte(bytes),
        }
    }

    pub fn sum(&self) -> NllSum {
        NllSum {
            scored: self.scored,
            nll_sum: self.nll_sum,
            nll_sq_sum: self.nll_sq_sum,
        }
    }
}

/// Calibration of a stream, domain or the whole run: the sums (so rows add up exactly) and
/// what they say. Absent when the backend's head does not compute it (CUDA, for now).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CalibrationReport {
    pub mean_entropy: f64,
    pub top1_accuracy: f64,
    pub mean_top1_confidence: f64,
    /// Expected calibration error of the top-1 confidence over equal-width bins.
    pub ece: f64,
    #[serde(flatten)]
    pub sums: Calibration,
}

impl CalibrationReport {
    pub fn new(c: &Calibration) -> Option<CalibrationReport> {
        let s = c.summary()?;
        Some(CalibrationReport {
            mean_entropy: s.mean_entropy,
            top1_accuracy: s.top1_accuracy,
            mean_top1_confidence: s.mean_top1_confidence,
            ece: s.ece,
            sums: c.clone(),
        })
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StreamReport {
    pub id: String,
    pub domain: String,
    /// As the manifest names it (relative to its folder); a `--text` file's absolute path.
    pub path: String,
    pub sha256: String,
    /// Tokens of the whole stream; `null` when a `--max-tokens` run tokenized only the
    /// prefix it scored.
    pub tokens: Option<usize>,
    /// Tokens scored over (after a `--max-tokens` cap).
    pub input_tokens: usize,
    /// Input tokens not scored: the first (the seed's 1), or more in a shard's report.
    #[serde(default)]
    pub unscored_tokens: usize,
    pub processed_tokens: usize,
    #[serde(flatten)]
    pub totals: Totals,
    pub seconds: f64,
    pub processed_tokens_per_s: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<CalibrationReport>,
    /// The comparison with the reference pass (`--reference-*`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<ReferenceSummary>,
    /// Its per-position values, for the domain and overall rows (not written).
    #[serde(skip)]
    pub reference_acc: Option<ReferenceAcc>,
    /// How evenly a mixture-of-experts model's router spread this stream's tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing: Option<RoutingReport>,
    pub windows: Vec<WindowScore>,
}

/// Token-to-expert assignments of a stream, per expert, summed over the sparse layers (every
/// routed row of every window: context rows included, the last layer only for the rows that
/// predict targets), and their spread.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoutingReport {
    pub assignments: u64,
    pub tokens_per_expert_min: u64,
    pub tokens_per_expert_median: f64,
    pub tokens_per_expert_max: u64,
    /// Experts no token of the stream was routed to (in any sparse layer).
    pub unused_experts: usize,
    pub tokens_per_expert: Vec<u64>,
}

impl RoutingReport {
    pub fn new(counts: &[u64]) -> Option<RoutingReport> {
        if counts.is_empty() {
            return None;
        }
        let mut s = counts.to_vec();
        s.sort_unstable();
        let n = s.len();
        let median = if n % 2 == 1 {
            s[n / 2] as f64
        } else {
            (s[n / 2 - 1] + s[n / 2]) as f64 / 2.0
        };
        Some(RoutingReport {
            assignments: counts.iter().sum(),
            tokens_per_expert_min: s[0],
            tokens_per_expert_median: median,
            tokens_per_expert_max: s[n - 1],
            unused_experts: counts.iter().filter(|&&c| c == 0).count(),
            tokens_per_expert: counts.to_vec(),
        })
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Aggregate {
    /// The seed engine's name of a domain row's id; absent from `overall`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    pub id: String,
    pub title: String,
    pub streams: usize,
    pub input_tokens: usize,
    #[serde(flatten)]
    pub totals: Totals,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<CalibrationReport>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<ReferenceSummary>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timings {
    pub load_s: f64,
    pub tokenize_s: f64,
    pub score_s: f64,
    pub total_s: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Throughput {
    pub processed_tokens: usize,
    pub processed_tokens_per_s: f64,
    pub scored_tokens_per_s: f64,
}

/// Token-weighted aggregation of streams into one row.
pub fn aggregate<'a>(
    id: &str,
    title: &str,
    streams: impl Iterator<Item = &'a StreamReport>,
) -> Aggregate {
    let mut s = NllSum::default();
    let (mut n, mut bytes, mut input) = (0usize, 0u64, 0usize);
    // Only when every stream has it.
    let mut calib = Some(Calibration::default());
    let mut reference = Some(ReferenceAcc::default());
    for st in streams {
        match (&st.reference_acc, reference.as_mut()) {
            (Some(r), Some(all)) => all.add(r),
            _ => reference = None,
        }
        match (&st.calibration, calib.as_mut()) {
            (Some(c), Some(all)) => all.add(&c.sums),
            _ => calib = None,
        }
        s.add(&st.totals.sum());
        bytes += st.totals.bytes;
        input += st.input_tokens;
        n += 1;
    }
    Aggregate {
        domain: None,
        id: id.into(),
        title: title.into(),
        streams: n,
        input_tokens: input,
        totals: Totals::new(&s, bytes),
        calibration: calib.as_ref().and_then(CalibrationReport::new),
        reference: reference.as_ref().and_then(ReferenceAcc::summary),
    }
}

/// Peak resident set size of this process (Linux), if known.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
