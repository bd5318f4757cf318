#!/usr/bin/env python3
"""Reference fixtures for the Qwen3.5 hybrid text model (Gated DeltaNet + gated attention).

Builds a tiny random-weight `Qwen3_5ForConditionalGeneration` (real `model.language_model.*`,
`model.visual.*` and `lm_head.weight` names, plus fake `mtp.*` tensors that a packer must drop),
stores it under eval/fixtures/tiny-qwen3_5/, and writes float32 per-token log-probabilities
from transformers' own pure-PyTorch Qwen3.5 code to eval/fixtures/tiny_qwen3_5_logprobs.json.

As a second, independent check the script re-implements the whole text model in numpy float64
from the written math (token-by-token Gated DeltaNet recurrence, partial RoPE, gated attention),
reading the stored safetensors bytes itself, and asserts that it agrees with transformers.

Run with the project venv (eval/generators/setup-python.sh creates it; do not install
flash-linear-attention or causal-conv1d there, the fallbacks are the reference):

    eval/.venv/bin/python eval/generators/make_hybrid_fixtures.py [--cache models/cache]
                                                                 [--out DIR]

--out writes tiny-qwen3_5/ and tiny_qwen3_5_logprobs.json under DIR instead of eval/fixtures/.

The window protocol, the scoring and the texts come from make_fixtures.py. Every output is a
deterministic function of the pinned inputs.
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch: the CPU kernels this script's committed files need
    from cpu_pins import pin_cpu
    pin_cpu("avx512")

import argparse
import json
import math
import struct
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen3_5 import modeling_qwen3_5 as mq
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import (  # noqa: E402  (the shared texts, window protocol and helpers)
    FIXTURES, FRANCE, MIXED, PARAGRAPH, QWEN3_TOKENIZER, QWEN3_TOKENIZER_SHA256,
    QWEN3_TOKENIZER_SOURCE, ROOT, TORCH_THREADS, adam_fit, ensure_file, logprob_cases, out_dir,
    sha256_file, shown, versions, windows, write_json,
)

NAME = "tiny-qwen3_5"
OUT_DIR = FIXTURES / NAME  # both moved under --out DIR when given
OUT_JSON = FIXTURES / "tiny_qwen3_5_logprobs.json"

SEED = 35
STEPS = 30
LR = 2e-2
VOCAB = 151936  # the Qwen3 tokenizer has 151,669 tokens; padded like the real Qwen3 checkpoints
LIN, FULL = "linear_attention", "full_attention"

TEXT_CONFIG = {
    "model_type": "qwen3_5_text",
    "vocab_size": VOCAB,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 6,
    "layer_types": [LIN, LIN, LIN, FULL, LIN, FULL],
    # gated full attention: 4 query heads / 2 KV heads, head_dim 16 (attention width 64 is not
    # the hidden size), rotary dim 16 * 0.5 = 8 < head_dim (the default factor would be 0.25)
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                        "mrope_interleaved": True},
    # Gated DeltaNet: 2 key heads of dim 8, 6 value heads (3 per key head, like the 27B) of
    # dim 6 (Dk != Dv so a transposed state shows up), conv kernel 4
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 6,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    # Fields the published Qwen3.5 configs carry and transformers does not read. A packer must
    # not trip on them; full_attention_interval 4 disagrees with layer_types on purpose
    # (layer 5 is full here, an interval of 4 would make it linear): layer_types wins.
    "full_attention_interval": 4,
    "attn_output_gate": True,
    "output_gate_type": "swish",
    "mamba_ssm_dtype": "float32",
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
}
VISION_CONFIG = {
    "model_type": "qwen3_5_vision",
    "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "in_channels": 3,
    "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 16,
    "num_position_embeddings": 16, "hidden_act": "gelu_pytorch_tanh",
}
TOP_CONFIG = {
    # the Qwen3 tokenizer's own vision special tokens (the real Qwen3.5 ids are past this vocab)
    "image_token_id": 151655, "video_token_id": 151656,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "tie_word_embeddings": False,  # the top-level flag is what decides tying for this class
}

# Qwen3.5 checkpoints store these two in float32 and everything else in bfloat16.
F32_SUFFIXES = ("linear_attn.A_log", "linear_attn.norm.weight")

TEXTS = [("france", FRANCE), ("prose", PARAGRAPH), ("mixed_code_zh", MIXED)]
LONG_PROTOCOLS = [(4096, 2048), (160, 80), (128, 64), (48, 40), (16, 8)]
CASES = [
    ("france", FRANCE, [(4096, 2048), (16, 8), (10, 3)]),
    ("prose", PARAGRAPH, LONG_PROTOCOLS),
    ("mixed_code_zh", MIXED, LONG_PROTOCOLS),
]
# float32 transformers against the float64 re-implementation, on per-token log-probabilities
CROSSCHECK_TOL = 1e-3
PITFALLS = ("norm_w", "gated_norm_1pw", "qgate_halves", "attn_gate_silu", "qk_norm_after_rope",
            "rope_interleaved", "rope_full_head", "kheads_tiled", "conv_reversed", "no_conv_silu",
            "no_qk_l2norm", "no_dk_scale", "no_dt_bias", "delta_undecayed",
            "read_before_update", "z_sigmoid")


# --------------------------------------------------------------------------------------------
# Model construction
# --------------------------------------------------------------------------------------------


def make_config() -> Qwen3_5Config:
    conf = Qwen3_5Config(text_config=dict(TEXT_CONFIG), vision_config=dict(VISION_CONFIG),
                         **TOP_CONFIG)
    conf.architectures = ["Qwen3_5ForConditionalGeneration"]
    assert conf.text_config.layer_types == TEXT_CONFIG["layer_types"]
    return conf


def randomize(model: torch.nn.Module) -> None:
    """Every parameter from numpy's legacy RandomState (a frozen stream), in name order.

    Zero-centred norms (applied as 1 + w) get w ~ 0.25 N(0,1), never 0, so an engine that reads
    them as w (or the gated norm as 1 + w) is far off. Linear maps get N(0, 1/fan_in); A_log and
    dt_bias give decays exp(g) spread over (0, 1), neither all ~1 nor all ~0.
    """
    params = dict(model.named_parameters())
    rng = np.random.RandomState(SEED)
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            shape = tuple(p.shape)
            z = rng.standard_normal(shape)
            if name.startswith("model.visual."):
                is_ln = name.split(".")[-2].startswith("norm") and name.endswith(".weight")
                a = 1.0 + 0.1 * z if is_ln else 0.1 * z  # LayerNorm weights near 1
            elif name.endswith("linear_attn.norm.weight"):
                a = 1.0 + 0.25 * z  # plain-weight gated norm
            elif name.endswith("norm.weight"):
                a = 0.25 * z  # zero-centred: input/post layernorm, final norm, q_norm, k_norm
            elif name.endswith("A_log"):
                a = rng.uniform(math.log(0.05), math.log(2.0), size=shape)
            elif name.endswith("dt_bias"):
                a = 0.5 * z
            elif name.endswith("conv1d.weight"):
                a = 0.5 * z
            elif name in ("model.language_model.embed_tokens.weight", "lm_head.weight"):
                a = 0.5 * z
            else:
                assert len(shape) == 2, name
                a = z / math.sqrt(shape[1])
            p.copy_(torch.from_numpy(np.asarray(a, dtype=np.float32)))


def train(model: torch.nn.Module, seqs: list[list[int]]) -> None:
    """A few full-batch Adam steps on the fixture texts (as make_fixtures.py does for the tiny
    Qwen3/Qwen2), so predictions depend on the context. Runs through transformers' chunked
    gated delta rule and its backward pass."""
    adam_fit(model, seqs, STEPS, LR,
             params=[p for n, p in model.named_parameters() if not n.startswith("model.visual.")])


def fake_mtp(rng: np.random.RandomState) -> dict[str, torch.Tensor]:
    """A few tensors named like the MTP head of the real checkpoints; main-head scoring never
    reads them and a packer must drop them (transformers ignores ^mtp.* on load)."""
    h, d, hq, hkv, inter = 16, 16, 4, 2, 32
    shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        "mtp.layers.0.input_layernorm.weight": (h,),
        "mtp.layers.0.post_attention_layernorm.weight": (h,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * hq * d, h),
        "mtp.layers.0.self_attn.k_proj.weight": (hkv * d, h),
        "mtp.layers.0.self_attn.v_proj.weight": (hkv * d, h),
        "mtp.layers.0.self_attn.o_proj.weight": (h, hq * d),
        "mtp.layers.0.self_attn.q_norm.weight": (d,),
        "mtp.layers.0.self_attn.k_norm.weight": (d,),
        "mtp.layers.0.mlp.gate_proj.weight": (inter, h),
        "mtp.layers.0.mlp.up_proj.weight": (inter, h),
        "mtp.layers.0.mlp.down_proj.weight": (h, inter),
    }
    return {k: torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to(torch.bfloat16)
            for k, s in sorted(shapes.items())}


def build_and_save(seqs: list[list[int]]) -> None:
    torch.manual_seed(SEED)  # only the constructor's own init draws from it; all is overwritten
    conf = make_config()
    model = Qwen3_5ForConditionalGeneration(conf).float()
    randomize(model)
    train(model, seqs)
    master = {k: v.detach().clone() for k, v in model.state_dict().items()}
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for old in OUT_DIR.iterdir():
        old.unlink()
    model.to(torch.bfloat16)
    model.save_pretrained(str(OUT_DIR), safe_serialization=True)
    # save_pretrained also writes generation_config.json; the packer only needs config.json
    (OUT_DIR / "generation_config.json").unlink(missing_ok=True)
    st = OUT_DIR / "model.safetensors"
    with safe_open(str(st), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert set(tensors) == set(master), set(tensors) ^ set(master)
    for k in tensors:
        if k.endswith(F32_SUFFIXES):
            tensors[k] = master[k].float().contiguous()
    tensors.update(fake_mtp(np.random.RandomState(SEED + 1)))
    save_file(dict(sorted(tensors.items())), str(st), metadata={"format": "pt"})
    st.chmod(0o644)
    print(f"wrote {shown(st)} ({st.stat().st_size} bytes, {len(tensors)} tensors)")


def load_reference() -> torch.nn.Module:
    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(
        str(OUT_DIR), dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"loading info {bad}"
    model.eval()
    # the loaded float32 weights are exactly the stored ones
    with safe_open(str(OUT_DIR / "model.safetensors"), framework="pt") as f:
        sd = model.state_dict()
        for k in f.keys():
            if k.startswith("mtp."):
                assert k not in sd
                continue
            assert torch.equal(f.get_tensor(k).float(), sd[k]), k
    assert model.lm_head.weight.data_ptr() != \
        model.model.language_model.embed_tokens.weight.data_ptr()
    return model


# --------------------------------------------------------------------------------------------
# Checks on transformers' own behaviour
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def check_text_rope(model, ids: list[int]) -> None:
    """Text-only input reduces the multimodal RoPE to plain partial RoPE."""
    lm = model.model.language_model
    tc = model.config.text_config
    x = torch.tensor([ids], dtype=torch.long)
    t = len(ids)
    # 1) Qwen3_5Model finds no image/video grids, computes no 3-D positions and passes None,
    #    so the text model uses arange(T) for all of (text, T, H, W).
    assert model.model.compute_3d_position_ids(
        input_ids=x, inputs_embeds=lm.embed_tokens(x), attention_mask=torch.ones_like(x)) is None
    # 2) With the three mrope axes all equal to arange(T), the interleaved section recomposition
    #    picks identical frequencies, so cos/sin equal the plain formula.
    pos = torch.arange(t)
    cos, sin = lm.rotary_emb(torch.zeros(1, dtype=torch.float32), pos.view(1, 1, -1).expand(3, 1, -1))
    rp = tc.rope_parameters
    r = int(tc.head_dim * rp["partial_rotary_factor"])
    inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, r, 2, dtype=torch.float) / r))
    ang = pos[:, None].float() * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    assert cos.shape == (1, t, r), cos.shape
    assert torch.equal(cos[0], ang.cos()) and torch.equal(sin[0], ang.sin())
    # 3) Explicit 2-D position_ids arange(T) give the same logits as none at all.
    a = model(input_ids=x, use_cache=False).logits
    b = model(input_ids=x, position_ids=pos.view(1, -1), use_cache=False).logits
    assert torch.equal(a, b)
    print(f"  text-only RoPE: plain partial RoPE over {r} of {tc.head_dim} dims (checked)")


@torch.no_grad()
def check_chunked_vs_recurrent(model, ids: list[int]) -> float:
    """transformers' own two Gated DeltaNet paths: the chunked prefill (no cache) and token-by-
    token decode with a cache (the recurrent rule and the conv-state update)."""
    x = torch.tensor([ids], dtype=torch.long)
    full = model(input_ids=x, use_cache=False).logits[0].double()
    cache = None
    rows = []
    for i in range(len(ids)):
        out = model(input_ids=x[:, i:i + 1], cache=cache, use_cache=True)
        cache = out.cache
        rows.append(out.logits[0, -1].double())
    step = torch.stack(rows)
    d = (torch.log_softmax(full, -1) - torch.log_softmax(step, -1)).abs().max().item()
    print(f"  transformers chunked prefill vs cached token-by-token decode "
          f"(N={len(ids)}): max |d logprob| = {d:.2e}")
    return d


# --------------------------------------------------------------------------------------------
# Independent float64 re-implementation (numpy; reads the safetensors bytes itself)
# --------------------------------------------------------------------------------------------


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        buf = raw[base + b:base + e]
        if info["dtype"] == "BF16":
            u = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
            a = u.view(np.float32)
        elif info["dtype"] == "F32":
            a = np.frombuffer(buf, dtype="<f4")
        else:
            raise ValueError(f"{name}: dtype {info['dtype']}")
        out[name] = a.astype(np.float64).reshape(info["shape"])
    return out


class Float64Reference:
    """The Qwen3.5 text model written from the math (see eval/generators/README.md)."""

    def __init__(self, model_dir: Path, bugs: frozenset = frozenset()):
        assert bugs <= set(PITFALLS), bugs - set(PITFALLS)
        self.bugs = bugs  # deliberate mistakes, for --pitfalls only
        cfg = json.loads((model_dir / "config.json").read_text())
        tc = cfg["text_config"]
        self.w = read_safetensors(model_dir / "model.safetensors")
        self.p = "model.language_model."
        self.eps = tc["rms_norm_eps"]
        self.layer_types = tc["layer_types"]
        self.hq, self.hkv, self.d = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
        rp = tc["rope_parameters"]
        self.r = int(self.d * rp.get("partial_rotary_factor", 0.25))
        self.theta = rp.get("rope_theta", 10000.0)
        self.hk, self.hv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
        self.dk, self.dv = tc["linear_key_head_dim"], tc["linear_value_head_dim"]
        self.kconv = tc["linear_conv_kernel_dim"]
        tied = cfg.get("tie_word_embeddings", False)
        self.head = self.w[self.p + "embed_tokens.weight"] if tied else self.w["lm_head.weight"]

    @staticmethod
    def silu(x):
        return x / (1.0 + np.exp(-x))

    @staticmethod
    def sigmoid(x):
        return 1.0 / (1.0 + np.exp(-x))

    def norm_zc(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * \
            (w if "norm_w" in self.bugs else 1.0 + w)

    def gdn(self, h, pre):
        w = self.w
        t = h.shape[0]
        mixed = h @ w[pre + "in_proj_qkv.weight"].T  # [T, 2*Hk*Dk + Hv*Dv]: q | k | v
        z = (h @ w[pre + "in_proj_z.weight"].T).reshape(t, self.hv, self.dv)
        b = h @ w[pre + "in_proj_b.weight"].T
        a = h @ w[pre + "in_proj_a.weight"].T
        cw = w[pre + "conv1d.weight"][:, 0, :]  # [C, K]; tap K-1 multiplies the current token
        if "conv_reversed" in self.bugs:
            cw = cw[:, ::-1]
        k = self.kconv
        padded = np.concatenate([np.zeros((k - 1, mixed.shape[1])), mixed], 0)
        c = sum(cw[:, j][None, :] * padded[j:j + t] for j in range(k))
        c = c if "no_conv_silu" in self.bugs else self.silu(c)
        kd = self.hk * self.dk
        q = c[:, :kd].reshape(t, self.hk, self.dk)
        kk = c[:, kd:2 * kd].reshape(t, self.hk, self.dk)
        v = c[:, 2 * kd:].reshape(t, self.hv, self.dv)
        if "no_qk_l2norm" not in self.bugs:
            q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
            kk = kk / np.sqrt((kk * kk).sum(-1, keepdims=True) + 1e-6)
        if "no_dk_scale" not in self.bugs:
            q = q * self.dk ** -0.5
        rep = self.hv // self.hk
        if "kheads_tiled" in self.bugs:
            q, kk = np.tile(q, (1, rep, 1)), np.tile(kk, (1, rep, 1))
        else:
            q = np.repeat(q, rep, axis=1)  # value head j reads key head j // rep
            kk = np.repeat(kk, rep, axis=1)
        beta = self.sigmoid(b)
        x = a if "no_dt_bias" in self.bugs else a + w[pre + "dt_bias"]
        softplus = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
        alpha = np.exp(-np.exp(w[pre + "A_log"]) * softplus)  # [T, Hv]
        s = np.zeros((self.hv, self.dk, self.dv))
        o = np.zeros((t, self.hv, self.dv))
        for i in range(t):
            pred = np.einsum("hkv,hk->hv", s, kk[i])  # undecayed: a pitfall only
            s = s * alpha[i][:, None, None]
            if "delta_undecayed" not in self.bugs:
                pred = np.einsum("hkv,hk->hv", s, kk[i])
            delta = beta[i][:, None] * (v[i] - pred)
            if "read_before_update" in self.bugs:
                o[i] = np.einsum("hkv,hk->hv", s, q[i])
            s = s + kk[i][:, :, None] * delta[:, None, :]
            if "read_before_update" not in self.bugs:
                o[i] = np.einsum("hkv,hk->hv", s, q[i])
        nw = w[pre + "norm.weight"]
        nw = 1.0 + nw if "gated_norm_1pw" in self.bugs else nw
        y = o / np.sqrt((o * o).mean(-1, keepdims=True) + self.eps) * nw
        y = y * (self.sigmoid(z) if "z_sigmoid" in self.bugs else self.silu(z))
        return y.reshape(t, -1) @ w[pre + "out_proj.weight"].T

    def rope(self, x, pos):
        r = self.d if "rope_full_head" in self.bugs else self.r
        inv = self.theta ** (-np.arange(0, r, 2) / r)
        ang = pos[:, None] * inv[None, :]
        xr = x[..., :r]
        if "rope_interleaved" in self.bugs:  # pairs (2i, 2i+1)
            c, s_ = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
            e, o = xr[..., 0::2], xr[..., 1::2]
            out = np.stack([e * c - o * s_, e * s_ + o * c], -1).reshape(xr.shape)
            return np.concatenate([out, x[..., r:]], -1)
        cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
        sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
        rot = np.concatenate([-xr[..., r // 2:], xr[..., :r // 2]], -1)  # rotate-half in R
        return np.concatenate([xr * cos + rot * sin, x[..., r:]], -1)

    def attn(self, h, pre):
        w = self.w
        t, d = h.shape[0], self.d
        qg = (h @ w[pre + "q_proj.weight"].T).reshape(t, self.hq, 2 * d)  # per head: q | gate
        q, gate = qg[..., :d], qg[..., d:].reshape(t, self.hq * d)
        if "qgate_halves" in self.bugs:
            flat = qg.reshape(t, -1)
            q, gate = flat[:, :self.hq * d].reshape(t, self.hq, d), flat[:, self.hq * d:]
        k = (h @ w[pre + "k_proj.weight"].T).reshape(t, self.hkv, d)
        v = (h @ w[pre + "v_proj.weight"].T).reshape(t, self.hkv, d)
        pos = np.arange(t, dtype=np.float64)
        if "qk_norm_after_rope" in self.bugs:
            q, k = self.rope(q, pos), self.rope(k, pos)
        q = self.norm_zc(q, w[pre + "q_norm.weight"])
        k = self.norm_zc(k, w[pre + "k_norm.weight"])
        if "qk_norm_after_rope" not in self.bugs:
            q, k = self.rope(q, pos), self.rope(k, pos)
        grp = self.hq // self.hkv
        out = np.zeros((t, self.hq, d))
        mask = np.triu(np.ones((t, t), dtype=bool), 1)
        for hh in range(self.hq):
            sc = q[:, hh] @ k[:, hh // grp].T * d ** -0.5
            sc[mask] = -np.inf
            sc = np.exp(sc - sc.max(-1, keepdims=True))
            out[:, hh] = (sc / sc.sum(-1, keepdims=True)) @ v[:, hh // grp]
        out = out.reshape(t, -1) * (self.silu(gate) if "attn_gate_silu" in self.bugs else
                                    self.sigmoid(gate))
        return out @ w[pre + "o_proj.weight"].T

    def logprobs(self, ids: list[int]) -> np.ndarray:
        w, p = self.w, self.p
        x = w[p + "embed_tokens.weight"][ids]
        for i, lt in enumerate(self.layer_types):
            pre = f"{p}layers.{i}."
            h = self.norm_zc(x, w[pre + "input_layernorm.weight"])
            x = x + (self.gdn(h, pre + "linear_attn.") if lt == LIN else
                     self.attn(h, pre + "self_attn."))
            h = self.norm_zc(x, w[pre + "post_attention_layernorm.weight"])
            mlp = pre + "mlp."
            x = x + (self.silu(h @ w[mlp + "gate_proj.weight"].T) * (h @ w[mlp + "up_proj.weight"].T)) \
                @ w[mlp + "down_proj.weight"].T
        x = self.norm_zc(x, w[p + "norm.weight"])
        logits = x @ self.head.T
        m = logits.max(-1, keepdims=True)
        return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def pitfalls(tokenize) -> None:
    """How far each classic mistake moves the tiny model's log-probabilities (one window over
    the English paragraph), to show that the fixture catches it."""
    ids = tokenize(PARAGRAPH)
    good = Float64Reference(OUT_DIR).logprobs(ids)
    t = np.arange(len(ids) - 1)
    for bug in PITFALLS:
        bad = Float64Reference(OUT_DIR, frozenset([bug])).logprobs(ids)
        d = np.abs(bad[t, ids[1:]] - good[t, ids[1:]])
        mean = abs(bad[t, ids[1:]].mean() - good[t, ids[1:]].mean())
        print(f"  {bug:20s} max |d logprob| {d.max():8.4f}   |d mean NLL| {mean:.4f}")


def crosscheck(ref: Float64Reference, cases: list[dict]) -> dict[str, dict]:
    per_case = {}
    for c in cases:
        ids = c["token_ids"]
        wins = list(windows(len(ids), c["context"], c["stride"]))
        assert [(w["begin"], w["start"], w["end"]) for w in c["windows"]] == wins
        case_max = 0.0
        nll = 0.0
        for w in c["windows"]:
            b, s, e = w["begin"], w["start"], w["end"]
            lp = ref.logprobs(ids[b:e])
            mine = lp[np.arange(s - 1 - b, e - 1 - b), ids[s:e]]
            case_max = max(case_max, float(np.abs(mine - np.array(w["logprobs"])).max()))
            for v in mine.tolist():
                nll -= v
        rel = abs(nll / c["scored"] - c["mean_nll"]) / c["mean_nll"]
        per_case[c["name"]] = {"max_abs_logprob": case_max, "rel_mean_nll": rel}
        print(f"  {c['name']:26s} float64 recurrence vs transformers: max |d logprob| "
              f"{case_max:.2e}, relative d mean NLL {rel:.2e}")
    return per_case


# --------------------------------------------------------------------------------------------


def config_summary(model) -> dict:
    tc = model.config.text_config
    rp = tc.rope_parameters
    return {
        "architectures": model.config.architectures,
        "tie_word_embeddings": model.config.tie_word_embeddings,
        "vocab_size": tc.vocab_size, "hidden_size": tc.hidden_size,
        "intermediate_size": tc.intermediate_size, "num_hidden_layers": tc.num_hidden_layers,
        "layer_types": list(tc.layer_types),
        "num_attention_heads": tc.num_attention_heads,
        "num_key_value_heads": tc.num_key_value_heads, "head_dim": tc.head_dim,
        "rotary_dim": int(tc.head_dim * rp["partial_rotary_factor"]),
        "rope_theta": rp["rope_theta"], "partial_rotary_factor": rp["partial_rotary_factor"],
        "linear_num_key_heads": tc.linear_num_key_heads,
        "linear_num_value_heads": tc.linear_num_value_heads,
        "linear_key_head_dim": tc.linear_key_head_dim,
        "linear_value_head_dim": tc.linear_value_head_dim,
        "linear_conv_kernel_dim": tc.linear_conv_kernel_dim,
        "rms_norm_eps": tc.rms_norm_eps, "hidden_act": tc.hidden_act,
        "float32_tensors": list(F32_SUFFIXES), "dropped_prefixes": ["model.visual.", "mtp."],
        "attn_implementation": tc._attn_implementation,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", default=str(ROOT / "models" / "cache"),
                    help="where the Qwen3 tokenizer is (fetched if missing)")
    ap.add_argument("--pitfalls", action="store_true",
                    help="only report how far classic mistakes move the stored model's "
                         "log-probabilities (writes nothing)")
    ap.add_argument("--out", help="write under this directory instead of eval/fixtures/ "
                                  "(with --pitfalls: read the model from there)")
    args = ap.parse_args()
    global OUT_DIR, OUT_JSON
    if args.out is not None:
        out = out_dir(args.out)
        OUT_DIR, OUT_JSON = out / NAME, out / OUT_JSON.name
    t0 = time.time()
    torch.set_num_threads(TORCH_THREADS)
    torch.use_deterministic_algorithms(True)
    cache = Path(args.cache).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    tok_path = ensure_file(cache, QWEN3_TOKENIZER, QWEN3_TOKENIZER_SHA256,
                           "fetch-qwen3-tokenizer.sh")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_path))
    assert len(tok) == 151669 and VOCAB >= len(tok)
    tokenize = lambda t: tok(t)["input_ids"]  # noqa: E731  (no BOS, as make_fixtures.py)
    # transformers must be on its pure-PyTorch fallbacks, which are the reference here
    for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
               "causal_conv1d_fn", "causal_conv1d_update"):
        assert getattr(mq, fn).__module__ == mq.__name__, f"{fn} is not the torch fallback"
    if args.pitfalls:
        pitfalls(tokenize)
        return

    build_and_save([tokenize(t) for _, t in TEXTS])
    print(f"  built and trained in {time.time() - t0:.1f} s")
    st_sha = sha256_file(OUT_DIR / "model.safetensors")
    model = load_reference()
    print(f"  model.safetensors sha256 {st_sha}")

    check_text_rope(model, tokenize(PARAGRAPH))
    cases = logprob_cases(model, tokenize, CASES)
    for c in cases:
        assert all(math.isfinite(v) for w in c["windows"] for v in w["logprobs"]), c["name"]
        assert math.isfinite(c["mean_nll"]), c["name"]
    one = [c for c in cases if c["context"] == 4096]
    print(f"  mean NLL over the one-window runs: "
          f"{sum(c['nll_sum'] for c in one) / sum(c['scored'] for c in one):.4f} "
          f"(uniform would be ln({VOCAB}) = {math.log(VOCAB):.4f})")

    t1 = time.time()
    decode_diff = check_chunked_vs_recurrent(model, tokenize(PARAGRAPH))
    per_case = crosscheck(Float64Reference(OUT_DIR), cases)
    worst = max(v["max_abs_logprob"] for v in per_case.values())
    worst_rel = max(v["rel_mean_nll"] for v in per_case.values())
    print(f"  float64 cross-check: max |d logprob| = {worst:.2e}, relative d mean NLL "
          f"{worst_rel:.2e} over all cases "
          f"({time.time() - t1:.1f} s)")
    assert worst < CROSSCHECK_TOL, worst
    assert decode_diff < CROSSCHECK_TOL, decode_diff

    write_json(OUT_JSON, {
        "model": (f"eval/fixtures/{NAME} (Qwen3_5ForConditionalGeneration, numpy RandomState "
                  f"seed {SEED} init, {STEPS} Adam steps lr {LR} on the fixture texts, stored as "
                  f"bfloat16 except {' and '.join(F32_SUFFIXES)} in float32, plus fake mtp.* "
                  f"tensors)"),
        "safetensors_sha256": st_sha,
        "tokenizer": QWEN3_TOKENIZER_SOURCE,
        "tokenizer_sha256": QWEN3_TOKENIZER_SHA256,
        "dtype": "float32", **versions(),
        "config": config_summary(model),
        "crosscheck": {
            "float64_token_recurrence_max_abs_logprob": worst,
            "float64_token_recurrence_max_rel_mean_nll": worst_rel,
            "transformers_cached_decode_max_abs_logprob": decode_diff,
            "float64_per_case": per_case,
        },
        "cases": cases,
    })
    print(f"done in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
