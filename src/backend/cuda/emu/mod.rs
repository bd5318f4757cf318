//! The emulated CUDA device: the kernels of `kernels/*.cu` compiled as C++ for the host
//! with `kernels/emu.h`, run block by block with one fiber per CUDA thread
//! (`kernels/emu_runtime.cpp`), and a reference GEMM with cuBLAS's semantics in place of
//! cuBLAS. It lets the CUDA model run end to end, and every kernel be held to its CPU twin,
//! on a machine without a GPU (`--device emu`, the kernel tests).
//!
//! Like NVRTC on a GPU machine, the host compiler runs at first use: the translation unit
//! (every kernel, every KV variant) is built into a shared library by `g++`
//! (`NINFER_EMU_CXX` overrides), cached on disk under a digest of its text and flags
//! (`NINFER_EMU_CACHE_DIR`, default the system temporary directory), and loaded with
//! `dlopen`. `NINFER_EMU_SANITIZE=address` builds it with AddressSanitizer (the process must
//! then preload libasan). `NINFER_EMU_RACECHECK=1` builds it with GCC's ThreadSanitizer
//! instrumentation but without its runtime: the emulator's runtime receives the calls and
//! fails a launch whose threads touch a word of shared memory, one of them writing, with
//! no barrier between them (kernels/emu_runtime.cpp, "the race checker").
//!
//! What it cannot show: NVRTC's code generation (FMA contraction, `--fmad`), the GPU's
//! `expf`/`exp2f`/`log`, the tensor cores' accumulation order, real warp-scheduling races,
//! and speed. A GPU run (`ci/gpu-check.sh`) remains the final word.

pub mod device;
pub mod gemm;

use super::kernels::{Program, COMMON, MODULES};
use anyhow::{anyhow, bail, Context, Result};
use sha2::{Digest, Sha256};
use std::ffi::{c_char, c_void, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

/// The emulation header, runtime and self-test kernels, embedded like the kernels.
pub const HEADER: &str = include_str!("../../../../kernels/emu.h");
pub const RUNTIME: &str = include_str!("../../../../kernels/emu_runtime.cpp");
pub const SELFTEST: &str = include_str!("../../../../kernels/emu_selftest.cu");

/// Entry points only the emulated device has (`kernels/emu_selftest.cu`).
pub const SELFTEST_ENTRIES: [&str; 6] = [
    "emu_selftest_warp_ops",
    "emu_selftest_divergent_barrier",
    "emu_selftest_early_exit",
    "emu_selftest_mma",
    "emu_selftest_race",
    "emu_selftest_template_shared",
];

/// Every entry point of the emulated device: each program's, then the self tests'.
pub fn entries() -> Vec<String> {
    let mut v: Vec<String> = Program::all().iter().flat_map(|p| p.entries()).collect();
    v.sort();
    v.dedup();
    v.extend(SELFTEST_ENTRIES.iter().map(|s| s.to_string()));
    v
}

/// A defect planted in the kernel text, for tests that show the emulated-device checks
/// catch it (`NINFER_EMU_FAULT=<name>`): every occurrence of `from` becomes `to`.
#[derive(Debug)]
pub struct Fault {
    pub name: &'static str,
    pub what: &'static str,
    pub from: &'static str,
    pub to: &'static str,
}

/// `delta_rule_chunked`'s sum of the chunk's decays by thread 0 (kernels/delta_net.cu),
/// which the fault `delta-gc-after-barrier` moves past the following barrier.
macro_rules! delta_gc_sum {
    () => {
        "        if (tid == 0) {
            float acc = 0.0f;
            for (int i = 0; i < n; ++i) {
                acc = __fadd_rn(acc, g[(row0 + i) * hv + j]);
                gc[i] = acc;
            }
        }
"
    };
}

pub const FAULTS: [Fault; 24] = [
    Fault {
        name: "e4m3-truncate",
        what: "the e4m3 encoder truncates normal values instead of rounding to nearest even",
        from: "u32 normal = ((abs + 0x7FFFFu + ((abs >> 20) & 1u)) >> 20) - 960u;",
        to: "u32 normal = (abs >> 20) - 960u;",
    },
    Fault {
        name: "attn-tile-bound",
        what: "the tensor-core attention stops one key tile early when the last query is a tile's first key",
        from: "for (int kt0 = 0; kt0 <= last_pos; kt0 += AM_KEYS)",
        to: "for (int kt0 = 0; kt0 < last_pos; kt0 += AM_KEYS)",
    },
    Fault {
        name: "gqa-interleaved",
        what: "query head h reads KV head h % Hkv instead of h / (Hq / Hkv)",
        from: "int kvh = h / (hq / hkv);",
        to: "int kvh = h % hkv;",
    },
    Fault {
        name: "nvfp4-global-inverted",
        what: "nvfp4 weights divide by a multiplying global scale and multiply by a dividing one",
        from: "v = divide ? __fdiv_rn(v, g) : __fmul_rn(v, g);",
        to: "v = divide ? __fmul_rn(v, g) : __fdiv_rn(v, g);",
    },
    Fault {
        name: "delta-keys-tiled",
        what: "Gated DeltaNet value head j reads key head j % Hk instead of j / (Hv / Hk)",
        from: "int kh = j / (hv / hk);",
        to: "int kh = j % hk;",
    },
    Fault {
        name: "delta-tc-single-tf32",
        what: "the tensor-core chunked delta rule drops the low tf32 parts, one tf32 product instead of 3xTF32",
        from: "lo = __float_as_uint(tf32_round(__fsub_rn(x, h)));",
        to: "lo = 0u;",
    },
    Fault {
        name: "delta-chunk-undecayed-carry",
        what: "the chunked delta rule carries the State into the next chunk without its decay exp(gc_last)",
        from: "? __fmul_rn(S[row_at(e, d, dv, vsw)], carry) : 0.0f;",
        to: "? S[row_at(e, d, dv, vsw)] : 0.0f;",
    },
    Fault {
        name: "bf16-store-overrun",
        what: "the bf16 K/V store writes one element past each vector",
        from: "if (j < D) ((u16*)t.data)[i * D + j] = f32_to_bf16(v[k]);",
        to: "if (j <= D) ((u16*)t.data)[i * D + j] = f32_to_bf16(v[k]);",
    },
    Fault {
        name: "moe-tie-upper",
        what: "the router's top-k breaks probability ties toward the higher expert index",
        from: "if (best < 0 || key > best_key) {",
        to: "if (best < 0 || key >= best_key) {",
    },
    Fault {
        name: "moe-no-renorm",
        what: "the router ignores norm_topk_prob and never renormalises the chosen weights",
        from: "    if (renorm) {",
        to: "    if (0) {",
    },
    Fault {
        name: "moe-shared-gate-silu",
        what: "the shared expert is scaled by silu(gate) instead of sigmoid(gate)",
        from: "float sg = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-z)));",
        to: "float sg = __fmul_rn(z, __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-z))));",
    },
    Fault {
        name: "f16-round-truncate",
        what: "f32 to FP16 (the int8/fp8 scales, bf16's V) truncates instead of rounding to nearest even",
        from: "u32 m = a + 0x0fffu + ((a >> 13) & 1u);",
        to: "u32 m = a;",
    },
    Fault {
        name: "int8-scale-divisor",
        what: "the int8 group scale is amax / 128 instead of amax / 127",
        from: "u16 sh = f32_to_f16(__fdiv_rn(__uint_as_float(am), 127.0f));",
        to: "u16 sh = f32_to_f16(__fdiv_rn(__uint_as_float(am), 128.0f));",
    },
    Fault {
        name: "fp8-scale-unclamped",
        what: "the fp8 row scale is not clamped to the smallest FP16 (2^-24) before rounding",
        from: "fminf(fmaxf(__fdiv_rn(amax, 448.0f), 5.9604644775390625e-8f), 65504.0f)",
        to: "fminf(__fdiv_rn(amax, 448.0f), 65504.0f)",
    },
    Fault {
        name: "fp8-not-saturating",
        what: "e4m3 codes past 448 become NaN (0x7F) instead of saturating at 448",
        from: "u32 mag = abs >= 0x43E00000u ? 0x7Eu :",
        to: "u32 mag = abs >= 0x43E00000u ? 0x7Fu :",
    },
    Fault {
        name: "nvfp4-scale-unclamped",
        what: "the nvfp4 block scale is not clamped to the smallest e4m3 (2^-9) before rounding",
        from: "fminf(fmaxf(__fdiv_rn(bam, 6.0f), 0.001953125f), 448.0f)",
        to: "fminf(__fdiv_rn(bam, 6.0f), 448.0f)",
    },
    Fault {
        name: "fp8tensor-multiplies",
        what: "fp8-tensor multiplies by its per-tensor scale before converting instead of dividing",
        from: "e4m3_from_f32(__fdiv_rn(v[k], t.tscale))",
        to: "e4m3_from_f32(__fmul_rn(v[k], t.tscale))",
    },
    Fault {
        name: "hadamard-sign",
        what: "the Hadamard butterfly's upper element is x_{i+s} - x_i instead of x_i - x_{i+s}",
        from: "v[k] = (lane & s) ? __fsub_rn(o, v[k]) : __fadd_rn(v[k], o);",
        to: "v[k] = (lane & s) ? __fsub_rn(v[k], o) : __fadd_rn(v[k], o);",
    },
    Fault {
        name: "hadamard-unnormalized",
        what: "the Hadamard rotation leaves out its 1/sqrt(D) normalization",
        from: "for (int k = 0; k < NK; ++k) v[k] = __fmul_rn(v[k], c);",
        to: "for (int k = 0; k < NK; ++k) v[k] = __fmul_rn(v[k], 1.0f);",
    },
    Fault {
        name: "delta-chunk-gc-race",
        what: "the chunked delta rule reads the chunk's decay sums without waiting for the thread that writes them (a barrier removed)",
        from: "                gc[i] = acc;\n            }\n        }\n        __syncthreads();",
        to: "                gc[i] = acc;\n            }\n        }",
    },
    Fault {
        name: "moe-gemm-one-chain",
        what: "the f32 expert GEMM sums the whole depth in one chain instead of the CPU's blocks of 768",
        from: "if (k0 > 0 && k0 % MG_KC == 0) {",
        to: "if (false) {",
    },
    Fault {
        name: "moe-tiles-overlap",
        what: "the expert GEMM tiles of one expert start 63 rows apart, so they overlap and miss its last rows",
        from: "v.y = o + t * MOE_TILE_ROWS;",
        to: "v.y = o + t * (MOE_TILE_ROWS - 1);",
    },
    Fault {
        name: "delta-gc-after-barrier",
        what: "the chunked delta rule's thread 0 sums the chunk's decays (gc) just after the barrier that should publish them: the threads resumed after it read them in time, the others would not",
        from: concat!(delta_gc_sum!(), "        __syncthreads();\n"),
        to: concat!("        __syncthreads();\n", delta_gc_sum!()),
    },
    Fault {
        name: "rope-no-syncwarp",
        what: "q/k preparation reads its RoPE partner from the warp's staging row without a __syncwarp",
        from: "        __syncwarp();\n        int half = rot >> 1;",
        to: "        int half = rot >> 1;",
    },
];

/// The planted fault of that name.
pub fn fault(name: &str) -> Result<&'static Fault> {
    FAULTS.iter().find(|f| f.name == name).ok_or_else(|| {
        let names: Vec<&str> = FAULTS.iter().map(|f| f.name).collect();
        anyhow!(
            "NINFER_EMU_FAULT={name}: no such planted fault (known: {})",
            names.join(", ")
        )
    })
}

/// The one C++ translation unit: header, shared device code, every module with every KV
/// variant, the self tests, the entry table and the runtime, with `fault` planted.
pub fn translation_unit(fault: Option<&Fault>) -> Result<String> {
    // `#line` keeps compiler messages and barrier sites in the files' own numbering.
    let file = |t: &mut String, name: &str, text: &str| {
        t.push_str(&format!("\n#line 1 \"kernels/{name}\"\n"));
        t.push_str(text);
    };
    let mut t = String::from("#define KV_ALL 1\n");
    file(&mut t, "emu.h", HEADER);
    file(&mut t, "common.cuh", COMMON);
    for m in &MODULES {
        file(&mut t, &format!("{}.cu", m.name), m.source);
    }
    file(&mut t, "emu_selftest.cu", SELFTEST);
    t.push_str("\n#line 1 \"(entry table)\"\n#define EMU_ENTRIES");
    for e in entries() {
        t.push_str(&format!(" EMU_ENTRY({e})"));
    }
    file(&mut t, "emu_runtime.cpp", RUNTIME);
    if let Some(f) = fault {
        if !t.contains(f.from) {
            bail!(
                "planted fault {}: its text is no longer in the kernels: {:?}",
                f.name,
                f.from
            );
        }
        t = t.replace(f.from, f.to);
    }
    Ok(t)
}

/// The planted fault `NINFER_EMU_FAULT` names, in a `fault-injection` build (none
/// otherwise); an unknown name is an error.
pub fn planted() -> Result<Option<&'static Fault>> {
    if !cfg!(feature = "fault-injection") {
        return Ok(None);
    }
    match std::env::var("NINFER_EMU_FAULT") {
        Ok(n) => Ok(Some(fault(&n)?)),
        Err(_) => Ok(None),
    }
}

/// How the library is built.
pub struct BuildOptions {
    pub sanitize_address: bool,
    /// The shared-memory race checker (`NINFER_EMU_RACECHECK=1`).
    pub race_check: bool,
    pub fault: Option<&'static Fault>,
}

impl BuildOptions {
    /// `NINFER_EMU_SANITIZE=address`, and `NINFER_EMU_FAULT=<name>` in a `fault-injection`
    /// build (a planted fault changes scores on purpose: never in an ordinary build, and a
    /// run records it in its report, `settings.test_fault`).
    pub fn from_env() -> Result<BuildOptions> {
        let o = BuildOptions {
            sanitize_address: std::env::var("NINFER_EMU_SANITIZE").is_ok_and(|v| v == "address"),
            race_check: std::env::var("NINFER_EMU_RACECHECK").is_ok_and(|v| v == "1"),
            fault: planted()?,
        };
        if o.sanitize_address && o.race_check {
            bail!("NINFER_EMU_SANITIZE=address and NINFER_EMU_RACECHECK=1 build different libraries: set one");
        }
        Ok(o)
    }

    /// The compiler's flags. The race checker's build compiles (`-c`) with ThreadSanitizer's
    /// instrumentation, then links (`link_flags`) without `-fsanitize`, so libtsan is not
    /// pulled in: the runtime in the library answers the instrumentation's calls.
    fn flags(&self) -> Vec<&'static str> {
        let mut f = vec![
            "-std=c++17",
            "-fPIC",
            "-ffp-contract=off",
            "-fno-fast-math",
            "-fno-strict-aliasing",
            "-w",
        ];
        if self.sanitize_address {
            f.extend([
                "-shared",
                "-O1",
                "-g",
                "-fsanitize=address",
                "-fno-omit-frame-pointer",
            ]);
        } else if self.race_check {
            f.extend([
                "-c",
                "-O1",
                "-g",
                "-fsanitize=thread",
                "--param",
                "tsan-instrument-func-entry-exit=0",
            ]);
        } else {
            f.extend(["-shared", "-O2"]);
        }
        f
    }

    /// The second step of a two-step build (the race checker's), or None.
    fn link_flags(&self) -> Option<Vec<&'static str>> {
        self.race_check.then(|| vec!["-shared", "-fPIC"])
    }
}

type LaunchFn = unsafe extern "C" fn(
    *const c_char,
    u32,
    u32,
    u32,
    u32,
    usize,
    *mut *mut c_void,
    *mut c_char,
    usize,
) -> i32;
type ArityFn = unsafe extern "C" fn(*const c_char) -> i32;
type StaticSharedFn = unsafe extern "C" fn(*const u64, *const u64, usize);

/// Whether strict mode is on (`NINFER_EMU_STRICT=1`, read by the runtime too).
fn strict() -> bool {
    std::env::var("NINFER_EMU_STRICT").is_ok_and(|v| v == "1")
}

/// The names of the kernels' `__shared__` variables (`__shared__ <type> <name>[..];` or
/// `<name>;`), from the sources.
fn shared_names() -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for text in MODULES.iter().map(|m| m.source).chain([COMMON, SELFTEST]) {
        for decl in text.split("__shared__").skip(1) {
            let decl = decl.split([';', '[', '\n']).next().unwrap_or("");
            if let Some(name) = decl.split_whitespace().last() {
                if name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    names.push(name.to_string());
                }
            }
        }
    }
    names.sort();
    names.dedup();
    names
}

/// (offset, bytes) of each function-local `__shared__` static in the library `so`, from
/// its symbol table (`nm`): GCC before 14 ignores the `emu_shared` section on the statics
/// of function templates (`qkv_prep`'s `stage`, the tensor-core kernels' tiles), so strict
/// mode is given their places to poison.
fn template_shared(so: &std::path::Path) -> Result<Vec<(u64, u64)>> {
    let out = std::process::Command::new("nm")
        .args(["-C", "-S", "--defined-only"])
        .arg(so)
        .output()
        .map_err(|e| anyhow!("NINFER_EMU_STRICT=1 needs `nm` (binutils) to find the kernels' shared statics: {e}"))?;
    if !out.status.success() {
        bail!("NINFER_EMU_STRICT=1: `nm {}` failed", so.display());
    }
    let names = shared_names();
    let table = String::from_utf8_lossy(&out.stdout);
    let mut found = Vec::new();
    for l in table.lines() {
        let mut f = l.splitn(4, ' ');
        let (Some(v), Some(n), Some(kind), Some(sym)) = (f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let (Ok(v), Ok(n)) = (u64::from_str_radix(v, 16), u64::from_str_radix(n, 16)) else {
            continue;
        };
        let var = sym.rsplit("::").next().unwrap_or("");
        if sym.contains(">(") && "bBdDu".contains(kind) && names.iter().any(|x| x == var) {
            found.push((v, n));
        }
    }
    Ok(found)
}

/// The loaded kernel library.
pub struct Library {
    _lib: libloading::Library,
    launch: LaunchFn,
    arity: ArityFn,
    pub path: PathBuf,
}

fn compiler() -> String {
    std::env::var("NINFER_EMU_CXX").unwrap_or_else(|_| "g++".to_string())
}

fn cache_dir() -> PathBuf {
    match std::env::var_os("NINFER_EMU_CACHE_DIR") {
        Some(d) => PathBuf::from(d),
        None => std::env::temp_dir().join("ninfer-perplexity-emu"),
    }
}

impl Library {
    /// Builds (or finds in the cache) and loads the library for `opts`.
    pub fn build(opts: &BuildOptions) -> Result<Library> {
        let text = translation_unit(opts.fault)?;
        let cxx = compiler();
        let version = std::process::Command::new(&cxx)
            .arg("--version")
            .output()
            .map_err(|e| anyhow!("the emulated CUDA device needs a C++ compiler: `{cxx}` did not run ({e}); install g++ or set NINFER_EMU_CXX"))?;
        let mut h = Sha256::new();
        h.update(&version.stdout);
        h.update(opts.flags().join(" "));
        if let Some(link) = opts.link_flags() {
            h.update(" link: ");
            h.update(link.join(" "));
        }
        h.update(&text);
        let digest = hex::encode(&h.finalize()[..12]);
        let dir = cache_dir();
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("emulated device cache {}", dir.display()))?;
        let so = dir.join(format!("kernels-{digest}.so"));
        if !so.exists() {
            let t = std::time::Instant::now();
            let work = tempfile::Builder::new()
                .prefix("build-")
                .tempdir_in(&dir)
                .with_context(|| format!("emulated device cache {}", dir.display()))?;
            let src = work.path().join("kernels.cpp");
            std::fs::write(&src, &text)?;
            let out = work.path().join("kernels.so");
            let run = |args: &[&str], input: &std::path::Path, output: &std::path::Path| {
                let r = std::process::Command::new(&cxx)
                    .args(args)
                    .arg(input)
                    .arg("-o")
                    .arg(output)
                    .output()
                    .map_err(|e| anyhow!("`{cxx}` did not run ({e})"))?;
                if !r.status.success() {
                    let log = String::from_utf8_lossy(&r.stderr);
                    let first: Vec<&str> = log
                        .lines()
                        .filter(|l| l.contains("error"))
                        .take(5)
                        .collect();
                    bail!(
                        "compiling the kernels for the emulated device failed ({cxx}): {}",
                        first.join(" | ")
                    );
                }
                Ok(())
            };
            match opts.link_flags() {
                Some(link) => {
                    let obj = work.path().join("kernels.o");
                    run(&opts.flags(), &src, &obj)?;
                    run(&link, &obj, &out)?;
                }
                None => run(&opts.flags(), &src, &out)?,
            }
            // Atomic publish: concurrent builders of the same digest race harmlessly.
            std::fs::rename(&out, &so)?;
            crate::ui::debug(format!(
                "built the emulated CUDA device ({}) in {:.1}s",
                so.display(),
                t.elapsed().as_secs_f64()
            ));
        }
        if let Some(f) = opts.fault {
            // Always said, whatever the log level: a planted fault must never go unnoticed.
            eprintln!(
                "warning: emulated device built with planted fault {}: {}",
                f.name, f.what
            );
        }
        // SAFETY: a library this function just compiled from the embedded sources; its
        // initializers only set up static storage.
        let lib = unsafe { libloading::Library::new(&so) }
            .with_context(|| format!("loading the emulated device {}", so.display()))?;
        // SAFETY: the symbols are defined by kernels/emu_runtime.cpp with these signatures.
        let (launch, arity) = unsafe {
            let l: libloading::Symbol<LaunchFn> = lib.get(b"ninfer_emu_launch\0")?;
            let a: libloading::Symbol<ArityFn> = lib.get(b"ninfer_emu_arity\0")?;
            (*l, *a)
        };
        if strict() {
            let (offsets, bytes): (Vec<u64>, Vec<u64>) = template_shared(&so)?.into_iter().unzip();
            // SAFETY: defined by kernels/emu_runtime.cpp with this signature; it copies the
            // arrays.
            unsafe {
                let f: libloading::Symbol<StaticSharedFn> =
                    lib.get(b"ninfer_emu_static_shared\0")?;
                f(offsets.as_ptr(), bytes.as_ptr(), offsets.len());
            }
        }
        Ok(Library {
            _lib: lib,
            launch,
            arity,
            path: so,
        })
    }

    /// The process-wide library for the environment's options, built at first use.
    pub fn shared() -> Result<&'static Library> {
        static L: OnceLock<std::result::Result<Library, String>> = OnceLock::new();
        L.get_or_init(|| {
            BuildOptions::from_env()
                .and_then(|o| Library::build(&o))
                .map_err(|e| format!("{e:#}"))
        })
        .as_ref()
        .map_err(|e| anyhow!("{e}"))
    }

    /// The parameter count of `entry`, or None when the library has no such kernel.
    pub fn arity(&self, entry: &str) -> Option<usize> {
        let c = CString::new(entry).ok()?;
        // SAFETY: a NUL-terminated name; the function only reads it.
        let n = unsafe { (self.arity)(c.as_ptr()) };
        (n >= 0).then_some(n as usize)
    }

    /// Runs `entry` over `grid` with `block` threads; `params[i]` points at argument i.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters and every pointer among them must
    /// be valid for what the kernel reads and writes (as for a CUDA launch).
    pub unsafe fn launch(
        &self,
        entry: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: usize,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let c = CString::new(entry).map_err(|_| anyhow!("kernel name with a NUL"))?;
        match self.arity(entry) {
            None => bail!("the emulated device has no kernel `{entry}`"),
            Some(n) if n != params.len() => bail!(
                "kernel `{entry}` takes {n} parameters, {} were given",
                params.len()
            ),
            _ => {}
        }
        // Room for the race checker's report (up to 16 hazards, a line each).
        let mut err = vec![0u8; 16 * 1024];
        let r = (self.launch)(
            c.as_ptr(),
            grid.0,
            grid.1,
            grid.2,
            block,
            smem,
            params.as_mut_ptr(),
            err.as_mut_ptr() as *mut c_char,
            err.len(),
        );
        if r != 0 {
            let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
            let why = String::from_utf8_lossy(&err[..end]);
            bail!(
                "emulated kernel launch failed: {}",
                symbolize(&why, &self.path)
            );
        }
        Ok(())
    }
}

/// The race checker's addresses in `report` (`{pc:0x..}` for an instruction, `{data:0x..}`
/// for a `__shared__` variable, offsets in the library `so`) as source lines (`addr2line`:
/// the `#line` directives of the translation unit name `kernels/*.cu`) and variable names
/// (`nm`). An address that cannot be resolved stays as `kernels.so+0x..`.
fn symbolize(report: &str, so: &std::path::Path) -> String {
    let mut pcs: Vec<String> = Vec::new();
    let mut datas: Vec<u64> = Vec::new();
    for (tag, list) in [("{pc:0x", 0), ("{data:0x", 1)] {
        for part in report.split(tag).skip(1) {
            if let Some(hex) = part.split('}').next() {
                if list == 0 {
                    pcs.push(format!("0x{hex}"));
                } else if let Ok(v) = u64::from_str_radix(hex, 16) {
                    datas.push(v);
                }
            }
        }
    }
    if pcs.is_empty() && datas.is_empty() {
        return report.to_string();
    }
    let mut out = report.to_string();
    pcs.sort();
    pcs.dedup();
    if !pcs.is_empty() {
        let lines = std::process::Command::new("addr2line")
            .arg("-e")
            .arg(so)
            .args(&pcs)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let lines: Vec<&str> = lines.lines().collect();
        for (i, pc) in pcs.iter().enumerate() {
            let at = match lines.get(i) {
                Some(l) if !l.starts_with("??") => {
                    // The #line directives name kernels/<file>, which addr2line puts under
                    // the compiler's working directory.
                    let l = l.split(" (discriminator").next().unwrap_or(l);
                    let l = l.rfind("kernels/").map_or(l, |i| &l[i..]);
                    format!("{l} (kernels.so+{pc})")
                }
                _ => format!("kernels.so+{pc}"),
            };
            out = out.replace(&format!("{{pc:{pc}}}"), &at);
        }
    }
    if !datas.is_empty() {
        // Local symbols with their sizes: "<value> <size> <type> <name>".
        let table = std::process::Command::new("nm")
            .args(["-C", "-S", "--defined-only"])
            .arg(so)
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let symbols: Vec<(u64, u64, &str)> = table
            .lines()
            .filter_map(|l| {
                let mut f = l.splitn(4, ' ');
                let v = u64::from_str_radix(f.next()?, 16).ok()?;
                let n = u64::from_str_radix(f.next()?, 16).ok()?;
                let _kind = f.next()?;
                Some((v, n, f.next()?))
            })
            .collect();
        for d in datas {
            let name = symbols
                .iter()
                .find(|(v, n, _)| d >= *v && d < v + n)
                .map(|(v, _, name)| {
                    let name = without_parameters(name);
                    if d == *v {
                        format!("`{name}`")
                    } else {
                        format!("`{name}`+0x{:x}", d - v)
                    }
                })
                .unwrap_or_else(|| format!("kernels.so+0x{d:x}"));
            out = out.replace(&format!("{{data:0x{d:x}}}"), &name);
        }
    }
    out
}

/// A demangled static local's name without its function's parameter list:
/// `f<1>(int, float)::x` becomes `f<1>::x`.
fn without_parameters(name: &str) -> String {
    let Some(end) = name.rfind(")::") else {
        return name.to_string();
    };
    let mut depth = 0;
    for (i, c) in name[..=end].char_indices().rev() {
        match c {
            ')' => depth += 1,
            '(' => {
                depth -= 1;
                if depth == 0 {
                    return format!("{}{}", &name[..i], &name[end + 1..]);
                }
            }
            _ => {}
        }
    }
    name.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unit_has_every_entry_and_every_fault_applies() {
        let t = translation_unit(None).unwrap();
        for e in entries() {
            assert!(t.contains(&format!("EMU_ENTRY({e})")), "{e}");
        }
        for f in &FAULTS {
            let planted = translation_unit(Some(f)).unwrap();
            assert!(
                !planted.contains(f.from) && planted.contains(f.to),
                "{}",
                f.name
            );
        }
        assert_eq!(
            without_parameters("qkv_prep<1, 5, 4>(float const*, void (*)(int), int)::stage"),
            "qkv_prep<1, 5, 4>::stage"
        );
        assert_eq!(
            without_parameters("emu_selftest_race::value"),
            "emu_selftest_race::value"
        );
        assert!(fault("nope")
            .unwrap_err()
            .to_string()
            .contains("known: e4m3-truncate"));
    }
}
