//! The emulated device behind the device interface: "device memory" is host memory (each
//! allocation exactly its size, filled with 0xFF bytes, NaN as f32 or bf16, so a read of
//! memory never written shows), launches run the host-compiled kernels synchronously, and
//! GEMMs run [`super::gemm`]. Every copy and GEMM operand is checked to lie inside one live
//! allocation, so a wrong size or offset is an error naming the operation, not a crash.

use super::gemm;
use super::Library;
use crate::backend::cuda::device::{pack_args, Backend, ColGemm, GemmInput};
use crate::backend::cuda::kernels::Program;
use crate::backend::cuda::launch::Arg;
use crate::backend::cuda::GpuInfo;
use anyhow::{anyhow, bail, Result};
use std::alloc::Layout;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::Mutex;

const ALIGN: usize = 256; // cudaMalloc's alignment

pub struct EmuGpu {
    info: GpuInfo,
    lib: &'static Library,
    live: Mutex<Live>,
}

/// Live allocations (address -> bytes) and their total.
#[derive(Default)]
struct Live {
    map: BTreeMap<u64, usize>,
    bytes: usize,
}

impl EmuGpu {
    pub fn open() -> Result<EmuGpu> {
        let lib = Library::shared()?;
        let total = match std::env::var("NINFER_EMU_MEMORY_MB") {
            Ok(v) => v
                .parse::<usize>()
                .ok()
                .filter(|&m| m > 0)
                .map(|m| m << 20)
                .ok_or_else(|| {
                    anyhow!("NINFER_EMU_MEMORY_MB={v}: expected a positive number of MiB")
                })?,
            Err(_) => crate::backend::cuda::EMU_MEMORY_BYTES as usize,
        };
        Ok(EmuGpu {
            info: GpuInfo {
                ordinal: 0,
                name: "emulated CUDA device".to_string(),
                compute_capability: (9, 0),
                memory_bytes: total as u64,
                multiprocessors: 1,
                // sm_90's opt-in limit, what the kernels are planned for.
                max_dynamic_smem: crate::backend::cuda::plan::MAX_DYNAMIC_SMEM,
            },
            lib,
            live: Mutex::new(Live::default()),
        })
    }

    /// Checks that `[addr, addr + bytes)` lies in one live allocation.
    fn check_range(&self, addr: u64, bytes: usize, what: &str) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let live = self.live.lock().unwrap();
        match live.map.range(..=addr).next_back() {
            Some((&base, &len)) if addr + bytes as u64 <= base + len as u64 => Ok(()),
            _ => bail!(
                "emulated device: {what} of {bytes} bytes at {addr:#x} is outside every allocation"
            ),
        }
    }

    fn used(&self) -> usize {
        self.live.lock().unwrap().bytes
    }
}

impl Backend for EmuGpu {
    fn info(&self) -> &GpuInfo {
        &self.info
    }

    fn arch(&self) -> &str {
        "sm_90"
    }

    fn alloc(&self, bytes: usize) -> Result<u64> {
        if self.used() + bytes > self.info.memory_bytes as usize {
            bail!(
                "emulated device out of memory: {bytes} bytes requested, {} of {} in use",
                self.used(),
                self.info.memory_bytes
            );
        }
        let layout =
            Layout::from_size_align(bytes, ALIGN).map_err(|e| anyhow!("allocation: {e}"))?;
        // SAFETY: a non-zero size (the caller never asks for 0).
        let p = unsafe { std::alloc::alloc(layout) };
        if p.is_null() {
            bail!("emulated device: host allocation of {bytes} bytes failed");
        }
        // SAFETY: `p` holds `bytes` bytes.
        unsafe { std::ptr::write_bytes(p, 0xFF, bytes) };
        let mut live = self.live.lock().unwrap();
        live.map.insert(p as u64, bytes);
        live.bytes += bytes;
        Ok(p as u64)
    }

    fn free(&self, ptr: u64, bytes: usize) {
        let removed = {
            let mut live = self.live.lock().unwrap();
            let r = live.map.remove(&ptr);
            if r.is_some() {
                live.bytes -= bytes;
            }
            r
        };
        if removed.is_some() {
            let layout = Layout::from_size_align(bytes, ALIGN).expect("allocated with it");
            // SAFETY: allocated in `alloc` with this layout, freed once (removed above).
            unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
        }
    }

    fn copy_to_device(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.check_range(dst, src.len(), "copy to device")?;
        // SAFETY: the destination range lies in a live allocation (checked).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    fn copy_to_host(&self, dst: &mut [u8], src: u64) -> Result<()> {
        self.check_range(src, dst.len(), "copy to host")?;
        // SAFETY: the source range lies in a live allocation (checked).
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn memset(&self, dst: u64, bytes: usize, value: u8) -> Result<()> {
        self.check_range(dst, bytes, "memset")?;
        // SAFETY: the range lies in a live allocation (checked).
        unsafe { std::ptr::write_bytes(dst as *mut u8, value, bytes) };
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        Ok(()) // every launch and copy completes before it returns
    }

    fn mem_info(&self) -> Result<(usize, usize)> {
        let total = self.info.memory_bytes as usize;
        Ok((total.saturating_sub(self.used()), total))
    }

    fn prepare(&self, _programs: &[Program]) -> Result<()> {
        Ok(()) // one library holds every program, built when the device opened
    }

    fn launch(
        &self,
        entry: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: usize,
        args: &[Arg],
    ) -> Result<()> {
        let mut slots = pack_args(args);
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s.as_mut_ptr() as *mut c_void)
            .collect();
        // SAFETY: the arguments come from the kernel's typed launcher (checked against the
        // kernel's declaration) and point into this device's allocations, as on a GPU.
        unsafe { self.lib.launch(entry, grid, block, smem, &mut params) }
    }

    fn gemm(&self, g: &ColGemm) -> Result<()> {
        let [ea, eb, ec] = gemm::check(g)?;
        let esz = match g.input {
            GemmInput::Bf16 => 2,
            GemmInput::F32 => 4,
        };
        let (ba, bb, bc) = (ea * esz, eb * esz, ec * 4);
        self.check_range(g.a, ba, "GEMM operand A")?;
        self.check_range(g.b, bb, "GEMM operand B")?;
        self.check_range(g.c, bc, "GEMM output C")?;
        let overlaps = |p: u64, n: usize| p < g.c + bc as u64 && g.c < p + n as u64;
        if (ba > 0 && overlaps(g.a, ba)) || (bb > 0 && overlaps(g.b, bb)) {
            bail!("emulated device: a GEMM's output overlaps an input");
        }
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        let bytes = |p: u64, n: usize| -> &[u8] {
            if n == 0 {
                &[]
            } else {
                // SAFETY: the range lies in a live allocation (checked above).
                unsafe { std::slice::from_raw_parts(p as *const u8, n) }
            }
        };
        let (a, b) = (bytes(g.a, ba), bytes(g.b, bb));
        // SAFETY: a non-empty range in a live allocation (checked), 4-aligned (allocations
        // are 256-aligned, offsets whole f32s), overlapping neither input.
        let c = unsafe { std::slice::from_raw_parts_mut(g.c as *mut f32, ec) };
        gemm::run(g, a, b, c)
    }
}

impl Drop for EmuGpu {
    fn drop(&mut self) {
        // Buffers outliving the device keep it alive (they hold an Arc), so nothing is left.
        debug_assert!(self.live.lock().unwrap().map.is_empty() || std::thread::panicking());
    }
}
