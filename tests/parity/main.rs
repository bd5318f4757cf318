//! The CUDA path against its CPU twins: the one place to add a device check.
//!
//! * `kernels`: every kernel on the emulated device against its Rust twin (bit for bit
//!   where the kernel promises it), planted kernel faults, AddressSanitizer.
//! * `kv`: the Main KV codecs store the CPU specification's bits.
//! * `model`: the whole CUDA model against the CPU engine, per KV format and precision.
//! * `nvrtc`: every kernel compiles with NVRTC to sm_90 (no GPU needed).
//!
//! A check that should hold on any device is written once with [`device_case!`], which
//! makes `<case>::emu` (the kernels compiled for the host: runs wherever g++ is) and
//! `<case>::cuda` (a real GPU: reported ignored, with the reason, where there is none).
//! `ci/gpu-check.sh` runs the `::cuda` ones on a GPU machine.

#![cfg(feature = "cuda")]

#[macro_use]
extern crate ninfer_testkit;

#[path = "../common/mod.rs"]
mod common;

use ninfer_perplexity::backend::cuda::device::Gpu;
use ninfer_perplexity::backend::cuda::Target;
use ninfer_perplexity::backend::DeviceRequest;

/// A device a parity case runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dev {
    /// The emulated device: the CUDA sources compiled for the host with g++.
    Emu,
    /// CUDA device 0.
    Cuda,
}

impl Dev {
    pub fn target(self) -> Target {
        match self {
            Dev::Emu => Target::Emulated,
            Dev::Cuda => Target::Cuda(0),
        }
    }

    pub fn request(self) -> DeviceRequest {
        match self {
            Dev::Emu => DeviceRequest::Emu,
            Dev::Cuda => DeviceRequest::Cuda(0),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dev::Emu => "emu",
            Dev::Cuda => "cuda",
        }
    }

    pub fn gpu(self) -> Gpu {
        Gpu::open_target(self.target()).expect("open the device")
    }
}

/// One check on every device: `device_case!(name, |dev| body)` defines the module `name`
/// with the tests `emu` (needs g++) and `cuda` (needs a GPU), each running `body` with
/// `dev` set. Outer attributes (doc comments) go on the module.
macro_rules! device_case {
    ($(#[$meta:meta])* $name:ident, |$dev:ident| $body:expr) => {
        $(#[$meta])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            fn case($dev: $crate::Dev) {
                $body;
            }
            #[test(gxx)]
            fn emu() {
                case($crate::Dev::Emu)
            }
            #[test(gpu)]
            fn cuda() {
                case($crate::Dev::Cuda)
            }
        }
    };
}

mod kernels;
mod kv;
mod model;
mod nvrtc;

/// A CUDA GPU this process can use.
fn gpu_probe() -> Result<(), String> {
    ninfer_perplexity::backend::cuda::probe(0).map(|_| ())
}

fn main() -> std::process::ExitCode {
    ninfer_testkit::main(ninfer_testkit::Probes {
        root: common::repo(),
        gpu: gpu_probe,
        nvrtc: nvrtc::probe,
    })
}
