//! Run-time compilation of the embedded kernels with NVRTC, straight to machine code
//! (CUBIN) for the device's architecture, so ptxas runs inside NVRTC and a kernel that
//! cannot be assembled fails here, not at launch. Needs only libnvrtc: no GPU or driver,
//! which is how `tests/parity/nvrtc.rs` checks every kernel on a CPU-only machine.

use super::kernels::Program;
use cudarc::nvrtc::{result, sys};
use std::ffi::{c_char, CString};

/// Options every module is compiled with: IEEE division and square root, no flush to zero
/// (the KV codecs reproduce the CPU's f32 arithmetic, subnormals included).
pub fn options(arch: &str, verbose_ptxas: bool) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--ftz=false".to_string(),
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
        "--fmad=true".to_string(),
        "--extra-device-vectorization".to_string(),
    ];
    if verbose_ptxas {
        o.push("--ptxas-options=-v".to_string());
    }
    o
}

/// A compiled module.
pub struct Compiled {
    pub cubin: Vec<u8>,
    /// NVRTC's log (warnings; with verbose ptxas, the resource usage of every kernel).
    pub log: String,
}

/// NVRTC's version, e.g. (13, 0).
pub fn version() -> Result<(i32, i32), String> {
    let (mut a, mut b) = (0, 0);
    // SAFETY: plain out-parameters.
    let r = unsafe { sys::nvrtcVersion(&mut a, &mut b) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcVersion: {r:?}"));
    }
    Ok((a, b))
}

/// Compiles one program for `arch` (`sm_90`, ...). The error carries NVRTC's log.
pub fn compile(p: &Program, arch: &str, verbose_ptxas: bool) -> Result<Compiled, String> {
    let key = p.key();
    let src = CString::new(p.text()).map_err(|_| format!("{key} holds a NUL byte"))?;
    let name = CString::new(format!("{}.cu", p.module)).expect("plain name");
    let prog = result::create_program(&src, Some(&name))
        .map_err(|e| format!("nvrtcCreateProgram: {e:?}"))?;
    struct Guard(sys::nvrtcProgram);
    impl Drop for Guard {
        fn drop(&mut self) {
            // SAFETY: the program was created above and is destroyed once.
            let _ = unsafe { result::destroy_program(self.0) };
        }
    }
    let g = Guard(prog);
    let opts = options(arch, verbose_ptxas);
    // SAFETY: a valid program and option strings.
    let compiled = unsafe { result::compile_program(g.0, &opts) };
    // SAFETY: the program is valid; the log is NUL terminated.
    let log = unsafe { result::get_program_log(g.0) }
        .map(|v| {
            let bytes: Vec<u8> = v
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .unwrap_or_default();
    if let Err(e) = compiled {
        return Err(format!(
            "kernels/{key} does not compile for {arch} ({e:?}):\n{log}"
        ));
    }
    let mut size = 0usize;
    // SAFETY: valid program, out-parameter.
    let r = unsafe { sys::nvrtcGetCUBINSize(g.0, &mut size) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
        return Err(format!(
            "kernels/{key}: no CUBIN for {arch} ({r:?}); the architecture must be sm_XX"
        ));
    }
    let mut cubin = vec![0u8; size];
    // SAFETY: the buffer holds `size` bytes as NVRTC asked.
    let r = unsafe { sys::nvrtcGetCUBIN(g.0, cubin.as_mut_ptr() as *mut c_char) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcGetCUBIN: {r:?}"));
    }
    Ok(Compiled { cubin, log })
}

/// Environment variable naming a directory where compiled CUBINs are kept across
/// processes (opt-in; without it kernels are compiled once per process).
pub const CACHE_ENV: &str = "NINFER_CUDA_CACHE_DIR";

/// Where the CUBIN of `p` for `arch` is cached, when `NINFER_CUDA_CACHE_DIR` is set. The
/// name holds a hash of the program text and the code-generating options, so an edited
/// kernel never meets a stale binary (ptxas verbosity does not change the code and is left
/// out).
pub fn cache_path(p: &Program, arch: &str) -> Option<std::path::PathBuf> {
    let dir = std::env::var_os(CACHE_ENV).filter(|d| !d.is_empty())?;
    Some(cache_path_in(std::path::Path::new(&dir), p, arch))
}

/// [`cache_path`] under a given directory.
pub fn cache_path_in(dir: &std::path::Path, p: &Program, arch: &str) -> std::path::PathBuf {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(p.text().as_bytes());
    for o in options(arch, false) {
        h.update(b"\0");
        h.update(o.as_bytes());
    }
    let hash = hex::encode(h.finalize());
    let key = p.key().replace(['[', ']'], "-");
    dir.join(format!(
        "{arch}-{}-{}.cubin",
        key.trim_end_matches('-'),
        &hash[..20]
    ))
}

/// A cached CUBIN, if there is one.
pub fn load_cached(p: &Program, arch: &str) -> Option<Vec<u8>> {
    load_cached_at(&cache_path(p, arch)?)
}

fn load_cached_at(path: &std::path::Path) -> Option<Vec<u8>> {
    std::fs::read(path)
        .ok()
        .filter(|b| b.starts_with(b"\x7fELF"))
}

/// Stores a CUBIN in the cache (atomically; failures only cost a later recompile).
pub fn store_cached(p: &Program, arch: &str, cubin: &[u8]) {
    if let Some(path) = cache_path(p, arch) {
        store_cached_at(&path, cubin);
    }
}

fn store_cached_at(path: &std::path::Path, cubin: &[u8]) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    if let Ok(mut tmp) = tempfile::NamedTempFile::new_in(dir) {
        use std::io::Write;
        if tmp.write_all(cubin).is_ok() {
            let _ = tmp.persist(path);
        }
    }
}

/// One kernel's resources as ptxas reports them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    pub name: String,
    pub registers: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    pub stack_frame: u32,
    pub shared_bytes: u32,
}

/// Parses ptxas `-v` output: a `Compiling entry function '<name>'` line, then
/// `N bytes stack frame, N bytes spill stores, N bytes spill loads` and
/// `Used N registers, ... N bytes smem ...`.
pub fn parse_ptxas_log(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    let num_before = |s: &str, unit: &str| -> Option<u32> {
        let i = s.find(unit)?;
        s[..i]
            .trim_end()
            .rsplit(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()
    };
    for line in log.lines() {
        if let Some(i) = line.find("Compiling entry function '") {
            let rest = &line[i + "Compiling entry function '".len()..];
            let name = rest.split('\'').next().unwrap_or("").to_string();
            out.push(KernelResources {
                name,
                ..Default::default()
            });
            continue;
        }
        let Some(cur) = out.last_mut() else { continue };
        if line.contains("stack frame") {
            cur.stack_frame = num_before(line, "bytes stack frame").unwrap_or(0);
            cur.spill_stores = num_before(line, "bytes spill stores").unwrap_or(0);
            cur.spill_loads = num_before(line, "bytes spill loads").unwrap_or(0);
        } else if line.contains("Used") && line.contains("registers") {
            cur.registers = num_before(line, "registers").unwrap_or(0);
            cur.shared_bytes = num_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_log_is_parsed_per_kernel() {
        let log = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'attn_mma_bf16_d128' for 'sm_90'\n\
ptxas info    : Function properties for attn_mma_bf16_d128\n\
    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 168 registers, used 0 barriers, 35840 bytes smem, 400 bytes cmem[0]\n\
ptxas info    : Compiling entry function 'head_finish' for 'sm_90'\n\
ptxas info    : Function properties for head_finish\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 10 registers, used 0 barriers, 380 bytes cmem[0]\n";
        let r = parse_ptxas_log(log);
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            KernelResources {
                name: "attn_mma_bf16_d128".into(),
                registers: 168,
                spill_stores: 8,
                spill_loads: 12,
                stack_frame: 16,
                shared_bytes: 35840
            }
        );
        assert_eq!(r[1].name, "head_finish");
        assert_eq!(r[1].registers, 10);
        assert_eq!(r[1].spill_stores, 0);
    }

    #[test]
    fn cache_names_change_with_the_program_text() {
        let d = tempfile::tempdir().unwrap();
        let a = Program {
            module: "attention",
            kv: Some("int8"),
        };
        let b = Program {
            module: "attention",
            kv: Some("fp8"),
        };
        let pa = cache_path_in(d.path(), &a, "sm_90");
        assert!(pa.starts_with(d.path()));
        let name = pa.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            name.starts_with("sm_90-attention-int8-") && name.ends_with(".cubin"),
            "{name}"
        );
        assert_ne!(pa, cache_path_in(d.path(), &b, "sm_90"));
        assert_ne!(pa, cache_path_in(d.path(), &a, "sm_80"));
        assert!(load_cached_at(&pa).is_none());
        store_cached_at(&pa, b"\x7fELF fake");
        assert_eq!(load_cached_at(&pa).unwrap(), b"\x7fELF fake");
        std::fs::write(&pa, b"garbage").unwrap();
        assert!(load_cached_at(&pa).is_none(), "non-ELF files are ignored");
    }

    #[test]
    fn options_keep_ieee_arithmetic() {
        let o = options("sm_90", true);
        assert!(o.contains(&"--gpu-architecture=sm_90".to_string()));
        assert!(
            o.contains(&"--ftz=false".to_string()) && o.contains(&"--prec-div=true".to_string())
        );
        assert!(!o.iter().any(|s| s.contains("fast-math")));
        assert!(o.contains(&"--ptxas-options=-v".to_string()));
    }
}
