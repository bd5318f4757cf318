//! The quantized KV formats against the PyTorch reference fixtures (bit for bit), their edge
//! cases, and round-trip error bounds as property tests.
//!
//! Fixtures: `eval/fixtures/kv/index.json` + `.bin` arrays, written by
//! `eval/generators/make_kv_fixtures.py`.

use std::path::PathBuf;

use ninfer_perplexity::kv::{self, fp8, int8, nvfp4, Elem, KvDtype};
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
    assert_eq!(idx["version"], 1);
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

/// Every fixture vector: encode gives the reference payload and scales, decode and both
/// round-trip entry points give the reference values, all bit for bit.
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
        let scales = f32s(&set["scales"]);
        let decoded = f32s(&set["decoded"]);
        assert_eq!(x.len(), n * count, "{name}");
        assert_eq!(decoded.len(), n * count, "{name}");
        assert_eq!(scales.len(), count, "{name}");
        let fmt = set["format"].as_str().unwrap();
        let elem = match fmt {
            "int8" => Elem::Int8,
            "fp8" => Elem::Fp8,
            "nvfp4" => Elem::Nvfp4,
            f => panic!("unknown format {f}"),
        };
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
            let want_scale = scales[r];
            let stored = match elem {
                Elem::Int8 => {
                    let e = int8::encode(xv);
                    let got: Vec<u8> = e.codes.iter().map(|&q| q as u8).collect();
                    mm.check(got == want_codes, || {
                        format!("{name}[{r}] codes {got:?} != {want_codes:?}")
                    });
                    mm.check(e.scale.to_bits() == want_scale.to_bits(), || {
                        format!("{name}[{r}] scale {:e} != {want_scale:e}", e.scale)
                    });
                    int8::decode(&e, &mut out);
                    e.to_bytes()
                }
                Elem::Fp8 => {
                    let e = fp8::encode(xv);
                    mm.check(e.codes == want_codes, || {
                        format!("{name}[{r}] codes {:?} != {want_codes:?}", e.codes)
                    });
                    mm.check(e.scale.to_bits() == want_scale.to_bits(), || {
                        format!("{name}[{r}] scale {:e} != {want_scale:e}", e.scale)
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
                    mm.check(e.global_scale.to_bits() == want_scale.to_bits(), || {
                        format!(
                            "{name}[{r}] global scale {:e} != {want_scale:e}",
                            e.global_scale
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

// ----------------------------------------------------------------------------- edge cases

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

#[test]
fn bytes_per_vector_is_payload_plus_scales() {
    for hd in HEAD_DIMS {
        assert_eq!(Elem::Int8.bytes_per_vector(hd), hd + 4);
        assert_eq!(Elem::Fp8.bytes_per_vector(hd), hd + 4);
        assert_eq!(
            Elem::Nvfp4.bytes_per_vector(hd),
            hd.div_ceil(2) + hd.div_ceil(16) + 4
        );
        for e in QUANT {
            let x: Vec<f32> = (0..hd).map(|i| (i as f32 - 3.3).sin()).collect();
            assert_eq!(
                e.encode_bytes(&x).len(),
                e.bytes_per_vector(hd),
                "{e:?} {hd}"
            );
        }
    }
    assert_eq!(Elem::Int8.bytes_per_vector(64), 68);
    assert_eq!(Elem::Fp8.bytes_per_vector(64), 68);
    assert_eq!(Elem::Nvfp4.bytes_per_vector(64), 40);
    assert_eq!(Elem::Nvfp4.bytes_per_vector(128), 76);
    assert_eq!(Elem::Nvfp4.bytes_per_vector(80), 49);
    assert_eq!(Elem::Nvfp4.bytes_per_vector(8), 9);
    // Per token per layer, 8 KV heads of 64: (K + V) · heads.
    assert_eq!(KvDtype::Int8.bytes_per_token_per_layer(8, 64), 8 * 136);
    assert_eq!(KvDtype::Fp8.bytes_per_token_per_layer(8, 64), 8 * 136);
    assert_eq!(KvDtype::Nvfp4.bytes_per_token_per_layer(8, 64), 8 * 80);
    assert_eq!(KvDtype::K8v4.bytes_per_token_per_layer(8, 64), 8 * 108);
    assert_eq!(KvDtype::Bf16.bytes_per_token_per_layer(8, 64), 8 * 256);
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
fn all_zero_vectors_decode_to_positive_zeros() {
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
}

#[test]
fn negative_zero() {
    // A vector with a -0.0 among non-zero values.
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

#[test]
fn single_huge_outlier() {
    for hd in HEAD_DIMS {
        for big in [1e4f32, -3e38, f32::MAX] {
            let mut x: Vec<f32> = (0..hd).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
            x[hd / 3] = big;
            for e in QUANT {
                let y = roundtripped(e, &x);
                assert!(y.iter().all(|v| v.is_finite()), "{e:?} {hd} {big}: {y:?}");
                // The outlier itself is the vector's amax: it is stored almost exactly.
                let rel = ((y[hd / 3] as f64 - big as f64) / big as f64).abs();
                assert!(
                    rel < 1e-6,
                    "{e:?} {hd} {big}: outlier came back as {}",
                    y[hd / 3]
                );
                // Every other value: rounding onto a grid that contains 0 never moves a value
                // by more than its own magnitude (up to the f32 rounding of the scaling).
                for (i, (&a, &b)) in x.iter().zip(&y).enumerate() {
                    if i != hd / 3 {
                        let bound = a.abs() as f64 * (1.0 + 1e-6);
                        assert!(
                            ((a - b) as f64).abs() <= bound,
                            "{e:?} {hd} {big}: [{i}] {a} -> {b}"
                        );
                    }
                }
            }
        }
    }
    // nvfp4: a block far below the outlier's block scale rounds to 0 (all codes zero).
    let mut x = vec![1e-3f32; 32];
    x[0] = 1e6;
    let enc = nvfp4::encode(&x);
    assert_eq!(
        enc.block_scales[1], 0,
        "1e-3 next to 1e6 is below the smallest e4m3 block scale"
    );
    assert!(enc.packed[8..].iter().all(|&b| b == 0));
    assert!(roundtripped(Elem::Nvfp4, &x)[16..]
        .iter()
        .all(|v| v.to_bits() == 0));
}

#[test]
fn subnormal_range_inputs() {
    let tiny = f32::from_bits(1); // 2^-149
    for hd in HEAD_DIMS {
        for mag in [
            tiny,
            f32::from_bits(200),
            1e-39,
            f32::MIN_POSITIVE,
            1e-36,
            1e-33,
        ] {
            let x: Vec<f32> = (0..hd).map(|i| mag * ((i % 5) as f32 - 2.0)).collect();
            for e in QUANT {
                let y = roundtripped(e, &x);
                assert!(y.iter().all(|v| v.is_finite()), "{e:?} {hd} {mag:e}");
                // Never larger than the input's amax (up to the scale's own rounding).
                let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert!(
                    y.iter().all(|v| v.abs() <= amax * 1.5),
                    "{e:?} {hd} {mag:e}: {y:?}"
                );
            }
        }
    }
    // amax / 127 underflows to 0: scale 0, zeros.
    let x = [tiny, -tiny, 0.0, tiny];
    assert_eq!(int8::encode(&x).scale, 0.0);
    assert!(roundtripped(Elem::Int8, &x)
        .iter()
        .all(|v| v.to_bits() == 0));
    assert_eq!(fp8::encode(&x).scale, 0.0);
    assert_eq!(nvfp4::encode(&x).global_scale, 0.0);
    // int8 with a subnormal scale: codes clamp to ±127 and never exceed it.
    let x = [
        f32::from_bits(190),
        f32::from_bits(100),
        -f32::from_bits(190),
    ];
    let e = int8::encode(&x);
    assert_eq!(e.scale.to_bits(), 1);
    assert_eq!(e.codes, vec![127, 100, -127]);
    // fp8 with a subnormal-range element next to a large one: e4m3 subnormal codes.
    let x = [
        448.0f32,
        3.0 * 2f32.powi(-9),
        2f32.powi(-10),
        3.0 * 2f32.powi(-10),
        -5.0 * 2f32.powi(-10),
    ];
    assert_eq!(fp8::encode(&x).codes, vec![0x7E, 0x03, 0x00, 0x02, 0x82]);
    // nvfp4 with a block scale in the e4m3 subnormal range: 2688 gives g = 1; a second block
    // with amax 6·3·2^-9 gets block scale 3·2^-9 (code 0x03) and stores its values exactly.
    let mut x = vec![0f32; 32];
    x[0] = 2688.0;
    let s = 3.0 * 2f32.powi(-9);
    for (i, m) in [6.0f32, -4.0, 3.0, 1.5, 0.5, -0.5].iter().enumerate() {
        x[16 + i] = m * s;
    }
    let e = nvfp4::encode(&x);
    assert_eq!(e.global_scale, 1.0);
    assert_eq!(e.block_scales, vec![0x7E, 0x03]);
    let y = roundtripped(Elem::Nvfp4, &x);
    assert_eq!(bits(&y[16..22]), bits(&x[16..22]));
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
    // nvfp4: amax 2688 gives g = 1 and block scale 448, so x / d = x / 448.
    let mids = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    let want = [0u8, 2, 2, 4, 4, 6, 6];
    let mut x = vec![2688.0f32];
    x.extend(mids.iter().map(|m| m * 448.0));
    x.extend(mids.iter().map(|m| -m * 448.0));
    let e = nvfp4::encode(&x);
    assert_eq!(e.global_scale, 1.0);
    assert_eq!(e.block_scales, vec![0x7E]);
    for (i, &w) in want.iter().enumerate() {
        assert_eq!(e.code(1 + i), w, "{}", mids[i]);
        assert_eq!(e.code(8 + i), w | 8, "-{}", mids[i]);
    }
    // One ulp off each tie goes to the nearer neighbour.
    for (&m, &w) in mids.iter().zip(&want) {
        let up = nvfp4::e2m1_from_f32(f32::from_bits(m.to_bits() + 1));
        let down = nvfp4::e2m1_from_f32(f32::from_bits(m.to_bits() - 1));
        assert_eq!(up - down, 1, "{m}");
        assert!(up == w || down == w);
    }
    // A block scale tie: amax_b / (6g) = 17 (between 16 and 18, even mantissa 16).
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

/// Vectors of assorted lengths (full and partial nvfp4 blocks) and magnitudes kept where the
/// scales are f32 normals (amax between 2^-60 and 2^60), with occasional outliers and zeros.
fn vectors() -> impl Strategy<Value = Vec<f32>> {
    let len = prop_oneof![
        Just(8usize),
        Just(16),
        Just(64),
        Just(80),
        Just(128),
        1usize..200
    ];
    (len, -60i32..40).prop_flat_map(|(n, exp)| {
        let scale = 2f32.powi(exp);
        let elem = prop_oneof![
            8 => (-1.0f32..1.0).prop_map(move |v| v * scale),
            1 => (-1.0f32..1.0).prop_map(move |v| v * scale * 1e4),
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
    // No regression files: failures are turned into named tests below instead.
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    /// In-place roundtrip is bit for bit decode(encode), for any finite bit pattern.
    #[test]
    fn roundtrip_is_decode_of_encode(x in proptest::collection::vec(any::<u32>(), 1..100)) {
        let x: Vec<f32> = x.into_iter().map(f32::from_bits).filter(|v| v.is_finite()).collect();
        for e in QUANT {
            let mut y = x.clone();
            e.roundtrip(&mut y);
            prop_assert_eq!(bits(&y), bits(&via_encode(e, &x)));
            prop_assert!(y.iter().all(|v| v.is_finite()));
        }
    }

    /// int8: every element is within half a step of its input,
    /// |x - x̂| <= scale/2 + amax·2^-22 (the last term covers the two f32 roundings, of
    /// x/scale and of q·scale, with room to spare).
    #[test]
    fn int8_error_bound(x in vectors()) {
        let enc = int8::encode(&x);
        let amax = max_abs(&x);
        let y = roundtripped(Elem::Int8, &x);
        let bound = enc.scale as f64 / 2.0 + amax * 2f64.powi(-22);
        for (&a, &b) in x.iter().zip(&y) {
            prop_assert!(((a - b) as f64).abs() <= bound, "{} -> {} (bound {})", a, b, bound);
        }
        prop_assert!(enc.codes.iter().all(|&q| q != -128));
    }

    /// fp8: relative half-ulp in the e4m3 normal range, half the subnormal step below it:
    /// |x - x̂| <= 2^-4·|x| + 2^-10·scale + amax·2^-22.
    #[test]
    fn fp8_error_bound(x in vectors()) {
        let enc = fp8::encode(&x);
        let amax = max_abs(&x);
        let y = roundtripped(Elem::Fp8, &x);
        for (&a, &b) in x.iter().zip(&y) {
            let bound = 2f64.powi(-4) * (a as f64).abs() + 2f64.powi(-10) * enc.scale as f64 + amax * 2f64.powi(-22);
            prop_assert!(((a - b) as f64).abs() <= bound, "{} -> {} (bound {})", a, b, bound);
        }
    }

    /// nvfp4, per block with scale S and global g. Values with |x/(S·g)| <= 6 are within one
    /// grid unit S·g (the largest gap of the e2m1 grid is 2, from 4 to 6). Larger ones saturate
    /// to 6·S·g, which is short of amax_b by at most 6·2^-10·g: S is amax_b/(6g) rounded to
    /// e4m3, so it is low by at most 1/16 relative when normal (overshoot <= 6/16 units) and by
    /// at most half the subnormal step, 2^-10, otherwise; a block whose S rounds to 0 has
    /// amax_b <= 6·2^-10·g. Hence max |x - x̂| <= max(S·g, 6·2^-10·g). A priori, from
    /// S <= (1+2^-4)·amax_b/(6g) + 2^-10: max |x - x̂| <= (17/96)·amax_b + 6·2^-10·g.
    /// Both with 2^-16 relative slack for the f32 roundings.
    #[test]
    fn nvfp4_error_bound(x in vectors()) {
        let enc = nvfp4::encode(&x);
        let g = enc.global_scale as f64;
        let y = roundtripped(Elem::Nvfp4, &x);
        for (b, (xb, yb)) in x.chunks(16).zip(y.chunks(16)).enumerate() {
            let s = fp8::e4m3_to_f32(enc.block_scales[b]) as f64;
            let amax_b = max_abs(xb);
            let err = xb.iter().zip(yb).fold(0f64, |m, (&a, &b)| m.max(((a - b) as f64).abs()));
            let slack = 1.0 + 2f64.powi(-16);
            let bound = (s * g).max(6.0 * 2f64.powi(-10) * g) * slack;
            prop_assert!(err <= bound, "block {}: err {} > max(S·g, 6·2^-10·g) = {}", b, err, bound);
            if s == 0.0 {
                prop_assert!(amax_b <= 6.0 * 2f64.powi(-10) * g * slack);
                prop_assert!(yb.iter().all(|v| *v == 0.0));
            }
            let apriori = (17.0 / 96.0 * amax_b + 6.0 * 2f64.powi(-10) * g) * slack;
            prop_assert!(err <= apriori, "block {}: err {} > {}", b, err, apriori);
        }
    }
}

/// Found by the property test: a block whose scale falls in the e4m3 subnormal range rounds
/// down by a third, so its value saturates at 6·S·g, well past one grid unit S·g.
#[test]
fn nvfp4_subnormal_block_scale_saturates() {
    let mut x = vec![0f32; 17];
    x[7] = -4_523_478_500.0;
    x[16] = -27_430.3;
    let e = nvfp4::encode(&x);
    assert_eq!(
        e.block_scales[1], 0x01,
        "amax_b/(6g) = 0.0027 rounds to 2^-9"
    );
    assert_eq!(e.code(16), 0xF, "-8.35 units saturates to -6");
    let y = roundtripped(Elem::Nvfp4, &x);
    let g = e.global_scale as f64;
    let err = (y[16] as f64 - x[16] as f64).abs();
    assert!(
        err > 2f64.powi(-9) * g && err <= 6.0 * 2f64.powi(-10) * g,
        "{err}"
    );
}
