//! Picking rows out of a source matrix, plain or quantized, with no arithmetic.
//!
//! Qwen3-Next stores its Gated DeltaNet projections grouped per key head; the packer
//! un-groups them by moving rows. A quantized checkpoint must keep its very bytes (an
//! imported artifact scores what a serving stack loads), so a quantized matrix's rows move
//! with their scales: nvfp4 block scales and fp8 per-channel scales are per row and move
//! row by row; an fp8 per-tensor scale is shared; fp8 128 × 128 block scales move only in
//! whole 128-row blocks, so a selection that cuts a block is refused rather than requantized.

use super::TensorData;
use crate::quant::fp8::{self, Fp8Scale, Fp8Tensor};
use crate::quant::nvfp4::{self, Nvfp4Tensor};
use crate::quant::QuantTensor;

/// Row `start .. start + n` of a matrix.
pub type Span = (usize, usize);

/// The rows `spans` of `data` (a `[rows, cols]` matrix), concatenated in order. Errors say
/// why the selection cannot be taken exactly; the caller names the file and tensor.
pub fn gather(data: &TensorData, cols: usize, spans: &[Span]) -> Result<TensorData, String> {
    let rows: usize = spans.iter().map(|s| s.1).sum();
    // Bytes of `per_row` per row: the selected rows of `v`, in order.
    let pick = |v: &[u8], per_row: usize| -> Vec<u8> {
        let mut out = Vec::with_capacity(rows * per_row);
        for &(s, n) in spans {
            out.extend_from_slice(&v[s * per_row..(s + n) * per_row]);
        }
        out
    };
    Ok(match data {
        TensorData::Values(v) => {
            let mut out = Vec::with_capacity(rows * cols);
            for &(s, n) in spans {
                out.extend_from_slice(&v[s * cols..(s + n) * cols]);
            }
            TensorData::Values(out)
        }
        TensorData::Quantized(QuantTensor::Nvfp4(t)) => {
            TensorData::Quantized(QuantTensor::Nvfp4(Nvfp4Tensor {
                rows,
                cols: t.cols,
                packed: pick(&t.packed, t.cols / 2),
                block_scales: pick(&t.block_scales, t.cols / nvfp4::BLOCK),
                global: t.global,
            }))
        }
        TensorData::Quantized(QuantTensor::Fp8(t)) => {
            let scale = match &t.scale {
                Fp8Scale::Tensor(s) => Fp8Scale::Tensor(*s),
                Fp8Scale::Channel(v) => Fp8Scale::Channel(
                    spans
                        .iter()
                        .flat_map(|&(s, n)| v[s..s + n].iter().copied())
                        .collect(),
                ),
                Fp8Scale::Block(v) => {
                    let b = fp8::BLOCK;
                    // Only the selection's last span may end in the matrix's last, partial
                    // block (any earlier, and the blocks after it would be misaligned).
                    let last = spans.len().saturating_sub(1);
                    let whole = |i: usize, &(s, n): &Span| {
                        s % b == 0 && (n % b == 0 || (s + n == t.rows && i == last))
                    };
                    let cut = spans.iter().enumerate().find(|(i, sp)| !whole(*i, sp));
                    if let Some((_, &(s, n))) = cut {
                        return Err(format!(
                            "its fp8 scales cover 128 x 128 blocks, and rows {s}..{} are not whole blocks, so they cannot move without requantizing",
                            s + n
                        ));
                    }
                    let per = t.cols.div_ceil(b);
                    let blocks: Vec<Span> =
                        spans.iter().map(|&(s, n)| (s / b, n.div_ceil(b))).collect();
                    Fp8Scale::Block(
                        blocks
                            .iter()
                            .flat_map(|&(s, n)| v[s * per..(s + n) * per].iter().copied())
                            .collect(),
                    )
                }
            };
            TensorData::Quantized(QuantTensor::Fp8(Fp8Tensor {
                rows,
                cols: t.cols,
                codes: pick(&t.codes, t.cols),
                scale,
            }))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::nvfp4::Global;

    fn values(d: &TensorData) -> Vec<f32> {
        match d {
            TensorData::Values(v) => v.clone(),
            TensorData::Quantized(q) => q.dequantize().unwrap(),
        }
    }

    /// `[rows, cols]` with row r's values distinct from every other row's.
    fn matrix(rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| ((i / cols) as f32 + 1.0) * if i % 3 == 0 { -0.5 } else { 0.25 })
            .collect()
    }

    /// The rows of the dequantized gather are the gathered rows of the dequantized matrix,
    /// for every format, so a quantized import un-groups to the same values as a plain one.
    #[test]
    fn quantized_rows_move_with_their_scales() {
        let spans = [(256, 128), (0, 128), (384, 256)];
        let (rows, cols) = (640, 32);
        let w = matrix(rows, cols);
        let nv = nvfp4::quantize_group(&[&w], cols).remove(0);
        assert!(matches!(nv.global, Global::Multiply(_)));
        let block = fp8::quantize_block(&w, rows, cols);
        let mut channel = block.clone();
        channel.scale = Fp8Scale::Channel((0..rows).map(|r| 1.0 + r as f32).collect());
        let mut tensor = block.clone();
        tensor.scale = Fp8Scale::Tensor(0.5);
        for q in [
            QuantTensor::Nvfp4(nv),
            QuantTensor::Fp8(block),
            QuantTensor::Fp8(channel),
            QuantTensor::Fp8(tensor),
        ] {
            let whole = TensorData::Values(q.dequantize().unwrap());
            let data = TensorData::Quantized(q);
            let got = gather(&data, cols, &spans).unwrap();
            assert_eq!(values(&got), values(&gather(&whole, cols, &spans).unwrap()));
            assert_eq!(values(&got).len(), 512 * cols);
        }
    }

    #[test]
    fn fp8_blocks_are_not_cut() {
        let (rows, cols) = (256, 16);
        let q = QuantTensor::Fp8(fp8::quantize_block(&matrix(rows, cols), rows, cols));
        let e = gather(&TensorData::Quantized(q), cols, &[(0, 64), (128, 128)]).unwrap_err();
        assert!(e.contains("rows 0..64 are not whole blocks"), "{e}");
    }
}
