//! The harness's own flags, taken out of the argument list before libtest-mimic parses the
//! rest, so every ordinary libtest flag keeps working.
//!
//! `--kv-dtype`, `--artifact`, `--device`, `--tier` and `--precision` each take a value (`--flag V` or
//! `--flag=V`); a value may list several choices separated by commas, and a flag may be
//! repeated. Each narrows the set of trials; absent, it selects everything.

use ninfer_perplexity::backend::Precision;
use ninfer_perplexity::kv::KvDtype;
use std::ffi::OsString;

/// Where a trial runs. Trial names carry the device except for the CPU (`cuda/...`,
/// `emu/...`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    Cpu,
    Cuda,
    /// The CUDA model on the emulated device.
    Emu,
}

impl DeviceKind {
    pub const ALL: [DeviceKind; 3] = [DeviceKind::Cpu, DeviceKind::Cuda, DeviceKind::Emu];

    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
            DeviceKind::Emu => "emu",
        }
    }
}

/// A test tier: which artifacts (the registry's `tiers`), how much of each stream, which
/// protocol and which device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    Cpu,
    Gpu,
    /// The CUDA tier's code on the emulated device: a few short trials in every CI run.
    Emu,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Cpu, Tier::Gpu, Tier::Emu];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Cpu => "cpu",
            Tier::Gpu => "gpu",
            Tier::Emu => "emu",
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct HarnessFlags {
    pub kv: Vec<KvDtype>,
    pub artifacts: Vec<String>,
    pub devices: Vec<DeviceKind>,
    /// The CUDA ordinal from `--device cuda:N` (0 when not given).
    pub cuda_index: usize,
    pub tiers: Vec<Tier>,
    /// `--precision`: the CUDA trials' arithmetic (default: bf16).
    pub precision: Option<Precision>,
    /// `--measure-spread N`: score every selected trial N times, pair each re-run with the
    /// first and propose the paired gate's θ from the spread (no baseline is compared).
    pub measure_spread: Option<usize>,
    pub help: bool,
}

impl HarnessFlags {
    pub fn wants_kv(&self, k: KvDtype) -> bool {
        self.kv.is_empty() || self.kv.contains(&k)
    }
    pub fn wants_artifact(&self, a: &str) -> bool {
        self.artifacts.is_empty() || self.artifacts.iter().any(|x| x == a)
    }
    pub fn wants_device(&self, d: DeviceKind) -> bool {
        self.devices.is_empty() || self.devices.contains(&d)
    }
    pub fn wants_tier(&self, t: Tier) -> bool {
        self.tiers.is_empty() || self.tiers.contains(&t)
    }
}

pub const HELP: &str = "\
Regression harness flags (given after `--`, before or among the libtest flags):
  --kv-dtype LIST   only these KV formats: bf16, int8, fp8, nvfp4, k8v4, f32, fp8-tensor
  --artifact LIST   only these registered artifacts (eval/registry.json)
  --device LIST     only trials on these devices: cpu, cuda (or cuda:N to pick a GPU), emu
  --tier LIST       only these tiers: cpu (short prefix, every KV format), gpu (full corpus),
                    emu (the CUDA model on the emulated device: quick streams, short prefix)
  --precision P     CUDA and emulated trials' arithmetic: bf16 (default) or f32; baselines
                    are kept per precision (device class cuda-smXY-P, emu-P)
  --measure-spread N  score each selected trial N >= 2 times, pair every re-run with the
                    first, and propose the paired gate's theta (registry `gate`) from the
                    largest standard error; baselines are neither read nor written
LIST is one value or several separated by commas; each flag may be repeated.
Environment:
  NINFER_HARNESS_FLAGS=FLAGS      the flags above, for `cargo test` over every test binary
                                  and for nextest (e.g. NINFER_HARNESS_FLAGS='--kv-dtype fp8')
  NINFER_HARNESS_REPORT_DIR=DIR   write DIR/trials.jsonl and DIR/summary.md
  NINFER_HARNESS_THREADS=N        CPU engine threads (default: one per core)
  CI=true or INSTA_UPDATE=no      write nothing into the tree
";

/// Splits the harness's flags from the rest. `args[0]` is the program name and is kept.
pub fn extract(args: Vec<OsString>) -> Result<(HarnessFlags, Vec<OsString>), String> {
    let mut flags = HarnessFlags::default();
    let mut rest = Vec::with_capacity(args.len());
    let mut it = args.into_iter();
    if let Some(program) = it.next() {
        rest.push(program);
    }
    while let Some(arg) = it.next() {
        let Some(s) = arg.to_str() else {
            rest.push(arg);
            continue;
        };
        if ninfer_testkit::LIBTEST_WITH_VALUE.contains(&s) {
            rest.push(arg);
            if let Some(v) = it.next() {
                rest.push(v);
            }
            continue;
        }
        if s == "-h" || s == "--help" {
            flags.help = true;
            rest.push(arg);
            continue;
        }
        let (name, inline) = match s.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (s, None),
        };
        if !ninfer_testkit::HARNESS_FLAGS.contains(&name) {
            rest.push(arg);
            continue;
        }
        let name = name.to_string();
        let value = match inline {
            Some(v) => v,
            None => match it.next() {
                Some(v) => v
                    .into_string()
                    .map_err(|_| format!("{name}: the value is not UTF-8"))?,
                None => return Err(format!("{name} needs a value\n\n{HELP}")),
            },
        };
        for v in value.split(',').map(str::trim) {
            if v.is_empty() {
                return Err(format!("{name}: empty value in `{value}`"));
            }
            match name.as_str() {
                "--kv-dtype" => flags
                    .kv
                    .push(KvDtype::parse(v).map_err(|e| format!("--kv-dtype: {e}"))?),
                "--artifact" => flags.artifacts.push(v.to_string()),
                "--device" => {
                    let d = parse_device(v)?;
                    if let (DeviceKind::Cuda, Some((_, n))) = (d, v.split_once(':')) {
                        flags.cuda_index = n.parse().unwrap_or(0);
                    }
                    flags.devices.push(d);
                }
                "--tier" => flags.tiers.push(parse_tier(v)?),
                "--precision" => {
                    flags.precision =
                        Some(Precision::parse(v).map_err(|e| format!("--precision: {e}"))?)
                }
                "--measure-spread" => match v.parse::<usize>() {
                    Ok(n) if (2..=1000).contains(&n) => flags.measure_spread = Some(n),
                    _ => {
                        return Err(format!(
                            "--measure-spread: `{v}` is not a number of runs from 2 to 1000"
                        ))
                    }
                },
                _ => unreachable!(),
            }
        }
    }
    Ok((flags, rest))
}

fn parse_device(v: &str) -> Result<DeviceKind, String> {
    match v {
        "cpu" => Ok(DeviceKind::Cpu),
        "cuda" => Ok(DeviceKind::Cuda),
        "emu" => Ok(DeviceKind::Emu),
        _ => match v.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(_)) => Ok(DeviceKind::Cuda),
            _ => Err(format!(
                "--device: unknown device `{v}` (valid: cpu, cuda, cuda:N, emu)"
            )),
        },
    }
}

fn parse_tier(v: &str) -> Result<Tier, String> {
    Tier::ALL
        .into_iter()
        .find(|t| t.name() == v)
        .ok_or_else(|| {
            let names: Vec<&str> = Tier::ALL.iter().map(|t| t.name()).collect();
            format!("--tier: unknown tier `{v}` (valid: {})", names.join(", "))
        })
}
