//! Compute backends. The CPU backend is the numerical reference; every CUDA kernel
//! (under `kernels/`) has its twin here.

pub mod cpu;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// The device a run asks for on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceRequest {
    /// CUDA when built with it and a GPU is present, else the CPU.
    Auto,
    Cpu,
    Cuda(usize),
}

impl DeviceRequest {
    pub fn parse(s: &str) -> Result<DeviceRequest> {
        match s {
            "auto" => Ok(DeviceRequest::Auto),
            "cpu" => Ok(DeviceRequest::Cpu),
            "cuda" => Ok(DeviceRequest::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceRequest::Cuda(n)),
                _ => bail!("unknown device `{s}` (valid: auto, cpu, cuda, cuda:N)"),
            },
        }
    }
}

/// The device a run actually uses.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Device {
    Cpu { threads: usize },
}

impl Device {
    /// Picks the device for a request. The CUDA backend is not part of this build yet, so
    /// `cuda` is an error and `auto` falls back to the CPU with the reason.
    pub fn select(req: DeviceRequest, threads: usize) -> Result<(Device, Option<String>)> {
        match req {
            DeviceRequest::Cpu => Ok((Device::Cpu { threads }, None)),
            DeviceRequest::Auto => Ok((
                Device::Cpu { threads },
                Some("device auto: this build has no CUDA backend, using the CPU".to_string()),
            )),
            DeviceRequest::Cuda(n) => {
                bail!("--device cuda:{n}: this build has no CUDA backend yet; use --device cpu")
            }
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Device::Cpu { threads } => format!("cpu ({threads} threads)"),
        }
    }

    /// A short class name for baselines: results are compared within a class.
    pub fn class(&self) -> &'static str {
        match self {
            Device::Cpu { .. } => "cpu",
        }
    }
}
