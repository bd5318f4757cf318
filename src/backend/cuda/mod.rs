//! The CUDA backend: the same forward pass and scoring head as the CPU reference, run on
//! an NVIDIA GPU over batches of windows.
//!
//! Built by default (cargo feature `cuda`) through cudarc with dynamic loading: nothing
//! from CUDA is needed to build, and the driver, NVRTC and cuBLAS are opened at run time
//! only after [`loader::missing_library`] has confirmed they exist (cudarc panics on a
//! missing library). Kernels (`kernels/*.cu`) are compiled by NVRTC for the device's
//! architecture at first use and cached per process; matrix products go through cuBLAS.
//! See `docs/cuda.md`.
//!
//! Always compiled, so their tests run on every machine: [`plan`] (batching, tiles, memory
//! planning), [`kernels`] (the embedded sources) and [`launch`] (typed kernel arguments,
//! checked against the sources). The forward pass is [`model`], the CPU model's twin.

pub mod kernels;
pub mod launch;
pub mod plan;

#[cfg(feature = "cuda")]
pub mod codec;
#[cfg(feature = "cuda")]
pub mod device;
#[cfg(feature = "cuda")]
pub mod emu;
#[cfg(feature = "cuda")]
pub mod gemm;
#[cfg(feature = "cuda")]
pub mod loader;
#[cfg(feature = "cuda")]
pub mod model;
#[cfg(feature = "cuda")]
pub mod nvrtc;
#[cfg(feature = "cuda")]
pub mod real;

#[cfg(feature = "cuda")]
pub use model::CudaModel;

use serde::{Deserialize, Serialize};

/// What a probe learns about a device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub memory_bytes: u64,
    pub multiprocessors: u32,
    /// The most dynamic shared memory one block may opt in to (bytes): 227 KiB on sm_90,
    /// 163 KiB on sm_80, 99 KiB on sm_86/89. The load refuses shapes that need more.
    pub max_dynamic_smem: usize,
}

/// Which device the CUDA model opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// CUDA device N.
    Cuda(usize),
    /// The emulated device (a developer and CI device; see `docs/cuda.md`).
    Emulated,
}

/// Memory the emulated device reports unless `NINFER_EMU_MEMORY_MB` says otherwise.
pub const EMU_MEMORY_BYTES: u64 = 8 << 30;

/// Whether this build contains the CUDA backend.
pub const BUILT: bool = cfg!(feature = "cuda");

/// Looks for device `ordinal` without creating a context: the libraries, the driver, the
/// device count, the device's name, architecture and memory. The error is one line that
/// says what is missing. Never panics, also without a driver.
#[cfg(feature = "cuda")]
pub fn probe(ordinal: usize) -> Result<GpuInfo, String> {
    use cudarc::driver::{result, sys};
    if let Some(m) = loader::missing_library() {
        return Err(m);
    }
    result::init().map_err(|e| format!("the CUDA driver did not initialize ({e})"))?;
    let count =
        result::device::get_count().map_err(|e| format!("cannot count CUDA devices ({e})"))?;
    if count <= 0 {
        return Err("the CUDA driver reports no device".to_string());
    }
    if ordinal >= count as usize {
        return Err(format!(
            "CUDA device {ordinal} does not exist ({count} present: 0..{})",
            count - 1
        ));
    }
    let dev =
        result::device::get(ordinal as i32).map_err(|e| format!("CUDA device {ordinal}: {e}"))?;
    let attr = |a: sys::CUdevice_attribute| -> Result<i32, String> {
        // SAFETY: a valid device handle.
        unsafe { result::device::get_attribute(dev, a) }
            .map_err(|e| format!("CUDA device {ordinal}: {e}"))
    };
    use sys::CUdevice_attribute::*;
    let major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let sms = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    let smem = attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
    let name = result::device::get_name(dev).map_err(|e| format!("CUDA device {ordinal}: {e}"))?;
    // SAFETY: a valid device handle.
    let mem = unsafe { result::device::total_mem(dev) }
        .map_err(|e| format!("CUDA device {ordinal}: {e}"))?;
    if major < 8 {
        return Err(format!(
            "CUDA device {ordinal} ({name}) is sm_{major}{minor}; the kernels need sm_80 or newer (bf16 tensor cores)"
        ));
    }
    Ok(GpuInfo {
        ordinal,
        name,
        compute_capability: (major, minor),
        memory_bytes: mem as u64,
        multiprocessors: sms.max(0) as u32,
        max_dynamic_smem: smem.max(0) as usize,
    })
}

#[cfg(not(feature = "cuda"))]
pub fn probe(_ordinal: usize) -> Result<GpuInfo, String> {
    Err("built without the `cuda` feature".to_string())
}

/// The CUDA model of artifact `a` on device `target`, behind the backends' contract.
#[cfg(feature = "cuda")]
pub fn load_scorer(
    a: &crate::artifact::Artifact,
    target: Target,
    precision: crate::backend::Precision,
    progress: &mut dyn FnMut(usize, usize),
) -> anyhow::Result<Box<dyn crate::backend::Scorer>> {
    Ok(Box::new(CudaModel::load(a, target, precision, progress)?))
}

/// Without the backend there is no CUDA model (`Device::select` refuses CUDA first).
#[cfg(not(feature = "cuda"))]
pub fn load_scorer(
    _: &crate::artifact::Artifact,
    _: Target,
    _: crate::backend::Precision,
    _: &mut dyn FnMut(usize, usize),
) -> anyhow::Result<Box<dyn crate::backend::Scorer>> {
    anyhow::bail!("this build has no CUDA backend")
}

#[cfg(feature = "cuda")]
pub mod bench {
    //! Device-side measurements for the benchmark: the bf16 matrix-product rate through
    //! the same cuBLAS path the model uses, the ceiling its throughput is compared with.

    use super::device::Gpu;
    use super::gemm::{Blas, Mat};
    use super::plan::Precision;
    use anyhow::Result;

    /// Median TFLOP/s of `reps` bf16 products `[n, n] x [n, n]ᵀ` (f32 output) on random data,
    /// after `warmup` untimed ones. Each product is timed alone between synchronizations.
    pub fn gemm_rate(gpu: &Gpu, n: usize, warmup: usize, reps: usize) -> Result<f64> {
        let blas = Blas::new(gpu, Precision::Bf16)?;
        let mut seed = 0x1234_5678_9abc_def0u64;
        let mut rnd = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            half::bf16::from_f32(((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0).to_bits()
        };
        let a: Vec<u16> = (0..n * n).map(|_| rnd()).collect();
        let b: Vec<u16> = (0..n * n).map(|_| rnd()).collect();
        let (da, db) = (gpu.upload(&a)?, gpu.upload(&b)?);
        let dc = gpu.alloc(4 * n * n)?;
        let mut times = Vec::with_capacity(reps);
        for i in 0..warmup + reps {
            gpu.sync()?;
            let t = std::time::Instant::now();
            blas.gemm(
                gpu,
                n,
                n,
                n,
                Mat::of(&da, 0, n),
                Mat::of(&db, 0, n),
                Mat::of(&dc, 0, n),
                false,
            )?;
            gpu.sync()?;
            if i >= warmup {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        times.sort_by(|x, y| x.total_cmp(y));
        let median = times[times.len() / 2];
        Ok(2.0 * (n as f64).powi(3) / median / 1e12)
    }
}
