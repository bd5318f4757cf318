//! Compute backends behind one contract ([`Scorer`], in `scorer.rs`): the CPU backend,
//! the numerical reference (`cpu/`: kernels, and the forward pass in `cpu/model/`), and the
//! CUDA backend (`cuda/`: device, launches, and the forward pass in `cuda/model/`, file for
//! file the CPU model's twin; every kernel under `kernels/` has its CPU twin in `cpu/`).

pub mod cpu;
pub mod cuda;
mod scorer;

pub use scorer::{
    CudaVersions, Extra, FinishWindow, HeadRows, MemoryReport, PairScore, RowScore, ScoreError,
    Scorer,
};

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// Arithmetic of the forward pass: what the matrix products and attention compute in.
/// The CPU backend computes in f32 only; CUDA defaults to bf16. It changes results, so it
/// is a command-line flag (`--precision`), recorded in reports and part of the class
/// CUDA baselines are kept under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// bf16 weights and GEMM inputs, f32 accumulation; tensor-core attention where the head
    /// dim allows it (64 or 128). The default.
    Bf16,
    /// f32 weights and activations (cuBLAS without TF32), f32 attention: the parity mode.
    F32,
}

impl Precision {
    pub fn parse(s: &str) -> Result<Precision> {
        match s {
            "bf16" => Ok(Precision::Bf16),
            "f32" => Ok(Precision::F32),
            other => bail!("unknown precision `{other}` (valid: bf16, f32)"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::Bf16 => "bf16",
            Precision::F32 => "f32",
        }
    }

    /// Bytes of one GEMM input element (weights and the activations fed to GEMMs).
    pub fn elem_bytes(self) -> usize {
        match self {
            Precision::Bf16 => 2,
            Precision::F32 => 4,
        }
    }
}

/// The device a run asks for on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceRequest {
    /// CUDA when built with it and a GPU is present, else the CPU.
    Auto,
    Cpu,
    Cuda(usize),
    /// The emulated CUDA device (developers and CI: the CUDA model on the host).
    Emu,
}

impl DeviceRequest {
    pub fn parse(s: &str) -> Result<DeviceRequest> {
        match s {
            "auto" => Ok(DeviceRequest::Auto),
            "cpu" => Ok(DeviceRequest::Cpu),
            "cuda" => Ok(DeviceRequest::Cuda(0)),
            "emu" => Ok(DeviceRequest::Emu),
            // A bare index is a GPU, as the seed engine's `--device N` takes it.
            _ if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => match s.parse() {
                Ok(n) => Ok(DeviceRequest::Cuda(n)),
                Err(_) => bail!("device index `{s}` is too large"),
            },
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceRequest::Cuda(n)),
                _ => bail!("unknown device `{s}` (valid: auto, cpu, cuda, cuda:N, N, emu)"),
            },
        }
    }
}

/// The device a run actually uses.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Device {
    Cpu {
        threads: usize,
    },
    Cuda {
        ordinal: usize,
        name: String,
        compute_capability: (i32, i32),
        memory_bytes: u64,
    },
    /// The CUDA model on the emulated device: the kernels compiled for the host.
    Emu {
        memory_bytes: u64,
    },
}

impl Device {
    /// Picks the device for a request. `auto` takes CUDA device 0 when this build has the
    /// CUDA backend and a usable GPU, else the CPU, with the reason as the note; `cuda[:N]`
    /// without a usable device is an error of one line saying what is missing.
    pub fn select(req: DeviceRequest, threads: usize) -> Result<(Device, Option<String>)> {
        Self::select_with(req, threads, cuda::probe)
    }

    /// [`Device::select`] with the CUDA probe given (tests pass their own).
    pub fn select_with(
        req: DeviceRequest,
        threads: usize,
        probe: impl Fn(usize) -> Result<cuda::GpuInfo, String>,
    ) -> Result<(Device, Option<String>)> {
        let cuda_device = |g: cuda::GpuInfo| Device::Cuda {
            ordinal: g.ordinal,
            name: g.name,
            compute_capability: g.compute_capability,
            memory_bytes: g.memory_bytes,
        };
        match req {
            DeviceRequest::Cpu => Ok((Device::Cpu { threads }, None)),
            DeviceRequest::Emu => {
                if !cuda::BUILT {
                    bail!("--device emu: this build has no CUDA backend (the emulated device runs its kernels); use --device cpu");
                }
                let memory_bytes = match std::env::var("NINFER_EMU_MEMORY_MB") {
                    Ok(v) => v.parse::<u64>().map(|m| m << 20).map_err(|_| {
                        anyhow::anyhow!(
                            "NINFER_EMU_MEMORY_MB={v}: expected a positive number of MiB"
                        )
                    })?,
                    Err(_) => cuda::EMU_MEMORY_BYTES,
                };
                Ok((Device::Emu { memory_bytes }, Some("device emu: the CUDA model on the emulated device (slow; a test device, not a measurement of any GPU)".to_string())))
            }
            DeviceRequest::Auto => match probe(0) {
                Ok(g) => {
                    let note = format!("device auto: using CUDA device 0 ({})", g.name);
                    Ok((cuda_device(g), Some(note)))
                }
                Err(why) => Ok((
                    Device::Cpu { threads },
                    Some(format!("device auto: using the CPU: {why}")),
                )),
            },
            DeviceRequest::Cuda(n) => match probe(n) {
                Ok(g) => Ok((cuda_device(g), None)),
                Err(why) => {
                    bail!("--device cuda:{n}: no CUDA backend available ({why}); use --device cpu")
                }
            },
        }
    }

    /// The precision a run uses on this device: `requested`, or the device's default (CPU
    /// f32, CUDA bf16). The CPU computes in f32 only, so asking it for bf16 is an error.
    pub fn precision(&self, requested: Option<Precision>) -> Result<Precision> {
        match (self, requested) {
            (Device::Cpu { .. }, None | Some(Precision::F32)) => Ok(Precision::F32),
            (Device::Cpu { .. }, Some(p)) => bail!(
                "--precision {}: the CPU backend computes in f32 only (use --device cuda, or drop --precision)",
                p.name()
            ),
            (Device::Cuda { .. } | Device::Emu { .. }, p) => Ok(p.unwrap_or(Precision::Bf16)),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Device::Cpu { threads } => format!("cpu ({threads} threads)"),
            Device::Cuda {
                ordinal,
                name,
                compute_capability: (a, b),
                memory_bytes,
            } => {
                format!(
                    "cuda:{ordinal} ({name}, sm_{a}{b}, {:.1} GiB)",
                    *memory_bytes as f64 / (1u64 << 30) as f64
                )
            }
            Device::Emu { memory_bytes } => format!(
                "emu (emulated CUDA device, sm_90 semantics, {:.1} GiB)",
                *memory_bytes as f64 / (1u64 << 30) as f64
            ),
        }
    }

    /// A short class name for baselines: results are compared within a class. CUDA results
    /// depend on the architecture (cuBLAS picks its kernels per chip), so the class names it:
    /// `cuda-sm90`. Tolerances keyed by the family (`cuda`) apply to every CUDA class.
    pub fn class(&self) -> String {
        match self {
            Device::Cpu { .. } => "cpu".to_string(),
            Device::Cuda {
                compute_capability: (a, b),
                ..
            } => format!("cuda-sm{a}{b}"),
            Device::Emu { .. } => "emu".to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h200(n: usize) -> Result<cuda::GpuInfo, String> {
        if n == 0 {
            Ok(cuda::GpuInfo {
                ordinal: 0,
                name: "NVIDIA H200".into(),
                compute_capability: (9, 0),
                memory_bytes: 150_000_000_000,
                multiprocessors: 132,
                max_dynamic_smem: 227 << 10,
            })
        } else {
            Err(format!("CUDA device {n} does not exist (1 present: 0..0)"))
        }
    }

    fn none(_: usize) -> Result<cuda::GpuInfo, String> {
        Err("no CUDA driver: libcuda.so could not be loaded".into())
    }

    #[test]
    fn auto_falls_back_to_the_cpu_and_says_why() {
        let (d, note) = Device::select_with(DeviceRequest::Auto, 4, none).unwrap();
        assert_eq!(d, Device::Cpu { threads: 4 });
        let note = note.unwrap();
        assert!(
            note.contains("using the CPU") && note.contains("libcuda.so"),
            "{note}"
        );
        assert!(!note.contains('\n'));
    }

    #[test]
    fn auto_takes_a_present_gpu() {
        let (d, note) = Device::select_with(DeviceRequest::Auto, 4, h200).unwrap();
        assert_eq!(d.class(), "cuda-sm90");
        assert_eq!(d.describe(), "cuda:0 (NVIDIA H200, sm_90, 139.7 GiB)");
        assert!(note.unwrap().contains("NVIDIA H200"));
    }

    #[test]
    fn cuda_without_a_device_is_a_one_line_error() {
        let e = Device::select_with(DeviceRequest::Cuda(0), 4, none)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "--device cuda:0: no CUDA backend available (no CUDA driver: libcuda.so could not be loaded); use --device cpu"
        );
        assert!(!e.contains('\n'));
        let e = Device::select_with(DeviceRequest::Cuda(3), 4, h200)
            .unwrap_err()
            .to_string();
        assert!(e.contains("CUDA device 3 does not exist"), "{e}");
        let (d, note) = Device::select_with(DeviceRequest::Cuda(0), 4, h200).unwrap();
        assert!(matches!(d, Device::Cuda { ordinal: 0, .. }) && note.is_none());
    }

    #[test]
    fn cpu_never_probes() {
        let (d, note) = Device::select_with(DeviceRequest::Cpu, 2, |_| panic!("probed")).unwrap();
        assert_eq!(d, Device::Cpu { threads: 2 });
        assert!(note.is_none());
    }
}
