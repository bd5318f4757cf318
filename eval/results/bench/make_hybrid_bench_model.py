#!/usr/bin/env python3
"""A random-weight Qwen3.5-shaped text model for the hybrid speed bench (benches/hybrid.rs).

Usage: eval/.venv/bin/python eval/results/bench/make_hybrid_bench_model.py OUT_DIR [--layers N]

Writes OUT_DIR/config.json and OUT_DIR/model.safetensors (bf16) of a `Qwen3_5ForCausalLM`
with transformers' own initialisation from a fixed seed. The geometry is this project's choice
of a small member of the family (not a published config): hidden 1024, MLP 3584, layers in the
pattern [linear, linear, linear, full] (12 by default), full attention 8 query / 2 KV heads of
256 with rotary dim 64, Gated DeltaNet 16 key and 16 value heads of 128, conv width 4, the
Qwen3 tokenizer's padded vocabulary (151936), tied embeddings. 0.40B parameters with 12 layers. Development only: the evaluator never runs Python.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=12)
    a = ap.parse_args()
    out = Path(a.out)
    torch.manual_seed(1234)
    torch.set_num_threads(2)
    cfg = Qwen3_5TextConfig(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=a.layers,
        layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(a.layers)],
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    )
    model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16)
    model.config.architectures = ["Qwen3_5ForCausalLM"]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"dir": str(out), "params": n, "layers": a.layers}))


if __name__ == "__main__":
    sys.exit(main())
