//! Finding the CUDA libraries at run time.
//!
//! cudarc opens `libcuda`, `libnvrtc` and `libcublas` by name, through the dynamic loader,
//! the first time one of their functions is called, and panics when a library is missing.
//! Every path into CUDA therefore checks presence first ([`missing_library`]). Libraries
//! outside the loader's search path (a pip wheel's `nvidia/cu13/lib`, a toolkit not in
//! `ld.so.conf`) can be named by directory: [`preload_env`] opens every library of ours
//! found in the directories listed in `NINFER_CUDA_LIB_DIR` (colon separated) and
//! `NINFER_NVRTC_LIB_DIR`, by full path and with global visibility, so the later open by
//! name finds the already-loaded object (the dynamic loader matches it by soname).

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    fn dlerror() -> *const c_char;
}
const RTLD_NOW: c_int = 2;
const RTLD_GLOBAL: c_int = 0x100;

/// Library file name prefixes, in load order (dependencies first).
const PREFIXES: [&str; 4] = [
    "libnvrtc-builtins.so",
    "libnvrtc.so",
    "libcublasLt.so",
    "libcublas.so",
];

/// Environment variables naming library directories.
pub const ENV_DIRS: [&str; 2] = ["NINFER_CUDA_LIB_DIR", "NINFER_NVRTC_LIB_DIR"];

/// The directories the environment names, in order.
pub fn env_dirs() -> Vec<PathBuf> {
    let mut v = Vec::new();
    for var in ENV_DIRS {
        if let Some(s) = std::env::var_os(var) {
            for p in std::env::split_paths(&s) {
                if !p.as_os_str().is_empty() {
                    v.push(p);
                }
            }
        }
    }
    v
}

/// Opens one library by full path; the handle is kept for the life of the process.
pub fn open_path(path: &Path) -> Result<(), String> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{}: bad path", path.display()))?;
    // SAFETY: dlopen with a valid C string; the handle is intentionally never closed.
    let h = unsafe { dlopen(c.as_ptr(), RTLD_NOW | RTLD_GLOBAL) };
    if h.is_null() {
        // SAFETY: dlerror returns a thread-local C string or null.
        let msg = unsafe {
            let e = dlerror();
            if e.is_null() {
                "unknown error".to_string()
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(format!("{}: {msg}", path.display()));
    }
    Ok(())
}

/// The version numbers after `prefix` in a file name (`libnvrtc.so.13.0.88` -> [13, 0,
/// 88]; the bare `.so` -> []), or `None` when the name is not that library (another prefix,
/// a `.alt.` second build from NVIDIA's wheels, a static archive).
fn version_of(name: &str, prefix: &str) -> Option<Vec<u64>> {
    let tail = name.strip_prefix(prefix)?;
    if name.contains(".alt.") {
        return None;
    }
    if tail.is_empty() {
        return Some(Vec::new());
    }
    tail.strip_prefix('.')?
        .split('.')
        .map(|p| p.parse().ok())
        .collect()
}

/// The CUDA libraries this backend uses that `dir` holds, in load order, one file each: of
/// `libnvrtc.so`, `libnvrtc.so.13` and `libnvrtc.so.13.0.88`, the highest version (two
/// copies of one library in a process, with `RTLD_GLOBAL`, would bind symbols to either).
pub fn libraries_in(dir: &Path) -> Vec<PathBuf> {
    let names: Vec<String> = match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => return Vec::new(),
    };
    PREFIXES
        .iter()
        .filter_map(|prefix| {
            names
                .iter()
                .filter_map(|n| version_of(n, prefix).map(|v| (v, n)))
                .max()
                .map(|(_, n)| dir.join(n))
        })
        .collect()
}

/// What [`preload_env`] opens for `dirs`: each library once, from the first directory that
/// holds it, in load order.
pub fn preload_plan(dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for prefix in PREFIXES {
        let first = dirs.iter().find_map(|d| {
            libraries_in(d).into_iter().find(|p| {
                p.file_name()
                    .is_some_and(|n| version_of(&n.to_string_lossy(), prefix).is_some())
            })
        });
        out.extend(first);
    }
    out
}

/// Preloads the libraries found in the environment's directories, once per process, one
/// copy of each ([`preload_plan`]). Returns the failures (a library that exists but cannot
/// be opened), for diagnostics.
pub fn preload_env() -> &'static [String] {
    static DONE: OnceLock<Vec<String>> = OnceLock::new();
    DONE.get_or_init(|| {
        preload_plan(&env_dirs())
            .iter()
            .filter_map(|lib| open_path(lib).err())
            .collect()
    })
}

/// Which of the driver, NVRTC and cuBLAS libraries cannot be opened, as one line naming
/// them; `None` when all are there. Never panics.
pub fn missing_library() -> Option<String> {
    let errs = preload_env();
    // SAFETY: these only try to open the libraries by name and close them again.
    let (drv, rtc, blas) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
            cudarc::cublas::sys::is_culib_present(),
        )
    };
    if !drv {
        return Some("no CUDA driver: libcuda.so could not be loaded".to_string());
    }
    let mut missing = Vec::new();
    if !rtc {
        missing.push("libnvrtc.so.13");
    }
    if !blas {
        missing.push("libcublas.so.13");
    }
    if missing.is_empty() {
        return None;
    }
    let mut msg = format!(
        "{} not found (install the CUDA 13 runtime libraries, or name their directory in NINFER_CUDA_LIB_DIR)",
        missing.join(" and ")
    );
    if !errs.is_empty() {
        msg.push_str(&format!("; preload failed: {}", errs.join("; ")));
    }
    Some(msg)
}

/// `cuDriverGetVersion`'s integer (1000 · major + 10 · minor) as "major.minor".
fn driver_version_name(v: i32) -> String {
    format!("{}.{}", v / 1000, v % 1000 / 10)
}

/// The driver's, NVRTC's and cuBLAS's versions; a library that does not answer gives "?".
/// Call only once [`missing_library`] has said all three are there (cudarc's loader panics
/// on a missing library).
pub fn library_versions() -> crate::backend::CudaVersions {
    use std::ffi::c_int;
    let (mut drv, mut major, mut minor) = (0 as c_int, 0 as c_int, 0 as c_int);
    // SAFETY: each call writes the integers it is given; the libraries are loaded.
    let driver = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut drv) };
    let driver = match driver {
        cudarc::driver::sys::CUresult::CUDA_SUCCESS => driver_version_name(drv),
        _ => "?".into(),
    };
    // SAFETY: as above.
    let nvrtc = match unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) } {
        cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS => format!("{major}.{minor}"),
        _ => "?".into(),
    };
    use cudarc::cublas::sys::{cublasGetProperty, cublasStatus_t, libraryPropertyType as P};
    let part = |p: P| {
        let mut v: c_int = 0;
        // SAFETY: as above.
        match unsafe { cublasGetProperty(p, &mut v) } {
            cublasStatus_t::CUBLAS_STATUS_SUCCESS => Some(v),
            _ => None,
        }
    };
    let cublas = match (
        part(P::MAJOR_VERSION),
        part(P::MINOR_VERSION),
        part(P::PATCH_LEVEL),
    ) {
        (Some(a), Some(b), Some(c)) => format!("{a}.{b}.{c}"),
        _ => "?".into(),
    };
    crate::backend::CudaVersions {
        driver,
        nvrtc,
        cublas,
    }
}

/// Whether NVRTC can be loaded (no driver needed): the compile-only check.
pub fn nvrtc_present() -> bool {
    preload_env();
    // SAFETY: only opens and closes the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_versions_read_as_cuda_names_them() {
        assert_eq!(driver_version_name(13000), "13.0");
        assert_eq!(driver_version_name(12080), "12.8");
    }

    #[test]
    fn library_files_are_found_in_dependency_order() {
        let d = tempfile::tempdir().unwrap();
        for n in [
            "libcublas.so.13",
            "libnvrtc.so.13",
            "libnvrtc.alt.so.13",
            "libnvrtc-builtins.so.13.0",
            "libcublasLt.so.13",
            "libcublasLt_static.a",
            "libnvrtc.so",
            "README",
        ] {
            std::fs::write(d.path().join(n), b"").unwrap();
        }
        let names: Vec<String> = libraries_in(d.path())
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [
                "libnvrtc-builtins.so.13.0",
                "libnvrtc.so.13",
                "libcublasLt.so.13",
                "libcublas.so.13"
            ]
        );
        assert!(libraries_in(Path::new("/nonexistent/dir")).is_empty());
    }

    /// One copy of each library: the highest version in a directory (numerically: 13.10
    /// after 13.9), and a library two directories hold from the first of them only.
    #[test]
    fn each_library_is_loaded_once() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        for n in [
            "libcublas.so.12",
            "libcublas.so.13.9",
            "libcublas.so.13.10",
            "libnvrtc.so.13",
        ] {
            std::fs::write(a.path().join(n), b"").unwrap();
        }
        for n in [
            "libnvrtc.so.13",
            "libnvrtc-builtins.so.13.0",
            "libcublas.so.13",
        ] {
            std::fs::write(b.path().join(n), b"").unwrap();
        }
        let plan = preload_plan(&[a.path().to_path_buf(), b.path().to_path_buf()]);
        let got: Vec<(bool, String)> = plan
            .iter()
            .map(|p| {
                (
                    p.starts_with(a.path()),
                    p.file_name().unwrap().to_string_lossy().into_owned(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (false, "libnvrtc-builtins.so.13.0".to_string()),
                (true, "libnvrtc.so.13".to_string()),
                (true, "libcublas.so.13.10".to_string()),
            ]
        );
        assert_eq!(version_of("libcublasLt.so.13", "libcublas.so"), None);
        assert_eq!(version_of("libcublasLt_static.a", "libcublasLt.so"), None);
        assert_eq!(version_of("libnvrtc.alt.so.13", "libnvrtc.so"), None);
    }

    #[test]
    fn opening_a_non_library_fails_with_the_path() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("libnvrtc.so.13");
        std::fs::write(&p, b"not an ELF file").unwrap();
        let e = open_path(&p).unwrap_err();
        assert!(e.contains("libnvrtc.so.13"), "{e}");
    }
}
