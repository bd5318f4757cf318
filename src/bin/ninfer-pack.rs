//! `ninfer-pack`: turn a GGUF file or a Hugging Face directory into a `.ninfer` artifact,
//! and inspect or verify existing artifacts.

use anyhow::Result;
use clap::{Parser, Subcommand};
use ninfer_perplexity::artifact::{write_artifact, Artifact, WeightFormat, WeightPlan};
use ninfer_perplexity::pack::{gguf, hf, PackSource};
use ninfer_perplexity::quant::Scheme;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Packs models (GGUF files, Hugging Face directories) into .ninfer artifacts and inspects them.
#[derive(Parser, Debug)]
#[command(
    name = "ninfer-pack",
    version = ninfer_perplexity::build_info::LONG_VERSION,
    after_help = "\
Examples:
  ninfer-pack gguf SmolLM2-135M-Instruct.Q4_1.gguf -o smollm2.ninfer --weights nvfp4
  ninfer-pack hf Qwen3.5-27B-NVFP4/ -o q27-nvfp4.ninfer   # quantized matrices kept as stored
  ninfer-pack random --preset qwen3_5-27b --weights nvfp4 -o q27.ninfer
  ninfer-pack inspect --verify smollm2.ninfer

Packing streams one tensor at a time; the closing line gives the peak memory.
Full reference: docs/usage.md, docs/weights.md"
)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Pack a GGUF file (llama architecture; F32, F16, BF16, Q8_0, Q4_0, Q4_1 tensors).
    Gguf {
        /// The .gguf file.
        input: PathBuf,
        /// Output .ninfer path.
        #[arg(short, long)]
        output: PathBuf,
        /// Weight format: bf16 or f32 (every matrix), or fp8 (128x128 block scales) or nvfp4
        /// (ModelOpt's rules) for the decoder's linear layers with the rest in bf16. A
        /// checkpoint that is already quantized keeps its quantized matrices as they are;
        /// bf16 or f32 then names the format of the others.
        #[arg(long, default_value = "bf16")]
        weights: String,
        /// With --weights fp8|nvfp4: quantize the output head too (an untied one).
        #[arg(long)]
        quantize_head: bool,
    },
    /// Pack a Hugging Face directory (config.json, *.safetensors, tokenizer.json).
    Hf {
        /// The model directory.
        input: PathBuf,
        /// Output .ninfer path.
        #[arg(short, long)]
        output: PathBuf,
        /// Weight format: bf16 or f32 (every matrix), or fp8 (128x128 block scales) or nvfp4
        /// (ModelOpt's rules) for the decoder's linear layers with the rest in bf16. A
        /// checkpoint that is already quantized keeps its quantized matrices as they are;
        /// bf16 or f32 then names the format of the others.
        #[arg(long, default_value = "bf16")]
        weights: String,
        /// With --weights fp8|nvfp4: quantize the output head too (an untied one).
        #[arg(long)]
        quantize_head: bool,
        /// tokenizer.json to use instead of DIR/tokenizer.json.
        #[arg(long)]
        tokenizer: Option<PathBuf>,
    },
    /// Write a random-weight artifact of a named shape (throughput benchmarks at real scale).
    Random {
        /// Output .ninfer path.
        #[arg(short, long)]
        output: PathBuf,
        /// Shape: qwen3-8b, llama3-8b, smollm2-135m, qwen3_5-27b (the Qwen3.5 27B hybrid) or
        /// qwen3_5-35b-a3b (the Qwen3.5 35B-A3B mixture of experts).
        #[arg(long, default_value = "qwen3-8b")]
        preset: String,
        /// Number of layers (default: the preset's).
        #[arg(long)]
        layers: Option<usize>,
        /// Seed of the weights.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// tokenizer.json to embed (default: a 256-token byte-level tokenizer).
        #[arg(long)]
        tokenizer: Option<PathBuf>,
        /// Weight format: bf16 (every matrix), or fp8 (128x128 block scales) or nvfp4
        /// (ModelOpt's rules) for the decoder's linear layers, quantized from the bf16 values
        /// as `ninfer-pack hf --weights` would, with the rest in bf16. Written tensor by
        /// tensor: memory holds one scale group.
        #[arg(long, default_value = "bf16")]
        weights: String,
    },
    /// Print an artifact's description; with --verify, recompute its digest.
    Inspect {
        artifact: PathBuf,
        #[arg(long)]
        verify: bool,
    },
}

fn main() -> ExitCode {
    ninfer_perplexity::app::exit(run(Args::parse()))
}

/// The files a pack reads (so the output can be checked against them before any work).
fn inputs_of(input: &Path, tokenizer: Option<&Path>) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = if input.is_dir() {
        std::fs::read_dir(input)
            .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.path()).collect())
            .unwrap_or_default()
    } else {
        vec![input.to_path_buf()]
    };
    v.extend(tokenizer.map(Path::to_path_buf));
    v
}

/// `--weights` and `--quantize-head` as a plan.
fn weight_plan(weights: &str, head: bool) -> Result<WeightPlan> {
    let (dense, quantize) = match weights {
        "fp8" => (WeightFormat::Bf16, Some(Scheme::Fp8Block)),
        "nvfp4" => (WeightFormat::Bf16, Some(Scheme::Nvfp4)),
        other => (
            WeightFormat::parse(other).map_err(|_| {
                anyhow::anyhow!(
                    "--weights: unknown weight format `{other}` (valid: bf16, f32, fp8, nvfp4)"
                )
            })?,
            None,
        ),
    };
    if head && quantize.is_none() {
        anyhow::bail!("--quantize-head needs --weights fp8 or nvfp4");
    }
    Ok(WeightPlan {
        dense,
        quantize,
        head,
    })
}

fn pack(
    read: impl FnOnce() -> Result<PackSource>,
    inputs: Vec<PathBuf>,
    plan: Result<WeightPlan>,
    output: &Path,
) -> Result<()> {
    let plan = plan?;
    ninfer_perplexity::outfile::check_output(output, &inputs)?;
    let t = std::time::Instant::now();
    let src = read()?;
    for n in &src.notes {
        eprintln!("{n}");
    }
    let digest = write_artifact(&src, plan, output)?;
    let summary = Artifact::open(output)?.weight_summary();
    let c = &src.config;
    eprintln!(
        "packed {} ({} {:.1}M params, weights {summary}) in {:.1}s, peak memory {}, digest {}",
        output.display(),
        c.family.name(),
        c.num_params() as f64 / 1e6,
        t.elapsed().as_secs_f64(),
        peak_memory(),
        digest
    );
    Ok(())
}

/// The process's peak resident memory, for the closing line ("unknown" off Linux).
fn peak_memory() -> String {
    match ninfer_perplexity::host::peak_resident_bytes() {
        Some(b) => format!("{:.1} MB", b as f64 / 1e6),
        None => "unknown".into(),
    }
}

fn run(args: Args) -> Result<()> {
    match args.cmd {
        Cmd::Gguf {
            input,
            output,
            weights,
            quantize_head,
        } => pack(
            || gguf::read_gguf(&input),
            inputs_of(&input, None),
            weight_plan(&weights, quantize_head),
            &output,
        ),
        Cmd::Hf {
            input,
            output,
            weights,
            quantize_head,
            tokenizer,
        } => pack(
            || hf::read_hf_dir(&input, tokenizer.as_deref()),
            inputs_of(&input, tokenizer.as_deref()),
            weight_plan(&weights, quantize_head),
            &output,
        ),
        Cmd::Random {
            output,
            preset,
            layers,
            seed,
            tokenizer,
            weights,
        } => ninfer_perplexity::pack::random::run_cli(
            &output,
            &preset,
            layers,
            seed,
            tokenizer.as_deref(),
            &weights,
        ),
        Cmd::Inspect { artifact, verify } => {
            let a = Artifact::open(&artifact)?;
            if verify {
                a.verify_digest()?;
            }
            let out = serde_json::json!({
                "path": artifact.display().to_string(),
                "digest": a.digest,
                "digest_verified": verify,
                "file_bytes": a.file_bytes,
                "weight_format": a.weight_format.name(),
                "weights": a.weight_summary(),
                "weight_formats": a.weight_formats().iter().map(|u| serde_json::json!({
                    "format": u.format,
                    "classes": u.classes,
                    "tensors": u.tensors,
                    "bytes": u.bytes,
                })).collect::<Vec<_>>(),
                "quantization": a.quantization,
                "params": a.config.num_params(),
                "config": a.config,
                "provenance": a.provenance,
            });
            let mut stdout = std::io::stdout().lock();
            match writeln!(stdout, "{}", serde_json::to_string_pretty(&out)?)
                .and_then(|()| stdout.flush())
            {
                // A reader that stopped early (`| head`) is not an error.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
                Err(e) => anyhow::bail!("stdout: cannot write the description: {e}"),
                Ok(()) => Ok(()),
            }
        }
    }
}
