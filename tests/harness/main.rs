//! The regression harness: one libtest-mimic trial per (artifact, stream, KV format) and
//! tier, each scoring its stream with the shared engine and comparing the result with its
//! insta baseline under a tolerance. See `docs/harness.md`.
//!
//! Tiers:
//! - `cpu`: every artifact registered for it, on the CPU, all 16 corpus streams truncated to
//!   [`CPU_TIER_PREFIX`] tokens, scored with context [`CPU_TIER_CONTEXT`] and stride
//!   [`CPU_TIER_STRIDE`], every KV format. Trial names: `<artifact>/<stream>/<kv>`.
//! - `gpu`: every artifact registered for it, on CUDA, the whole corpus with the default
//!   protocol (context 4096, stride 2048), every KV format. Names: `cuda/<artifact>/<stream>/<kv>`.
//! - `emu`: the CUDA tier's path (the CUDA model, its precision and device class, non-CPU
//!   baselines) on the emulated device, so it runs in every CI run: artifacts registered
//!   for it, the four quick streams cut to [`EMU_TIER_PREFIX`] tokens, the CPU tier's
//!   protocol, the KV formats [`EMU_TIER_KV`] (or `--kv-dtype`). Names: `emu/<artifact>/<stream>/<kv>`.
//!
//! `cargo test --release --test harness -- [--kv-dtype ..] [--artifact ..] [--device ..]
//! [--tier ..] [--precision ..] [--measure-spread N] [libtest flags]`; the same flags given
//! to `cargo test --release -- ...` reach it too (every other test binary drops them). See
//! `docs/harness.md`. The binary's own `#[test]`s (`gate`) prove that the trials gate.

#[macro_use]
extern crate ninfer_testkit;

#[path = "../common/mod.rs"]
mod common;

mod baseline;
mod flags;
mod gate;
mod report;

use baseline::{Location, Record, Rule, Verdict};
use flags::{DeviceKind, HarnessFlags, Tier};
use libtest_mimic::{Completion, Failed, Trial};
use ninfer_perplexity::backend::{Device, DeviceRequest, Precision};
use ninfer_perplexity::corpus::{Corpus, StreamEntry};
use ninfer_perplexity::engine::{Engine, LoadOptions};
use ninfer_perplexity::kv::KvDtype;
use ninfer_perplexity::registry::{Entry, Registry, Tolerance, DEFAULT_REGISTRY};
use ninfer_perplexity::score::Protocol;
use report::{Numbers, Sink, TrialReport};
use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// Emulated tier: tokens per quick stream (the emulated device runs SmolLM2 at tens of
/// tokens per second).
pub const EMU_TIER_PREFIX: usize = 128;
/// Emulated tier: KV formats unless `--kv-dtype` names others (one unrounded, one rounded).
pub const EMU_TIER_KV: [KvDtype; 2] = [KvDtype::Bf16, KvDtype::Nvfp4];

/// CPU tier: tokens scored per stream (a prefix of the stream's tokenization).
pub const CPU_TIER_PREFIX: usize = 256;
/// CPU tier: window length.
pub const CPU_TIER_CONTEXT: usize = 128;
/// CPU tier: new targets per window after the first (so 3 windows per stream).
pub const CPU_TIER_STRIDE: usize = 64;
/// GPU tier: the CLI's default protocol over whole streams.
pub const GPU_TIER_CONTEXT: usize = 4096;
pub const GPU_TIER_STRIDE: usize = 2048;

/// The corpus every tier scores.
pub const CORPUS_MANIFEST: &str = "eval/corpora/perplexity-1m/manifest.json";

/// Tolerances for what the registry entry does not list (docs/harness.md, "Tolerance policy").
pub fn default_tolerance(class: &str, kv: KvDtype) -> Tolerance {
    if class == "cpu" {
        // Measured spread 0 (bit-identical for 1..N threads and run to run) plus a margin.
        Tolerance {
            abs: 0.0,
            rel: 1e-9,
        }
    } else if matches!(kv, KvDtype::F32 | KvDtype::Bf16) {
        // GPU classes: another reduction order and window batching; provisional until measured.
        Tolerance {
            abs: 5e-4,
            rel: 0.0,
        }
    } else {
        // Quantized KV turns tiny activation differences into rounding flips (measured on the
        // CPU: a 3e-6 change with f32 KV became up to 3e-2 with nvfp4 over 255 tokens).
        Tolerance {
            abs: 5e-3,
            rel: 0.0,
        }
    }
}

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn registry_path(root: &Path) -> PathBuf {
    match std::env::var_os("NINFER_REGISTRY") {
        Some(p) => PathBuf::from(p),
        None => root.join(DEFAULT_REGISTRY),
    }
}

/// One planned trial.
#[derive(Clone)]
pub struct Spec {
    pub name: String,
    pub tier: Tier,
    pub device: DeviceKind,
    pub cuda_index: usize,
    /// CUDA arithmetic (`--precision`); `None`: the device's default. CPU trials: `None`.
    pub precision: Option<Precision>,
    pub artifact: Entry,
    pub stream: StreamEntry,
    pub kv: KvDtype,
    pub protocol: Protocol,
    pub max_tokens: Option<usize>,
    /// Set when the trial cannot run here (artifact file missing, no GPU).
    pub ignore_reason: Option<String>,
}

pub struct Plan {
    pub specs: Vec<Spec>,
    pub corpus: Arc<Corpus>,
    /// How many of the selected trials a registry gate may judge: the family whose gates
    /// share one α (`GateSpec::in_family`). Counted from the flags' selection before name
    /// filters, so every process of a partitioned run counts the same family.
    pub gated: usize,
}

pub fn trial_name(device: DeviceKind, artifact: &str, stream: &str, kv: KvDtype) -> String {
    match device {
        DeviceKind::Cpu => format!("{artifact}/{stream}/{}", kv.name()),
        DeviceKind::Cuda => format!("cuda/{artifact}/{stream}/{}", kv.name()),
        DeviceKind::Emu => format!("emu/{artifact}/{stream}/{}", kv.name()),
    }
}

/// Enumerates the trials the registry, the corpus and the flags ask for.
pub fn plan(root: &Path, flags: &HarnessFlags) -> Result<Plan, String> {
    let reg_path = registry_path(root);
    let reg = Registry::load(&reg_path).map_err(|e| format!("{e:#}"))?;
    for a in &flags.artifacts {
        if reg.get(a).is_none() {
            let names: Vec<&str> = reg.artifacts.iter().map(|e| e.name.as_str()).collect();
            return Err(format!(
                "--artifact: `{a}` is not registered in {} (registered: {})",
                reg_path.display(),
                names.join(", ")
            ));
        }
    }
    let corpus = Corpus::open(&root.join(CORPUS_MANIFEST), None).map_err(|e| format!("{e:#}"))?;
    let mut cuda_unavailable: Option<Option<String>> = None;
    let mut specs = Vec::new();
    for tier in Tier::ALL {
        if !flags.wants_tier(tier) {
            continue;
        }
        let device = match tier {
            Tier::Cpu => DeviceKind::Cpu,
            Tier::Gpu => DeviceKind::Cuda,
            Tier::Emu => DeviceKind::Emu,
        };
        if !flags.wants_device(device) {
            continue;
        }
        let (protocol, max_tokens) = match tier {
            Tier::Cpu => (
                Protocol::new(CPU_TIER_CONTEXT, CPU_TIER_STRIDE),
                Some(CPU_TIER_PREFIX),
            ),
            Tier::Gpu => (Protocol::new(GPU_TIER_CONTEXT, GPU_TIER_STRIDE), None),
            Tier::Emu => (
                Protocol::new(CPU_TIER_CONTEXT, CPU_TIER_STRIDE),
                Some(EMU_TIER_PREFIX),
            ),
        };
        let protocol = protocol.map_err(|e| format!("tier {}: {e}", tier.name()))?;
        let device_reason = match device {
            DeviceKind::Cpu => None,
            DeviceKind::Emu => (!ninfer_perplexity::backend::cuda::BUILT).then(|| {
                "built without the CUDA backend (the emulated device runs its kernels)".to_string()
            }),
            DeviceKind::Cuda => cuda_unavailable
                .get_or_insert_with(|| {
                    Device::select(DeviceRequest::Cuda(flags.cuda_index), 1)
                        .err()
                        .map(|e| format!("no usable GPU: {e:#}"))
                })
                .clone(),
        };
        for entry in &reg.artifacts {
            if !entry.tiers.iter().any(|t| t == tier.name()) || !flags.wants_artifact(&entry.name) {
                continue;
            }
            let file = root.join(&entry.path);
            let missing = (!file.exists()).then(|| {
                format!(
                    "artifact file {} is missing (produce it with `{}`)",
                    entry.path, entry.produce
                )
            });
            for stream in &corpus.manifest.streams {
                if tier == Tier::Emu && !corpus.manifest.modes.quick.contains(&stream.id) {
                    continue;
                }
                for kv in KvDtype::ALL {
                    if !flags.wants_kv(kv) || !entry.runs_kv(kv.name()) {
                        continue;
                    }
                    if tier == Tier::Emu && flags.kv.is_empty() && !EMU_TIER_KV.contains(&kv) {
                        continue;
                    }
                    specs.push(Spec {
                        name: trial_name(device, &entry.name, &stream.id, kv),
                        tier,
                        device,
                        cuda_index: flags.cuda_index,
                        precision: match device {
                            DeviceKind::Cpu => None,
                            DeviceKind::Cuda | DeviceKind::Emu => flags.precision,
                        },
                        artifact: entry.clone(),
                        stream: stream.clone(),
                        kv,
                        protocol,
                        max_tokens,
                        ignore_reason: missing.clone().or_else(|| device_reason.clone()),
                    });
                }
            }
        }
    }
    let gated = specs
        .iter()
        .filter(|s| {
            let family = match s.device {
                DeviceKind::Cpu => "cpu",
                DeviceKind::Cuda => "cuda",
                DeviceKind::Emu => "emu",
            };
            s.ignore_reason.is_none() && s.artifact.may_gate(family, s.kv.name())
        })
        .count();
    Ok(Plan {
        specs,
        corpus: Arc::new(corpus),
        gated,
    })
}

// ---- shared engines and token streams (loaded once per process) ----------------------

type Shared<T> = Arc<OnceLock<Result<Arc<T>, String>>>;

fn shared<T>(
    map: &Mutex<HashMap<String, Shared<T>>>,
    key: String,
    init: impl FnOnce() -> Result<T, String>,
) -> Result<Arc<T>, String> {
    let cell = map
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key)
        .or_default()
        .clone();
    cell.get_or_init(|| init().map(Arc::new)).clone()
}

static ENGINES: OnceLock<Mutex<HashMap<String, Shared<Engine>>>> = OnceLock::new();
static TOKENS: OnceLock<Mutex<HashMap<String, Shared<StreamTokens>>>> = OnceLock::new();

pub struct StreamTokens {
    pub tokens: Vec<u32>,
    pub sha256: String,
    pub path: PathBuf,
}

fn engine_for(root: &Path, spec: &Spec) -> Result<Arc<Engine>, String> {
    let request = match spec.device {
        DeviceKind::Cpu => DeviceRequest::Cpu,
        DeviceKind::Cuda => DeviceRequest::Cuda(spec.cuda_index),
        DeviceKind::Emu => DeviceRequest::Emu,
    };
    let path = root.join(&spec.artifact.path);
    let key = format!("{}|{request:?}|{:?}", path.display(), spec.precision);
    shared(ENGINES.get_or_init(Default::default), key, || {
        let opts = LoadOptions {
            device: request,
            threads: engine_threads(),
            verify_digest: false,
            precision: spec.precision,
            ..LoadOptions::default()
        };
        let e = Engine::load(&path, &opts, &mut |_, _| {}).map_err(|e| format!("{e:#}"))?;
        if let Some(pinned) = &spec.artifact.digest {
            if *pinned != e.artifact.digest {
                return Err(format!(
                    "{}: the registry pins digest {pinned} but the file records {}; re-produce it with `{}` or update the registry",
                    spec.artifact.path, e.artifact.digest, spec.artifact.produce
                ));
            }
        }
        Ok(e)
    })
}

fn tokens_for(corpus: &Corpus, engine: &Engine, spec: &Spec) -> Result<Arc<StreamTokens>, String> {
    let key = format!("{}|{}", engine.tokenizer.sha256(), spec.stream.id);
    shared(TOKENS.get_or_init(Default::default), key, || {
        let s = corpus.load(&spec.stream).map_err(|e| format!("{e:#}"))?;
        let tokens = engine
            .tokenizer
            .encode(&s.text)
            .map_err(|e| format!("stream `{}`: {e:#}", s.id))?;
        Ok(StreamTokens {
            tokens,
            sha256: s.sha256,
            path: s.path,
        })
    })
}

// ---- one trial -------------------------------------------------------------------------

struct Ctx {
    root: PathBuf,
    corpus: Arc<Corpus>,
    sink: Arc<Sink>,
    /// `--measure-spread N`, and what it measured per trial.
    measure_spread: Option<usize>,
    spreads: Mutex<Vec<SpreadRow>>,
    /// [`Plan::gated`]: every gate is judged at α over this many trials.
    gated: usize,
}

/// One trial's re-runs paired with its first run.
struct SpreadRow {
    /// `(artifact, device class, kv)`: what one registry `gate` entry covers.
    key: (String, String, String),
    windows: usize,
    /// Paired standard errors (nats/token) of runs 2..N against run 1.
    ses: Vec<f64>,
    /// The largest |paired ΔNLL| among them.
    max_delta: f64,
}

fn numbers(r: &Record) -> Numbers {
    Numbers {
        mean_nll: r.mean_nll,
        ppl: r.ppl,
        nll_sum: r.nll_sum,
        input_tokens: r.input_tokens,
        scored_tokens: r.scored_tokens,
    }
}

fn run_trial(ctx: &Ctx, spec: &Spec) -> Result<Completion, Failed> {
    if let Some(reason) = &spec.ignore_reason {
        // Only reached with --ignored / --include-ignored: still never a pass.
        return Ok(Completion::ignored_with(reason));
    }
    let t0 = Instant::now();
    let mut rep = TrialReport {
        name: spec.name.clone(),
        tier: spec.tier.name().into(),
        artifact: spec.artifact.name.clone(),
        stream: spec.stream.id.clone(),
        kv_dtype: spec.kv.name().into(),
        device_class: None,
        status: "error".into(),
        message: None,
        baseline: None,
        result: None,
        delta_mean_nll: None,
        allowed: None,
        seconds: 0.0,
    };
    let outcome = score_and_compare(ctx, spec, &mut rep);
    rep.seconds = t0.elapsed().as_secs_f64();
    if let Err(msg) = &outcome {
        rep.message = Some(msg.clone());
    }
    ctx.sink.push(rep);
    outcome
        .map(|()| Completion::Completed)
        .map_err(Failed::from)
}

/// `--measure-spread N`: the trial's windows scored N times, runs 2..N paired with run 1.
fn measure_spread(
    ctx: &Ctx,
    spec: &Spec,
    rep: &mut TrialReport,
    engine: &ninfer_perplexity::engine::Engine,
    input: &[u32],
    runs: usize,
) -> Result<(), String> {
    use ninfer_perplexity::score::paired::{paired, WindowPair};
    let class = engine.result_class();
    let score = || {
        engine
            .score(input, spec.protocol, spec.kv, false, &mut |_, _| {})
            .map_err(|e| format!("stream `{}`: {e:#}", spec.stream.id))
    };
    let first = score()?;
    let (mut ses, mut max_delta) = (Vec::new(), 0f64);
    for _ in 1..runs {
        let again = score()?;
        let pairs: Vec<WindowPair> = first
            .windows
            .iter()
            .zip(&again.windows)
            .map(|(a, b)| WindowPair {
                scored: a.scored,
                base: a.nll_sum,
                new: b.nll_sum,
            })
            .collect();
        let p = paired(&pairs).map_err(|e| format!("{}: {e:#}", spec.name))?;
        ses.push(p.delta_nll_std_err.unwrap_or(0.0));
        max_delta = max_delta.max(p.delta_nll.abs());
    }
    let worst = ses.iter().copied().fold(0.0, f64::max);
    let msg = format!(
        "{}: {runs} runs over {} windows: largest paired se {worst:.3e}, largest |ΔNLL| {max_delta:.3e} nats/token",
        spec.name,
        first.windows.len()
    );
    eprintln!("spread {msg}");
    rep.status = "spread".into();
    rep.message = Some(msg);
    ctx.spreads
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(SpreadRow {
            key: (
                spec.artifact.name.clone(),
                class,
                spec.kv.name().to_string(),
            ),
            windows: first.windows.len(),
            ses,
            max_delta,
        });
    Ok(())
}

/// The `--measure-spread` summary: per (artifact, class, KV format) the θ the paired gate
/// can detect at α = 0.05, β = 0.1 with a margin of 2, as a registry `gate` entry.
fn print_spread_summary(rows: &[SpreadRow], runs: usize) {
    let (alpha, beta, margin) = (0.05, 0.1, 2.0);
    // θ must hold α over the whole family of trials a gated run judges (Bonferroni, see
    // `GateSpec::in_family`): the trials measured here stand for it.
    let family = rows.len().max(1);
    eprintln!(
        "spread: θ below is for a family of {family} gated trials (the ones measured): α {alpha} over the run, {:.3e} per trial",
        alpha / family as f64
    );
    // Per key: fewest windows, every se, largest |ΔNLL|.
    type Pooled = (usize, Vec<f64>, f64);
    let mut by: BTreeMap<(String, String, String), Pooled> = BTreeMap::new();
    for r in rows {
        let e = by
            .entry(r.key.clone())
            .or_insert((usize::MAX, Vec::new(), 0.0));
        e.0 = e.0.min(r.windows);
        e.1.extend(&r.ses);
        e.2 = e.2.max(r.max_delta);
    }
    for ((artifact, class, kv), (windows, ses, max_delta)) in by {
        let worst = ses.iter().copied().fold(0.0, f64::max);
        if worst == 0.0 && max_delta == 0.0 {
            eprintln!(
                "spread {artifact} on {class}, KV {kv}: {runs} runs are bit-identical: keep the exact tolerance, no gate needed"
            );
            continue;
        }
        let per_trial = alpha / family as f64;
        match ninfer_perplexity::gate::propose_theta(&ses, windows, per_trial, beta, margin) {
            Ok(theta) => eprintln!(
                "spread {artifact} on {class}, KV {kv}: proposed registry entry for `{artifact}`:\n  \"gate\": {{\"{class}/{kv}\": {{\"theta\": {theta:.3e}, \"alpha\": {alpha}, \"beta\": {beta}, \"spread\": {{\"runs\": {runs}, \"windows\": {windows}, \"max_std_err\": {worst:.3e}, \"margin\": {margin}}}}}}}"
            ),
            Err(e) => eprintln!("spread {artifact} on {class}, KV {kv}: {e:#}"),
        }
    }
}

fn score_and_compare(ctx: &Ctx, spec: &Spec, rep: &mut TrialReport) -> Result<(), String> {
    let engine = engine_for(&ctx.root, spec)?;
    let class = engine.result_class();
    rep.device_class = Some(class.clone());
    let stream = tokens_for(&ctx.corpus, &engine, spec)?;
    let n = spec
        .max_tokens
        .map_or(stream.tokens.len(), |m| m.min(stream.tokens.len()));
    let input = &stream.tokens[..n];
    if let Some(runs) = ctx.measure_spread {
        return measure_spread(ctx, spec, rep, &engine, input, runs);
    }
    let score = engine
        .score(input, spec.protocol, spec.kv, false, &mut |_, _| {})
        .map_err(|e| format!("stream `{}`: {e:#}", spec.stream.id))?;
    let t = score.totals;
    let new = Record {
        artifact: spec.artifact.name.clone(),
        device_class: class.clone(),
        kv_dtype: spec.kv.name().into(),
        stream: spec.stream.id.clone(),
        context: spec.protocol.context,
        stride: spec.protocol.stride,
        max_tokens: spec.max_tokens,
        corpus: ctx.corpus.manifest.corpus_id.clone(),
        stream_sha256: stream.sha256.clone(),
        tokenizer_sha256: engine.tokenizer.sha256().to_string(),
        stream_tokens: stream.tokens.len(),
        input_tokens: n,
        scored_tokens: t.scored,
        mean_nll: t.mean_nll(),
        ppl: t.ppl(),
        nll_sum: t.nll_sum,
        window_scored: score.windows.iter().map(|w| w.scored).collect(),
        window_nll_sums: score.windows.iter().map(|w| w.nll_sum).collect(),
    };
    rep.result = Some(numbers(&new));
    // The registry's paired gate where it has one, else the tolerance on the mean.
    let rule = match spec.artifact.gate_for(&class, spec.kv.name()) {
        Some(g) => Rule::Gate(g.spec().in_family(ctx.gated)),
        None => Rule::Tolerance(
            spec.artifact
                .tolerance_for(&class, spec.kv.name())
                .unwrap_or_else(|| default_tolerance(&class, spec.kv)),
        ),
    };
    let loc = Location::new(&ctx.root, &new);
    let rel = |p: &Path| p.strip_prefix(&ctx.root).unwrap_or(p).display().to_string();

    // Our own reading of the baseline, for the message; insta makes the decision below with
    // the same comparison.
    let old = baseline::load(&loc, &ctx.root);
    let verdict = match &old {
        Ok(Some(old)) => {
            rep.baseline = Some(numbers(old));
            let v = baseline::judge(old, &new, rule);
            match v {
                Verdict::Pass { delta, allowed } | Verdict::Drift { delta, allowed } => {
                    rep.delta_mean_nll = Some(delta);
                    rep.allowed = Some(allowed);
                }
                Verdict::Gated {
                    delta, threshold, ..
                } => {
                    rep.delta_mean_nll = Some(delta);
                    rep.allowed = Some(threshold);
                }
                _ => {}
            }
            Some(v)
        }
        _ => None,
    };
    let description = format!(
        "{} on {class}, KV {}: {} of `{}`, context {}, stride {}; tolerance {}",
        spec.artifact.name,
        spec.kv.name(),
        spec.max_tokens
            .map_or("all tokens".to_string(), |m| format!("first {m} tokens")),
        spec.stream.id,
        spec.protocol.context,
        spec.protocol.stride,
        rule.text()
    );
    let started = std::time::SystemTime::now();
    let insta_ok = baseline::assert_with_insta(&loc, &new, rule, description, Some(&stream.path));
    let our_ok = verdict.as_ref().is_some_and(Verdict::passed);
    if insta_ok && our_ok {
        rep.status = "pass".into();
        return Ok(());
    }
    // Which file insta left behind, if any.
    let fresh = |p: &Path| {
        p.metadata()
            .and_then(|m| m.modified())
            .map(|m| m >= started - std::time::Duration::from_secs(1))
            .unwrap_or(false)
    };
    let written = if fresh(&loc.pending()) {
        format!(
            "pending snapshot written to {}: review it with `cargo insta review`",
            rel(&loc.pending())
        )
    } else if fresh(&loc.snap()) {
        format!(
            "{} was rewritten in place (INSTA_UPDATE=always or force)",
            rel(&loc.snap())
        )
    } else {
        "nothing was written (CI=true or INSTA_UPDATE=no); run without them to get a pending snapshot".to_string()
    };
    let (status, body) = match (&old, &verdict) {
        (Err(e), _) => ("bad-baseline", format!("malformed baseline: {e}")),
        (Ok(None), _) => (
            "new",
            format!(
                "{}\n  no baseline at {}",
                baseline::failure_message(None, &new, None, rule),
                rel(&loc.snap())
            ),
        ),
        (Ok(Some(old)), Some(v)) => (
            match v {
                Verdict::Pass { .. } => "insta-mismatch",
                Verdict::WrongSubject(_) => "wrong-subject",
                Verdict::ProtocolChanged(_) => "protocol-changed",
                Verdict::TokensChanged(_) => "tokens-changed",
                Verdict::Drift { .. } | Verdict::Gated { .. } => "drift",
            },
            baseline::failure_message(Some(old), &new, Some(v), rule),
        ),
        (Ok(Some(_)), None) => unreachable!("a loaded baseline always has a verdict"),
    };
    rep.status = status.into();
    Err(format!("{}: {body}\n  {written}", spec.name))
}

// ---- main ------------------------------------------------------------------------------

/// Harness flags from `NINFER_HARNESS_FLAGS` (whitespace-separated), for runners that
/// cannot pass them on the command line (`cargo test` passes `--` arguments to every test
/// binary, nextest passes none). Only harness flags are accepted there.
fn with_env_flags(args: Vec<OsString>) -> Result<Vec<OsString>, String> {
    let Some(env) = std::env::var_os("NINFER_HARNESS_FLAGS") else {
        return Ok(args);
    };
    let env = env
        .into_string()
        .map_err(|_| "NINFER_HARNESS_FLAGS is not UTF-8".to_string())?;
    let words: Vec<OsString> = std::iter::once("harness")
        .chain(env.split_whitespace())
        .map(OsString::from)
        .collect();
    let (_, rest) =
        flags::extract(words.clone()).map_err(|e| format!("NINFER_HARNESS_FLAGS: {e}"))?;
    if rest.len() > 1 {
        return Err(format!(
            "NINFER_HARNESS_FLAGS may hold only harness flags (--kv-dtype, --artifact, --device, --tier), not {:?}",
            rest[1]
        ));
    }
    let mut out: Vec<OsString> = args.iter().take(1).cloned().collect();
    out.extend(words.into_iter().skip(1));
    out.extend(args.into_iter().skip(1));
    Ok(out)
}

/// CPU worker threads for the engine: `NINFER_HARNESS_THREADS`, else one per core. Results
/// do not depend on it (the gate test checks that).
fn engine_threads() -> usize {
    std::env::var("NINFER_HARNESS_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Exit status for usage and setup errors (bad flag values, malformed registry).
pub const EXIT_USAGE: u8 = 2;
/// Exit status when a trial failed (libtest's).
pub const EXIT_FAILED: u8 = 101;

/// The harness's `main`: harness flags first, then libtest-mimic with the rest. Returns the
/// exit status: 0, [`EXIT_FAILED`] or [`EXIT_USAGE`].
pub fn main_with(args: Vec<OsString>) -> u8 {
    let root = repo_root();
    // insta's failed assertion is a panic we catch and report ourselves: keep it quiet.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let p = info.payload();
        let msg = p
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| p.downcast_ref::<&str>().copied());
        if !msg.is_some_and(|m| m.starts_with("snapshot assertion for '")) {
            default_hook(info)
        }
    }));
    if std::env::var_os("INSTA_WORKSPACE_ROOT").is_none() {
        // Spares insta a `cargo metadata` call; this crate is its own workspace.
        std::env::set_var("INSTA_WORKSPACE_ROOT", &root);
    }
    if let Some(f) = std::env::var_os("NINFER_TEST_FAULT") {
        eprintln!(
            "harness: NINFER_TEST_FAULT={} is set: the engine is deliberately perturbed; nothing will be written into the tree",
            f.to_string_lossy()
        );
        std::env::set_var("INSTA_UPDATE", "no");
    }
    let args = match with_env_flags(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("harness: {e}");
            return EXIT_USAGE;
        }
    };
    let (flags, rest) = match flags::extract(args) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("harness: {e}");
            return EXIT_USAGE;
        }
    };
    if flags.help {
        eprintln!("{}", flags::HELP);
    }
    let args = libtest_mimic::Arguments::from_iter(rest);
    let plan = match plan(&root, &flags) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("harness: {e}");
            return EXIT_USAGE;
        }
    };
    let sink = match Sink::from_env() {
        Ok(s) => Arc::new(s),
        Err(e) => {
            eprintln!("harness: {e}");
            return EXIT_USAGE;
        }
    };
    // Say once why trials are ignored (libtest-mimic prints only "ignored" for them).
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    for s in &plan.specs {
        if let Some(r) = &s.ignore_reason {
            *reasons
                .entry(format!("{}-tier {}: {r}", s.tier.name(), s.artifact.name))
                .or_default() += 1;
        }
    }
    if !args.list {
        for (r, n) in &reasons {
            eprintln!("harness: {n} trial(s) ignored: {r}");
        }
    }
    if flags.measure_spread.is_some() {
        // Measuring is not judging: nothing is compared with a baseline or written.
        std::env::set_var("INSTA_UPDATE", "no");
    }
    let ctx = Arc::new(Ctx {
        root,
        corpus: plan.corpus.clone(),
        sink: sink.clone(),
        measure_spread: flags.measure_spread,
        spreads: Mutex::new(Vec::new()),
        gated: plan.gated,
    });
    let mut trials: Vec<Trial> = plan
        .specs
        .into_iter()
        .map(|spec| {
            let ignored = spec.ignore_reason.is_some();
            let ctx = ctx.clone();
            let name = spec.name.clone();
            Trial::ignorable_test(name, move || run_trial(&ctx, &spec)).with_ignored_flag(ignored)
        })
        .collect();
    // The harness's own tests (`gate`), except in the child processes they start.
    if std::env::var_os("NINFER_CHILD").is_none() {
        let probes = Box::leak(Box::new(ninfer_testkit::Probes::host(ctx.root.clone())));
        trials.extend(ninfer_testkit::trials(probes));
    }
    let c = libtest_mimic::run(&args, trials);
    if let Some(runs) = flags.measure_spread {
        print_spread_summary(&ctx.spreads.lock().unwrap_or_else(|e| e.into_inner()), runs);
    }
    if !args.list {
        let reasons: Vec<(String, usize)> = reasons.into_iter().collect();
        sink.finish(
            (
                c.num_passed,
                c.num_failed,
                c.num_ignored,
                c.num_filtered_out,
            ),
            &reasons,
        );
    }
    if c.has_failed() {
        EXIT_FAILED
    } else {
        0
    }
}

fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(main_with(std::env::args_os().collect()))
}
