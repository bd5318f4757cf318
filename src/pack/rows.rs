//! Picking rows out of a source matrix, plain or quantized, with no arithmetic.
//!
//! Qwen3-Next stores its Gated DeltaNet projections grouped per key head; the packer
//! un-groups them by moving rows. A quantized checkpoint must keep its very bytes (an
//! imported artifact scores what a serving stack loads), so a quantized matrix's rows move
//! with their scales: nvfp4 block scales and fp8 per-channel scales belong to one row and move
//! with it; an fp8 per-tensor scale is shared. An fp8 128 × 128 block scale belongs to 128
//! rows at once, so each 128-row block of the result must take all its rows from one block of
//! the source (whose scales it then takes); a selection that mixes two source blocks in one
//! result block is refused rather than requantized.

use super::TensorData;
use crate::quant::fp8::{self, Fp8Scale, Fp8Tensor};
use crate::quant::nvfp4::{self, Nvfp4Tensor};
use crate::quant::QuantTensor;

/// Rows `start .. start + n` of a matrix.
pub type Span = (usize, usize);

/// The selected rows of `v`, a row-major matrix of `per_row` elements per row, in order.
fn take<T: Copy>(v: &[T], spans: &[Span], per_row: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(spans.iter().map(|s| s.1).sum::<usize>() * per_row);
    for &(s, n) in spans {
        out.extend_from_slice(&v[s * per_row..(s + n) * per_row]);
    }
    out
}

/// The rows `spans` of `data`, a `[rows, cols]` matrix, concatenated in order. Errors say why
/// the selection cannot be taken (exactly); the caller names the file and tensor.
pub fn gather(
    data: &TensorData,
    rows: usize,
    cols: usize,
    spans: &[Span],
) -> Result<TensorData, String> {
    if let Some(&(s, n)) = spans.iter().find(|&&(s, n)| s + n > rows) {
        return Err(format!("rows {s}..{} are past its {rows} rows", s + n));
    }
    let data = data.resolve().map_err(|e| format!("{e:#}"))?;
    let data = data.as_ref();
    if let TensorData::Quantized(q) = data {
        if (q.rows(), q.cols()) != (rows, cols) {
            return Err(format!(
                "it holds [{}, {}], not [{rows}, {cols}]",
                q.rows(),
                q.cols()
            ));
        }
    }
    let out_rows: usize = spans.iter().map(|s| s.1).sum();
    Ok(match data {
        TensorData::Values(v) => TensorData::Values(take(v, spans, cols)),
        // packed [rows, cols/2], block scales [rows, cols/16]: both per row.
        TensorData::Quantized(QuantTensor::Nvfp4(t)) => {
            TensorData::Quantized(QuantTensor::Nvfp4(Nvfp4Tensor {
                rows: out_rows,
                cols,
                packed: take(&t.packed, spans, cols / 2),
                block_scales: take(&t.block_scales, spans, cols / nvfp4::BLOCK),
                global: t.global,
            }))
        }
        // codes [rows, cols]; scales [1], [rows] or [⌈rows/128⌉, ⌈cols/128⌉].
        TensorData::Mapped { .. } | TensorData::Deferred(_) | TensorData::Raw { .. } => {
            unreachable!("resolved above")
        }
        TensorData::Quantized(QuantTensor::Fp8(t)) => {
            let scale = match &t.scale {
                Fp8Scale::Tensor(s) => Fp8Scale::Tensor(*s),
                Fp8Scale::Channel(v) => Fp8Scale::Channel(take(v, spans, 1)),
                Fp8Scale::Block(v) => {
                    let blocks = source_blocks(spans, out_rows)?;
                    // One scale row (a scale per 128 columns) per result block.
                    let per = cols.div_ceil(fp8::BLOCK);
                    let picked: Vec<Span> = blocks.iter().map(|&b| (b, 1)).collect();
                    Fp8Scale::Block(take(v, &picked, per))
                }
            };
            TensorData::Quantized(QuantTensor::Fp8(Fp8Tensor {
                rows: out_rows,
                cols,
                codes: take(&t.codes, spans, cols),
                scale,
            }))
        }
    })
}

/// For each 128-row block of the result (`out_rows` rows taken by `spans`), the source block
/// all its rows come from; an error when a result block mixes two.
fn source_blocks(spans: &[Span], out_rows: usize) -> Result<Vec<usize>, String> {
    let b = fp8::BLOCK;
    let source_rows = spans.iter().flat_map(|&(s, n)| s..s + n);
    let mut blocks: Vec<usize> = Vec::with_capacity(out_rows.div_ceil(b));
    for (r, src) in source_rows.enumerate() {
        if r % b == 0 {
            blocks.push(src / b);
        } else if blocks[r / b] != src / b {
            return Err(format!(
                "its fp8 scales cover 128 x 128 blocks, and un-grouped rows {}..{} would share one block scale while coming from source blocks {} and {}; they cannot move without requantizing",
                r / b * b,
                (r / b * b + b).min(out_rows),
                blocks[r / b],
                src / b
            ));
        }
    }
    Ok(blocks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::nvfp4::Global;

    fn values(d: &TensorData) -> Vec<f32> {
        match d.resolve().unwrap().as_ref() {
            TensorData::Values(v) => v.clone(),
            TensorData::Quantized(q) => q.dequantize().unwrap(),
            _ => unreachable!("resolved"),
        }
    }

    /// `[rows, cols]` whose 128 × 128 blocks all have different maxima (so different fp8
    /// block scales, across rows and across columns) and whose rows all differ.
    fn matrix(rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| {
                let (r, c) = (i / cols, i % cols);
                let block = (r / 128 * 7 + c / 128 * 3) as i32;
                let sign = if i % 3 == 0 { -1.0 } else { 1.0 };
                sign * 2f32.powi(block % 9 - 4) * (1.0 + (r % 128) as f32 / 256.0)
            })
            .collect()
    }

    /// The rows of the dequantized gather are the gathered rows of the dequantized matrix,
    /// for every format, so a quantized import un-groups to the same values as a plain one.
    /// 320 columns: three fp8 block columns, the last partial; 640 rows: five row blocks.
    #[test]
    fn quantized_rows_move_with_their_scales() {
        let spans = [(256, 128), (0, 128), (512, 128), (384, 100)];
        let (rows, cols) = (640, 320);
        let w = matrix(rows, cols);
        let nv = nvfp4::quantize_group(&[&w], cols).remove(0);
        assert!(matches!(nv.global, Global::Multiply(_)));
        let block = fp8::quantize_block(&w, rows, cols);
        let scales = block.scale.values();
        assert_eq!(scales.len(), 5 * 3);
        let distinct: std::collections::BTreeSet<u32> =
            scales.iter().map(|s| s.to_bits()).collect();
        assert!(distinct.len() >= 9, "block scales {scales:?}");
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
            let got = gather(&data, rows, cols, &spans).unwrap();
            let want = gather(&whole, rows, cols, &spans).unwrap();
            assert_eq!(values(&got), values(&want));
            assert_eq!(values(&got).len(), 484 * cols);
        }
    }

    /// A result block may take rows from anywhere inside one source block (a matrix of at
    /// most 128 rows always un-groups), never from two.
    #[test]
    fn fp8_blocks_are_not_mixed() {
        let (rows, cols) = (256, 16);
        let q = QuantTensor::Fp8(fp8::quantize_block(&matrix(rows, cols), rows, cols));
        let data = TensorData::Quantized(q);
        let inside = [(64, 32), (0, 64), (96, 32), (128, 128)];
        let whole = TensorData::Values(values(&data));
        assert_eq!(
            values(&gather(&data, rows, cols, &inside).unwrap()),
            values(&gather(&whole, rows, cols, &inside).unwrap())
        );
        let e = gather(&data, rows, cols, &[(0, 64), (128, 128)]).unwrap_err();
        assert!(
            e.contains(
                "rows 0..128 would share one block scale while coming from source blocks 0 and 1"
            ),
            "{e}"
        );
        let e = gather(&data, rows, cols, &[(200, 64)]).unwrap_err();
        assert!(e.contains("rows 200..264 are past its 256 rows"), "{e}");
        let e = gather(&data, rows, 32, &[(0, 1)]).unwrap_err();
        assert!(e.contains("it holds [256, 16], not [256, 32]"), "{e}");
    }
}
