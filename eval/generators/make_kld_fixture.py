#!/usr/bin/env python3
"""Full-vocabulary KL divergence and top-1 agreement between two Main KV formats, computed
independently with transformers, for `--reference-kv` (tests/reference_pass.rs).

SmolLM2-135M (the pinned GGUF, dequantized to float32 by transformers) scores a fixed text
with the window protocol twice: K (after RoPE) and V exact (f32), and through the `nvfp4` KV
format, the seed engine's Nvfp4Group16 (docs/kv-formats.md): keys, queries and values
multiplied by the normalized Hadamard matrix of size head_dim, keys and values through E2M1
with one E4M3 scale per 16 elements, the attention output turned back; written here from that
definition in PyTorch (nothing shared with the Rust code). Per scored position it records KL(f32 || nvfp4) over the full vocabulary (float64
from the float32 logits), both target log-probabilities and both top-1 tokens.

    eval/.venv/bin/python eval/generators/make_kld_fixture.py [--cache models/cache] [--out DIR]

--out writes DIR/smollm2_kld_f32_vs_nvfp4.json instead of the committed file.
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch: the CPU kernels this script's committed files need
    from cpu_pins import pin_cpu
    pin_cpu("avx512")

import argparse
import math
import tempfile
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import make_fixtures as mf

CONTEXT, STRIDE = 128, 64
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def overlap(run: torch.Tensor, ref: torch.Tensor, k: int) -> int:
    """How many of the run's k largest logits' ids are among the reference's k (ties to the
    lower id: a stable sort of the negated logits)."""
    top = lambda x: set(torch.sort(-x, stable=True).indices[:k].tolist())
    return len(top(run) & top(ref))


def e2m1_round(a: torch.Tensor) -> torch.Tensor:
    """Magnitudes to the nearest e2m1 value, ties to the even code, saturating at 6."""
    code = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
            + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    return E2M1[code]


def nvfp4_qdq(x: torch.Tensor) -> torch.Tensor:
    """`x[..., n]` through nvfp4 and back: per block of 16, s = e4m3(clamp(amax / 6, 2^-9,
    448)), value = e2m1(x / s) * s; an all-zero block stays zero."""
    assert x.dtype == torch.float32 and x.shape[-1] % 16 == 0
    xb = x.unflatten(-1, (-1, 16))
    amax_b = xb.abs().amax(-1, keepdim=True)
    s = (amax_b / 6.0).clamp(2.0 ** -9, 448.0).to(torch.float8_e4m3fn).to(torch.float32)
    s = torch.where(amax_b > 0, s, torch.zeros_like(s))
    y = torch.where(s > 0, xb / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(xb))
    out = torch.sign(y) * e2m1_round(y.abs()) * s
    return out.flatten(-2)


def hadamard(n: int) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix, float32 (symmetric, its own inverse)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n ** 0.5).to(torch.float32)


MODE = {"kv": "f32"}


def kv_attention(module, query, key, value, attention_mask, **kw):
    if MODE["kv"] != "nvfp4":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
    h = hadamard(query.shape[-1])
    query, key, value = query @ h, nvfp4_qdq(key @ h), nvfp4_qdq(value @ h)
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
    return out @ h, weights


@torch.no_grad()
def window_logits(model, ids, kv):
    MODE["kv"] = kv
    out = []
    for begin, start, end in mf.windows(len(ids), CONTEXT, STRIDE):
        x = torch.tensor([ids[begin:end]], dtype=torch.long)
        logits = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits[0]
        out.append(((begin, start, end), logits[start - 1 - begin:end - 1 - begin]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", default=str(mf.ROOT / "models" / "cache"))
    ap.add_argument("--out", help="write under this directory instead of eval/fixtures/")
    args = ap.parse_args()
    out = mf.out_dir(args.out)
    torch.set_num_threads(mf.TORCH_THREADS)
    torch.use_deterministic_algorithms(True)
    AttentionInterface.register("ninfer_kv", kv_attention)
    text = "\n\n".join([mf.PARAGRAPH, mf.MIXED, mf.FRANCE])
    with tempfile.TemporaryDirectory() as t:
        d = mf.smollm2_dir(Path(args.cache).resolve(), Path(t))
        tok = mf.smollm2_tokenizer(d)
        model = AutoModelForCausalLM.from_pretrained(
            str(d), gguf_file=mf.SMOLLM2_GGUF, dtype=torch.float32, attn_implementation="ninfer_kv")
        model.eval()
        ids = tok(text)["input_ids"]
        ref = window_logits(model, ids, "f32")
        run = window_logits(model, ids, "nvfp4")
    wins = []
    for (bounds, lr), (_, ln) in zip(ref, run):
        begin, start, end = bounds
        pr, pn = torch.log_softmax(lr.double(), -1), torch.log_softmax(ln.double(), -1)
        kld = (pr.exp() * (pr - pn)).sum(-1)
        # Jensen-Shannon with the mixture m = (p + q) / 2, in float64.
        lm = torch.logaddexp(pr, pn) - math.log(2.0)
        js = 0.5 * ((pr.exp() * (pr - lm)).sum(-1) + (pn.exp() * (pn - lm)).sum(-1))
        tgt = torch.tensor(ids[start:end])[:, None]
        wins.append({
            "begin": begin, "start": start, "end": end,
            "kld": kld.tolist(),
            "ref_logprob": pr.gather(1, tgt)[:, 0].tolist(),
            "run_logprob": pn.gather(1, tgt)[:, 0].tolist(),
            "ref_top1": lr.argmax(-1).tolist(),
            "run_top1": ln.argmax(-1).tolist(),
            "js": js.tolist(),
            "top5_overlap": [overlap(a, b, 5) for a, b in zip(ln, lr)],
            "top10_overlap": [overlap(a, b, 10) for a, b in zip(ln, lr)],
        })
    n = sum(len(w["kld"]) for w in wins)
    mean = sum(sum(w["kld"]) for w in wins) / n
    agree = sum(a == b for w in wins for a, b in zip(w["ref_top1"], w["run_top1"])) / n
    mean_js = sum(sum(w["js"]) for w in wins) / n
    top5 = sum(sum(w["top5_overlap"]) for w in wins) / (5 * n)
    top10 = sum(sum(w["top10_overlap"]) for w in wins) / (10 * n)
    print(f"{n} positions, {len(wins)} windows: mean KLD {mean:.6f}, top-1 agreement {agree:.4f}, "
          f"mean JS {mean_js:.6f}, top-5 overlap {top5:.4f}, top-10 overlap {top10:.4f}")
    mf.write_json(out / "smollm2_kld_f32_vs_nvfp4.json", {
        "model": mf.SMOLLM2_SOURCE, "gguf_sha256": mf.SMOLLM2_GGUF_SHA256, **mf.versions(),
        "reference_kv": "f32", "run_kv": "nvfp4", "context": CONTEXT, "stride": STRIDE,
        "text": text, "token_ids": ids, "mean_kld": mean, "top1_agreement": agree,
        "mean_js": mean_js, "top5_overlap": top5, "top10_overlap": top10,
        "windows": wins,
    })


if __name__ == "__main__":
    main()
