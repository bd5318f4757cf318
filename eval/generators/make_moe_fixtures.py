#!/usr/bin/env python3
"""Reference fixtures for the mixture-of-experts text models (qwen3_moe, qwen3_5_moe, qwen3_next).

Builds two tiny random-weight models with transformers' own classes, trains them a few Adam
steps on the fixture texts, stores them under eval/fixtures/tiny-<family>/ and writes float32
per-token log-probabilities from transformers to eval/fixtures/tiny_<family>_logprobs.json:

* tiny-qwen3_moe: `Qwen3MoeForCausalLM`, 3 layers, 8 experts, top-2 renormalised, layer 1
  dense (`mlp_only_layers`), stored in the per-expert layout of the published checkpoints
  (`mlp.experts.E.{gate,up,down}_proj.weight`; transformers' own save_pretrained);
* tiny-qwen3_5_moe: `Qwen3_5MoeForCausalLM`, the Qwen3.5 hybrid (3 Gated DeltaNet layers, 1
  gated attention layer) with 8 experts, top-2 and a gated shared expert in every layer,
  stored in the fused layout (`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`);
* tiny-qwen3_next: `Qwen3NextForCausalLM`, the same layers with layer 1 dense, its Gated
  DeltaNet projections grouped per key head (`in_proj_qkvz`, `in_proj_ba`, 3 value heads per
  key head) and per-expert tensors, as transformers saves it.

Every parameter is re-randomised after construction from numpy's legacy RandomState (norms
and routers included: transformers initialises routers to zero and norms to one/zero), with
routers scaled so routing is decisive (no near-ties that float rounding could flip). The
script checks that every expert gets tokens over the fixture texts and that some get none in
a short window, and prints the routing counts.

    eval/.venv/bin/python eval/generators/make_moe_fixtures.py [--cache models/cache]
                                        [--family NAME ...] [--out DIR]

--out writes under DIR (laid out as eval/fixtures/) instead of over the committed files.
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch: the CPU kernels this script's committed files need
    from cpu_pins import pin_cpu
    pin_cpu("zen3")

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import (  # noqa: E402
    FIXTURES, FRANCE, MIXED, PARAGRAPH, QWEN3_TOKENIZER, QWEN3_TOKENIZER_SHA256,
    QWEN3_TOKENIZER_SOURCE, ROOT, TORCH_THREADS, adam_fit, ensure_file, logprob_cases, out_dir,
    sha256_file, shown, versions, write_json,
)

VOCAB = 151936
STEPS = 20
LR = 2e-2
EXPERTS, TOP_K = 8, 2
TEXTS = [("france", FRANCE), ("prose", PARAGRAPH), ("mixed_code_zh", MIXED)]
PROTOCOLS = [(4096, 2048), (128, 64), (16, 8)]
CASES = [(n, t, PROTOCOLS) for n, t in TEXTS]
LIN, FULL = "linear_attention", "full_attention"

QWEN3_MOE = dict(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_act="silu",
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=True, attention_bias=False, num_experts=EXPERTS,
    num_experts_per_tok=TOP_K, moe_intermediate_size=12, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[1], bos_token_id=151643, eos_token_id=151645,
)
QWEN3_5_MOE = dict(
    vocab_size=VOCAB, hidden_size=16, num_hidden_layers=4, layer_types=[LIN, LIN, FULL, LIN],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                     "partial_rotary_factor": 0.5},
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
    linear_value_head_dim=6, linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6,
    max_position_embeddings=32768, tie_word_embeddings=True, num_experts=EXPERTS,
    num_experts_per_tok=TOP_K, moe_intermediate_size=12, shared_expert_intermediate_size=20,
    bos_token_id=151643, eos_token_id=151645,
)
QWEN3_NEXT = dict(
    QWEN3_5_MOE, layer_types=[LIN, LIN, FULL, LIN], intermediate_size=32, mlp_only_layers=[1],
    decoder_sparse_step=1, norm_topk_prob=True,
)
SEEDS = {"qwen3_moe": 301, "qwen3_5_moe": 351, "qwen3_next": 381}
CLASSES = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, QWEN3_MOE),
           "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, QWEN3_5_MOE),
           "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM, QWEN3_NEXT)}


def randomize(model: torch.nn.Module, seed: int, zero_centred: bool) -> None:
    params = dict(model.named_parameters())
    rng = np.random.RandomState(seed)
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            shape = tuple(p.shape)
            z = rng.standard_normal(shape)
            if name.endswith("linear_attn.norm.weight"):
                a = 1.0 + 0.25 * z
            elif name.endswith("norm.weight"):
                a = 0.25 * z if zero_centred else 1.0 + 0.25 * z
            elif name.endswith("A_log"):
                a = rng.uniform(math.log(0.05), math.log(2.0), size=shape)
            elif name.endswith(("dt_bias", "conv1d.weight")):
                a = 0.5 * z
            elif name.endswith("embed_tokens.weight"):
                a = 0.5 * z
            elif name.endswith("mlp.gate.weight"):
                a = 1.5 * z  # decisive routing: logits spread by several units
            else:
                a = z / math.sqrt(shape[-1])
            p.copy_(torch.from_numpy(np.asarray(a, dtype=np.float32)))


@torch.no_grad()
def routing_counts(model: torch.nn.Module, ids: list[int]) -> list[list[int]]:
    """Tokens per expert in every sparse layer for one sequence, from transformers' router."""
    counts = []
    hooks = []

    def hook(_m, _inp, out):
        _, _, idx = out
        counts.append(torch.bincount(idx.flatten(), minlength=EXPERTS).tolist())

    for mod in model.modules():
        if type(mod).__name__.endswith("TopKRouter"):
            hooks.append(mod.register_forward_hook(hook))
    model(input_ids=torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    return counts


def build(family: str, tokenize, dest: Path = FIXTURES) -> None:
    out = dest / f"tiny-{family}"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    torch.manual_seed(SEEDS[family])
    conf_cls, cls, kwargs = CLASSES[family]
    conf = conf_cls(**kwargs)
    conf.architectures = [cls.__name__]
    model = cls(conf).float()
    randomize(model, SEEDS[family], zero_centred=family != "qwen3_moe")
    seqs = [tokenize(t) for _, t in TEXTS]
    adam_fit(model, seqs, STEPS, LR)
    model.to(torch.bfloat16)
    if family != "qwen3_5_moe":
        model.save_pretrained(str(out), safe_serialization=True)  # per-expert tensors
    else:
        conf.save_pretrained(str(out))
        sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)
        save_file(dict(sorted(sd.items())), str(out / "model.safetensors"),
                  metadata={"format": "pt"})
    (out / "generation_config.json").unlink(missing_ok=True)
    st = out / "model.safetensors"
    st_sha = sha256_file(st)
    print(f"wrote {shown(st)} ({st.stat().st_size} bytes, sha256 {st_sha})")

    ref, info = cls.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"{family}: loading info {bad}"
    ref.eval()

    total = np.zeros(EXPERTS, dtype=np.int64)
    for s in seqs:
        for layer in routing_counts(ref, s):
            total += np.array(layer)
    short = routing_counts(ref, seqs[0][:10])
    print(f"  {family} tokens per expert over the texts (all sparse layers): {total.tolist()}")
    print(f"  first 10 tokens, per layer: {short}")
    assert (total > 0).all(), "an expert got no tokens over the fixture texts"
    assert any(0 in layer for layer in short), "every expert got tokens in a 10-token window"

    cases = logprob_cases(ref, tokenize, CASES)
    for c in cases:
        assert all(math.isfinite(v) for w in c["windows"] for v in w["logprobs"]), c["name"]
    write_json(dest / f"tiny_{family}_logprobs.json", {
        "model": (f"eval/fixtures/tiny-{family} ({conf.architectures[0]}, numpy RandomState "
                  f"seed {SEEDS[family]} init, {STEPS} Adam steps lr {LR} on the fixture "
                  f"texts, stored as bfloat16)"),
        "safetensors_sha256": st_sha,
        "tokenizer": QWEN3_TOKENIZER_SOURCE,
        "tokenizer_sha256": QWEN3_TOKENIZER_SHA256,
        "dtype": "float32", **versions(),
        "routing_tokens_per_expert": total.tolist(),
        "cases": cases,
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", default=str(ROOT / "models" / "cache"))
    ap.add_argument("--family", choices=sorted(CLASSES), action="append")
    ap.add_argument("--out", help="write under this directory instead of eval/fixtures/")
    args = ap.parse_args()
    dest = out_dir(args.out)
    t0 = time.time()
    torch.set_num_threads(TORCH_THREADS)
    torch.use_deterministic_algorithms(True)
    tok_path = ensure_file(Path(args.cache).resolve(), QWEN3_TOKENIZER, QWEN3_TOKENIZER_SHA256,
                           "fetch-qwen3-tokenizer.sh")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_path))
    tokenize = lambda t: tok(t)["input_ids"]  # noqa: E731
    for family in args.family or list(CLASSES):
        build(family, tokenize, dest)
    print(f"done in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
