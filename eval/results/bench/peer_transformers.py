"""Benchmark peer: transformers float32 scoring exactly the windows the Rust bench scores.

Usage: eval/.venv/bin/python eval/results/bench/peer_transformers.py WORK.json [--gemm-only]
WORK.json: {"gguf": path | "model_dir": path, "threads": int, "tokens": [...],
            "windows": [[begin, start, end], ...]}
Prints one JSON line: seconds, processed/scored token counts, nll_sum, and torch's float32
GEMM rate (fastest of five 2048^3 products, same thread count) measured just before the
scoring starts (`gemm_before_gflops`) and just after it ends (`gemm_gflops`). The bench uses
them as the machine's GEMM rate around its own neighbouring runs. `--gemm-only` skips the
model and prints only `gemm_gflops`.
"""
import json
import os
import sys
import time

import torch


def gemm_gflops():
    """Fastest of five single 2048^3 float32 products (the same rule as the engine's side)."""
    n = 2048
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(5):
        t1 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t1)
    return 2 * n**3 / best / 1e9


def main():
    work = json.load(open(sys.argv[1]))
    torch.set_num_threads(work["threads"])
    if "--gemm-only" in sys.argv[2:]:
        with torch.inference_mode():
            print(json.dumps({"gemm_gflops": gemm_gflops()}))
        return

    from transformers import AutoModelForCausalLM

    if "model_dir" in work:
        model = AutoModelForCausalLM.from_pretrained(work["model_dir"], dtype=torch.float32)
    else:
        gguf = work["gguf"]
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
        )
    model.eval()
    tokens = torch.tensor(work["tokens"], dtype=torch.long)
    windows = work["windows"]

    def score(b, s, e):
        ids = tokens[b:e][None]
        logits = model(ids).logits[0]
        lp = torch.log_softmax(logits[s - b - 1 : e - b - 1].float(), dim=-1)
        return -lp.gather(1, tokens[s:e][:, None]).double().sum().item()

    with torch.inference_mode():
        score(*windows[0])  # warm-up
        gemm_before = gemm_gflops()
        t0 = time.perf_counter()
        nll = sum(score(*w) for w in windows)
        secs = time.perf_counter() - t0
        gemm_after = gemm_gflops()

    print(
        json.dumps(
            {
                "peer": f"transformers {__import__('transformers').__version__} / torch {torch.__version__} float32",
                "seconds": secs,
                "processed_tokens": sum(e - b for b, s, e in windows),
                "scored_tokens": sum(e - s for b, s, e in windows),
                "nll_sum": nll,
                "gemm_before_gflops": gemm_before,
                "gemm_gflops": gemm_after,
            }
        )
    )


if __name__ == "__main__":
    main()
