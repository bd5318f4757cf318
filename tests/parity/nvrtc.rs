//! Every CUDA kernel compiles with NVRTC to sm_90 machine code, on any machine: NVRTC is a
//! plain library (no GPU, no driver). ptxas runs inside NVRTC, so inline PTX (the tensor
//! core `mma.sync`) is assembled too, and its resource report is checked: the hot kernels
//! must not spill to local memory.
//!
//! NVRTC is found through `NINFER_NVRTC_LIB_DIR` (what `ci/install-nvrtc.sh` prints), else
//! `eval/.cache/nvrtc/<version>/nvidia/cu13/lib`, else the dynamic loader's search path.
//! Without it the test is reported ignored with that reason; a kernel that fails to compile
//! fails it.

use ninfer_perplexity::backend::cuda::kernels::{is_hot, Program};
use ninfer_perplexity::backend::cuda::{loader, nvrtc};
use std::path::PathBuf;

/// Loads NVRTC from the places above (`Err(why)` when it is not there or does not load).
pub fn probe() -> Result<(), String> {
    let mut dirs: Vec<PathBuf> = loader::env_dirs();
    let cache = crate::common::repo().join("eval/.cache/nvrtc");
    if let Ok(rd) = std::fs::read_dir(&cache) {
        for e in rd.flatten() {
            dirs.push(e.path().join("nvidia/cu13/lib"));
        }
    }
    for d in &dirs {
        for lib in loader::libraries_in(d) {
            loader::open_path(&lib)
                .map_err(|e| format!("NVRTC is there but does not load: {e}"))?;
        }
    }
    if !loader::nvrtc_present() {
        return Err(format!(
            "libnvrtc.so.13 not found (run `export NINFER_NVRTC_LIB_DIR=\"$(bash ci/install-nvrtc.sh)\"`; searched {dirs:?} and the loader path)"
        ));
    }
    Ok(())
}

#[test(nvrtc)]
fn nvrtc_compiles_every_kernel() {
    let (maj, min) = nvrtc::version().expect("nvrtcVersion");
    eprintln!("NVRTC {maj}.{min}");

    // Programs compile in parallel (each NVRTC program is independent); results in order.
    use rayon::prelude::*;
    let results: Vec<(Program, f64, Result<nvrtc::Compiled, String>)> = Program::all()
        .into_par_iter()
        .map(|p| {
            let t = std::time::Instant::now();
            let c = nvrtc::compile(&p, "sm_90", true);
            (p, t.elapsed().as_secs_f64(), c)
        })
        .collect();
    let mut failures = Vec::new();
    let mut table = Vec::new();
    for (p, secs, c) in results {
        let c = match c {
            Ok(c) => c,
            Err(e) => {
                failures.push(e);
                continue;
            }
        };
        eprintln!(
            "kernels/{}: {} bytes of sm_90 code in {secs:.1}s",
            p.key(),
            c.cubin.len()
        );
        assert!(
            c.cubin.starts_with(b"\x7fELF"),
            "kernels/{}: NVRTC returned no ELF CUBIN",
            p.key()
        );
        // With NINFER_CUDA_CACHE_DIR set, this run also fills the CUBIN cache that a GPU
        // machine without time to compile can be given.
        nvrtc::store_cached(&p, "sm_90", &c.cubin);
        let res = nvrtc::parse_ptxas_log(&c.log);
        for w in c.log.lines().filter(|l| l.contains("warning")) {
            eprintln!("  {w}");
        }
        for e in p.entries() {
            match res.iter().find(|r| r.name == e) {
                None => failures.push(format!(
                    "kernels/{}: entry `{e}` missing from the compiled program",
                    p.key()
                )),
                Some(r) => {
                    if is_hot(&e) && (r.spill_stores > 0 || r.spill_loads > 0) {
                        failures.push(format!(
                            "`{e}` spills to local memory ({} bytes stored, {} loaded, {} registers)",
                            r.spill_stores, r.spill_loads, r.registers
                        ));
                    }
                    table.push(r.clone());
                }
            }
        }
    }
    eprintln!(
        "{:<28} {:>5} {:>7} {:>7} {:>6} {:>7}",
        "kernel (sm_90)", "regs", "spill-w", "spill-r", "stack", "smem"
    );
    for r in &table {
        eprintln!(
            "{:<28} {:>5} {:>7} {:>7} {:>6} {:>7}",
            r.name, r.registers, r.spill_stores, r.spill_loads, r.stack_frame, r.shared_bytes
        );
    }
    assert!(
        failures.is_empty(),
        "{} kernel failure(s):\n{}",
        failures.len(),
        failures.join("\n")
    );
}
