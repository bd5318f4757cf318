//! The quantized KV formats (the seed engine's Int8Group64, Fp8E4M3Row256, Nvfp4Group16 and
//! its Hadamard rotation) against the PyTorch reference fixtures (bit for bit; the rotation
//! to within its f32 rounding), hand-computed cases for each rule, and round-trip error
//! bounds as property tests.
//!
//! Fixtures: `eval/fixtures/kv/index.json` + `.bin` arrays, written by
//! `eval/generators/make_kv_fixtures.py`.

use std::path::PathBuf;

use half::f16;
use ninfer_perplexity::kv::{self, fp8, hadamard, int8, nvfp4, Elem, KvDtype};
use proptest::prelude::*;
use serde_json::Value;

// ----------------------------------------------------------------------------- fixtures

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("eval/fixtures/kv")
}

fn index() -> Value {
    let p = fixture_dir().join("index.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).expect("index.json parses")
}

fn bytes(name: &Value) -> Vec<u8> {
    let p = fixture_dir().join(name.as_str().expect("file name"));
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn f32s(name: &Value) -> Vec<f32> {
    bytes(name)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn usize_of(v: &Value) -> usize {
    v.as_u64().expect("integer") as usize
}

/// Collects mismatches and fails with the first few of them.
#[derive(Default)]
struct Mismatches {
    count: usize,
    first: Vec<String>,
}

impl Mismatches {
    fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        if !ok {
            self.count += 1;
            if self.first.len() < 10 {
                self.first.push(what());
            }
        }
    }

    fn finish(self, what: &str, total: usize) {
        assert!(total > 0, "{what}: no fixture data");
        assert!(
            self.count == 0,
            "{what}: {} of {total} mismatches:\n{}",
            self.count,
            self.first.join("\n")
        );
    }
}

#[test]
fn fixture_index_is_complete() {
    let idx = index();
    assert_eq!(idx["version"], 2);
    let scalar: Vec<&str> = idx["scalar"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["kind"].as_str().unwrap())
        .collect();
    assert!(scalar.contains(&"e4m3") && scalar.contains(&"e2m1"));
    for fmt in ["int8", "fp8", "nvfp4"] {
        let dims: Vec<usize> = idx["vectors"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|v| v["format"] == fmt)
            .map(|v| usize_of(&v["head_dim"]))
            .collect();
        for hd in [8, 64, 80, 128] {
            assert!(dims.contains(&hd), "{fmt}: no fixture for head_dim {hd}");
        }
    }
    let total: u64 = std::fs::read_dir(fixture_dir())
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    let sizes: Vec<u64> = idx["rotations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["n"].as_u64().unwrap())
        .collect();
    assert!(sizes.contains(&64) && sizes.contains(&128) && sizes.contains(&256));
    assert!(total < 2_200_000, "fixtures take {total} bytes");
}

#[test]
fn e4m3_and_e2m1_scalars_match_torch() {
    let idx = index();
    for set in idx["scalar"].as_array().unwrap() {
        let name = set["name"].as_str().unwrap();
        let x = f32s(&set["input"]);
        let want = bytes(&set["codes"]);
        assert_eq!(x.len(), usize_of(&set["n"]), "{name}");
        assert_eq!(x.len(), want.len(), "{name}");
        let mut mm = Mismatches::default();
        for (&v, &w) in x.iter().zip(&want) {
            let got = match set["kind"].as_str().unwrap() {
                "e4m3" => fp8::e4m3_from_f32(v),
                "e2m1" => nvfp4::e2m1_from_f32(v),
                k => panic!("unknown scalar kind {k}"),
            };
            mm.check(got == w, || {
                format!(
                    "{v:e} ({:#010x}): got {got:#04x}, want {w:#04x}",
                    v.to_bits()
                )
            });
        }
        mm.finish(name, x.len());
    }
}

fn f16s(name: &Value) -> Vec<f16> {
    bytes(name)
        .chunks_exact(2)
        .map(|c| f16::from_le_bytes([c[0], c[1]]))
        .collect()
}

/// Every fixture vector: encode gives the reference payload and scales, decode and the
/// in-place round trip give the reference values, all bit for bit.
#[test]
fn vectors_match_torch() {
    let idx = index();
    let mut sets = 0;
    for set in idx["vectors"].as_array().unwrap() {
        sets += 1;
        let name = set["name"].as_str().unwrap().to_string();
        let n = usize_of(&set["head_dim"]);
        let count = usize_of(&set["count"]);
        let x = f32s(&set["input"]);
        let codes = bytes(&set["codes"]);
        let decoded = f32s(&set["decoded"]);
        assert_eq!(x.len(), n * count, "{name}");
        assert_eq!(decoded.len(), n * count, "{name}");
        let fmt = set["format"].as_str().unwrap();
        let elem = match fmt {
            "int8" => Elem::Int8,
            "fp8" => Elem::Fp8,
            "nvfp4" => Elem::Nvfp4,
            f => panic!("unknown format {f}"),
        };
        // FP16 scales per vector: one per 64 (int8), one (fp8); nvfp4 has block scales only.
        let per = match elem {
            Elem::Int8 => int8::groups(n),
            Elem::Fp8 => 1,
            _ => 0,
        };
        let scales = if per > 0 {
            f16s(&set["scales"])
        } else {
            vec![]
        };
        assert_eq!(scales.len(), per * count, "{name}");
        let block_scales = if fmt == "nvfp4" {
            bytes(&set["block_scales"])
        } else {
            Vec::new()
        };
        let payload = if fmt == "nvfp4" { n.div_ceil(2) } else { n };
        assert_eq!(codes.len(), payload * count, "{name}");

        let mut mm = Mismatches::default();
        let mut out = vec![0f32; n];
        for r in 0..count {
            let xv = &x[r * n..(r + 1) * n];
            let want_codes = &codes[r * payload..(r + 1) * payload];
            let want_dec = &decoded[r * n..(r + 1) * n];
            let want_scales = &scales[r * per..(r + 1) * per];
            let stored = match elem {
                Elem::Int8 => {
                    let e = int8::encode(xv);
                    let got: Vec<u8> = e.codes.iter().map(|&q| q as u8).collect();
                    mm.check(got == want_codes, || {
                        format!("{name}[{r}] codes {got:?} != {want_codes:?}")
                    });
                    mm.check(e.scales == want_scales, || {
                        format!("{name}[{r}] scales {:?} != {want_scales:?}", e.scales)
                    });
                    int8::decode(&e, &mut out);
                    e.to_bytes()
                }
                Elem::Fp8 => {
                    let e = fp8::encode(xv);
                    mm.check(e.codes == want_codes, || {
                        format!("{name}[{r}] codes {:?} != {want_codes:?}", e.codes)
                    });
                    mm.check(e.scale.to_bits() == want_scales[0].to_bits(), || {
                        format!("{name}[{r}] scale {} != {}", e.scale, want_scales[0])
                    });
                    fp8::decode(&e, &mut out);
                    e.to_bytes()
                }
                Elem::Nvfp4 => {
                    let nb = n.div_ceil(16);
                    let want_bs = &block_scales[r * nb..(r + 1) * nb];
                    let e = nvfp4::encode(xv);
                    mm.check(e.packed == want_codes, || {
                        format!("{name}[{r}] packed {:02x?} != {want_codes:02x?}", e.packed)
                    });
                    mm.check(e.block_scales == want_bs, || {
                        format!(
                            "{name}[{r}] block scales {:02x?} != {want_bs:02x?}",
                            e.block_scales
                        )
                    });
                    nvfp4::decode(&e, &mut out);
                    e.to_bytes()
                }
                _ => unreachable!(),
            };
            assert_eq!(stored.len(), elem.bytes_per_vector(n), "{name}");
            assert_eq!(stored, elem.encode_bytes(xv), "{name}");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            mm.check(bits(&out) == bits(want_dec), || {
                format!("{name}[{r}] decode {out:?} != {want_dec:?}")
            });
            let mut rt = xv.to_vec();
            elem.roundtrip(&mut rt);
            mm.check(bits(&rt) == bits(want_dec), || {
                format!("{name}[{r}] roundtrip {rt:?} != {want_dec:?}")
            });
        }
        mm.finish(&name, count);
    }
    assert!(sets >= 12);
}

/// The rotation is the Sylvester Hadamard matrix over sqrt(n): the f32 butterfly lands
/// within a few f32 roundings of the exact (float64) product PyTorch computed.
#[test]
fn the_rotation_matches_the_exact_hadamard_product() {
    let idx = index();
    for set in idx["rotations"].as_array().unwrap() {
        let n = usize_of(&set["n"]);
        let count = usize_of(&set["count"]);
        let x = f32s(&set["input"]);
        let exact: Vec<f64> = bytes(&set["exact"])
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!((x.len(), exact.len()), (n * count, n * count));
        for (xv, want) in x.chunks(n).zip(exact.chunks(n)) {
            let mut y = xv.to_vec();
            hadamard::rotate(&mut y);
            // log2(n) additions and one product, each rounding by at most half an ulp of a
            // partial sum, and every partial sum is at most the vector's L1 norm.
            let l1: f64 = xv.iter().map(|v| v.abs() as f64).sum();
            let bound = l1 * (n.trailing_zeros() as f64 + 1.0) * f32::EPSILON as f64;
            for (j, (&a, &b)) in y.iter().zip(want).enumerate() {
                assert!(
                    (a as f64 - b).abs() <= bound,
                    "n {n} [{j}]: {a} vs exact {b} (bound {bound:e})"
                );
            }
        }
    }
}

// ----------------------------------------------------------------------------- hand-computed

/// NInfer's byte counts per (token, KV head), K + V, at head_dim 256: bf16 1024, int8 528,
/// fp8 516, nvfp4 288, k8v4 402 (paged_kv_storage.h). Other head dims follow the same rules.
#[test]
fn bytes_per_vector_are_the_seed_engines() {
    let per_head = |k: KvDtype, d| k.bytes_per_token_per_layer(1, d);
    assert_eq!(per_head(KvDtype::Bf16, 256), 1024);
    assert_eq!(per_head(KvDtype::Int8, 256), 528);
    assert_eq!(per_head(KvDtype::Fp8, 256), 516);
    assert_eq!(per_head(KvDtype::Nvfp4, 256), 288);
    assert_eq!(per_head(KvDtype::K8v4, 256), 402);
    assert_eq!(per_head(KvDtype::F32, 256), 2048);
    for hd in HEAD_DIMS {
        assert_eq!(Elem::Int8.bytes_per_vector(hd), hd + 2 * hd.div_ceil(64));
        assert_eq!(Elem::Fp8.bytes_per_vector(hd), hd + 2);
        assert_eq!(
            Elem::Nvfp4.bytes_per_vector(hd),
            hd.div_ceil(2) + hd.div_ceil(16)
        );
        assert_eq!(Elem::F16.bytes_per_vector(hd), 2 * hd);
        for e in QUANT {
            let x: Vec<f32> = (0..hd).map(|i| (i as f32 - 3.3).sin()).collect();
            assert_eq!(
                e.encode_bytes(&x).len(),
                e.bytes_per_vector(hd),
                "{e:?} {hd}"
            );
        }
    }
    // Per token per layer, 8 KV heads of 64.
    assert_eq!(KvDtype::Int8.bytes_per_token_per_layer(8, 64), 8 * 2 * 66);
    assert_eq!(
        KvDtype::K8v4.bytes_per_token_per_layer(8, 64),
        8 * (66 + 36)
    );
}

/// The representations are NInfer's: element formats, rotations, report names, default.
#[test]
fn the_five_names_are_the_seed_engines_formats() {
    use KvDtype::*;
    let elems = |k: KvDtype| (k.key_elem(), k.value_elem());
    assert_eq!(
        elems(Bf16),
        (Elem::Bf16, Elem::F16),
        "bf16 stores V in FP16"
    );
    assert_eq!(elems(Int8), (Elem::Int8, Elem::Int8));
    assert_eq!(elems(Fp8), (Elem::Fp8, Elem::Fp8));
    assert_eq!(elems(Nvfp4), (Elem::Nvfp4, Elem::Nvfp4));
    assert_eq!(
        elems(K8v4),
        (Elem::Fp8, Elem::Nvfp4),
        "fp8 keys, nvfp4 values"
    );
    let rot = |k: KvDtype, d| {
        let r = k.rotation(d);
        (r.keys, r.values)
    };
    for d in [64, 128, 256] {
        assert_eq!(rot(Bf16, d), (false, false));
        assert_eq!(rot(F32, d), (false, false));
        assert_eq!(rot(Int8, d), (true, false));
        assert_eq!(rot(Fp8, d), (true, false));
        assert_eq!(rot(Nvfp4, d), (true, true));
        assert_eq!(rot(K8v4, d), (true, true));
    }
    for d in [80, 96, 33] {
        assert_eq!(rot(Nvfp4, d), (false, false), "no rotation at head_dim {d}");
    }
    let names: Vec<String> = [Bf16, Int8, Fp8, Nvfp4, K8v4, F32]
        .iter()
        .map(|k| k.format_name(256))
        .collect();
    assert_eq!(
        names,
        ["bf16", "int8-g64", "fp8-e4m3-r256", "nvfp4", "k8v4", "f32"]
    );
    assert_eq!(Fp8.format_name(128), "fp8-e4m3-r128");
}

#[test]
fn head_dims_accepted_and_zero_rejected() {
    for k in KvDtype::ALL {
        for hd in [1, 2, 7, 8, 24, 33, 64, 80, 96, 128, 256] {
            k.check_head_dim(hd).unwrap();
        }
        let err = k.check_head_dim(0).unwrap_err().to_string();
        assert!(
            err.contains("head_dim 0") && err.contains(k.name()),
            "{err}"
        );
    }
}

#[test]
fn all_zero_vectors_store_zeros_and_decode_to_positive_zeros() {
    for e in QUANT {
        for hd in HEAD_DIMS {
            for z in [0.0f32, -0.0] {
                let x = vec![z; hd];
                let y = roundtripped(e, &x);
                assert!(
                    y.iter().all(|v| v.to_bits() == 0),
                    "{e:?} hd {hd} zero {z}: {y:?}"
                );
                let stored = e.encode_bytes(&x);
                assert!(
                    stored.iter().all(|&b| b == 0),
                    "{e:?} hd {hd}: stored {stored:?}"
                );
            }
        }
    }
    // An all-zero group or block among non-zero ones: its own scale is 0 (int8, nvfp4).
    let mut x = vec![0.0f32; 128];
    x[3] = 1.0;
    assert_eq!(int8::encode(&x).scales[1], f16::ZERO);
    assert_eq!(nvfp4::encode(&x).block_scales[1..], [0u8; 7]);
}

#[test]
fn negative_zero() {
    let mut x = vec![1.0f32; 64];
    x[5] = -0.0;
    x[6] = -1e-30; // rounds to zero in every format
                   // int8 has no negative zero.
    let y = roundtripped(Elem::Int8, &x);
    assert_eq!(y[5].to_bits(), 0);
    assert_eq!(y[6].to_bits(), 0);
    // fp8 and nvfp4 keep the sign of zero: codes 0x80 and 0x8, decoded -0.0.
    let e = fp8::encode(&x);
    assert_eq!((e.codes[5], e.codes[6]), (0x80, 0x80));
    let y = roundtripped(Elem::Fp8, &x);
    assert_eq!(
        (y[5].to_bits(), y[6].to_bits()),
        ((-0.0f32).to_bits(), (-0.0f32).to_bits())
    );
    let e = nvfp4::encode(&x);
    assert_eq!((e.code(5), e.code(6)), (0x8, 0x8));
    let y = roundtripped(Elem::Nvfp4, &x);
    assert_eq!(
        (y[5].to_bits(), y[6].to_bits()),
        ((-0.0f32).to_bits(), (-0.0f32).to_bits())
    );
}

/// Scales are FP16, rounded to nearest even: the int8 scale of amax 127·(1 + 3·2^-11) is the
/// tie between 1 + 2^-10 and 1 + 2^-9 (odd, even mantissa): it rounds to 1 + 2^-9; fp8 with
/// amax 448·(1 + 2^-11) is the tie between 1 (even) and 1 + 2^-10: it rounds to 1.
#[test]
fn fp16_scales_round_to_nearest_even() {
    let t = 1.0f32 + 3.0 * 2f32.powi(-11);
    let mut x = vec![0.0f32; 64];
    x[0] = 127.0 * t;
    assert_eq!(x[0] / 127.0, t, "the quotient is the exact tie");
    assert_eq!(int8::encode(&x).scales[0].to_f32(), 1.0 + 2f32.powi(-9));
    let t = 1.0f32 + 2f32.powi(-11);
    let x = [448.0 * t, 1.0];
    assert_eq!(x[0] / 448.0, t);
    let e = fp8::encode(&x);
    assert_eq!(e.scale, f16::ONE);
    // 448·(1 + 2^-11) · (1/1) passes 448: saturates.
    assert_eq!(e.codes[0], 0x7E);
    // An FP16 subnormal scale is kept, not flushed: amax 127·2^-20.
    let mut x = vec![0.0f32; 64];
    x[0] = 127.0 * 2f32.powi(-20);
    let s = int8::encode(&x).scales[0];
    assert!(!s.is_normal() && s.to_f32() == 2f32.powi(-20));
}

/// Codes are value · (1/scale) for int8 and fp8 (a reciprocal multiply, as NInfer computes
/// them), not value / scale: a value next to a rounding tie whose two codes differ is
/// searched for over FP16 scales in [0.5, 2), and int8 must give the reciprocal's code.
#[test]
fn int8_multiplies_by_the_reciprocal() {
    let mut found = None;
    'search: for bits in 0x3800u16..0x4000 {
        let s = f16::from_bits(bits).to_f32();
        let r = 1.0 / s;
        for m in 0..127 {
            let tie = (m as f32 + 0.5) * s;
            for v in [
                f32::from_bits(tie.to_bits() - 1),
                tie,
                f32::from_bits(tie.to_bits() + 1),
            ] {
                if v <= 127.0 * s && (v * r).round_ties_even() != (v / s).round_ties_even() {
                    found = Some((s, v));
                    break 'search;
                }
            }
        }
    }
    let (s, v) = found.expect("a value that tells x·(1/s) from x/s apart");
    let mut x = vec![0.0f32; 64];
    x[0] = 127.0 * s;
    x[1] = v;
    let e = int8::encode(&x);
    assert_eq!(e.scales[0].to_f32(), s, "amax/127 is the FP16 scale itself");
    assert_eq!(e.codes[1] as f32, (v * (1.0 / s)).round_ties_even());
    assert_ne!(e.codes[1] as f32, (v / s).round_ties_even());
}

/// fp8 clamps its scale to [2^-24, 65504]; nvfp4 its block scale to [2^-9, 448]; int8 does
/// not clamp (a scale below half of 2^-24 is 0, one past 65504 infinite).
#[test]
fn scale_clamps() {
    let tiny = f32::from_bits(1); // 2^-149
    let x = [tiny, -tiny, 0.0, tiny];
    assert_eq!(fp8::encode(&x).scale.to_f32(), 2f32.powi(-24));
    assert_eq!(nvfp4::encode(&x).block_scales, vec![0x01]);
    assert_eq!(int8::encode(&x).scales[0], f16::ZERO);
    assert!(roundtripped(Elem::Int8, &x)
        .iter()
        .all(|v| v.to_bits() == 0));
    let big = [3e38f32, -1.0];
    assert_eq!(fp8::encode(&big).scale.to_f32(), 65504.0);
    assert_eq!(nvfp4::encode(&big).block_scales, vec![0x7E]);
    let y = roundtripped(Elem::Fp8, &big);
    assert_eq!(y[0], 448.0 * 65504.0, "saturates at 448 · 65504");
    let y = roundtripped(Elem::Nvfp4, &big);
    assert_eq!(y[0], 6.0 * 448.0, "saturates at 6 · 448");
    let mut x = vec![0.0f32; 64];
    x[9] = 1e7;
    assert!(int8::encode(&x).scales[0].is_infinite());
}

#[test]
fn rounding_boundaries() {
    // int8: amax 127 makes scale exactly 1, so k + 0.5 is an exact tie: to even.
    let mut x = vec![127.0f32; 8];
    x[1..7].copy_from_slice(&[0.5, 1.5, 2.5, -0.5, -1.5, 126.5]);
    assert_eq!(int8::encode(&x).codes, vec![127, 0, 2, 2, 0, -2, 126, 127]);
    // fp8: amax 448 makes scale 1: e4m3 ties.
    let x = [
        448.0f32,
        1.0625,
        1.1875,
        17.0,
        19.0,
        432.0,
        15.0 * 2f32.powi(-10),
    ];
    assert_eq!(
        fp8::encode(&x).codes,
        vec![0x7E, 0x38, 0x3A, 0x58, 0x5A, 0x7E, 0x08]
    );
    // nvfp4: a block with amax 2688 has block scale 448 (0x7E), so x / d = x / 448.
    let mids = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    let want = [0u8, 2, 2, 4, 4, 6, 6];
    let mut x = vec![2688.0f32];
    x.extend(mids.iter().map(|m| m * 448.0));
    x.extend(mids.iter().map(|m| -m * 448.0));
    let e = nvfp4::encode(&x);
    assert_eq!(e.block_scales, vec![0x7E]);
    for (i, &w) in want.iter().enumerate() {
        assert_eq!(e.code(1 + i), w, "{}", mids[i]);
        assert_eq!(e.code(8 + i), w | 8, "-{}", mids[i]);
    }
    // A block scale tie: amax_b / 6 = 17 (between 16 and 18, even mantissa 16).
    let mut x = vec![0f32; 32];
    x[0] = 2688.0;
    x[16] = 6.0 * 17.0;
    assert_eq!(nvfp4::encode(&x).block_scales[1], fp8::e4m3_from_f32(16.0));
}

#[test]
fn find_non_finite_reports_first() {
    assert_eq!(kv::find_non_finite(&[]), None);
    assert_eq!(
        kv::find_non_finite(&[1.0, f32::MAX, -0.0, f32::from_bits(1)]),
        None
    );
    assert_eq!(
        kv::find_non_finite(&[1.0, 2.0, f32::NAN, f32::INFINITY]),
        Some(2)
    );
    assert_eq!(kv::find_non_finite(&[f32::NEG_INFINITY]), Some(0));
    let mut v = vec![0.5f32; 130];
    v[129] = f32::INFINITY;
    assert_eq!(kv::find_non_finite(&v), Some(129));
}

#[test]
fn non_finite_inputs_do_not_panic() {
    for e in QUANT {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = vec![1.0f32; 40];
            x[17] = bad;
            e.roundtrip(&mut x);
            let _ = e.encode_bytes(&x);
        }
    }
}

// ----------------------------------------------------------------------------- properties

const QUANT: [Elem; 3] = [Elem::Int8, Elem::Fp8, Elem::Nvfp4];
const HEAD_DIMS: [usize; 6] = [64, 128, 80, 8, 24, 33];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// decode(encode(x)) through each module's own API.
fn via_encode(elem: Elem, x: &[f32]) -> Vec<f32> {
    let mut out = vec![f32::NAN; x.len()];
    match elem {
        Elem::Int8 => int8::decode(&int8::encode(x), &mut out),
        Elem::Fp8 => fp8::decode(&fp8::encode(x), &mut out),
        Elem::Nvfp4 => nvfp4::decode(&nvfp4::encode(x), &mut out),
        _ => unreachable!(),
    }
    out
}

fn roundtripped(elem: Elem, x: &[f32]) -> Vec<f32> {
    let mut y = x.to_vec();
    elem.roundtrip(&mut y);
    assert_eq!(
        bits(&y),
        bits(&via_encode(elem, x)),
        "{elem:?}: roundtrip != decode(encode)"
    );
    y
}

/// Vectors of assorted lengths (full and partial groups and blocks) and magnitudes between
/// 2^lo and 2^hi (16 times more for occasional outliers), with zeros and tiny values.
fn vectors(lo: i32, hi: i32) -> impl Strategy<Value = Vec<f32>> {
    let len = prop_oneof![
        Just(8usize),
        Just(16),
        Just(64),
        Just(80),
        Just(128),
        Just(256),
        1usize..300
    ];
    (len, lo..hi).prop_flat_map(|(n, exp)| {
        let scale = 2f32.powi(exp);
        let elem = prop_oneof![
            8 => (-1.0f32..1.0).prop_map(move |v| v * scale),
            1 => (-1.0f32..1.0).prop_map(move |v| v * scale * 16.0),
            1 => Just(0.0f32),
            1 => (-1.0f32..1.0).prop_map(move |v| v * scale * 1e-6),
        ];
        proptest::collection::vec(elem, n)
    })
}

fn max_abs(x: &[f32]) -> f64 {
    x.iter().fold(0f64, |m, &v| m.max((v as f64).abs()))
}

proptest! {
    // No regression files: failures are turned into named tests instead.
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    /// In-place roundtrip is bit for bit decode(encode), for any finite bit pattern whose
    /// int8 scales stay finite (an amax past 127 · 65504 decodes to NaN by definition).
    #[test]
    fn roundtrip_is_decode_of_encode(x in proptest::collection::vec(any::<u32>(), 1..100)) {
        let x: Vec<f32> = x.into_iter().map(f32::from_bits).filter(|v| v.is_finite()).collect();
        for e in QUANT {
            let mut y = x.clone();
            e.roundtrip(&mut y);
            prop_assert_eq!(bits(&y), bits(&via_encode(e, &x)));
            if e != Elem::Int8 || max_abs(&x) < 127.0 * 65504.0 {
                prop_assert!(y.iter().all(|v| v.is_finite()));
            }
        }
    }

    /// int8, per group of 64 whose FP16 scale s is normal (amax between 127 · 2^-14 and
    /// 127 · 65504): every element within half a step, |x - x̂| <= s/2 + amax·2^-20 (the f32
    /// roundings of 1/s, x·(1/s) and q·s); the FP16 rounding of s (2^-11 relative) keeps
    /// |x·(1/s)| below 127.5, so nothing clamps.
    #[test]
    fn int8_error_bound(x in vectors(-4, 19)) {
        let enc = int8::encode(&x);
        let y = roundtripped(Elem::Int8, &x);
        for ((xg, yg), s) in x.chunks(64).zip(y.chunks(64)).zip(&enc.scales) {
            let s = s.to_f32() as f64;
            if !s.is_normal() || s < 2f64.powi(-14) {
                continue;
            }
            let amax = max_abs(xg);
            let bound = s / 2.0 + amax * 2f64.powi(-20);
            for (&a, &b) in xg.iter().zip(yg) {
                prop_assert!(((a - b) as f64).abs() <= bound, "{} -> {} (bound {})", a, b, bound);
            }
        }
        prop_assert!(enc.codes.iter().all(|&q| q != -128));
    }

    /// fp8 with an FP16-normal scale (amax between 448 · 2^-14 and 448 · 65504): relative
    /// half-ulp in the e4m3 normal range, half the subnormal step below it, and the
    /// saturation of the amax element when the scale rounded down (at most 2^-11 relative):
    /// |x - x̂| <= 2^-4·|x| + 2^-10·s + amax·2^-10.
    #[test]
    fn fp8_error_bound(x in vectors(-5, 20)) {
        let enc = fp8::encode(&x);
        let s = enc.scale.to_f32() as f64;
        prop_assume!(s >= 2f64.powi(-14));
        let amax = max_abs(&x);
        let y = roundtripped(Elem::Fp8, &x);
        for (&a, &b) in x.iter().zip(&y) {
            let bound = 2f64.powi(-4) * (a as f64).abs() + 2f64.powi(-10) * s + amax * 2f64.powi(-10);
            prop_assert!(((a - b) as f64).abs() <= bound, "{} -> {} (bound {})", a, b, bound);
        }
    }

    /// nvfp4, per block with scale S (amax_b at most 6 · 448, so S is not clamped from
    /// above). Values with |x/S| <= 6 are within one grid unit S (the largest gap of the e2m1
    /// grid is 2, from 4 to 6). Larger ones saturate to 6·S, which is short of amax_b by at
    /// most 6·2^-10: S is amax_b/6 rounded to e4m3, low by at most 1/16 relative when normal
    /// (overshoot <= 6/16 units) and by at most half the subnormal step, 2^-10, otherwise; a
    /// block whose amax_b/6 is below 2^-9 gets S = 2^-9 and never saturates. Hence
    /// max |x - x̂| <= max(S, 6·2^-10), with 2^-16 relative slack for the f32 division.
    #[test]
    fn nvfp4_error_bound(x in vectors(-60, 7)) {
        let enc = nvfp4::encode(&x);
        let y = roundtripped(Elem::Nvfp4, &x);
        for (b, (xb, yb)) in x.chunks(16).zip(y.chunks(16)).enumerate() {
            let s = fp8::e4m3_to_f32(enc.block_scales[b]) as f64;
            let amax_b = max_abs(xb);
            let err = xb.iter().zip(yb).fold(0f64, |m, (&a, &b)| m.max(((a - b) as f64).abs()));
            let slack = 1.0 + 2f64.powi(-16);
            let bound = s.max(6.0 * 2f64.powi(-10)) * slack;
            prop_assert!(err <= bound, "block {}: err {} > max(S, 6·2^-10) = {}", b, err, bound);
            if amax_b == 0.0 {
                prop_assert_eq!(enc.block_scales[b], 0);
            } else {
                prop_assert!(s >= 2f64.powi(-9));
            }
        }
    }

    /// The rotation is its own inverse up to rounding, and keeps the L2 norm.
    #[test]
    fn rotating_twice_gives_back_the_vector(l in 1u32..9, seed in any::<u64>()) {
        let n = 1usize << l;
        let mut s = seed | 1;
        let x: Vec<f32> = (0..n).map(|_| {
            s ^= s << 13; s ^= s >> 7; s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }).collect();
        let mut y = x.clone();
        hadamard::rotate(&mut y);
        let norm = |v: &[f32]| v.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
        prop_assert!((norm(&x) - norm(&y)).abs() <= 1e-5 * norm(&x).max(1e-30));
        hadamard::rotate(&mut y);
        for (a, b) in x.iter().zip(&y) {
            prop_assert!((a - b).abs() <= 1e-5, "{} vs {}", a, b);
        }
    }
}

/// `fp8-tensor` is vLLM's default: no rotation, E4M3 of `x / s` under one f32 scale per
/// layer (1.0 by default), named `fp8-e4m3-tensor`.
#[test]
fn fp8_tensor_is_vllms_default_fp8() {
    let k = KvDtype::parse("fp8-tensor").unwrap();
    assert_eq!(
        (k.key_elem(), k.value_elem()),
        (Elem::Fp8Tensor, Elem::Fp8Tensor)
    );
    assert_eq!(k.format_name(256), "fp8-e4m3-tensor");
    for d in [64, 128, 256] {
        let r = k.rotation(d);
        assert_eq!((r.keys, r.values), (false, false));
    }
    assert_eq!(k.layer_scales(5), (1.0, 1.0));
    assert_eq!(k.bytes_per_token_per_layer(2, 256), 2 * 2 * 256);
    // Scale 1.0 saturates past 448 and flushes below 2^-10 where the row-scaled fp8 keeps
    // both ends.
    for (x, tensor) in [
        ([1000.0f32, -3.0], [448.0f32, -3.0]),
        ([0.25, 2f32.powi(-11)], [0.25, 0.0]),
    ] {
        let mut t = x;
        k.roundtrip_k(0, &mut t);
        assert_eq!(t, tensor);
        let mut r = x;
        KvDtype::Fp8.roundtrip_k(0, &mut r);
        assert!(r[0] > 0.9 * x[0] && r[1] != 0.0, "{r:?}");
    }
    // Per-layer scales reach their layer, keys and values apart.
    let s = KvDtype::fp8_tensor_with(kv::fp8_tensor::TensorScales {
        source: Some("t".into()),
        k: vec![1.0, 4.0],
        v: vec![0.5, 1.0],
    });
    let mut a = [1000.0f32];
    s.roundtrip_k(1, &mut a);
    assert_eq!(a, [1024.0], "1000 / 4 = 250 -> 256 (step 16) -> 1024");
    let mut b = [300.0f32];
    s.roundtrip_v(0, &mut b);
    assert_eq!(b, [224.0], "300 / 0.5 saturates at 448 -> 224");
}

/// `--kv-scales` reaches the run and its report; a bad file is one line naming it, with no
/// output left; the flag needs `--kv-dtype fp8-tensor`.
#[test(prepared)]
fn kv_scales_from_a_file() {
    let tmp = crate::common::tempdir();
    let art = crate::common::tiny_artifact(tmp.path());
    let text = tmp.path().join("t.txt");
    std::fs::write(
        &text,
        "The river rose over the old stone steps by morning. ".repeat(6),
    )
    .unwrap();
    let run = |kv: &str, scales: Option<&str>, out: &str| {
        let out = tmp.path().join(out);
        let mut a = vec![
            art.to_str().unwrap().to_string(),
            "--text".into(),
            text.to_str().unwrap().into(),
            "--context".into(),
            "32".into(),
            "--stride".into(),
            "16".into(),
            "--kv-dtype".into(),
            kv.into(),
            "--output".into(),
            out.to_str().unwrap().into(),
        ];
        if let Some(s) = scales {
            let f = tmp.path().join(format!(
                "{}.json",
                out.file_name().unwrap().to_string_lossy()
            ));
            std::fs::write(&f, s).unwrap();
            a.extend(["--kv-scales".into(), f.to_str().unwrap().into()]);
        }
        let args: Vec<&str> = a.iter().map(String::as_str).collect();
        let o = crate::common::run_bin("ninfer-perplexity", &args);
        let report = std::fs::read_to_string(out.join("report.json"))
            .ok()
            .map(|r| serde_json::from_str::<Value>(&r).unwrap());
        (o, report, out)
    };
    let (o, plain, _) = run("fp8-tensor", None, "plain");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let plain = plain.unwrap();
    let st = &plain["settings"];
    assert_eq!(st["kv_format"]["name"], "fp8-e4m3-tensor");
    assert_eq!(st["kv_format"]["key_rotation"], "none");
    let layers = plain["artifact"]["config"]["num_layers"].as_u64().unwrap() as usize;
    assert_eq!(
        st["kv_tensor_scales"]["k"],
        serde_json::json!(vec![1.0; layers])
    );
    assert!(st["kv_tensor_scales"]["source"].is_null());
    // Tiny scales saturate nearly everything: another result, recorded with its source.
    let (o, scaled, _) = run(
        "fp8-tensor",
        Some(r#"{"k_scale": 1e-3, "v_scale": 1e-3}"#),
        "scaled",
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let scaled = scaled.unwrap();
    // The f32 scale, written as its shortest f32 representation.
    assert_eq!(
        scaled["settings"]["kv_tensor_scales"]["v"][0]
            .as_f64()
            .unwrap() as f32,
        1e-3f32
    );
    assert!(scaled["settings"]["kv_tensor_scales"]["source"]
        .as_str()
        .unwrap()
        .ends_with("scaled.json"));
    assert_ne!(plain["overall"]["nll_sum"], scaled["overall"]["nll_sum"]);
    // Bad files and a flag without its format.
    for (kv, body, needle) in [
        ("fp8-tensor", "{\"k_scale\": 1}", "missing field `v_scale`"),
        (
            "fp8-tensor",
            "{\"k_scale\": [1, 1, 1, 1, 1, 1, 1, 1, 1], \"v_scale\": 1}",
            "has 9 entries",
        ),
        ("fp8-tensor", "not json", "not JSON"),
        (
            "fp8",
            "{\"k_scale\": 1, \"v_scale\": 1}",
            "only --kv-dtype fp8-tensor",
        ),
    ] {
        let (o, report, out) = run(kv, Some(body), "bad");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.contains(needle),
            "{needle}: {err}"
        );
        assert!(
            report.is_none() && !out.exists(),
            "nothing written on failure"
        );
    }
}
