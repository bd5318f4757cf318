//! The CUDA kernel sources, embedded at build time, and the NVRTC programs made of them.
//!
//! A program is `kernels/common.cuh` followed by one `kernels/*.cu` file, so NVRTC needs no
//! include path or CUDA header at run time. The modules whose kernels are instantiated per
//! Main KV representation (`qkv`, `attention`) are compiled once per representation, with
//! `KV_ONLY_<name>` defined, so a run compiles only what it launches.

/// Shared device code, prepended to every program.
pub const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// One `kernels/*.cu` file.
pub struct KernelModule {
    pub name: &'static str,
    pub source: &'static str,
    /// Compiled once per KV representation.
    pub per_kv: bool,
}

pub const MODULES: [KernelModule; 8] = [
    KernelModule {
        name: "elementwise",
        source: include_str!("../../../kernels/elementwise.cu"),
        per_kv: false,
    },
    KernelModule {
        name: "qkv",
        source: include_str!("../../../kernels/qkv.cu"),
        per_kv: true,
    },
    KernelModule {
        name: "attention",
        source: include_str!("../../../kernels/attention.cu"),
        per_kv: true,
    },
    KernelModule {
        name: "head",
        source: include_str!("../../../kernels/head.cu"),
        per_kv: false,
    },
    KernelModule {
        name: "codec",
        source: include_str!("../../../kernels/codec.cu"),
        per_kv: false,
    },
    KernelModule {
        name: "weights",
        source: include_str!("../../../kernels/weights.cu"),
        per_kv: false,
    },
    KernelModule {
        name: "delta_net",
        source: include_str!("../../../kernels/delta_net.cu"),
        per_kv: false,
    },
    KernelModule {
        name: "moe",
        source: include_str!("../../../kernels/moe.cu"),
        per_kv: false,
    },
];

/// KV representation names as they appear in entry points (`KvDtype::ident`).
pub const KV_NAMES: [&str; 7] = ["f32", "bf16", "int8", "fp8", "nvfp4", "k8v4", "fp8tensor"];
/// Element formats of the standalone codecs (`Elem::name`).
const ELEM_NAMES: [&str; 7] = ["f32", "bf16", "f16", "int8", "fp8", "nvfp4", "fp8tensor"];

/// What NVRTC compiles: a module, for one KV representation when the module is per-KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Program {
    pub module: &'static str,
    pub kv: Option<&'static str>,
}

fn module(name: &str) -> &'static KernelModule {
    MODULES
        .iter()
        .find(|m| m.name == name)
        .unwrap_or_else(|| panic!("unknown kernel module {name}"))
}

impl Program {
    /// Every program, each module's KV variants in `KV_NAMES` order.
    pub fn all() -> Vec<Program> {
        let mut v = Vec::new();
        for m in &MODULES {
            if m.per_kv {
                v.extend(KV_NAMES.iter().map(|k| Program {
                    module: m.name,
                    kv: Some(*k),
                }));
            } else {
                v.push(Program {
                    module: m.name,
                    kv: None,
                });
            }
        }
        v
    }

    /// A name for logs and caches: `attention[int8]`.
    pub fn key(&self) -> String {
        match self.kv {
            Some(k) => format!("{}[{k}]", self.module),
            None => self.module.to_string(),
        }
    }

    /// The full text NVRTC compiles.
    pub fn text(&self) -> String {
        let m = module(self.module);
        let define = match self.kv {
            Some(k) => format!("#define KV_ONLY_{k} 1\n"),
            None => String::new(),
        };
        format!(
            "{define}{COMMON}\n// ---- kernels/{}.cu\n{}",
            m.name, m.source
        )
    }

    /// Every `extern "C"` entry point the program defines.
    pub fn entries(&self) -> Vec<String> {
        match (self.module, self.kv) {
            ("elementwise", _) => [
                "embed_gather",
                "rms_norm",
                "swiglu",
                "residual_add",
                "cast_f32_bf16",
                "attn_output_gate",
                "hadamard_rows",
                "nonfinite_scan",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            ("qkv", Some(k)) => [2, 4, 8]
                .iter()
                .map(|nk| format!("qkv_prep_{k}_nk{nk}"))
                .collect(),
            ("attention", Some(k)) => {
                vec![
                    format!("attn_f32_{k}"),
                    format!("attn_mma_{k}_d64"),
                    format!("attn_mma_{k}_d128"),
                    format!("attn_mma_{k}_d256"),
                ]
            }
            ("head", _) => [
                "head_reduce",
                "head_finish",
                "head_pair_reduce",
                "head_pair_js",
                "head_pair_finish",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            ("weights", _) => vec!["dequant_nvfp4".into(), "dequant_fp8".into()],
            ("moe", _) => [
                "moe_route",
                "moe_combine",
                "moe_count",
                "moe_offsets",
                "moe_place",
                "moe_gemm_bf16",
                "moe_gemm_f32",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            ("delta_net", _) => [
                "delta_conv_silu",
                "delta_prep",
                "delta_rule_recurrent",
                "delta_rule_chunked",
                "delta_rule_chunked_tc",
                "delta_gated_norm",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            ("codec", _) => {
                let mut v: Vec<String> = ELEM_NAMES
                    .iter()
                    .flat_map(|e| {
                        [
                            format!("kv_encode_{e}_nk2"),
                            format!("kv_encode_{e}_nk4"),
                            format!("kv_encode_{e}_nk8"),
                            format!("kv_decode_{e}"),
                        ]
                    })
                    .collect();
                v.push("e4m3_encode".into());
                v.push("e2m1_encode".into());
                v
            }
            (m, k) => panic!("no program {m} {k:?}"),
        }
    }

    /// The program that defines an entry point.
    pub fn of(entry: &str) -> Option<Program> {
        Program::all()
            .into_iter()
            .find(|p| p.entries().iter().any(|e| e == entry))
    }
}

/// Entry points whose speed matters most: local-memory spills there are a defect. Besides
/// attention, the q/k/v preparation and the head, the Qwen3.5 family's own: every Gated
/// DeltaNet kernel (the chunked rule above all) and the MoE routing and combination.
pub fn is_hot(entry: &str) -> bool {
    ["attn_mma_", "qkv_prep_", "head_", "delta_", "moe_"]
        .iter()
        .any(|p| entry.starts_with(p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::plan::{qkv_entry, AttnKernel, Precision};
    use crate::kv::{Elem, KvDtype};

    /// The 27B's hot kernels are held to "no spills" (tests/parity/nvrtc.rs) with the rest.
    #[test]
    fn the_hybrid_and_moe_kernels_are_hot() {
        for e in [
            "delta_rule_chunked",
            "delta_rule_chunked_tc",
            "delta_prep",
            "moe_route",
            "moe_gemm_bf16",
            "moe_gemm_f32",
            "attn_mma_bf16_d256",
            "head_pair_js",
        ] {
            assert!(is_hot(e), "{e}");
        }
        for e in [
            "kv_decode_f32",
            "dequant_fp8",
            "attn_f32_bf16",
            "nonfinite_scan",
        ] {
            assert!(!is_hot(e), "{e}");
        }
    }

    #[test]
    fn every_launched_entry_has_a_program() {
        for kv in KvDtype::ALL {
            assert!(KV_NAMES.contains(&kv.ident()));
            for hd in [8, 64, 128, 256] {
                let q = qkv_entry(kv, hd).unwrap();
                assert_eq!(
                    Program::of(&q),
                    Some(Program {
                        module: "qkv",
                        kv: Some(kv.ident())
                    }),
                    "{q}"
                );
                for p in [Precision::Bf16, Precision::F32] {
                    let a = AttnKernel::choose(p, hd).entry(kv);
                    assert_eq!(
                        Program::of(&a),
                        Some(Program {
                            module: "attention",
                            kv: Some(kv.ident())
                        }),
                        "{a}"
                    );
                }
            }
        }
        for e in Elem::ALL {
            assert_eq!(
                Program::of(&format!("kv_encode_{}_nk4", e.name()))
                    .unwrap()
                    .module,
                "codec"
            );
            assert_eq!(
                Program::of(&format!("kv_decode_{}", e.name()))
                    .unwrap()
                    .module,
                "codec"
            );
        }
        for e in [
            "embed_gather",
            "rms_norm",
            "swiglu",
            "head_reduce",
            "head_finish",
            "head_pair_reduce",
            "head_pair_js",
            "head_pair_finish",
            "dequant_nvfp4",
            "dequant_fp8",
            "delta_conv_silu",
            "delta_prep",
            "delta_rule_recurrent",
            "delta_gated_norm",
            "moe_route",
            "moe_combine",
            "moe_count",
            "moe_offsets",
            "moe_place",
            "moe_gemm_bf16",
            "moe_gemm_f32",
        ] {
            assert!(Program::of(e).is_some(), "{e}");
        }
        assert!(Program::of("nope").is_none());
        assert_eq!(Program::all().len(), 6 + 2 * KV_NAMES.len());
    }

    /// The host's launch constants equal the kernels' compile-time ones.
    #[test]
    fn host_constants_match_the_kernel_sources() {
        use crate::backend::cuda::plan;
        let def = |m: &str, name: &str| -> usize {
            let src = module(m).source;
            let line = src
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("#define {name} in kernels/{m}.cu"));
            line.split_whitespace().nth(2).unwrap().parse().unwrap()
        };
        assert_eq!(def("attention", "AF_ROWS"), plan::ATTN_F32_ROWS);
        assert_eq!(def("attention", "AF_KEYS"), plan::ATTN_F32_KEYS);
        assert_eq!(def("attention", "AM_ROWS"), plan::ATTN_MMA_ROWS);
        assert_eq!(def("qkv", "QKV_WARPS"), plan::QKV_WARPS);
    }

    #[test]
    fn programs_are_self_contained_and_select_their_variant() {
        for p in Program::all() {
            let t = p.text();
            assert!(t.contains(COMMON));
            if let Some(k) = p.kv {
                assert!(
                    t.starts_with(&format!("#define KV_ONLY_{k} 1\n")),
                    "{}",
                    p.key()
                );
                // The source guards every variant it instantiates.
                assert!(
                    module(p.module)
                        .source
                        .contains(&format!("defined(KV_ONLY_{k})")),
                    "{}",
                    p.key()
                );
            }
        }
        for m in &MODULES {
            assert!(
                !m.source.contains("#include"),
                "{} must not include headers",
                m.name
            );
        }
        assert!(!COMMON.contains("#include"));
        assert_eq!(
            Program {
                module: "attention",
                kv: Some("int8")
            }
            .key(),
            "attention[int8]"
        );
    }
}
