//! The two GEMMs behind the CPU linear layers, side by side on SmolLM2's shapes: the peer
//! `matrixmultiply` (with its AVX-512 or AVX2 kernel), this crate's broadcast tiles
//! (`sgemm16`: `12 × 32` on AVX-512, `6 × 16` on AVX2), and `auto`, which picks between them per call by measured speed. All three
//! give the same bits; the question is only speed, which on a shared host changes with its
//! load, so the three run interleaved, round after round, and every round is printed.
//!
//! `cargo bench --bench gemm [-- --rows 4096 --rounds 6 --threads 2]`

use ninfer_perplexity::backend::cpu::matmul::{matmul_wt_with, Gemm};
use ninfer_perplexity::backend::cpu::operand::WeightRows;
use std::time::Instant;

mod common;

use common::arg;

fn filled(n: usize, seed: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((((i + seed) * 2_654_435_761) % 2001) as f32 / 1000.0 - 1.0) * scale)
        .collect()
}

fn main() {
    let rows: usize = arg("--rows", 4096);
    let rounds: usize = arg("--rounds", 6);
    let threads: usize = arg("--threads", 2);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .expect("rayon pool");
    // (name, depth k, output columns n, accumulate): SmolLM2-135M's linear layers and a
    // 2048-column vocabulary chunk of the head.
    let shapes = [
        ("qkv", 576, 960, false),
        ("o", 576, 576, true),
        ("gate/up", 576, 3072, false),
        ("down", 1536, 576, true),
        ("head chunk", 576, 2048, false),
    ];
    let gemms = [Gemm::Matrixmultiply, Gemm::Tile16, Gemm::Auto];
    let reps: usize = arg("--reps", 5);
    println!("GFLOP/s, {rows} rows, {threads} threads, best of {reps} per round");
    println!("| round | shape | matrixmultiply | tile16 | auto |");
    println!("|---|---|---:|---:|---:|");
    let mut best = vec![[0.0f64; 3]; shapes.len()];
    for round in 1..=rounds {
        for (si, &(name, k, n, accumulate)) in shapes.iter().enumerate() {
            let x = filled(rows * k, 1, 1.0);
            let w = filled(n * k, 2, 0.05);
            let mut out = vec![0.0f32; rows * n];
            let mut best_s = [f64::INFINITY; 3];
            let mut check: Vec<Option<Vec<u32>>> = vec![None; 3];
            // The GEMMs alternate call by call, so a change in the host's speed hits all alike.
            for _ in 0..reps {
                for (gi, &g) in gemms.iter().enumerate() {
                    out.fill(0.25);
                    let t = Instant::now();
                    matmul_wt_with(
                        g,
                        &x,
                        rows,
                        k,
                        WeightRows::f32(&w, k),
                        n,
                        &mut out,
                        accumulate,
                    );
                    best_s[gi] = best_s[gi].min(t.elapsed().as_secs_f64());
                    check[gi] = Some(out.iter().map(|v| v.to_bits()).collect());
                }
            }
            assert!(
                check.iter().all(|c| c == &check[0]),
                "{name}: the GEMMs gave different bits"
            );
            let mut rates = [0.0f64; 3];
            for gi in 0..3 {
                rates[gi] = 2.0 * (rows * k * n) as f64 / best_s[gi] / 1e9;
                best[si][gi] = best[si][gi].max(rates[gi]);
            }
            println!(
                "| {round} | {name} | {:.1} | {:.1} | {:.1} |",
                rates[0], rates[1], rates[2]
            );
        }
    }
    println!();
    println!("best over all rounds:");
    println!("| shape | matrixmultiply | tile16 | auto |");
    println!("|---|---:|---:|---:|");
    for (si, &(name, ..)) in shapes.iter().enumerate() {
        println!(
            "| {name} | {:.1} | {:.1} | {:.1} |",
            best[si][0], best[si][1], best[si][2]
        );
    }
}
