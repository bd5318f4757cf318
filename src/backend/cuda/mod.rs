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

    /// The chunked gated delta rule's two forms on the same inputs.
    #[derive(Debug, Clone, Copy)]
    pub struct DeltaRuleTimes {
        /// Median seconds per launch of `delta_rule_chunked` (CUDA cores, f32 mode's).
        pub cuda_cores_s: f64,
        /// Median seconds per launch of `delta_rule_chunked_tc` (tensor cores, bf16 mode's).
        pub tensor_cores_s: f64,
        /// max |o_tc − o_cc| / max |o_cc|: the two forms computed the same thing.
        pub max_rel_diff: f64,
    }

    /// Times both forms of the chunked rule, alternating, `reps` launches each after one
    /// untimed, on `windows` packed windows of `tokens` rows with Hk key heads of Dk and Hv
    /// value heads of Dv (the layer's own input ranges: q, k unit-norm, q scaled by
    /// Dk^-1/2, beta in (0, 1), g in (-0.3, 0]). Each launch is timed alone between
    /// synchronizations.
    #[allow(clippy::too_many_arguments)]
    pub fn delta_rule_times(
        gpu: &Gpu,
        windows: usize,
        tokens: usize,
        hk: usize,
        dk: usize,
        hv: usize,
        dv: usize,
        reps: usize,
    ) -> Result<DeltaRuleTimes> {
        use super::launch::{self, DeltaRuleChunked, Ptr};
        anyhow::ensure!(
            launch::delta_chunked_fits(dk, dv) && launch::delta_chunked_state_in_shared(dk, dv),
            "delta_rule_times: {dk} x {dv} heads need the State in global scratch"
        );
        let (rows, conv_dim) = (windows * tokens, 2 * hk * dk + hv * dv);
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut unit = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32
        };
        let mut c: Vec<f32> = (0..rows * conv_dim).map(|_| 2.0 * unit() - 1.0).collect();
        for row in c.chunks_mut(conv_dim) {
            for (h, x) in row[..2 * hk * dk].chunks_mut(dk).enumerate() {
                let scale = if h < hk {
                    (dk as f32).sqrt().recip()
                } else {
                    1.0
                };
                let norm = x.iter().map(|a| a * a).sum::<f32>().sqrt().max(1e-6);
                x.iter_mut().for_each(|a| *a *= scale / norm);
            }
        }
        let beta: Vec<f32> = (0..rows * hv).map(|_| 0.02 + 0.96 * unit()).collect();
        let g: Vec<f32> = (0..rows * hv).map(|_| -0.3 * unit()).collect();
        let spans: Vec<[i32; 2]> = (0..windows)
            .map(|w| [(w * tokens) as i32, tokens as i32])
            .collect();
        let (cb, bb, gb, sb) = (
            gpu.upload(&c)?,
            gpu.upload(&beta)?,
            gpu.upload(&g)?,
            gpu.upload(&spans)?,
        );
        drop(c);
        let outs = [
            gpu.alloc(4 * rows * hv * dv)?,
            gpu.alloc(4 * rows * hv * dv)?,
        ];
        let entries = ["delta_rule_chunked", "delta_rule_chunked_tc"];
        let mut times = [Vec::with_capacity(reps), Vec::with_capacity(reps)];
        for i in 0..=reps {
            for (k, entry) in entries.iter().enumerate() {
                gpu.sync()?;
                let t = std::time::Instant::now();
                gpu.launch(
                    entry,
                    (windows as u32, hv as u32, 1),
                    launch::DELTA_CHUNKED_THREADS,
                    launch::delta_chunked_smem(dk, dv) as usize,
                    &DeltaRuleChunked {
                        c: Ptr::new(cb.ptr),
                        conv_dim: conv_dim as i32,
                        beta: Ptr::new(bb.ptr),
                        g: Ptr::new(gb.ptr),
                        spans: Ptr::new(sb.ptr),
                        hk: hk as i32,
                        dk: dk as i32,
                        hv: hv as i32,
                        dv: dv as i32,
                        state: Ptr::NULL,
                        o: Ptr::new(outs[k].ptr),
                    },
                )?;
                gpu.sync()?;
                if i > 0 {
                    times[k].push(t.elapsed().as_secs_f64());
                }
            }
        }
        let n = rows * hv * dv;
        let (a, b): (Vec<f32>, Vec<f32>) = (gpu.read(&outs[0], 0, n)?, gpu.read(&outs[1], 0, n)?);
        let (mut d, mut m) = (0f64, 0f64);
        for (x, y) in a.iter().zip(&b) {
            anyhow::ensure!(
                x.is_finite() && y.is_finite(),
                "delta_rule_times: a non-finite output"
            );
            d = d.max((x - y).abs() as f64);
            m = m.max(x.abs() as f64);
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(|x, y| x.total_cmp(y));
            v[v.len() / 2]
        };
        Ok(DeltaRuleTimes {
            cuda_cores_s: median(&mut times[0]),
            tensor_cores_s: median(&mut times[1]),
            max_rel_diff: d / m.max(f64::MIN_POSITIVE),
        })
    }
}
