//! The device interface under the CUDA model: allocate, copy, launch a typed kernel, run a
//! GEMM, synchronize. Two implementations: the real GPU ([`super::real`]: the CUDA driver,
//! NVRTC and cuBLAS through cudarc) and the emulated device ([`super::emu::device`]: the
//! same kernels compiled for the host, a reference GEMM with cuBLAS's semantics). The model,
//! its weights, memory planning and head are written once over [`Gpu`], so everything but
//! the kernels' machine code and cuBLAS runs, and is tested, without a GPU.

use super::kernels::Program;
use super::launch::{Arg, Launch};
use super::GpuInfo;
use anyhow::{bail, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

pub use super::Target;

/// The element type of a GEMM's inputs (the output is f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmInput {
    Bf16,
    F32,
}

/// One cuBLAS `gemmEx` call, in cuBLAS's own column-major terms:
/// `C[m, n] = alpha · op(A)[m, k] · op(B)[k, n] + beta · C`, every matrix column-major with
/// its leading dimension; `op(X)` is `Xᵀ` when the flag is set. A is `[m, k]` (or `[k, m]`
/// when transposed) with `lda >= rows`, likewise B; C is f32 with `ldc >= m`. Compute in f32.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ColGemm {
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
    pub a: u64,
    pub lda: usize,
    pub b: u64,
    pub ldb: usize,
    pub beta: f32,
    pub c: u64,
    pub ldc: usize,
    pub input: GemmInput,
}

/// What a device implementation provides. Addresses are device addresses (`u64`); the
/// typed layer above ([`Gpu`]) checks sizes and keeps the memory counters.
pub trait Backend: Send + Sync {
    fn info(&self) -> &GpuInfo;
    /// `sm_XY`: the architecture kernels are built for.
    fn arch(&self) -> &str;
    /// `bytes` (> 0) of uninitialized device memory.
    fn alloc(&self, bytes: usize) -> Result<u64>;
    /// Frees an allocation of `alloc` (after all queued work that uses it).
    fn free(&self, ptr: u64, bytes: usize);
    fn copy_to_device(&self, dst: u64, src: &[u8]) -> Result<()>;
    /// Waits for queued work, then copies.
    fn copy_to_host(&self, dst: &mut [u8], src: u64) -> Result<()>;
    fn memset(&self, dst: u64, bytes: usize, value: u8) -> Result<()>;
    /// Waits for all queued work and reports any asynchronous fault.
    fn sync(&self) -> Result<()>;
    /// (free, total) device memory in bytes.
    fn mem_info(&self) -> Result<(usize, usize)>;
    /// Builds the programs' kernels ahead of their first launch.
    fn prepare(&self, programs: &[Program]) -> Result<()>;
    /// Launches `entry` with its arguments in parameter order (from a typed launcher).
    fn launch(
        &self,
        entry: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: usize,
        args: &[Arg],
    ) -> Result<()>;
    fn gemm(&self, g: &ColGemm) -> Result<()>;
}

/// Memory accounting of one device, in bytes.
#[derive(Debug, Default)]
pub struct MemStats {
    pub current: AtomicUsize,
    pub peak: AtomicUsize,
}

/// A device allocation, freed on drop.
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
    dev: Arc<dyn Backend>,
    stats: Arc<MemStats>,
}

impl DevBuf {
    /// The address `offset` bytes in.
    pub fn at(&self, offset: usize) -> u64 {
        debug_assert!(offset <= self.bytes);
        self.ptr + offset as u64
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        self.dev.free(self.ptr, self.bytes);
        self.stats.current.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// An open device: the implementation, its description and memory counters.
pub struct Gpu {
    pub info: GpuInfo,
    pub arch: String,
    pub stats: Arc<MemStats>,
    pub target: Target,
    dev: Arc<dyn Backend>,
}

impl Gpu {
    /// Opens a device. For CUDA the caller has checked that the libraries are present.
    pub fn open_target(t: Target) -> Result<Gpu> {
        let dev: Arc<dyn Backend> = match t {
            Target::Cuda(n) => Arc::new(super::real::RealGpu::open(n)?),
            Target::Emulated => Arc::new(super::emu::device::EmuGpu::open()?),
        };
        Ok(Gpu {
            info: dev.info().clone(),
            arch: dev.arch().to_string(),
            stats: Arc::new(MemStats::default()),
            target: t,
            dev,
        })
    }

    /// Opens CUDA device `ordinal`.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        Gpu::open_target(Target::Cuda(ordinal))
    }

    /// Opens the emulated device.
    pub fn emulated() -> Result<Gpu> {
        Gpu::open_target(Target::Emulated)
    }

    /// Uninitialized device memory (`bytes` may be 0: a null buffer).
    pub fn alloc(&self, bytes: usize) -> Result<DevBuf> {
        let ptr = if bytes == 0 {
            0
        } else {
            use anyhow::Context;
            self.dev
                .alloc(bytes)
                .with_context(|| format!("{} MiB on {}", bytes >> 20, self.info.name))?
        };
        let cur = self.stats.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.stats.peak.fetch_max(cur, Ordering::Relaxed);
        Ok(DevBuf {
            ptr,
            bytes,
            dev: self.dev.clone(),
            stats: self.stats.clone(),
        })
    }

    pub fn upload<T: bytemuck::Pod>(&self, data: &[T]) -> Result<DevBuf> {
        let b = self.alloc(std::mem::size_of_val(data))?;
        self.write(&b, 0, data)?;
        Ok(b)
    }

    /// Copies `data` to `dst` at byte `offset` (synchronous for the host).
    pub fn write<T: bytemuck::Pod>(&self, dst: &DevBuf, offset: usize, data: &[T]) -> Result<()> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if bytes.is_empty() {
            return Ok(());
        }
        if offset + bytes.len() > dst.bytes {
            bail!(
                "device write of {} bytes at {offset} overruns a {}-byte buffer",
                bytes.len(),
                dst.bytes
            );
        }
        self.dev.copy_to_device(dst.at(offset), bytes)
    }

    /// Reads `n` values of `T` from `src` at byte `offset`, after all queued work.
    pub fn read<T: bytemuck::Pod>(&self, src: &DevBuf, offset: usize, n: usize) -> Result<Vec<T>> {
        let bytes = n * std::mem::size_of::<T>();
        if offset + bytes > src.bytes {
            bail!(
                "device read of {bytes} bytes at {offset} overruns a {}-byte buffer",
                src.bytes
            );
        }
        let mut out = vec![T::zeroed(); n];
        if n == 0 {
            return Ok(out);
        }
        self.dev
            .copy_to_host(bytemuck::cast_slice_mut(&mut out), src.at(offset))?;
        Ok(out)
    }

    /// Sets `bytes` bytes at `offset` to `value`.
    pub fn memset(&self, dst: &DevBuf, offset: usize, bytes: usize, value: u8) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        if offset + bytes > dst.bytes {
            bail!("device memset overruns its buffer");
        }
        self.dev.memset(dst.at(offset), bytes, value)
    }

    pub fn sync(&self) -> Result<()> {
        self.dev.sync()
    }

    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.dev.mem_info()
    }

    pub fn prepare(&self, programs: &[Program]) -> Result<()> {
        self.dev.prepare(programs)
    }

    /// Launches `entry`, a kernel whose signature is `L`'s.
    pub fn launch<L: Launch>(
        &self,
        entry: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: usize,
        args: &L,
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        self.dev.launch(entry, grid, block, smem, &args.args())
    }

    pub fn gemm(&self, g: &ColGemm) -> Result<()> {
        self.dev.gemm(g)
    }
}

/// Packs arguments as `cuLaunchKernel` takes them: each in its own 32-byte, 8-aligned slot
/// (the kernel reads its parameter's size at the slot's address, little endian), and one
/// pointer per slot. The slots must outlive the pointers' use.
pub fn pack_args(args: &[Arg]) -> Vec<[u64; 4]> {
    args.iter()
        .map(|a| {
            let mut s = [0u64; 4];
            match *a {
                Arg::Ptr(p) => s[0] = p,
                Arg::I32(v) => s[0] = v as u32 as u64,
                Arg::I64(v) => s[0] = v as u64,
                Arg::F32(v) => s[0] = v.to_bits() as u64,
                Arg::F64(v) => s[0] = v.to_bits(),
                // `{void*, u16*, u8*, float}`: the float at byte 24, low half of s[3].
                Arg::Kv(t) => s.copy_from_slice(&t),
            }
            s
        })
        .collect()
}
