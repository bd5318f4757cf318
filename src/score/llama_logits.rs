//! llama.cpp's `--kl-divergence-base` file as a saved reference: another engine's
//! log-probabilities, read so `--kld-base` can hold this tool's run to them on the same
//! tokens (or show that the tokens differ).
//!
//! The layout, as `llama-perplexity` writes it (`llama.cpp:tools/perplexity/perplexity.cpp`,
//! `perplexity()` with `--kl-divergence-base`): the 8 bytes `_logits_`, u32 `n_ctx`, i32
//! `n_vocab`, i32 `n_chunk`, i32 token ids `[n_chunk · n_ctx]`, then for every chunk its
//! `n_ctx − 1 − n_ctx/2` scored positions, each `nv = 2·⌈n_vocab/2⌉ + 4` u16: an f32 scale
//! and an f32 `min_log_prob` (in the first four u16), then one u16 `q` per token with
//! `log p = min_log_prob + scale · q` over the 16 nats below the top token (`q = 0` at and
//! below them). Its chunks are this tool's `--window-plan kld-chunks` windows.

use super::saved::{tokens_sha256, Identity, Index, SavedStream, SavedWindow};
use anyhow::{anyhow, bail, Result};
use std::path::Path;

pub const MAGIC: &[u8; 8] = b"_logits_";

/// What the header says, checked against the file's size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub n_ctx: usize,
    pub n_vocab: usize,
    pub n_chunk: usize,
    /// u16 per scored position (`2·⌈n_vocab/2⌉ + 4`).
    pub nv: usize,
}

impl Layout {
    pub fn scored_per_chunk(&self) -> usize {
        self.n_ctx - 1 - self.n_ctx / 2
    }

    fn tokens_offset(&self) -> u64 {
        20
    }

    fn data_offset(&self) -> u64 {
        20 + 4 * (self.n_chunk * self.n_ctx) as u64
    }
}

/// Reads the header of `f` (`size` bytes) and checks that the file holds exactly what it
/// announces.
pub fn layout(shown: &str, head: &[u8; 20], size: u64) -> Result<Layout> {
    let u = |i: usize| u32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
    let (n_ctx, n_vocab, n_chunk) = (u(8) as u64, u(12) as i32, u(16) as i32);
    if n_ctx < 3 || n_vocab < 1 || n_chunk < 1 {
        bail!("{shown}: a llama.cpp logits file with n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk}");
    }
    let (n_vocab, n_chunk) = (n_vocab as u64, n_chunk as u64);
    let nv = 2 * n_vocab.div_ceil(2) + 4;
    let scored = n_ctx - 1 - n_ctx / 2;
    let want = n_chunk
        .checked_mul(n_ctx)
        .and_then(|t| t.checked_mul(4))
        .and_then(|t| t.checked_add(20))
        .and_then(|t| {
            n_chunk
                .checked_mul(scored)
                .and_then(|p| p.checked_mul(nv))
                .and_then(|p| p.checked_mul(2))
                .and_then(|p| t.checked_add(p))
        });
    if want != Some(size) {
        bail!(
            "{shown}: a llama.cpp logits file of {n_chunk} chunks of {n_ctx} over {n_vocab} tokens needs {} bytes; it has {size} (cut short, or not from this llama.cpp)",
            want.map_or("more than 2^64".to_string(), |w| w.to_string())
        );
    }
    Ok(Layout {
        n_ctx: n_ctx as usize,
        n_vocab: n_vocab as usize,
        n_chunk: n_chunk as usize,
        nv: nv as usize,
    })
}

/// The index of a llama.cpp logits file: one stream of its tokens, one window per chunk,
/// its identity what the file can say (llama.cpp records no model, tokenizer or KV).
pub fn index(path: &Path, l: &Layout, tokens: &[u32]) -> Index {
    let per_position = 2 * l.nv as u64;
    let c = l.n_ctx;
    let windows = (0..l.n_chunk)
        .map(|k| SavedWindow {
            begin: k * c,
            first_target: k * c + c / 2 + 1,
            end: (k + 1) * c,
            offset: l.data_offset() + (k * l.scored_per_chunk()) as u64 * per_position,
        })
        .collect();
    Index {
        format: "llama.cpp kl-divergence-base".into(),
        version: 1,
        identity: Identity {
            artifact_path: path.display().to_string(),
            artifact_digest: "unknown (llama.cpp)".into(),
            weight_format: "unknown (llama.cpp)".into(),
            head_sha256: String::new(),
            tokenizer_sha256: String::new(),
            hidden_size: 0,
            context: c,
            stride: c,
            window_plan: crate::score::WindowPlan::KldChunks,
            kv_dtype: "unknown (llama.cpp)".into(),
            device: "llama.cpp".into(),
            build: "llama-perplexity --kl-divergence-base".into(),
        },
        streams: vec![SavedStream {
            tokens_sha256: tokens_sha256(tokens),
            input_tokens: tokens.len(),
            tokens_offset: l.tokens_offset(),
            windows,
        }],
    }
}

/// Token ids from the file's i32s (a negative one is refused).
pub fn tokens(shown: &str, bytes: &[u8]) -> Result<Vec<u32>> {
    bytes
        .chunks_exact(4)
        .map(|b| {
            let t = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            u32::try_from(t).map_err(|_| anyhow!("{shown}: a negative token id ({t})"))
        })
        .collect()
}

/// `[positions, n_vocab]` log-probabilities from `positions` records of `nv` u16.
pub fn dequantize(shown: &str, bytes: &[u8], l: &Layout) -> Result<Vec<f32>> {
    let rec = 2 * l.nv;
    let mut out = Vec::with_capacity(bytes.len() / rec * l.n_vocab);
    for r in bytes.chunks_exact(rec) {
        let f = |i: usize| f32::from_le_bytes([r[i], r[i + 1], r[i + 2], r[i + 3]]);
        let (scale, min) = (f(0), f(4));
        if !scale.is_finite() || !min.is_finite() || scale < 0.0 {
            bail!("{shown}: a position with scale {scale} and minimum {min}");
        }
        out.extend(
            r[8..8 + 2 * l.n_vocab]
                .chunks_exact(2)
                .map(|q| min + scale * u16::from_le_bytes([q[0], q[1]]) as f32),
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file as llama-perplexity writes one: `n_chunk` chunks of `n_ctx`, `vocab` tokens.
    pub fn file(
        n_ctx: u32,
        vocab: i32,
        n_chunk: i32,
        logprobs: &dyn Fn(usize, usize) -> f32,
    ) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        b.extend(n_ctx.to_le_bytes());
        b.extend(vocab.to_le_bytes());
        b.extend(n_chunk.to_le_bytes());
        for t in 0..n_chunk as usize * n_ctx as usize {
            b.extend(((t * 7 % vocab as usize) as i32).to_le_bytes());
        }
        let scored = (n_ctx - 1 - n_ctx / 2) as usize;
        for p in 0..n_chunk as usize * scored {
            let lp: Vec<f32> = (0..vocab as usize).map(|v| logprobs(p, v)).collect();
            let max = lp.iter().cloned().fold(f32::MIN, f32::max);
            let min = lp.iter().cloned().fold(f32::MAX, f32::min).max(max - 16.0);
            let scale = (max - min) / 65535.0;
            b.extend(scale.to_le_bytes());
            b.extend(min.to_le_bytes());
            for v in &lp {
                let q = if *v > min {
                    ((v - min) / scale).round() as u16
                } else {
                    0
                };
                b.extend(q.to_le_bytes());
            }
            if vocab % 2 == 1 {
                b.extend([0u8, 0]);
            }
        }
        b
    }

    #[test]
    fn a_file_reads_back_within_its_quantization_step() {
        let lp = |p: usize, v: usize| -(((p + v) % 13) as f32) * 0.7 - 0.1;
        let b = file(8, 5, 2, &lp);
        let head: [u8; 20] = b[..20].try_into().unwrap();
        let l = layout("f", &head, b.len() as u64).unwrap();
        assert_eq!((l.n_ctx, l.n_vocab, l.n_chunk, l.nv), (8, 5, 2, 10));
        let idx = index(Path::new("f"), &l, &tokens("f", &b[20..20 + 64]).unwrap());
        let w = &idx.streams[0].windows[1];
        assert_eq!((w.begin, w.first_target, w.end), (8, 13, 16));
        let at = w.offset as usize;
        let rows = dequantize("f", &b[at..at + 3 * 20], &l).unwrap();
        for (i, x) in rows.iter().enumerate() {
            let want = lp(3 + i / 5, i % 5);
            assert!((x - want).abs() < 1e-3, "{i}: {x} vs {want}");
        }
        // Cut short, or one byte too many: refused with the expected size.
        for n in [b.len() - 1, b.len() + 1] {
            let e = layout("f", &head, n as u64).unwrap_err().to_string();
            assert!(e.contains(&format!("needs {} bytes", b.len())), "{e}");
        }
        let mut bad = head;
        bad[16..20].copy_from_slice(&i32::MAX.to_le_bytes());
        assert!(layout("f", &bad, b.len() as u64).is_err());
    }
}
