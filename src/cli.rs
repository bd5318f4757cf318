//! Command-line surface: raw clap arguments, validated into a [`RunConfig`].
//!
//! Validation happens before anything is loaded, so a bad flag costs nothing and never
//! leaves output behind.

use crate::backend::{DeviceRequest, Precision};
use crate::kv::KvDtype;
use crate::score::{Protocol, WindowPlan};
use crate::ui::LogLevel;
use anyhow::{bail, Result};
use clap::Parser;
use std::path::PathBuf;

/// Examples and the other modes, after the flags in `--help`.
const AFTER_HELP: &str = "\
Examples:
  # the corpus's four quick streams with fp8 KV (M = eval/corpora/perplexity-1m/manifest.json)
  ninfer-perplexity smollm2-135m-bf16 --corpus M --quick --kv-dtype fp8
  # a text file at the long-context profile
  ninfer-perplexity model.ninfer --text book.txt --context 65536 --stride 32768
  # nvfp4 KV against bf16 KV at every position (KL divergence, top-1 agreement)
  ninfer-perplexity model.ninfer --corpus M --quick --kv-dtype nvfp4 --reference-kv bf16
  # a CI gate: fail when the new run is worse by more than 0.01 nats/token with 95% confidence
  ninfer-perplexity compare base/ new/ --fail-on 0.01

Compare two runs (paired per-window deltas with 95% intervals):
  ninfer-perplexity compare BASE NEW [--json FILE] [--plot FILE] [--fail-on NATS]
Merge a run's shards (--shard I/N) into its report:
  ninfer-perplexity merge SHARD... [--output DIR]
(`ninfer-perplexity compare --help`, `ninfer-perplexity merge --help`)

Exit status: 0 success; 1 error (one `error:` line, no report); 2 usage;
3 a `compare --fail-on` gate failed. Full reference: docs/usage.md";

/// Causal perplexity of a .ninfer artifact on a fixed corpus or a text file.
#[derive(Parser, Debug)]
#[command(name = "ninfer-perplexity", version = crate::build_info::LONG_VERSION, long_about = None)]
#[command(after_help = AFTER_HELP)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["corpus", "text"])))]
pub struct Args {
    /// The artifact: a .ninfer path or a name registered in eval/registry.json.
    pub artifact: String,

    /// Corpus manifest (e.g. eval/corpora/perplexity-1m/manifest.json).
    #[arg(long, value_name = "MANIFEST", conflicts_with = "text")]
    pub corpus: Option<PathBuf>,

    /// Score only the corpus's quick streams (one per domain).
    #[arg(long)]
    pub quick: bool,

    /// Score only these streams of the corpus (repeatable).
    #[arg(long = "stream", value_name = "ID")]
    pub streams: Vec<String>,

    /// Directory holding the built corpus streams (default: streams/ beside the manifest).
    #[arg(long, value_name = "DIR")]
    pub stream_dir: Option<PathBuf>,

    /// Score one UTF-8 text file as a single stream (`-`: standard input, up to 1 GiB).
    #[arg(long, value_name = "FILE")]
    pub text: Option<PathBuf>,

    /// Tokens per window (the model sees at most context-1 tokens of history).
    #[arg(long, default_value_t = 4096, allow_hyphen_values = true, value_parser = count)]
    pub context: usize,

    /// New targets scored per window after the first; must be below --context [default:
    /// 2048; the sliding plan's only]
    #[arg(long, allow_hyphen_values = true, value_parser = count)]
    pub stride: Option<usize>,

    /// How streams are cut into windows: sliding (the seed's: every token after the first
    /// scored once, strided), disjoint (windows of --context side by side, each scoring all
    /// but its first token: lm-eval's and vLLM's published numbers), kld-chunks
    /// (llama-perplexity's: whole chunks of --context, each scoring its last context-1-
    /// context/2 tokens, the rest of the stream dropped)
    #[arg(long, default_value = "sliding", value_name = "PLAN")]
    pub window_plan: String,

    /// Main KV representation, as the seed's engine defines them: fp8 (FP8 E4M3, one FP16
    /// scale per row), bf16 (V in FP16), int8 (FP16 scale per 64), nvfp4 (E4M3 scale per 16),
    /// k8v4 (fp8 keys, nvfp4 values); keys Hadamard-rotated in every quantized one, values in
    /// nvfp4 and k8v4. f32 is the exact reference; fp8-tensor is vLLM's default FP8 cache
    /// (one f32 scale per layer for K and for V, 1.0 unless --kv-scales, no rotation)
    #[arg(long, default_value = "fp8", value_name = "DTYPE")]
    pub kv_dtype: String,

    /// fp8-tensor's calibrated scales: a JSON file {"k_scale": S or [S per layer],
    /// "v_scale": ...} (vLLM's k_scale / v_scale); default 1.0 for every layer
    #[arg(long, value_name = "FILE")]
    pub kv_scales: Option<PathBuf>,

    /// Score only the first N tokens of each stream (bounded smoke runs).
    #[arg(long, value_name = "N", allow_hyphen_values = true, value_parser = count)]
    pub max_tokens: Option<usize>,

    /// Directory for report.json; must be absent or empty (default, the seed engine's layout:
    /// profiles/perplexity/MODEL/WEIGHTS/KV/CORPUS/MODE/YYYYMMDD-HHMMSS, `-2`, `-3`, ...
    /// added when another run has that one).
    #[arg(long, value_name = "DIR")]
    pub output: Option<PathBuf>,

    /// auto, cpu, cuda, cuda:N, N (GPU N, as the seed engine takes it), or emu (the CUDA
    /// model on an emulated device: slow, a developer device for testing the CUDA path
    /// without a GPU).
    #[arg(long, default_value = "auto")]
    pub device: String,

    /// Arithmetic of the forward pass: bf16 or f32. CUDA defaults to bf16; the CPU computes
    /// in f32 only. Recorded in report.json.
    #[arg(long, value_name = "P")]
    pub precision: Option<String>,

    /// CPU worker threads (default: one per core). Results do not depend on it.
    #[arg(long, default_value_t = 0, allow_hyphen_values = true, value_parser = count)]
    pub threads: usize,

    /// Memory the CPU run may fill, e.g. 20G (default: the cgroup's limit or the available
    /// memory). A run that does not fit is refused before the weights are read.
    #[arg(long, value_name = "SIZE", value_parser = memory_size)]
    pub max_memory: Option<u64>,

    /// Recompute the artifact's digest and refuse it if the contents changed.
    #[arg(long)]
    pub verify_artifact: bool,

    /// Compare every position with a reference pass of the same artifact using this KV
    /// format (e.g. f32): KL divergence, top-1 agreement, Δp, paired ΔNLL. CPU only.
    #[arg(long, value_name = "DTYPE")]
    pub reference_kv: Option<String>,

    /// Compare with a reference pass of another artifact (same tokenizer), e.g. the bf16
    /// artifact of an nvfp4 one; its KV format is --reference-kv or else --kv-dtype. CPU only.
    #[arg(long, value_name = "ARTIFACT")]
    pub reference_artifact: Option<String>,

    /// Save this run as a reference for later runs: every scored position's final-normed
    /// hidden state (4 x hidden size bytes each), sha256-checked, naming the artifact, head,
    /// tokenizer, protocol, KV format, device and build. Any device (CUDA reads the rows
    /// back from the device).
    #[arg(long, value_name = "FILE")]
    pub save_reference: Option<PathBuf>,

    /// Compare every position with a saved reference (--save-reference) of the same head and
    /// tokens: the reference table and fields of --reference-kv, without the reference model.
    /// CPU only, for now.
    #[arg(long, value_name = "FILE")]
    pub kld_base: Option<PathBuf>,

    /// Also write plot.svg beside report.json: per-window mean NLL along each stream by
    /// domain, and the KL-divergence histogram of a run with a reference pass.
    #[arg(long)]
    pub plot: bool,

    /// Add calibration columns to the table: mean entropy, top-1 accuracy, mean top-1
    /// confidence, ECE (report.json always has them where the backend computes them).
    #[arg(long)]
    pub show_calibration: bool,

    /// Score only the I-th of N pieces of the run's windows (1-based; balanced by processed
    /// tokens), for `ninfer-perplexity merge` to combine into the unsharded report.
    #[arg(long, value_name = "I/N")]
    pub shard: Option<String>,

    /// stderr verbosity.
    #[arg(long, value_enum, default_value = "info")]
    pub log_level: LogLevel,
}

/// Compare two runs of the same corpus and protocol, window by window (paired ΔNLL with a
/// 95% interval, PPL ratio, Δ bits per byte).
#[derive(Parser, Debug)]
#[command(name = "ninfer-perplexity compare", bin_name = "ninfer-perplexity compare", version = crate::build_info::LONG_VERSION, long_about = None)]
pub struct CompareArgs {
    /// The base run: its report.json or its run directory.
    pub base: PathBuf,

    /// The new run: its report.json or its run directory.
    pub new: PathBuf,

    /// Also write the comparison as JSON to FILE (written atomically; replaces FILE).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,

    /// Also draw the per-window deltas with the interval band as an SVG to FILE.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,

    /// Gate: exit 3 when the new run is worse by more than NATS nats/token with 95%
    /// confidence (the interval's lower bound of new - base exceeds NATS; with one window,
    /// no interval, the point delta). `--fail-on 0`: any significant worsening.
    #[arg(long, value_name = "NATS", value_parser = non_negative_nats)]
    pub fail_on: Option<f64>,

    /// stderr verbosity.
    #[arg(long, value_enum, default_value = "info")]
    pub log_level: LogLevel,
}

/// Combine the reports of a run's shards (`--shard I/N`) into the report of the whole run:
/// the same NLL sums, calibration and table as one unsharded run.
#[derive(Parser, Debug)]
#[command(name = "ninfer-perplexity merge", bin_name = "ninfer-perplexity merge", version = crate::build_info::LONG_VERSION, long_about = None)]
pub struct MergeArgs {
    /// The shards' run directories or report.json files, in any order (all N of them).
    #[arg(required = true, value_name = "SHARD")]
    pub shards: Vec<PathBuf>,

    /// Directory for the merged report.json; must be absent or empty
    /// (default: profiles/perplexity/RUN_ID-merged-N/, after shard 1's run).
    #[arg(long, value_name = "DIR")]
    pub output: Option<PathBuf>,

    /// Also write plot.svg beside the merged report.json.
    #[arg(long)]
    pub plot: bool,

    /// Add the calibration columns to the table.
    #[arg(long)]
    pub show_calibration: bool,

    /// stderr verbosity.
    #[arg(long, value_enum, default_value = "info")]
    pub log_level: LogLevel,
}

/// `--max-memory`: a byte count with an optional K, M, G or T.
fn memory_size(s: &str) -> Result<u64, String> {
    crate::host::parse_bytes(s)
}

/// Most CPU worker threads `--threads` takes.
pub const MAX_THREADS: usize = 1024;

/// A whole, non-negative number (clap would otherwise suggest `-- -5` for a negative one).
fn count(s: &str) -> Result<usize, String> {
    s.parse::<usize>()
        .map_err(|_| format!("expected a whole number (0, 1, 2, ...), got `{s}`"))
}

/// What to score.
#[derive(Clone, Debug)]
pub enum Input {
    Corpus {
        manifest: PathBuf,
        quick: bool,
        streams: Vec<String>,
        stream_dir: Option<PathBuf>,
    },
    Text(PathBuf),
}

/// Validated run configuration.
#[derive(Clone, Debug)]
pub struct RunConfig {
    pub artifact: String,
    pub input: Input,
    pub protocol: Protocol,
    pub kv: KvDtype,
    /// `--kv-scales`: read once the model's layer count is known ([`crate::run`]).
    pub kv_scales: Option<PathBuf>,
    pub max_tokens: Option<usize>,
    pub output: Option<PathBuf>,
    pub device: DeviceRequest,
    /// `None`: the device's default.
    pub precision: Option<Precision>,
    pub threads: usize,
    /// `--max-memory`, bytes.
    pub max_memory: Option<u64>,
    pub verify_artifact: bool,
    pub show_calibration: bool,
    pub plot: bool,
    /// The reference pass to compare with, if any.
    pub reference: Option<ReferenceConfig>,
    /// `--save-reference FILE`, `--kld-base FILE`.
    pub save_reference: Option<PathBuf>,
    pub kld_base: Option<PathBuf>,
    /// `--shard I/N`: score only that piece of the run's windows.
    pub shard: Option<crate::shard::Shard>,
    pub log_level: LogLevel,
}

/// `--reference-kv` / `--reference-artifact`, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct ReferenceConfig {
    pub kv: KvDtype,
    /// Another artifact (path or registered name); `None`: the run's own.
    pub artifact: Option<String>,
}

impl Args {
    pub fn validate(self) -> Result<RunConfig> {
        let plan = WindowPlan::parse(&self.window_plan).ok_or_else(|| {
            anyhow::anyhow!(
                "--window-plan: `{}` is not one of sliding, disjoint, kld-chunks",
                self.window_plan
            )
        })?;
        let stride = match plan {
            WindowPlan::Sliding => Some(self.stride.unwrap_or(2048)),
            _ => self.stride,
        };
        let protocol = Protocol::with_plan(plan, self.context, stride)?;
        let kv = KvDtype::parse(&self.kv_dtype).map_err(|e| anyhow::anyhow!("--kv-dtype: {e}"))?;
        if self.kv_scales.is_some() && kv.tensor_scales().is_none() {
            bail!(
                "--kv-scales: only --kv-dtype fp8-tensor has per-tensor scales (got --kv-dtype {})",
                kv.name()
            );
        }
        let device =
            DeviceRequest::parse(&self.device).map_err(|e| anyhow::anyhow!("--device: {e}"))?;
        let precision = self
            .precision
            .as_deref()
            .map(Precision::parse)
            .transpose()
            .map_err(|e| anyhow::anyhow!("--precision: {e}"))?;
        if precision == Some(Precision::Bf16) && device == DeviceRequest::Cpu {
            bail!("--precision bf16: the CPU backend computes in f32 only (use --device cuda, or drop --precision)");
        }
        if self.threads > MAX_THREADS {
            bail!(
                "--threads {}: at most {MAX_THREADS} worker threads (0 means one per core)",
                self.threads
            );
        }
        if let Some(m) = self.max_tokens {
            if m < 2 {
                bail!("--max-tokens must be at least 2 (got {m})");
            }
        }
        let input = match (self.corpus, self.text) {
            (Some(manifest), None) => Input::Corpus {
                manifest,
                quick: self.quick,
                streams: self.streams,
                stream_dir: self.stream_dir,
            },
            (None, Some(t)) => {
                if self.quick || !self.streams.is_empty() || self.stream_dir.is_some() {
                    bail!("--quick, --stream and --stream-dir select corpus streams and need --corpus, not --text");
                }
                Input::Text(t)
            }
            _ => bail!("give exactly one of --corpus MANIFEST or --text FILE"),
        };
        let reference = match (&self.reference_kv, &self.reference_artifact) {
            (None, None) => None,
            (k, a) => Some(ReferenceConfig {
                kv: match k {
                    Some(k) => {
                        KvDtype::parse(k).map_err(|e| anyhow::anyhow!("--reference-kv: {e}"))?
                    }
                    None => kv,
                },
                artifact: a.clone(),
            }),
        };
        if reference.is_some() && matches!(device, DeviceRequest::Cuda(_) | DeviceRequest::Emu) {
            bail!("--reference-kv and --reference-artifact run on the CPU backend only, for now (use --device cpu)");
        }
        let shard = self
            .shard
            .as_deref()
            .map(crate::shard::Shard::parse)
            .transpose()?;
        let saved = self.save_reference.is_some() || self.kld_base.is_some();
        if self.save_reference.is_some() && self.kld_base.is_some() {
            bail!("--save-reference and --kld-base: give one (a run saves a reference or compares with one)");
        }
        if saved && reference.is_some() {
            bail!("--save-reference and --kld-base do not go with --reference-kv or --reference-artifact");
        }
        if saved && shard.is_some() {
            bail!("--shard cannot be combined with --save-reference or --kld-base (a saved reference holds a whole run)");
        }
        if shard.is_some() && reference.is_some() {
            bail!("--shard cannot be combined with --reference-kv or --reference-artifact (a reference pass's KL quantiles need every position in one process)");
        }
        Ok(RunConfig {
            artifact: self.artifact,
            input,
            protocol,
            kv,
            max_tokens: self.max_tokens,
            output: self.output,
            device,
            precision,
            threads: self.threads,
            max_memory: self.max_memory,
            verify_artifact: self.verify_artifact,
            kv_scales: self.kv_scales,
            show_calibration: self.show_calibration,
            plot: self.plot,
            reference,
            save_reference: self.save_reference,
            kld_base: self.kld_base,
            shard,
            log_level: self.log_level,
        })
    }
}

/// `--fail-on`: a finite, non-negative number of nats per token.
fn non_negative_nats(v: &str) -> Result<f64, String> {
    match v.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(format!(
            "`{v}` is not a finite number of nats per token >= 0"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<RunConfig> {
        let mut v = vec!["ninfer-perplexity"];
        v.extend_from_slice(args);
        Args::try_parse_from(v)
            .map_err(|e| anyhow::anyhow!(e.to_string()))?
            .validate()
    }

    #[test]
    fn defaults_follow_the_spec() {
        let c = parse(&["m.ninfer", "--text", "a.txt"]).unwrap();
        assert_eq!(c.protocol, Protocol::new(4096, 2048).unwrap());
        assert_eq!(c.protocol.plan, WindowPlan::Sliding);
        // The seed's evaluator scores with NInfer's fp8 by default.
        assert_eq!(c.kv, KvDtype::Fp8);
    }

    #[test]
    fn a_reference_pass_is_refused_on_cuda_and_the_emulated_device() {
        for dev in ["cuda", "cuda:1", "emu"] {
            let e = parse(&["m", "--text", "a", "--device", dev, "--reference-kv", "f32"])
                .unwrap_err()
                .to_string();
            assert!(e.contains("run on the CPU backend only"), "{dev}: {e}");
        }
        assert!(parse(&["m", "--text", "a", "--device", "emu"]).is_ok());
    }

    #[test]
    fn window_plans_parse_and_refuse_a_stride() {
        let c = parse(&[
            "m",
            "--text",
            "a",
            "--window-plan",
            "disjoint",
            "--context",
            "512",
        ])
        .unwrap();
        assert_eq!(
            (c.protocol.plan, c.protocol.context, c.protocol.stride),
            (WindowPlan::Disjoint, 512, 512)
        );
        let c = parse(&["m", "--text", "a", "--window-plan", "kld-chunks"]).unwrap();
        assert_eq!(
            (c.protocol.plan, c.protocol.stride),
            (WindowPlan::KldChunks, 4096)
        );
        let e = parse(&[
            "m",
            "--text",
            "a",
            "--window-plan",
            "kld-chunks",
            "--stride",
            "8",
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("drop --stride"), "{e}");
        let e = parse(&["m", "--text", "a", "--window-plan", "rolling"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("not one of sliding, disjoint, kld-chunks"),
            "{e}"
        );
        // The sliding plan keeps its stride default and its check.
        let c = parse(&["m", "--text", "a", "--context", "100"]);
        assert!(c
            .unwrap_err()
            .to_string()
            .contains("stride must be smaller"));
    }

    #[test]
    fn errors_are_specific() {
        let e = parse(&["m", "--text", "a", "--context", "8", "--stride", "8"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("stride must be smaller than the context"), "{e}");
        let e = parse(&["m", "--text", "a", "--stride", "0"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("stride must be at least 1"), "{e}");
        let e = parse(&["m", "--text", "a", "--kv-dtype", "fp9"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown KV dtype `fp9`") && e.contains("bf16, int8, fp8, nvfp4, k8v4, f32"),
            "{e}"
        );
        let e = parse(&["m", "--text", "a", "--corpus", "c.json"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot be used with"), "{e}");
        let e = parse(&["m"]).unwrap_err().to_string();
        assert!(e.contains("--corpus") && e.contains("--text"), "{e}");
        let e = parse(&["m", "--text", "a", "--quick"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--corpus"), "{e}");
        // A bare index is GPU N, as the seed engine's `--device N`.
        assert_eq!(
            parse(&["m", "--text", "a", "--device", "1"])
                .unwrap()
                .device,
            DeviceRequest::Cuda(1)
        );
        for bad in ["-1", "1.5", "99999999999999999999999"] {
            assert!(
                parse(&["m", "--text", "a", "--device", bad]).is_err(),
                "{bad}"
            );
        }
        let e = parse(&["m", "--text", "a", "--device", "tpu"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown device `tpu`"), "{e}");
        let e = parse(&["m", "--text", "a", "--precision", "fp16"])
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "--precision: unknown precision `fp16` (valid: bf16, f32)"
        );
        let e = parse(&["m", "--text", "a", "--device", "cpu", "--precision", "bf16"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("the CPU backend computes in f32 only"), "{e}");
        let c = parse(&["m", "--text", "a", "--precision", "f32"]).unwrap();
        assert_eq!(c.precision, Some(Precision::F32));
        let e = parse(&["m", "--text", "a", "--threads", "100000"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--threads 100000: at most 1024"), "{e}");
        let e = parse(&["m", "--text", "a", "--context", "-5"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("expected a whole number") && e.contains("`-5`") && !e.contains("-- -5"),
            "{e}"
        );
        for (spec, want) in [
            (
                "3/2",
                "--shard 3/2: the shard index counts from 1 to the shard count",
            ),
            ("0/0", "--shard 0/0: the shard count must be at least 1"),
        ] {
            let e = parse(&["m", "--text", "a", "--shard", spec])
                .unwrap_err()
                .to_string();
            assert!(e.starts_with(want), "{e}");
        }
        let e = parse(&[
            "m",
            "--text",
            "a",
            "--shard",
            "1/2",
            "--reference-kv",
            "f32",
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--shard cannot be combined with --reference-kv"),
            "{e}"
        );
        let c = parse(&["m", "--text", "a", "--shard", "2/3"]).unwrap();
        assert_eq!(c.shard, Some(crate::shard::Shard { index: 2, count: 3 }));
        let e = parse(&["m", "--text", "a", "--max-tokens", "1"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--max-tokens must be at least 2"), "{e}");
    }

    /// Every example `--help` shows parses (as a run, or as `compare`), and its run examples
    /// pass the checks that need no file.
    #[test]
    fn the_help_examples_parse() {
        let examples: Vec<&str> = AFTER_HELP
            .split("\n\n")
            .next()
            .unwrap()
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with("ninfer-perplexity "))
            .collect();
        assert!(examples.len() >= 4, "{examples:?}");
        for e in examples {
            let words: Vec<&str> = e.split_whitespace().collect();
            if words[1] == "compare" {
                let mut argv = vec!["ninfer-perplexity compare"];
                argv.extend(&words[2..]);
                CompareArgs::try_parse_from(argv).unwrap_or_else(|err| panic!("{e}: {err}"));
            } else {
                let args = Args::try_parse_from(&words).unwrap_or_else(|err| panic!("{e}: {err}"));
                args.validate().unwrap_or_else(|err| panic!("{e}: {err}"));
            }
        }
    }
}
