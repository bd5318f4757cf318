//! The Main KV codecs on the GPU store exactly the CPU specification's bits.
//!
//! The device encoders (`kv_store_warp`, what `qkv_prep` stores K/V with) and decoder
//! (`kv_load`, what attention reads) are run over random vectors of many head dims, edge
//! cases (zeros, subnormals, ties, huge values, one-hot) and the PyTorch reference vectors
//! of `eval/fixtures/kv`, and compared byte for byte with `Elem::encode_bytes` and bit for
//! bit with `Elem::roundtrip`.
//!
//! Every check runs twice: on the emulated device (the kernels compiled for the host, in
//! every `cargo test`), and on a CUDA GPU (`<check>::cuda`: reported ignored where there is
//! none; `ci/gpu-check.sh` runs them).

use ninfer_perplexity::backend::cuda::codec::{
    element_codes, encode_scaled, encode_with, STORE_VARIANTS,
};
use ninfer_perplexity::backend::cuda::device::Gpu;
use ninfer_perplexity::kv::{fp8, fp8_tensor, nvfp4, Elem};

const ELEMS: [Elem; 7] = Elem::ALL;

use crate::common::rng::Rng;

/// Vectors with a spread of magnitudes per vector (scales from 1e-30 to 1e30).
fn random_vectors(n: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng(seed | 1);
    let mut v = Vec::with_capacity(n * d);
    for i in 0..n {
        let scale = 10f32.powf((i % 13) as f32 * 5.0 - 30.0);
        for _ in 0..d {
            let x = (r.unit() * 2.0 - 1.0) * scale;
            // Some exact zeros and negative zeros.
            v.push(match r.next() % 29 {
                0 => 0.0,
                1 => -0.0,
                _ => x,
            });
        }
    }
    v
}

fn edge_vectors(d: usize) -> Vec<f32> {
    let mut v = Vec::new();
    let mut push = |f: &dyn Fn(usize) -> f32| v.extend((0..d).map(f));
    push(&|_| 0.0);
    push(&|_| -0.0);
    push(&|i| if i == 0 { 1.0 } else { 0.0 });
    push(&|i| if i == d - 1 { -3.5 } else { 1e-3 });
    push(&|i| f32::from_bits(1 + i as u32)); // subnormals only
    push(&|i| (i as f32 - d as f32 / 2.0) * 0.5); // half-integer ties
    push(&|i| {
        if i % 2 == 0 {
            f32::MAX
        } else {
            -f32::MAX / 3.0
        }
    });
    push(&|i| 1e-38 * (i as f32 + 1.0));
    push(&|i| ((i * 7) % 11) as f32 - 5.0);
    v
}

/// Every store variant that holds `d` values (nk2, nk4, nk8).
fn check(gpu: &Gpu, elem: Elem, x: &[f32], d: usize, what: &str) {
    for nk in STORE_VARIANTS.into_iter().filter(|&nk| d <= 32 * nk) {
        check_variant(gpu, elem, x, d, nk, &format!("{what} nk{nk}"));
    }
}

fn check_variant(gpu: &Gpu, elem: Elem, x: &[f32], d: usize, nk: usize, what: &str) {
    let got = encode_with(gpu, elem, x, d, nk).unwrap_or_else(|e| panic!("{what}: {e:#}"));
    for (i, vec) in x.chunks(d).enumerate() {
        let want = elem.encode_bytes(vec);
        assert_eq!(
            got.stored[i],
            want,
            "{what}: {} d={d} vector {i} stored bytes",
            elem.name()
        );
        let mut rt = vec.to_vec();
        elem.roundtrip(&mut rt);
        for (j, (a, b)) in got.decoded[i * d..(i + 1) * d].iter().zip(&rt).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{what}: {} d={d} vector {i} element {j}: {a:e} vs {b:e}",
                elem.name()
            );
        }
    }
}

device_case!(codecs_store_the_cpu_bits, |dev| codecs_store_the_cpu_bits(
    &dev.gpu()
));

device_case!(per_tensor_scales_store_the_cpu_bits, |dev| {
    per_tensor_scales_store_the_cpu_bits(&dev.gpu())
});

/// `fp8tensor` under scales other than 1.0 (the standalone codecs above use 1.0): the
/// device divides by the scale and multiplies back exactly as `kv::fp8_tensor`.
fn per_tensor_scales_store_the_cpu_bits(g: &Gpu) {
    for scale in [0.0123f32, 3.5, 2f32.powi(-20), 1e20] {
        for d in [8, 64, 128, 256] {
            for (what, x) in [
                ("random", random_vectors(61, d, d as u64 * 17 + 3)),
                ("edge", edge_vectors(d)),
            ] {
                let nk = ninfer_perplexity::backend::cuda::codec::store_variant(d);
                let got = encode_scaled(g, Elem::Fp8Tensor, &x, d, nk, scale)
                    .unwrap_or_else(|e| panic!("{e:#}"));
                for (i, vec) in x.chunks(d).enumerate() {
                    assert_eq!(
                        got.stored[i],
                        fp8_tensor::encode(vec, scale),
                        "{what} scale {scale:e} d={d} vector {i} stored bytes"
                    );
                    let mut rt = vec.to_vec();
                    fp8_tensor::roundtrip(&mut rt, scale);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got.decoded[i * d..(i + 1) * d]),
                        bits(&rt),
                        "{what} scale {scale:e} d={d} vector {i} decoded"
                    );
                }
            }
        }
    }
}

device_case!(codecs_match_the_reference_fixtures, |dev| {
    codecs_match_the_reference_fixtures(&dev.gpu())
});

fn codecs_store_the_cpu_bits(g: &Gpu) {
    for elem in ELEMS {
        for d in [1, 7, 8, 16, 33, 64, 80, 96, 128, 200, 256] {
            check(
                g,
                elem,
                &random_vectors(97, d, d as u64 * 31 + 7),
                d,
                "random",
            );
            check(g, elem, &edge_vectors(d), d, "edge");
        }
    }
}

fn codecs_match_the_reference_fixtures(g: &Gpu) {
    let dir = crate::common::repo().join("eval/fixtures/kv");
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("index.json")).expect("eval/fixtures/kv/index.json"),
    )
    .unwrap();
    let floats = |name: &str| -> Vec<f32> {
        let b = std::fs::read(dir.join(name)).unwrap();
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let mut n = 0;
    for v in index["vectors"].as_array().unwrap() {
        let elem = match v["format"].as_str().unwrap() {
            "int8" => Elem::Int8,
            "fp8" => Elem::Fp8,
            "nvfp4" => Elem::Nvfp4,
            other => panic!("unknown fixture format {other}"),
        };
        let d = v["head_dim"].as_u64().unwrap() as usize;
        check(
            g,
            elem,
            &floats(v["input"].as_str().unwrap()),
            d,
            v["name"].as_str().unwrap(),
        );
        n += 1;
    }
    // Element codecs over their edge sets (e4m3: every finite bf16 value too), non-finite
    // inputs left out: the device encoders are specified for finite input only.
    for s in index["scalar"].as_array().unwrap() {
        let kind = s["kind"].as_str().unwrap();
        let x: Vec<f32> = floats(s["input"].as_str().unwrap())
            .into_iter()
            .filter(|v| v.is_finite())
            .collect();
        let got = element_codes(g, kind, &x).unwrap();
        for (i, (&v, &c)) in x.iter().zip(&got).enumerate() {
            let want = match kind {
                "e4m3" => fp8::e4m3_from_f32(v),
                _ => nvfp4::e2m1_from_f32(v),
            };
            assert_eq!(c, want, "{kind} value {i} = {v:e} ({:#010x})", v.to_bits());
        }
        n += 1;
    }
    assert!(n >= 10, "too few fixtures in {}", dir.display());
}
