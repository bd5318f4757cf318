//! A thin layer over the CUDA driver: one device context, device buffers, kernel modules
//! compiled on first use, and kernel launches. All work goes to the legacy default stream,
//! so copies, kernels and cuBLAS calls run in issue order.

use super::kernels::Program;
use super::launch::{Arg, Launch};
use super::nvrtc;
use super::GpuInfo;
use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{result, sys, CudaContext};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The stream every call uses: the legacy default stream.
pub const STREAM: sys::CUstream = std::ptr::null_mut();

fn drv<T>(r: Result<T, result::DriverError>, what: &str) -> Result<T> {
    r.map_err(|e| anyhow!("CUDA {what}: {e}"))
}

type Slot = Arc<Mutex<Option<Arc<Vec<u8>>>>>;
type CubinCache = Mutex<HashMap<(String, Program), Slot>>;

/// Compiled CUBINs, per (architecture, program), shared by every context of the process.
fn cubin_cache() -> &'static CubinCache {
    static C: OnceLock<CubinCache> = OnceLock::new();
    C.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The CUBIN of a program for an architecture, compiled at the first request (or read
/// from `NINFER_CUDA_CACHE_DIR`). Each program has its own lock: concurrent first requests
/// for one program compile it once, different programs compile in parallel.
pub fn cubin(p: Program, arch: &str) -> Result<Arc<Vec<u8>>> {
    let slot: Slot = cubin_cache()
        .lock()
        .unwrap()
        .entry((arch.to_string(), p))
        .or_default()
        .clone();
    let mut slot = slot.lock().unwrap();
    if let Some(c) = slot.as_ref() {
        return Ok(c.clone());
    }
    let c = match nvrtc::load_cached(&p, arch) {
        Some(bin) => bin,
        None => {
            let t = std::time::Instant::now();
            let c = nvrtc::compile(&p, arch, false).map_err(|e| anyhow!(e))?;
            crate::ui::debug(format!(
                "NVRTC compiled kernels/{} for {arch} in {:.2}s",
                p.key(),
                t.elapsed().as_secs_f64()
            ));
            nvrtc::store_cached(&p, arch, &c.cubin);
            c.cubin
        }
    };
    let c = Arc::new(c);
    *slot = Some(c.clone());
    Ok(c)
}

/// Compiles several programs at once, one thread each (first use of a KV representation
/// needs two large ones).
pub fn precompile(programs: &[Program], arch: &str) -> Result<()> {
    std::thread::scope(|s| {
        let handles: Vec<_> = programs
            .iter()
            .map(|&p| s.spawn(move || cubin(p, arch).map(|_| ())))
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join()
                .unwrap_or_else(|_| Err(anyhow!("NVRTC compile thread panicked")))
        })
    })
}

/// Memory accounting of one device, in bytes.
#[derive(Debug, Default)]
pub struct MemStats {
    pub current: AtomicUsize,
    pub peak: AtomicUsize,
}

/// A device allocation, freed on drop.
pub struct DevBuf {
    pub ptr: sys::CUdeviceptr,
    pub bytes: usize,
    ctx: Arc<CudaContext>,
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
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by cuMemAlloc in `Gpu::alloc`, freed once; the default stream
        // serializes the free after every queued use.
        let _ = unsafe { result::free_sync(self.ptr) };
        self.stats.current.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// An open device: its context, loaded modules and memory counters.
pub struct Gpu {
    pub info: GpuInfo,
    pub arch: String,
    modules: Mutex<HashMap<Program, ModuleHandle>>,
    functions: Mutex<HashMap<String, FunctionHandle>>,
    pub stats: Arc<MemStats>,
    /// Synchronize and check after every launch (NINFER_CUDA_SYNC=1): slow, localizes faults.
    pub sync_each: bool,
    ctx: Arc<CudaContext>,
}

struct ModuleHandle(sys::CUmodule);
// SAFETY: module handles are plain driver handles, usable from any thread bound to the context.
unsafe impl Send for ModuleHandle {}

#[derive(Clone, Copy)]
pub struct FunctionHandle(sys::CUfunction);
// SAFETY: as above.
unsafe impl Send for FunctionHandle {}
unsafe impl Sync for FunctionHandle {}

impl Drop for Gpu {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        for (_, m) in self.modules.lock().unwrap().drain() {
            // SAFETY: loaded by this Gpu, unloaded once, after all work finished below.
            let _ = result::ctx::synchronize();
            let _ = unsafe { result::module::unload(m.0) };
        }
    }
}

impl Gpu {
    /// Opens device `ordinal`. The caller has checked that the libraries are present.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        let info = super::probe(ordinal).map_err(|e| anyhow!(e))?;
        let ctx = drv(CudaContext::new(ordinal), "context creation")?;
        let arch = format!(
            "sm_{}{}",
            info.compute_capability.0, info.compute_capability.1
        );
        Ok(Gpu {
            info,
            arch,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            stats: Arc::new(MemStats::default()),
            sync_each: std::env::var("NINFER_CUDA_SYNC").is_ok_and(|v| v == "1"),
            ctx,
        })
    }

    /// Makes the context current on the calling thread (every public entry does this).
    pub fn bind(&self) -> Result<()> {
        drv(self.ctx.bind_to_thread(), "bind context")
    }

    /// A kernel entry point; its module is compiled and loaded at the first request.
    pub fn function(&self, entry: &str) -> Result<FunctionHandle> {
        if let Some(f) = self.functions.lock().unwrap().get(entry) {
            return Ok(*f);
        }
        let p =
            Program::of(entry).with_context(|| format!("no kernel program defines `{entry}`"))?;
        let module = {
            let mut mods = self.modules.lock().unwrap();
            match mods.get(&p) {
                Some(h) => h.0,
                None => {
                    let bin = cubin(p, &self.arch)?;
                    self.bind()?;
                    // SAFETY: a CUBIN image produced by NVRTC for this device's architecture.
                    let h = drv(
                        unsafe { result::module::load_data(bin.as_ptr() as *const c_void) },
                        "module load",
                    )?;
                    mods.insert(p, ModuleHandle(h));
                    h
                }
            }
        };
        let name = CString::new(entry).expect("entry names are plain");
        // SAFETY: a loaded module.
        let f = drv(
            unsafe { result::module::get_function(module, name) },
            "get function",
        )
        .with_context(|| format!("kernel `{entry}`"))?;
        let f = FunctionHandle(f);
        self.functions.lock().unwrap().insert(entry.to_string(), f);
        Ok(f)
    }

    /// Allows a kernel more than 48 KiB of dynamic shared memory.
    pub fn set_max_dynamic_smem(&self, f: FunctionHandle, bytes: usize) -> Result<()> {
        // SAFETY: a valid function handle.
        drv(
            unsafe {
                result::function::set_function_attribute(
                    f.0,
                    sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
            },
            "set shared memory limit",
        )
    }

    /// Uninitialized device memory (`bytes` may be 0: a null buffer).
    pub fn alloc(&self, bytes: usize) -> Result<DevBuf> {
        let ptr = if bytes == 0 {
            0
        } else {
            self.bind()?;
            // SAFETY: plain allocation; the contents are written before they are read.
            drv(unsafe { result::malloc_sync(bytes) }, "allocation")
                .with_context(|| format!("{} MiB on {}", bytes >> 20, self.info.name))?
        };
        let cur = self.stats.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.stats.peak.fetch_max(cur, Ordering::Relaxed);
        Ok(DevBuf {
            ptr,
            bytes,
            ctx: self.ctx.clone(),
            stats: self.stats.clone(),
        })
    }

    pub fn upload<T: Copy>(&self, data: &[T]) -> Result<DevBuf> {
        let b = self.alloc(std::mem::size_of_val(data))?;
        self.write(&b, 0, data)?;
        Ok(b)
    }

    /// Copies `data` to `dst` at byte `offset` (synchronous for the host).
    pub fn write<T: Copy>(&self, dst: &DevBuf, offset: usize, data: &[T]) -> Result<()> {
        let n = std::mem::size_of_val(data);
        if n == 0 {
            return Ok(());
        }
        if offset + n > dst.bytes {
            bail!(
                "device write of {n} bytes at {offset} overruns a {}-byte buffer",
                dst.bytes
            );
        }
        self.bind()?;
        // SAFETY: bounds checked above; the host slice outlives the synchronous copy.
        drv(
            unsafe { result::memcpy_htod_sync(dst.at(offset), data) },
            "copy to device",
        )
    }

    /// Reads `n` values of `T` from `src` at byte `offset`, after all queued work.
    pub fn read<T: Copy + Default>(&self, src: &DevBuf, offset: usize, n: usize) -> Result<Vec<T>> {
        let bytes = n * std::mem::size_of::<T>();
        if offset + bytes > src.bytes {
            bail!(
                "device read of {bytes} bytes at {offset} overruns a {}-byte buffer",
                src.bytes
            );
        }
        let mut out = vec![T::default(); n];
        if n == 0 {
            return Ok(out);
        }
        self.sync()?;
        // SAFETY: bounds checked; `out` holds `n` values.
        drv(
            unsafe { result::memcpy_dtoh_sync(&mut out, src.at(offset)) },
            "copy to host",
        )?;
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
        self.bind()?;
        // SAFETY: bounds checked.
        drv(
            unsafe { result::memset_d8_async(dst.at(offset), value, bytes, STREAM) },
            "memset",
        )
    }

    /// Waits for all queued work and reports any asynchronous fault.
    pub fn sync(&self) -> Result<()> {
        self.bind()?;
        drv(result::ctx::synchronize(), "kernel execution")
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        drv(result::mem_get_info(), "memory query")
    }

    /// Launches `entry`, a kernel whose signature is `L`'s, on the default stream.
    pub fn launch<L: Launch>(
        &self,
        entry: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: usize,
        args: &L,
    ) -> Result<()> {
        self.launch_args(entry, grid, block, smem, &args.args())
    }

    fn launch_args(
        &self,
        entry: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: usize,
        args: &[Arg],
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let f = self.function(entry)?;
        // Each argument in its own 32-byte, 8-aligned slot; the driver reads the parameter's
        // size from the kernel's signature at the slot's address (little endian).
        let mut slots: Vec<[u64; 4]> = args
            .iter()
            .map(|a| {
                let mut s = [0u64; 4];
                match *a {
                    Arg::Ptr(p) => s[0] = p,
                    Arg::I32(v) => s[0] = v as u32 as u64,
                    Arg::I64(v) => s[0] = v as u64,
                    Arg::F32(v) => s[0] = v.to_bits() as u64,
                    Arg::F64(v) => s[0] = v.to_bits(),
                    Arg::Kv(t) => s[..3].copy_from_slice(&t),
                }
                s
            })
            .collect();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s.as_mut_ptr() as *mut c_void)
            .collect();
        self.bind()?;
        // SAFETY: the arguments come from the kernel's typed launcher (`launch::Launch`, its
        // field order checked against the kernel's declaration by a unit test); the slots
        // outlive the launch call, which copies them.
        drv(
            unsafe {
                result::launch_kernel(f.0, grid, (block, 1, 1), smem as u32, STREAM, &mut params)
            },
            "kernel launch",
        )
        .with_context(|| format!("`{entry}` grid {grid:?} block {block} smem {smem}"))?;
        if self.sync_each {
            self.sync().with_context(|| format!("after `{entry}`"))?;
        }
        Ok(())
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}
