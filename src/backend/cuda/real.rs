//! The real GPU behind the device interface: one CUDA context, kernel modules compiled by
//! NVRTC on first use, launches through the driver and GEMMs through cuBLAS. All work goes
//! to the legacy default stream, so copies, kernels and cuBLAS calls run in issue order.

use super::device::{pack_args, Backend, ColGemm, GemmInput};
use super::kernels::Program;
use super::launch::Arg;
use super::nvrtc;
use super::GpuInfo;
use anyhow::{anyhow, Context, Result};
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{result, sys, CudaContext};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex, OnceLock};

/// cuBLAS's compute type for a GEMM's inputs. bf16: f32 accumulation on tensor cores.
/// f32 (the parity mode): the pedantic type, which rules out TF32 and the bf16x9
/// emulation of f32 whatever the handle's math mode or the environment
/// (`NVIDIA_TF32_OVERRIDE`, `CUBLAS_EMULATION_STRATEGY`) say, so the claim "f32 products
/// in f32" does not rest on a default.
pub fn compute_type(input: GemmInput) -> blas_sys::cublasComputeType_t {
    match input {
        GemmInput::Bf16 => blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        GemmInput::F32 => blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC,
    }
}

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

/// An open GPU: its context, loaded modules and cuBLAS handle.
pub struct RealGpu {
    info: GpuInfo,
    arch: String,
    modules: Mutex<HashMap<Program, ModuleHandle>>,
    functions: Mutex<HashMap<String, FunctionHandle>>,
    /// Kernels already allowed more than 48 KiB of dynamic shared memory.
    /// Per kernel, the dynamic shared memory it was allowed (raised when a launch needs more).
    smem_set: Mutex<HashMap<String, usize>>,
    /// Synchronize and check after every launch (NINFER_CUDA_SYNC=1): slow, localizes faults.
    sync_each: bool,
    blas: BlasHandle,
    ctx: Arc<CudaContext>,
}

struct ModuleHandle(sys::CUmodule);
// SAFETY: module handles are plain driver handles, usable from any thread bound to the context.
unsafe impl Send for ModuleHandle {}

#[derive(Clone, Copy)]
struct FunctionHandle(sys::CUfunction);
// SAFETY: as above.
unsafe impl Send for FunctionHandle {}
unsafe impl Sync for FunctionHandle {}

struct BlasHandle(blas_sys::cublasHandle_t);
// SAFETY: the handle is used by one call at a time (the model serializes its work).
unsafe impl Send for BlasHandle {}
unsafe impl Sync for BlasHandle {}

impl Drop for RealGpu {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = result::ctx::synchronize();
        // SAFETY: created in `open`, destroyed once.
        let _ = unsafe { blas::destroy_handle(self.blas.0) };
        for (_, m) in self.modules.lock().unwrap().drain() {
            // SAFETY: loaded by this device, unloaded once, after all work finished above.
            let _ = unsafe { result::module::unload(m.0) };
        }
    }
}

impl RealGpu {
    /// Opens device `ordinal`. The caller has checked that the libraries are present.
    pub fn open(ordinal: usize) -> Result<RealGpu> {
        if let Some(m) = super::loader::missing_library() {
            anyhow::bail!(m);
        }
        let info = super::probe(ordinal).map_err(|e| anyhow!(e))?;
        let ctx = drv(CudaContext::new(ordinal), "context creation")?;
        let arch = format!(
            "sm_{}{}",
            info.compute_capability.0, info.compute_capability.1
        );
        drv(ctx.bind_to_thread(), "bind context")?;
        let handle = blas::create_handle().map_err(|e| anyhow!("cuBLAS handle: {e}"))?;
        // SAFETY: a fresh handle; the null stream is the legacy default stream.
        unsafe {
            blas::set_stream(handle, STREAM as _).map_err(|e| anyhow!("cuBLAS stream: {e}"))?;
            blas_sys::cublasSetMathMode(handle, blas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH)
                .result()
                .map_err(|e| anyhow!("cuBLAS math mode: {e}"))?;
        }
        Ok(RealGpu {
            info,
            arch,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            smem_set: Mutex::new(HashMap::new()),
            sync_each: std::env::var("NINFER_CUDA_SYNC").is_ok_and(|v| v == "1"),
            blas: BlasHandle(handle),
            ctx,
        })
    }

    /// Makes the context current on the calling thread (every entry does this).
    fn bind(&self) -> Result<()> {
        drv(self.ctx.bind_to_thread(), "bind context")
    }

    /// A kernel entry point; its module is compiled and loaded at the first request.
    fn function(&self, entry: &str) -> Result<FunctionHandle> {
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

    /// Allows a kernel more than 48 KiB of dynamic shared memory: the first time, and again
    /// whenever a launch needs more than it was allowed.
    fn allow_smem(&self, entry: &str, f: FunctionHandle, bytes: usize) -> Result<()> {
        let mut set = self.smem_set.lock().unwrap();
        if set.get(entry).is_some_and(|&allowed| allowed >= bytes) {
            return Ok(());
        }
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
        )?;
        set.insert(entry.to_string(), bytes);
        Ok(())
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl Backend for RealGpu {
    fn info(&self) -> &GpuInfo {
        &self.info
    }

    fn arch(&self) -> &str {
        &self.arch
    }

    fn alloc(&self, bytes: usize) -> Result<u64> {
        self.bind()?;
        // SAFETY: plain allocation; the contents are written before they are read.
        drv(unsafe { result::malloc_sync(bytes) }, "allocation")
    }

    fn free(&self, ptr: u64, _bytes: usize) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by cuMemAlloc in `alloc`, freed once; the default stream
        // serializes the free after every queued use.
        let _ = unsafe { result::free_sync(ptr) };
    }

    fn copy_to_device(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller checked the bounds; the host slice outlives the synchronous copy.
        drv(
            unsafe { result::memcpy_htod_sync(dst, src) },
            "copy to device",
        )
    }

    fn copy_to_host(&self, dst: &mut [u8], src: u64) -> Result<()> {
        self.sync()?;
        // SAFETY: the caller checked the bounds; `dst` holds the bytes.
        drv(
            unsafe { result::memcpy_dtoh_sync(dst, src) },
            "copy to host",
        )
    }

    fn memset(&self, dst: u64, bytes: usize, value: u8) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller checked the bounds.
        drv(
            unsafe { result::memset_d8_async(dst, value, bytes, STREAM) },
            "memset",
        )
    }

    fn sync(&self) -> Result<()> {
        self.bind()?;
        drv(result::ctx::synchronize(), "kernel execution")
    }

    fn mem_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        drv(result::mem_get_info(), "memory query")
    }

    fn prepare(&self, programs: &[Program]) -> Result<()> {
        self.bind()?;
        precompile(programs, &self.arch)
    }

    fn launch(
        &self,
        entry: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: usize,
        args: &[Arg],
    ) -> Result<()> {
        let f = self.function(entry)?;
        if smem > 48 * 1024 {
            self.allow_smem(entry, f, smem)?;
        }
        let mut slots = pack_args(args);
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

    fn gemm(&self, g: &ColGemm) -> Result<()> {
        let int = |v: usize, what: &str| -> Result<i32> {
            i32::try_from(v).map_err(|_| anyhow!("GEMM {what} {v} exceeds cuBLAS's 32-bit sizes"))
        };
        let op = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let in_type = match g.input {
            GemmInput::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
            GemmInput::F32 => blas_sys::cudaDataType::CUDA_R_32F,
        };
        let compute = compute_type(g.input);
        self.bind()?;
        // SAFETY: device pointers and leading dimensions describe allocations of the
        // model's buffers (checked by the callers' size arithmetic); alpha/beta are host
        // scalars that outlive the call.
        unsafe {
            blas::gemm_ex(
                self.blas.0,
                op(g.trans_a),
                op(g.trans_b),
                int(g.m, "m")?,
                int(g.n, "n")?,
                int(g.k, "k")?,
                &g.alpha as *const f32 as *const c_void,
                g.a as *const c_void,
                in_type,
                int(g.lda, "lda")?,
                g.b as *const c_void,
                in_type,
                int(g.ldb, "ldb")?,
                &g.beta as *const f32 as *const c_void,
                g.c as *mut c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                int(g.ldc, "ldc")?,
                compute,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| anyhow!("cuBLAS GEMM m {} n {} k {}: {e}", g.m, g.n, g.k))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blas_sys::cublasComputeType_t as C;

    #[test]
    fn f32_products_ask_cublas_for_pedantic_f32() {
        // The f32 (parity) mode must not depend on cuBLAS's default math mode.
        assert_eq!(compute_type(GemmInput::F32), C::CUBLAS_COMPUTE_32F_PEDANTIC);
        assert_eq!(compute_type(GemmInput::Bf16), C::CUBLAS_COMPUTE_32F);
    }
}
