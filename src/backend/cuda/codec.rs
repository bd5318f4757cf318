//! The Main KV codecs on the device, for tests: encode vectors with the same device code
//! the forward pass stores K/V with (`kv_store_warp` via `kv_encode_*`), read back the
//! stored bytes in the CPU's `Encoded::to_bytes` layout, and decode them with the
//! attention kernels' loader (`kv_load` via `kv_decode_*`).

use super::device::Gpu;
use super::launch::{ElementEncode, KvArg, KvDecode, KvEncode, Ptr};
use super::plan;
use crate::kv::Elem;
use anyhow::{bail, Result};

/// Stored bytes of every vector (CPU layout: payload, block scales, scale) and the decoded
/// values, for `x` holding `x.len() / d` vectors of `d` values.
pub struct DeviceCodec {
    pub stored: Vec<Vec<u8>>,
    pub decoded: Vec<f32>,
}

/// The register counts of the store (`nk` values per lane, `d <= 32 nk`), as `qkv_prep`
/// has them.
pub const STORE_VARIANTS: [usize; 3] = [2, 4, 8];

/// The narrowest store variant for `d` values (the one `qkv_prep` uses).
pub fn store_variant(d: usize) -> usize {
    STORE_VARIANTS
        .into_iter()
        .find(|&nk| d <= 32 * nk)
        .unwrap_or(8)
}

/// [`encode_with`] through the store variant `qkv_prep` uses for `d`.
pub fn encode_decode(gpu: &Gpu, elem: Elem, x: &[f32], d: usize) -> Result<DeviceCodec> {
    encode_with(gpu, elem, x, d, store_variant(d))
}

/// Encodes through the store with `nk` values per lane (2, 4 or 8; `d <= 32 nk`), decodes
/// through the attention loader (`fp8tensor` under scale 1.0).
pub fn encode_with(gpu: &Gpu, elem: Elem, x: &[f32], d: usize, nk: usize) -> Result<DeviceCodec> {
    encode_scaled(gpu, elem, x, d, nk, 1.0)
}

/// [`encode_with`] under the per-tensor scale `tscale` (`fp8tensor`; the others ignore it).
pub fn encode_scaled(
    gpu: &Gpu,
    elem: Elem,
    x: &[f32],
    d: usize,
    nk: usize,
    tscale: f32,
) -> Result<DeviceCodec> {
    if d == 0 || d > plan::MAX_HEAD_DIM || !x.len().is_multiple_of(d) {
        bail!(
            "vectors of {d} values: 1..={} and a whole number of them",
            plan::MAX_HEAD_DIM
        );
    }
    if !STORE_VARIANTS.contains(&nk) || d > 32 * nk {
        bail!("store variant nk{nk} cannot hold {d} values");
    }
    let n = x.len() / d;
    let (a, s, bs) = plan::kv_arrays(elem, n, d);
    let xin = gpu.upload(x)?;
    let data = gpu.alloc(a.max(256))?;
    let scale = gpu.alloc(s.max(256))?;
    let bscale = gpu.alloc(bs.max(256))?;
    for buf in [&data, &scale, &bscale] {
        gpu.memset(buf, 0, buf.bytes, 0xA5)?; // poison: every stored byte must be written
    }
    let t = KvArg {
        data: data.ptr,
        scale: scale.ptr,
        bscale: bscale.ptr,
        tscale,
    };
    let name = elem.name();
    gpu.launch(
        &format!("kv_encode_{name}_nk{nk}"),
        (plan::blocks_for(n, 8), 1, 1),
        256,
        0,
        &KvEncode {
            x: Ptr::new(xin.ptr),
            n: n as i64,
            D: d as i32,
            t,
        },
    )?;
    let out = gpu.alloc(4 * n * d)?;
    gpu.launch(
        &format!("kv_decode_{name}"),
        (plan::blocks_for(n * d, 256), 1, 1),
        256,
        0,
        &KvDecode {
            t,
            n: n as i64,
            D: d as i32,
            out: Ptr::new(out.ptr),
        },
    )?;
    let decoded: Vec<f32> = gpu.read(&out, 0, n * d)?;
    let payload_per = match elem {
        Elem::F32 => 4 * d,
        Elem::Bf16 | Elem::F16 => 2 * d,
        Elem::Int8 | Elem::Fp8 | Elem::Fp8Tensor => d,
        Elem::Nvfp4 => d.div_ceil(2),
    };
    // FP16 scales per vector: one per 64 elements (int8), one (fp8).
    let scale_per = match elem {
        Elem::Int8 => 2 * crate::kv::int8::groups(d),
        Elem::Fp8 => 2,
        _ => 0,
    };
    let payload: Vec<u8> = gpu.read(&data, 0, n * payload_per)?;
    let scales: Vec<u8> = if scale_per > 0 {
        gpu.read(&scale, 0, n * scale_per)?
    } else {
        vec![]
    };
    let nb = d.div_ceil(16);
    let bscales: Vec<u8> = if elem == Elem::Nvfp4 {
        gpu.read(&bscale, 0, n * nb)?
    } else {
        vec![]
    };
    let stored = (0..n)
        .map(|i| {
            let mut v = payload[i * payload_per..(i + 1) * payload_per].to_vec();
            if elem == Elem::Nvfp4 {
                v.extend_from_slice(&bscales[i * nb..(i + 1) * nb]);
            }
            v.extend_from_slice(&scales[i * scale_per..(i + 1) * scale_per]);
            v
        })
        .collect();
    Ok(DeviceCodec { stored, decoded })
}

/// Element codes of every value: `e4m3` (fp8 e4m3fn) or `e2m1` (the nvfp4 element).
pub fn element_codes(gpu: &Gpu, kind: &str, x: &[f32]) -> Result<Vec<u8>> {
    let entry = match kind {
        "e4m3" => "e4m3_encode",
        "e2m1" => "e2m1_encode",
        other => bail!("unknown element format {other}"),
    };
    let n = x.len();
    let xin = gpu.upload(x)?;
    let out = gpu.alloc(n.max(1))?;
    gpu.launch(
        entry,
        (plan::blocks_for(n, 256), 1, 1),
        256,
        0,
        &ElementEncode {
            x: Ptr::new(xin.ptr),
            out: Ptr::new(out.ptr),
            n: n as i64,
        },
    )?;
    gpu.read(&out, 0, n)
}
