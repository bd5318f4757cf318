//! ggml tensor types, their dequantization to f32 with ggml's own definitions, and the
//! Q/K row order llama.cpp's converter uses.

use anyhow::{anyhow, bail, Result};
use half::{bf16, f16};

/// A ggml tensor type id as stored in a tensor descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GgmlType(pub u32);

impl GgmlType {
    pub const F32: GgmlType = GgmlType(0);
    pub const F16: GgmlType = GgmlType(1);
    pub const Q4_0: GgmlType = GgmlType(2);
    pub const Q4_1: GgmlType = GgmlType(3);
    pub const Q8_0: GgmlType = GgmlType(8);
    pub const BF16: GgmlType = GgmlType(30);

    /// ggml's name for the type ("Q6_K", "IQ2_XS", ...); ids ggml never assigned or has
    /// retired read as `ggml type <id>`.
    pub fn name(self) -> String {
        let known = match self.0 {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            30 => "BF16",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            _ => "",
        };
        if known.is_empty() {
            format!("ggml type {}", self.0)
        } else {
            known.to_string()
        }
    }

    /// `(elements per block, bytes per block)` for the types this reader dequantizes.
    pub fn block_layout(self) -> Option<(usize, usize)> {
        match self {
            GgmlType::F32 => Some((1, 4)),
            GgmlType::F16 | GgmlType::BF16 => Some((1, 2)),
            GgmlType::Q8_0 => Some((QK, Q8_0_BLOCK_BYTES)),
            GgmlType::Q4_0 => Some((QK, Q4_0_BLOCK_BYTES)),
            GgmlType::Q4_1 => Some((QK, Q4_1_BLOCK_BYTES)),
            _ => None,
        }
    }

    pub fn is_supported(self) -> bool {
        self.block_layout().is_some()
    }

    /// Bytes taken by `n_elements` values of this type, when supported and whole blocks.
    pub fn byte_size(self, n_elements: u64) -> Option<u64> {
        let (be, bb) = self.block_layout()?;
        if !n_elements.is_multiple_of(be as u64) {
            return None;
        }
        (n_elements / be as u64).checked_mul(bb as u64)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// Elements per block of the 32-wide quantized types.
pub const QK: usize = 32;
/// Q8_0: f16 scale `d`, then 32 signed bytes; value = q·d.
pub const Q8_0_BLOCK_BYTES: usize = 2 + QK;
/// Q4_0: f16 scale `d`, then 16 bytes of nibbles; value = (q − 8)·d.
pub const Q4_0_BLOCK_BYTES: usize = 2 + QK / 2;
/// Q4_1: f16 scale `d`, f16 minimum `m`, then 16 bytes of nibbles; value = q·d + m.
pub const Q4_1_BLOCK_BYTES: usize = 2 + 2 + QK / 2;

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q8_0 blocks → f32. `out.len()` must be 32 × the number of blocks in `data`.
pub fn dequantize_q8_0(data: &[u8], out: &mut [f32]) {
    assert_eq!(data.len() / Q8_0_BLOCK_BYTES * QK, out.len());
    assert_eq!(data.len() % Q8_0_BLOCK_BYTES, 0);
    for (blk, y) in data
        .chunks_exact(Q8_0_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(QK))
    {
        let d = f16_at(blk, 0);
        for (yi, &q) in y.iter_mut().zip(&blk[2..]) {
            *yi = (q as i8) as f32 * d;
        }
    }
}

/// Q4_0 blocks → f32. In byte `j` of a block's nibbles, the low nibble is element `j` and
/// the high nibble is element `j + 16`.
pub fn dequantize_q4_0(data: &[u8], out: &mut [f32]) {
    assert_eq!(data.len() / Q4_0_BLOCK_BYTES * QK, out.len());
    assert_eq!(data.len() % Q4_0_BLOCK_BYTES, 0);
    for (blk, y) in data
        .chunks_exact(Q4_0_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(QK))
    {
        let d = f16_at(blk, 0);
        let qs = &blk[2..];
        for j in 0..QK / 2 {
            let lo = (qs[j] & 0x0F) as i32 - 8;
            let hi = (qs[j] >> 4) as i32 - 8;
            y[j] = lo as f32 * d;
            y[j + QK / 2] = hi as f32 * d;
        }
    }
}

/// Q4_1 blocks → f32 (value = q·d + m, computed as a product then a sum in f32, as ggml's
/// reference code and NumPy do).
pub fn dequantize_q4_1(data: &[u8], out: &mut [f32]) {
    assert_eq!(data.len() / Q4_1_BLOCK_BYTES * QK, out.len());
    assert_eq!(data.len() % Q4_1_BLOCK_BYTES, 0);
    for (blk, y) in data
        .chunks_exact(Q4_1_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(QK))
    {
        let d = f16_at(blk, 0);
        let m = f16_at(blk, 2);
        let qs = &blk[4..];
        for j in 0..QK / 2 {
            let lo = (qs[j] & 0x0F) as f32;
            let hi = (qs[j] >> 4) as f32;
            y[j] = lo * d + m;
            y[j + QK / 2] = hi * d + m;
        }
    }
}

/// Dequantize `data` (whole blocks of `ty`) into `out`. Errors for unsupported types and
/// for a byte count that does not match `out.len()`.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    let expect = ty
        .byte_size(out.len() as u64)
        .ok_or_else(|| anyhow!("cannot dequantize {} elements of type {ty}", out.len()))?;
    if expect != data.len() as u64 {
        bail!(
            "{ty} data for {} elements should be {expect} bytes, got {}",
            out.len(),
            data.len()
        );
    }
    match ty {
        GgmlType::F32 => {
            for (y, b) in out.iter_mut().zip(data.chunks_exact(4)) {
                *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (y, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *y = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (y, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *y = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::Q8_0 => dequantize_q8_0(data, out),
        GgmlType::Q4_0 => dequantize_q4_0(data, out),
        GgmlType::Q4_1 => dequantize_q4_1(data, out),
        _ => bail!("ggml type {ty} is not supported"),
    }
    Ok(())
}

/// Undo llama.cpp's Q/K row permutation for interleaved RoPE.
///
/// `w` is a row-major `[rows, cols]` matrix with `rows = n_head · head_dim`. llama.cpp's
/// converter viewed each head's rows as `[2, head_dim/2]` and transposed that to
/// `[head_dim/2, 2]`, so Hugging Face row `h·hd + s·hd/2 + j` (s ∈ {0,1}) sits at GGUF row
/// `h·hd + 2j + s`. This puts every row back where Hugging Face had it.
pub fn unpermute_qk(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Result<Vec<f32>> {
    if rows * cols != w.len() {
        bail!("un-permute: {} values for a {rows}×{cols} matrix", w.len());
    }
    if n_head == 0 || !rows.is_multiple_of(n_head) || !(rows / n_head).is_multiple_of(2) {
        bail!("un-permute: {rows} rows do not split into {n_head} heads of even size");
    }
    let hd = rows / n_head;
    let half = hd / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..n_head {
        for j in 0..half {
            for s in 0..2 {
                let src = h * hd + 2 * j + s;
                let dst = h * hd + s * half + j;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_names() {
        assert_eq!(GgmlType(14).name(), "Q6_K");
        assert_eq!(GgmlType(12).name(), "Q4_K");
        assert_eq!(GgmlType(4).name(), "ggml type 4");
        assert_eq!(GgmlType::Q4_1.byte_size(64), Some(40));
        assert_eq!(GgmlType::Q4_1.byte_size(33), None);
        assert_eq!(GgmlType(14).byte_size(256), None);
    }

    #[test]
    fn unpermute_moves_rows_per_head() {
        // 2 heads of head_dim 4, one column: GGUF row order per head is (0,2,1,3) of HF.
        let gguf = [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0];
        let hf = unpermute_qk(&gguf, 8, 1, 2).unwrap();
        assert_eq!(hf, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
        assert!(unpermute_qk(&gguf, 8, 1, 3).is_err());
    }
}
