//! Hugging Face checkpoints made for tests: copies of the committed tiny fixtures with an
//! edited config, safetensors read and written tensor by tensor, tensors reshaped, and
//! quantized matrices written in the layouts the exporters use. The tests that import
//! quantized checkpoints build them here from the crate's own quantizers, so that an import
//! can be compared bit for bit with packing the same bf16 checkpoint.

use ninfer_perplexity::quant::{fp8, nvfp4, QuantTensor};
use safetensors::Dtype;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A checkpoint tensor: name, dtype, shape, little-endian bytes.
pub type Tensor = (String, Dtype, Vec<usize>, Vec<u8>);

/// A copy of the committed `eval/fixtures/tiny-{family}` with `config.json` edited by `edit`.
/// The directory lives as long as the returned guard.
pub fn fixture_copy(family: &str, edit: impl Fn(&mut Value)) -> (tempfile::TempDir, PathBuf) {
    let tmp = super::tempdir();
    let dir = tmp.path().join(family);
    std::fs::create_dir(&dir).unwrap();
    let src = super::repo().join(format!("eval/fixtures/tiny-{family}"));
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let mut c = read_config(&dir);
    edit(&mut c);
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    (tmp, dir)
}

pub fn read_config(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

pub fn read_safetensors(path: &Path) -> Vec<Tensor> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect()
}

pub fn write_safetensors(path: &Path, tensors: &[Tensor]) {
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            let v = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
            (n.clone(), v)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

pub fn bf16_to_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Gives the tensors of `dir`'s checkpoint whose names end in one of `shapes`' suffixes that
/// shape, filled with their own values strided and repeated (so a reshaped tensor keeps the
/// trained one's scale); returns how many it reshaped.
pub fn reshape(dir: &Path, shapes: &[(&str, &[usize])]) -> usize {
    let path = dir.join("model.safetensors");
    let mut out: Vec<Tensor> = Vec::new();
    let mut reshaped = 0;
    for (name, dtype, old_shape, old) in read_safetensors(&path) {
        let new = shapes.iter().find(|(suffix, _)| name.ends_with(suffix));
        let Some((_, shape)) = new else {
            out.push((name, dtype, old_shape, old));
            continue;
        };
        let esz = dtype.bitsize() / 8;
        let (n_old, n_new) = (old.len() / esz, shape.iter().product::<usize>());
        let mut data = Vec::with_capacity(n_new * esz);
        for i in 0..n_new {
            let j = (i * 7 + 3) % n_old;
            data.extend_from_slice(&old[j * esz..(j + 1) * esz]);
        }
        out.push((name, dtype, shape.to_vec(), data));
        reshaped += 1;
    }
    write_safetensors(&path, &out);
    reshaped
}

/// The checkpoint tensors of the quantized matrix `base.weight`, as exporters write them:
/// nvfp4 as ModelOpt does (`weight` U8 `[O, I/2]`, `weight_scale` F8_E4M3 `[O, I/16]`,
/// `weight_scale_2` F32 `[]`); fp8 as the FP8-block exports do (`weight` F8_E4M3 `[O, I]`,
/// `weight_scale_inv` F32 `[⌈O/128⌉, ⌈I/128⌉]`, `[O, 1]` per row or `[]` per tensor).
pub fn quantized_parts(base: &str, q: QuantTensor) -> Vec<Tensor> {
    let (o, i) = (q.rows(), q.cols());
    let part = |suffix: &str, d: Dtype, shape: Vec<usize>, bytes: Vec<u8>| {
        (format!("{base}.{suffix}"), d, shape, bytes)
    };
    match q {
        QuantTensor::Nvfp4(t) => vec![
            part("weight", Dtype::U8, vec![o, i / 2], t.packed),
            part(
                "weight_scale",
                Dtype::F8_E4M3,
                vec![o, i / nvfp4::BLOCK],
                t.block_scales,
            ),
            part(
                "weight_scale_2",
                Dtype::F32,
                vec![],
                t.global.value().to_le_bytes().to_vec(),
            ),
        ],
        QuantTensor::Fp8(t) => {
            let shape = match &t.scale {
                fp8::Fp8Scale::Tensor(_) => vec![],
                fp8::Fp8Scale::Channel(_) => vec![o, 1],
                fp8::Fp8Scale::Block(_) => vec![o.div_ceil(fp8::BLOCK), i.div_ceil(fp8::BLOCK)],
            };
            let scales = f32_bytes(t.scale.values());
            vec![
                part("weight", Dtype::F8_E4M3, vec![o, i], t.codes),
                part("weight_scale_inv", Dtype::F32, shape, scales),
            ]
        }
    }
}

/// fp8 with one scale per row (`[O, 1]`): each row quantized as its own block.
pub fn fp8_per_row(w: &[f32], rows: usize, cols: usize) -> fp8::Fp8Tensor {
    let per_row: Vec<fp8::Fp8Tensor> = w
        .chunks(cols)
        .map(|r| fp8::quantize_block(r, 1, cols))
        .collect();
    fp8::Fp8Tensor {
        rows,
        cols,
        codes: per_row.iter().flat_map(|t| t.codes.clone()).collect(),
        scale: fp8::Fp8Scale::Channel(per_row.iter().map(|t| t.scale.values()[0]).collect()),
    }
}
