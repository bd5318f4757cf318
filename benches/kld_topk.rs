//! What a bounded (top-K) reference record would lose against the exact one, measured on
//! real positions: two saved references of the same tokens (`--save-reference`: a
//! reference run and a run under test, exact final hidden states), the artifact's head
//! applied to both, and at every position the exact full-vocabulary KL(reference ‖ run)
//! beside what a top-K record gives (`score::topk`): the reference's top K plus a tail
//! bucket against the live run, and the seed engine's union-of-top-K form.
//!
//! `bash eval/results/kld-topk.sh` makes the two files and runs this; by hand:
//! `NINFER_TOPK_ARTIFACT=A NINFER_TOPK_REFERENCE=ref.bin NINFER_TOPK_RUN=run.bin
//! cargo bench --bench kld_topk` (`NINFER_BENCH_OUT=FILE` also writes the figures as JSON).

use ninfer_perplexity::artifact::Artifact;
use ninfer_perplexity::model::layout::{EMBED, LM_HEAD};
use ninfer_perplexity::score::saved::SavedReference;
use ninfer_perplexity::score::topk::{kl_exact, kl_top_k_tail, kl_top_k_union, top_k};
use rayon::prelude::*;
use std::path::PathBuf;

const KS: [usize; 6] = [1, 8, 32, 100, 256, 1024];
/// Rows per head GEMM.
const BLOCK: usize = 64;

fn env_path(name: &str) -> PathBuf {
    PathBuf::from(std::env::var(name).unwrap_or_else(|_| {
        eprintln!("kld_topk: set {name} (see the file's header); nothing measured");
        std::process::exit(0)
    }))
}

/// Per position: the exact KL, then per K the tail-bucket and union forms.
struct Position {
    exact: f64,
    tail: Vec<f64>,
    union: Vec<f64>,
}

/// `[rows, vocab]` log-probabilities of `h[rows, d]` through `w[vocab, d]`, f64.
fn log_softmax_rows(h: &[f32], w: &[f32], d: usize, vocab: usize) -> Vec<Vec<f64>> {
    let rows = h.len() / d;
    let mut logits = vec![0f32; rows * vocab];
    // logits[rows, vocab] = h[rows, d] · w[vocab, d]ᵀ
    unsafe {
        matrixmultiply::sgemm(
            rows,
            d,
            vocab,
            1.0,
            h.as_ptr(),
            d as isize,
            1,
            w.as_ptr(),
            1,
            d as isize,
            0.0,
            logits.as_mut_ptr(),
            vocab as isize,
            1,
        );
    }
    logits
        .chunks_exact(vocab)
        .map(|l| {
            let m = l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
            let z = m + l.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
            l.iter().map(|&x| x as f64 - z).collect()
        })
        .collect()
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn main() {
    let artifact = Artifact::open(&env_path("NINFER_TOPK_ARTIFACT")).unwrap();
    let reference = SavedReference::open(&env_path("NINFER_TOPK_REFERENCE")).unwrap();
    let run = SavedReference::open(&env_path("NINFER_TOPK_RUN")).unwrap();
    let c = &artifact.config;
    let (d, vocab) = (c.hidden_size, c.vocab_size);
    let head = if c.tie_word_embeddings {
        EMBED
    } else {
        LM_HEAD
    };
    let w = artifact.tensor_f32(head).unwrap(); // [vocab, d]
    assert_eq!(reference.index.identity.hidden_size, d);
    let mut positions: Vec<Position> = Vec::new();
    for s in &reference.index.streams {
        let r = run
            .index
            .streams
            .iter()
            .find(|x| x.tokens_sha256 == s.tokens_sha256)
            .expect("the run file holds the reference's streams");
        assert_eq!(r.windows.len(), s.windows.len(), "the same windows");
        let tokens = reference.tokens(s).unwrap();
        for (a, b) in s.windows.iter().zip(&r.windows) {
            assert_eq!(
                (a.begin, a.first_target, a.end),
                (b.begin, b.first_target, b.end)
            );
            let (ha, hb) = (reference.rows(a).unwrap(), run.rows(b).unwrap());
            let targets = &tokens[a.first_target..a.end];
            let block: Vec<Position> = ha
                .par_chunks(BLOCK * d)
                .zip(hb.par_chunks(BLOCK * d))
                .zip(targets.par_chunks(BLOCK))
                .flat_map_iter(|((ha, hb), t)| {
                    let (p, q) = (
                        log_softmax_rows(ha, &w, d, vocab),
                        log_softmax_rows(hb, &w, d, vocab),
                    );
                    p.into_iter()
                        .zip(q)
                        .zip(t.iter().copied())
                        .map(|((p, q), t)| {
                            // The top K of each side is a prefix of its top 1024.
                            let kmax = *KS.last().unwrap();
                            let (tp, tq) = (top_k(&p, kmax), top_k(&q, kmax));
                            let at = |v: &[(u32, f64)], k: usize| v[..k.min(v.len())].to_vec();
                            Position {
                                exact: kl_exact(&p, &q),
                                tail: KS.iter().map(|&k| kl_top_k_tail(&at(&tp, k), &q)).collect(),
                                union: KS
                                    .iter()
                                    .map(|&k| kl_top_k_union(&p, &q, &at(&tp, k), &at(&tq, k), t))
                                    .collect(),
                            }
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
            positions.extend(block);
        }
    }
    let n = positions.len() as f64;
    let exact_mean = positions.iter().map(|p| p.exact).sum::<f64>() / n;
    println!(
        "{} positions, vocabulary {vocab}, hidden size {d}: exact mean KL(reference || run) {exact_mean:.6e} nats",
        positions.len()
    );
    println!(
        "{:<6} {:>9} {:<6} {:>12} {:>10} {:>14} {:>12} {:>12}",
        "K",
        "bytes/pos",
        "form",
        "mean KL",
        "mean/exact",
        "median rel.err",
        "p99 |err|",
        "max |err|"
    );
    let mut json = Vec::new();
    for (i, &k) in KS.iter().enumerate() {
        // A record of K ids (u32) and log-probabilities (f32), the target's log-probability
        // and the tail mass: 8K + 8 bytes a position.
        let bytes = 8 * k + 8;
        for (form, get) in [
            (
                "tail",
                (|p: &Position, i: usize| p.tail[i]) as fn(&Position, usize) -> f64,
            ),
            ("union", |p: &Position, i: usize| p.union[i]),
        ] {
            let mean = positions.iter().map(|p| get(p, i)).sum::<f64>() / n;
            let mut rel: Vec<f64> = positions
                .iter()
                .filter(|p| p.exact > 1e-12)
                .map(|p| (get(p, i) - p.exact).abs() / p.exact)
                .collect();
            let mut abs: Vec<f64> = positions
                .iter()
                .map(|p| (get(p, i) - p.exact).abs())
                .collect();
            let (med, p99, max) = (
                quantile(&mut rel, 0.5),
                quantile(&mut abs, 0.99),
                abs.iter().cloned().fold(0.0, f64::max),
            );
            println!(
                "{k:<6} {bytes:>9} {form:<6} {mean:>12.6e} {:>10.4} {med:>14.3e} {p99:>12.3e} {max:>12.3e}",
                mean / exact_mean
            );
            json.push(serde_json::json!({
                "k": k, "bytes_per_position": bytes, "form": form, "mean_kld": mean,
                "mean_over_exact": mean / exact_mean, "median_relative_error": med,
                "p99_abs_error": p99, "max_abs_error": max,
            }));
        }
    }
    if let Ok(out) = std::env::var("NINFER_BENCH_OUT") {
        let v = serde_json::json!({
            "positions": positions.len(),
            "vocab": vocab,
            "hidden_size": d,
            "exact_mean_kld": exact_mean,
            "exact_bytes_per_position": 4 * d,
            "rows": json,
        });
        std::fs::write(out, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    }
}
