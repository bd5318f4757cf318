#!/usr/bin/env python3
"""Reference fixtures for the quantized weight formats (fp8 and nvfp4).

Two kinds of output, all under eval/fixtures/quantized/:

1. Four small quantized checkpoints of the tiny random Qwen3 (eval/fixtures/tiny-qwen3), each
   made by the real library on CPU:
     tiny-qwen3-modelopt-nvfp4/  NVIDIA ModelOpt NVFP4_DEFAULT_CFG + export_hf_checkpoint
     tiny-qwen3-modelopt-mixed/  ModelOpt MIXED_PRECISION: NVFP4 MLP, per-tensor FP8 attention
     tiny-qwen3-ct-nvfp4/        compressed-tensors NVFP4 scheme, nvfp4-pack-quantized format
     tiny-qwen3-fp8-block/       transformers' fine-grained FP8 (128x128 blocks) quantizer op
   Each directory holds the checkpoint's config.json (+ hf_quant_config.json for ModelOpt) and
   quantized.safetensors with ONLY the tensors of the quantized Linear layers, exactly as the
   library wrote them; the embedding and norms (and nothing else) were taken out and are the
   bf16 tensors of eval/fixtures/tiny-qwen3/model.safetensors. Beside each directory,
   tiny-qwen3-<kind>.json holds the sha256 of every quantized tensor's dequantized float32
   weight (from an independent numpy dequantization written below from shared/WEIGHTS.md,
   cross-checked against the library's own dequantization) and transformers float32
   log-probabilities of the model with those weights (the tiny_qwen3_logprobs.json schema).

2. SmolLM2-135M (transformers' float32 weights from the GGUF) quantized by ModelOpt NVFP4 and by
   transformers' fine-grained FP8-block op: the dtype, shape and sha256 of every exported
   tensor, for the Rust packer to reproduce byte for byte. An independent numpy implementation
   of the quantizer rules of WEIGHTS.md must reproduce every weight byte, or the script fails.

    eval/.venv/bin/python eval/generators/make_weight_fixtures.py [--cache models/cache]
                                                               [--only tiny|smollm2] [--out DIR]

--out writes DIR/quantized/... instead of eval/fixtures/quantized/ (the inputs, such as
eval/fixtures/tiny-qwen3, are still read from eval/fixtures/).

Deterministic: fixed texts, 2 torch threads, deterministic algorithms; the quantizers are pure
functions of the weights (and, for the activation scales, of the calibration texts).
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch: the CPU kernels this script's committed files need
    from cpu_pins import pin_cpu
    pin_cpu("avx512")

import argparse
import copy
import hashlib
import json
import shutil
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path

import numpy as np
import torch

warnings.filterwarnings("ignore")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import (  # noqa: E402  (the shared texts, window protocol and helpers)
    FIXTURES, QWEN3_TOKENIZER, QWEN3_TOKENIZER_SHA256, QWEN3_TOKENIZER_SOURCE, ROOT,
    SMOLLM2_GGUF, SMOLLM2_GGUF_SHA256, SMOLLM2_SOURCE, TINY_PROTOCOLS, TINY_TEXTS,
    TORCH_THREADS, ensure_file, logprob_cases, out_dir, sha256_file, shown, smollm2_dir, versions,
    write_json,
)

import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

OUT = FIXTURES / "quantized"  # DIR/quantized with --out DIR
TINY_DIR = FIXTURES / "tiny-qwen3"  # an input: always the committed fixture
KINDS = ("modelopt-nvfp4", "modelopt-mixed", "ct-nvfp4", "fp8-block")
FP8_BLOCK = 128

# Linears that read the same input (WEIGHTS.md rule 1: one shared global amax).
FUSED_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                ("mlp.gate_proj", "mlp.up_proj"))
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

# ============================================================================================
# Element formats, written from shared/WEIGHTS.md (numpy only; no library code below is used)
# ============================================================================================

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float64)


def _e4m3_table() -> np.ndarray:
    t = np.empty(256, dtype=np.float64)
    for c in range(256):
        s, e, m = c >> 7, (c >> 3) & 15, c & 7
        if e == 15 and m == 7:
            v = np.nan
        elif e == 0:
            v = m * 2.0 ** -9
        else:
            v = (1 + m / 8) * 2.0 ** (e - 7)
        t[c] = -v if s else v
    return t


E4M3_VALUES = _e4m3_table()


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """u8 codes -> float64 values (exact)."""
    return E4M3_VALUES[codes.astype(np.int64)]


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> E4M3FN codes: clamp to +-448, round to nearest even, subnormals down to 2^-9."""
    x = np.asarray(x, dtype=np.float32)
    assert not np.isnan(x).any()
    a = np.minimum(np.abs(x).astype(np.float64), 448.0)
    code = np.zeros(a.shape, dtype=np.int64)
    sub = a < 2.0 ** -6
    code[sub] = np.rint(a[sub] * 512.0).astype(np.int64)  # 0..8; 8 is the smallest normal
    nrm = ~sub
    _, e = np.frexp(a[nrm])  # a = f * 2^e, f in [0.5, 1)
    ex = e.astype(np.int64) - 1
    mq = np.rint((np.ldexp(a[nrm], -ex) - 1.0) * 8.0).astype(np.int64)  # exact, ties to even
    carry = mq == 8
    ex[carry] += 1
    mq[carry] = 0
    code[nrm] = ((ex + 7) << 3) | mq
    assert code.max(initial=0) <= 0x7E
    code |= np.where(np.signbit(x), 0x80, 0)
    return code.astype(np.uint8)


def e2m1_encode(y: np.ndarray) -> np.ndarray:
    """float32 -> E2M1 codes: nearest, ties to the even code, saturating at 6; sign from y < 0."""
    a = np.abs(y)
    mag = np.select([a <= 0.25, a < 0.75, a <= 1.25, a < 1.75, a <= 2.5, a < 3.5, a <= 5.0],
                    [0, 1, 2, 3, 4, 5, 6], 7)
    return (mag | np.where(y < 0, 8, 0)).astype(np.uint8)


def pack_e2m1(codes: np.ndarray) -> np.ndarray:
    """[O, I] codes -> [O, I/2] bytes, even column in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """[O, I/2] bytes -> [O, I] float64 values."""
    out = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.int64)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return E2M1_VALUES[out]


def f32(x) -> np.float32:
    return np.float32(x)


# ============================================================================================
# Quantizers (WEIGHTS.md "Quantizing in the packer") and dequantizers
# ============================================================================================


def nvfp4_quantize(w: np.ndarray, amax: np.float32):
    """ModelOpt's default NVFP4 rules with the given (possibly shared) global amax.

    Returns (packed u8 [O, I/2], block-scale codes u8 [O, I/16], global scale g f32)."""
    w = np.asarray(w, dtype=np.float32)
    o, i = w.shape
    assert i % 16 == 0
    g = f32(amax) / f32(2688.0)  # f32 division
    blocks = w.reshape(o, i // 16, 16)
    bamax = np.abs(blocks).max(axis=-1)
    ps = bamax / (f32(6.0) * g)  # (6 * g) rounded to f32, then an f32 division
    ps = np.where(ps == 0, f32(1.0), ps).astype(np.float32)
    ps = np.clip(ps, f32(2.0 ** -9), f32(448.0))
    sc = e4m3_encode(ps)
    denom = (e4m3_decode(sc).astype(np.float32) * g).astype(np.float32)  # f32 product
    y = (blocks / denom[..., None]).astype(np.float32).reshape(o, i)    # f32 division
    return pack_e2m1(e2m1_encode(y)), sc, np.float32(g)


def fp8_tensor_quantize(w: np.ndarray, amax: np.float32):
    """Per-tensor FP8 (ModelOpt FP8): s = amax / 448, q = e4m3(clamp(w / s))."""
    w = np.asarray(w, dtype=np.float32)
    s = f32(amax) / f32(448.0)
    y = (w / s).astype(np.float32)
    return e4m3_encode(np.clip(y, f32(-448.0), f32(448.0))), np.float32(s)


def fp8_block_quantize(w: np.ndarray, block: int = FP8_BLOCK, true_division: bool = False):
    """transformers' fine-grained FP8: per tile amax (0 -> 1), s = 448 / amax evaluated as PyTorch
    does (reciprocal(amax) * 448, two f32 roundings), q = e4m3(clamp(w * s)), stored 1 / s (the
    f32 reciprocal). Partial tiles at the edges are tiles of the elements they hold."""
    w = np.asarray(w, dtype=np.float32)
    o, i = w.shape
    ro, ri = -(-o // block), -(-i // block)
    s = np.empty((ro, ri), dtype=np.float32)
    q = np.empty((o, i), dtype=np.uint8)
    for r in range(ro):
        for c in range(ri):
            t = w[r * block:(r + 1) * block, c * block:(c + 1) * block]
            amax = np.abs(t).max()
            if amax > 0:
                # true_division: what a plain f32 448 / amax would give (not what PyTorch does)
                scale = f32(448.0) / amax if true_division else (f32(1.0) / amax) * f32(448.0)
            else:
                scale = f32(1.0)
            y = (t * scale).astype(np.float32)
            q[r * block:(r + 1) * block, c * block:(c + 1) * block] = e4m3_encode(
                np.clip(y, f32(-448.0), f32(448.0)))
            s[r, c] = f32(1.0) / scale
    return q, s


def _round_once(x64: np.ndarray) -> np.ndarray:
    # Every product below is exact in float64 (at most 4 + 3 + 24 significant bits) and a
    # float64 quotient rounded again to float32 is still correctly rounded (53 >= 2 * 24 + 2),
    # so this is the float32 result of the formula rounded once.
    return x64.astype(np.float32)


def deq_nvfp4(packed, scale_codes, g, inverted: bool = False, scale_first: bool = False):
    """W[r,c] = e2m1 * e4m3(s[r, c/16]) * g  (ModelOpt, g = weight_scale_2), or
    W[r,c] = e2m1 * e4m3(s[r, c/16]) / g  (compressed-tensors, g = weight_global_scale).

    scale_first=False: evaluated left to right, i.e. rounded once to f32 (the product of the
    two codes is exact). scale_first=True: the per-block scale e4m3 * g (or / g) is rounded to
    f32 first and then multiplied by the element (two roundings; the libraries' order)."""
    v = unpack_e2m1(packed)
    s = np.repeat(e4m3_decode(scale_codes), 16, axis=1)
    g = np.float64(np.float32(g))
    if scale_first:
        bs = _round_once(s / g if inverted else s * g)
        return (v.astype(np.float32) * bs).astype(np.float32)
    return _round_once((v * s) / g if inverted else (v * s) * g)


def deq_fp8(q_codes, scale, block: int | None = None):
    """W[r,c] = q * s (per-tensor scalar / [1]) or q * s[r/128, c/128] (block)."""
    v = e4m3_decode(q_codes)
    s = np.asarray(scale, dtype=np.float32).astype(np.float64)
    if block is not None:
        s = np.repeat(np.repeat(s, block, axis=0), block, axis=1)[:v.shape[0], :v.shape[1]]
    else:
        s = s.reshape(())
    return _round_once(v * s)


def sha256_f32(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a, dtype="<f4")
    return hashlib.sha256(a.tobytes()).hexdigest()


def raw_bytes(t: torch.Tensor) -> bytes:
    """The little-endian bytes a safetensors file stores for this tensor."""
    t = t.detach().contiguous().cpu()
    if t.dtype in (torch.float8_e4m3fn, torch.bfloat16):
        t = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int16)
    return t.numpy().tobytes()


def np_u8(t: torch.Tensor) -> np.ndarray:
    """u8 or float8 tensor -> its bytes as a numpy u8 array of the same shape."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
    assert t.dtype == torch.uint8, t.dtype
    return t.numpy()


def np_f32(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu()
    assert t.dtype == torch.float32, t.dtype
    return t.numpy()


def ulp_diff(a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
    """(number of elements that differ, largest difference in float32 ulps)."""
    ia = a.astype(np.float32).view(np.int32).astype(np.int64)
    ib = b.astype(np.float32).view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    d = np.abs(ia - ib)
    return int((d != 0).sum()), int(d.max(initial=0))


# ============================================================================================
# Models, tokenizers, calibration
# ============================================================================================


def tiny_tokenizer(cache: Path):
    path = ensure_file(cache, QWEN3_TOKENIZER, QWEN3_TOKENIZER_SHA256, "fetch-qwen3-tokenizer.sh")
    return PreTrainedTokenizerFast(tokenizer_file=str(path))


def load_tiny() -> torch.nn.Module:
    """The bf16 fixture widened to float32 (exactly the stored values)."""
    m = AutoModelForCausalLM.from_pretrained(str(TINY_DIR), dtype=torch.float32)
    m.eval()
    return m


def calibrator(seqs: list[list[int]]):
    """ModelOpt-style forward loop over the fixture texts (one full sequence each)."""
    @torch.no_grad()
    def loop(model):
        for ids in seqs:
            model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return loop


def linear_names(model) -> list[str]:
    n_layers = model.config.num_hidden_layers
    return [f"model.layers.{li}.{lin}" for li in range(n_layers) for lin in LINEARS]


def source_weights(model) -> dict[str, np.ndarray]:
    sd = model.state_dict()
    return {n: sd[n + ".weight"].detach().float().numpy().copy() for n in linear_names(model)}


def group_of(name: str) -> list[str]:
    prefix, lin = name.rsplit(".", 2)[0], ".".join(name.rsplit(".", 2)[1:])
    for grp in FUSED_GROUPS:
        if lin in grp:
            return [f"{prefix}.{x}" for x in grp]
    return [name]


def shared_amax(src: dict[str, np.ndarray], name: str, members=None) -> np.float32:
    members = members if members is not None else group_of(name)
    return np.float32(max(np.abs(src[m]).max() for m in members))


# ============================================================================================
# ModelOpt
# ============================================================================================


def modelopt_export(model, cfg, calib, export_dir: Path) -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    mtq.quantize(model, cfg, calib)
    export_hf_checkpoint(model, export_dir=str(export_dir))


def modelopt_mixed_cfg() -> dict:
    """NVFP4 everywhere ModelOpt's default puts it, then per-tensor FP8 (weights and inputs) for
    every attention projection: the later quant_cfg entries win, and the exporter infers
    quant_algo MIXED_PRECISION from the two formats (as for the Qwen3.5 recipe)."""
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    fp8 = {"num_bits": (4, 3), "axis": None}
    cfg["quant_cfg"] = list(cfg["quant_cfg"]) + [
        {"quantizer_name": "*self_attn*weight_quantizer", "cfg": fp8},
        {"quantizer_name": "*self_attn*input_quantizer", "cfg": fp8},
    ]
    return cfg


def modelopt_deq_nvfp4(packed, ws, ws2) -> np.ndarray:
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    shape = torch.Size([packed.shape[0], packed.shape[1] * 2])
    qt = NVFP4QTensor(shape, torch.float32, packed)
    return qt.dequantize(dtype=torch.float32, scale=ws, double_scale=ws2,
                         block_sizes={-1: 16}).numpy()


def modelopt_deq_fp8(q, ws) -> np.ndarray:
    from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor

    qt = FP8QTensor(q.shape, torch.float32, q)
    return qt.dequantize(dtype=torch.float32, scale=ws).numpy()


# ============================================================================================
# compressed-tensors
# ============================================================================================


def ct_quantize(model, seqs: list[list[int]], save_dir: Path) -> None:
    """compressed-tensors' NVFP4 scheme applied and compressed with the library's own functions.

    compressed-tensors holds the scheme, the qparam arithmetic (generate_gparam,
    calculate_qparams), the FP4 quantize-and-pack and the nvfp4-pack-quantized compressor; the
    calibration driver (observers) lives in llm-compressor, whose release pins an older torch
    and transformers than this venv, so its few steps are done here as it does them:
    weight global scale from the min/max of the whole weight, one global scale (the smallest)
    for q/k/v and for gate/up, group scales from each group's min/max, and the input global
    scale from the min/max of the calibration activations (its static_minmax observer)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig, QuantizationScheme, QuantizationStatus, apply_quantization_config,
    )
    from compressed_tensors.quantization.quant_scheme import NVFP4
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    qc = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **copy.deepcopy(NVFP4))},
        ignore=["lm_head"])
    apply_quantization_config(model, qc)
    mods = {n: m for n, m in model.named_modules() if hasattr(m, "quantization_scheme")}
    assert sorted(mods) == sorted(linear_names(model)), sorted(mods)

    # input activations: running min/max over every calibration token (quantization off)
    lo = {n: None for n in mods}
    hi = {n: None for n in mods}
    hooks = []
    for n, m in mods.items():
        m.quantization_enabled = False

        def hook(mod, args, n=n):
            x = args[0].detach()
            mn, mx = x.min(), x.max()
            lo[n] = mn if lo[n] is None else torch.minimum(lo[n], mn)
            hi[n] = mx if hi[n] is None else torch.maximum(hi[n], mx)
        hooks.append(m.register_forward_pre_hook(hook))
    calibrator(seqs)(model)
    for h in hooks:
        h.remove()

    with torch.no_grad():
        for n, m in mods.items():
            m.quantization_enabled = True
            m.input_global_scale.copy_(generate_gparam(lo[n], hi[n]))
            w = m.weight
            m.weight_global_scale.copy_(generate_gparam(w.min(), w.max()))
        for n in mods:
            grp = group_of(n)
            if grp[0] == n and len(grp) > 1:
                gs = torch.min(torch.cat([mods[x].weight_global_scale for x in grp]))
                for x in grp:
                    mods[x].weight_global_scale.fill_(gs)
        for n, m in mods.items():
            args = m.quantization_scheme.weights
            w = m.weight.unflatten(-1, (-1, args.group_size))
            scale, zp = calculate_qparams(w.amin(-1), w.amax(-1), args,
                                          global_scale=m.weight_global_scale)
            m.weight_scale.copy_(scale)
            m.weight_zero_point.copy_(zp)
            m.quantization_status = QuantizationStatus.FROZEN

    compressor = ModelCompressor.from_pretrained_model(model, "nvfp4-pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(str(save_dir))
    compressor.update_config(str(save_dir))


def ct_deq_nvfp4(packed, ws, wgs) -> tuple[np.ndarray, np.ndarray]:
    """compressed-tensors' own dequantization: (its compressor's decompress, which works in
    bfloat16 by default, widened; the same unpack + dequantize functions asked for float32)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.quant_scheme import NVFP4

    scheme = QuantizationScheme(targets=["Linear"], **copy.deepcopy(NVFP4))
    out = NVFP4PackedCompressor.decompress(
        {"weight_packed": packed, "weight_scale": ws, "weight_global_scale": wgs}, scheme)
    default = out["weight"]
    assert default.dtype == torch.bfloat16, default.dtype
    m, n = packed.shape
    x_q = unpack_fp4_from_uint8(packed, m, n * 2, dtype=torch.float32)
    as_f32 = dequantize(x_q=x_q, scale=ws.to(torch.float32), args=scheme.weights,
                        global_scale=wgs, dtype=torch.float32)
    assert as_f32.dtype == torch.float32
    return default.float().numpy(), as_f32.numpy()


def to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even) -> float32."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16).float().numpy()


# ============================================================================================
# transformers fine-grained FP8
# ============================================================================================


def hf_fp8_config() -> dict:
    """The quantization_config a real FP8-block checkpoint carries (Qwen3-*-FP8 style)."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def hf_fp8_quantize(w: torch.Tensor):
    """transformers' own Fp8Quantize op (the one from_pretrained(..., FineGrainedFP8Config())
    runs on a GPU). It skips a tensor whose sides are not multiples of 128, so the weight is
    zero-padded to whole tiles first (zeros change no tile's amax) and the result cropped."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    cfg = FineGrainedFP8Config(weight_block_size=(FP8_BLOCK, FP8_BLOCK))
    op = Fp8Quantize(types.SimpleNamespace(quantization_config=cfg))
    o, i = w.shape
    po, pi = -(-o // FP8_BLOCK) * FP8_BLOCK, -(-i // FP8_BLOCK) * FP8_BLOCK
    padded = torch.zeros((po, pi), dtype=torch.float32)
    padded[:o, :i] = w.float()
    out = op._quantize_one("x.weight", padded)
    q, s = out["x.weight"], out["x.weight_scale_inv"]
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    return q[:o, :i].contiguous(), s.contiguous()


def hf_fp8_deq(q: torch.Tensor, s: torch.Tensor) -> np.ndarray:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(q, s, torch.float32).numpy()


# ============================================================================================
# Tiny Qwen3 checkpoints
# ============================================================================================

REPORT: dict = {}


def tiny_logprobs(weights: dict[str, np.ndarray], tok) -> list[dict]:
    model = load_tiny()
    sd = model.state_dict()
    with torch.no_grad():
        for n, w in weights.items():
            p = sd[n + ".weight"]
            assert tuple(p.shape) == w.shape and p.dtype == torch.float32
            p.copy_(torch.from_numpy(w))
    return logprob_cases(model, lambda t: tok(t)["input_ids"],
                         [(n, t, TINY_PROTOCOLS) for n, t in TINY_TEXTS])


def extract_linear_tensors(src_file: Path, names: list[str]) -> tuple[dict, list]:
    """The tensors of the quantized Linear layers, exactly as stored (bytes, dtypes, shapes)."""
    keep, dropped = {}, []
    with safe_open(str(src_file), framework="pt") as f:
        for k in f.keys():
            if k.rsplit(".", 1)[0] in names:
                keep[k] = f.get_tensor(k)
            else:
                t = f.get_slice(k)
                dropped.append(f"{k} {t.get_dtype()} {list(t.get_shape())}")
    return dict(sorted(keep.items())), sorted(dropped)


def write_checkpoint(kind: str, export_dir: Path, names: list[str], note: str) -> tuple[dict, Path]:
    d = OUT / f"tiny-qwen3-{kind}"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    files = sorted(export_dir.glob("*.safetensors"))
    assert len(files) == 1, files
    keep, dropped = extract_linear_tensors(files[0], names)
    save_file(keep, str(d / "quantized.safetensors"), metadata={"format": "pt"})
    (d / "quantized.safetensors").chmod(0o644)
    # the bytes of every kept tensor are unchanged by the rewrite
    with safe_open(str(d / "quantized.safetensors"), framework="pt") as f:
        for k, v in keep.items():
            assert raw_bytes(f.get_tensor(k)) == raw_bytes(v), k
    for cfg in ("config.json", "hf_quant_config.json"):
        if (export_dir / cfg).exists():
            shutil.copyfile(export_dir / cfg, d / cfg)
    readme = [f"# tiny-qwen3-{kind}", "", note, "",
              "`quantized.safetensors` holds only the tensors of the quantized Linear layers, "
              "byte for byte as the library wrote them. Taken out of the library's "
              "`" + files[0].name + "` (as exported; use the bf16 tensors of "
              "`eval/fixtures/tiny-qwen3/model.safetensors` instead):", ""]
    readme += [f"- `{x}`" for x in dropped]
    readme += ["", "Regenerate with `eval/.venv/bin/python eval/generators/make_weight_fixtures.py "
               "--only tiny` (see eval/generators/README.md)."]
    (d / "README.md").write_text("\n".join(readme) + "\n")
    print(f"wrote {shown(d)}/ (quantized.safetensors "
          f"{(d / 'quantized.safetensors').stat().st_size} bytes, {len(keep)} tensors; "
          f"dropped {len(dropped)})")
    return keep, d


def assemble_full(kind: str, tmp: Path) -> Path:
    """What a user's checkpoint directory would be: the committed quantized tensors plus the
    unquantized ones (embedding, norms) of the bf16 fixture."""
    d = OUT / f"tiny-qwen3-{kind}"
    full = tmp / f"full-{kind}"
    full.mkdir()
    for cfg in ("config.json", "hf_quant_config.json"):
        if (d / cfg).exists():
            shutil.copyfile(d / cfg, full / cfg)
    tensors = {}
    with safe_open(str(d / "quantized.safetensors"), framework="pt") as f:
        quantized = {k.rsplit(".", 1)[0] for k in f.keys()}
        tensors.update({k: f.get_tensor(k) for k in f.keys()})
    with safe_open(str(TINY_DIR / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            if k.rsplit(".", 1)[0] not in quantized:
                tensors[k] = f.get_tensor(k)
    save_file(dict(sorted(tensors.items())), str(full / "model.safetensors"),
              metadata={"format": "pt"})
    return full


def tensor_table(tensors: dict) -> dict:
    return {k: {"dtype": st_dtype(v), "shape": list(v.shape)} for k, v in tensors.items()}


def st_dtype(t: torch.Tensor) -> str:
    return {torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32",
            torch.bfloat16: "BF16", torch.float16: "F16"}[t.dtype]


def check_equal(what: str, a: np.ndarray, b: np.ndarray) -> None:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        sys.exit(f"make_weight_fixtures: {what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}")
    a, b = a.reshape(-1), b.reshape(-1)
    if a.shape != b.shape or not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
        bad = int((a.view(np.uint8) != b.view(np.uint8)).sum()) if a.shape == b.shape else -1
        sys.exit(f"make_weight_fixtures: {what}: the independent rule gives different bytes "
                 f"({bad} bytes differ)")


def tiny_modelopt(kind: str, tok, seqs, tmp: Path) -> None:
    import modelopt.torch.quantization as mtq

    model = load_tiny()
    src = source_weights(model)
    names = linear_names(model)
    cfg = mtq.NVFP4_DEFAULT_CFG if kind == "modelopt-nvfp4" else modelopt_mixed_cfg()
    export_dir = tmp / kind
    modelopt_export(model, cfg, calibrator(seqs), export_dir)
    del model
    note = ("ModelOpt " + ("`quantize(model, NVFP4_DEFAULT_CFG, forward_loop)`" if kind ==
            "modelopt-nvfp4" else "`quantize` with NVFP4_DEFAULT_CFG plus per-tensor FP8 "
            "(num_bits (4,3), axis None) for `*self_attn*weight_quantizer` and "
            "`*self_attn*input_quantizer`") + " + `export_hf_checkpoint` on CPU, from the tiny "
            "model loaded in float32, calibrated on the two fixture texts.")
    keep, _ = write_checkpoint(kind, export_dir, names, note)

    deq, rep = {}, {"rule_bytes_match": 0, "lib_vs_round_once": [0, 0], "lib_vs_scale_first": [0, 0]}
    for n in names:
        w = keep[n + ".weight"]
        if w.dtype == torch.uint8:  # NVFP4
            ws, ws2 = keep[n + ".weight_scale"], keep[n + ".weight_scale_2"]
            assert ws.dtype == torch.float8_e4m3fn and ws2.dtype == torch.float32 and ws2.ndim == 0
            assert keep[n + ".input_scale"].ndim == 0
            packed, sc, g = nvfp4_quantize(src[n], shared_amax(src, n))
            check_equal(n + ".weight", packed, np_u8(w))
            check_equal(n + ".weight_scale", sc, np_u8(ws))
            check_equal(n + ".weight_scale_2", np.float32(g).reshape(()), np_f32(ws2))
            a = deq_nvfp4(np_u8(w), np_u8(ws), np_f32(ws2))
            b = deq_nvfp4(np_u8(w), np_u8(ws), np_f32(ws2), scale_first=True)
            lib = modelopt_deq_nvfp4(w, ws, ws2)
            entry = {"format": "nvfp4", "sha256": sha256_f32(a),
                     "sha256_scale_first": sha256_f32(b)}
        else:  # FP8 per tensor
            ws = keep[n + ".weight_scale"]
            assert w.dtype == torch.float8_e4m3fn and ws.dtype == torch.float32 and ws.ndim == 0
            # ModelOpt does not share the amax of q/k/v (or gate/up) for per-tensor FP8: its
            # exporter skips the shared-input fusion for the FP8 formats (unlike NVFP4)
            q, s = fp8_tensor_quantize(src[n], shared_amax(src, n, members=[n]))
            check_equal(n + ".weight", q, np_u8(w))
            check_equal(n + ".weight_scale", np.float32(s).reshape(()), np_f32(ws))
            a = b = deq_fp8(np_u8(w), np_f32(ws))
            lib = modelopt_deq_fp8(w, ws)
            entry = {"format": "fp8-tensor", "sha256": sha256_f32(a)}
        rep["rule_bytes_match"] += 1
        d1, d2 = ulp_diff(lib, a), ulp_diff(lib, b)
        rep["lib_vs_round_once"] = [rep["lib_vs_round_once"][0] + d1[0],
                                    max(rep["lib_vs_round_once"][1], d1[1])]
        rep["lib_vs_scale_first"] = [rep["lib_vs_scale_first"][0] + d2[0],
                                     max(rep["lib_vs_scale_first"][1], d2[1])]
        entry["elements"] = int(a.size)
        deq[n + ".weight"] = (entry, a)
    REPORT[kind] = rep
    finish_tiny(kind, keep, deq, tok, library=f"nvidia-modelopt {modelopt_version()}")


def modelopt_version() -> str:
    import modelopt
    return modelopt.__version__


def tiny_ct(tok, seqs, tmp: Path) -> None:
    import compressed_tensors

    model = load_tiny()
    names = linear_names(model)
    export_dir = tmp / "ct"
    ct_quantize(model, seqs, export_dir)
    del model
    keep, _ = write_checkpoint(
        "ct-nvfp4", export_dir, names,
        "compressed-tensors `NVFP4` scheme (weights tensor_group 16, E4M3 group scales; inputs "
        "dynamic local with a static global scale), targets `Linear`, ignore `lm_head`, "
        "calibrated on the two fixture texts as llm-compressor's observers do (see the script), "
        "compressed by `ModelCompressor` with format `nvfp4-pack-quantized`, "
        "`save_pretrained` + `update_config`; the model was loaded in float32.")
    deq, rep = {}, {"lib_vs_round_once": [0, 0], "lib_vs_scale_first": [0, 0],
                    "lib_default_bf16_vs_bf16_of_scale_first": [0, 0],
                    "global_scale_is_2688_over_amax": 0}
    src = source_weights(load_tiny())
    for n in names:
        wp, ws, wgs = keep[n + ".weight_packed"], keep[n + ".weight_scale"], keep[n + ".weight_global_scale"]
        assert wp.dtype == torch.uint8 and ws.dtype == torch.float8_e4m3fn
        assert wgs.dtype == torch.float32 and tuple(wgs.shape) == (1,)
        assert keep[n + ".input_global_scale"].shape == (1,)
        # the global scale is inverted: 2688 / (smallest over the fused group of each amax)
        amaxes = [np.abs(src[x]).max() for x in group_of(n)]
        expect = min(f32(2688.0) / f32(a) for a in amaxes)
        if np_f32(wgs)[0] == expect:
            rep["global_scale_is_2688_over_amax"] += 1
        a = deq_nvfp4(np_u8(wp), np_u8(ws), np_f32(wgs)[0], inverted=True)
        b = deq_nvfp4(np_u8(wp), np_u8(ws), np_f32(wgs)[0], inverted=True, scale_first=True)
        lib_bf16, lib = ct_deq_nvfp4(wp, ws, wgs)
        d1, d2, d3 = ulp_diff(lib, a), ulp_diff(lib, b), ulp_diff(lib_bf16, to_bf16(b))
        rep["lib_vs_round_once"] = [rep["lib_vs_round_once"][0] + d1[0],
                                    max(rep["lib_vs_round_once"][1], d1[1])]
        rep["lib_vs_scale_first"] = [rep["lib_vs_scale_first"][0] + d2[0],
                                     max(rep["lib_vs_scale_first"][1], d2[1])]
        rep["lib_default_bf16_vs_bf16_of_scale_first"] = [
            rep["lib_default_bf16_vs_bf16_of_scale_first"][0] + d3[0],
            max(rep["lib_default_bf16_vs_bf16_of_scale_first"][1], d3[1])]
        deq[n + ".weight"] = ({"format": "nvfp4-ct", "sha256": sha256_f32(a),
                               "sha256_scale_first": sha256_f32(b), "elements": int(a.size)}, a)
    # end to end: transformers' compressed-tensors loader, decompressing on load
    from transformers import CompressedTensorsConfig

    m = AutoModelForCausalLM.from_pretrained(
        str(assemble_full("ct-nvfp4", tmp)), dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(run_compressed=False))
    loaded = m.state_dict()
    worst_bf16, worst_f32 = 0, 0
    for n in names:
        t = loaded[n + ".weight"]
        assert t.dtype == torch.float32
        b = deq_nvfp4(np_u8(keep[n + ".weight_packed"]), np_u8(keep[n + ".weight_scale"]),
                      np_f32(keep[n + ".weight_global_scale"])[0], inverted=True, scale_first=True)
        worst_bf16 = max(worst_bf16, ulp_diff(t.numpy(), to_bf16(b))[1])
        worst_f32 = max(worst_f32, ulp_diff(t.numpy(), deq[n + ".weight"][1])[1])
    rep["transformers_load_vs_bf16_of_scale_first_max_ulp"] = worst_bf16
    rep["transformers_load_vs_round_once_max_ulp"] = worst_f32
    del m
    REPORT["ct-nvfp4"] = rep
    finish_tiny("ct-nvfp4", keep, deq, tok, library=f"compressed-tensors {compressed_tensors.__version__}")


def tiny_fp8_block(tok, tmp: Path) -> None:
    model = load_tiny()
    names = linear_names(model)
    src = source_weights(model)
    export_dir = tmp / "fp8"
    export_dir.mkdir()
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    sd.pop("lm_head.weight", None)  # tied
    for n in names:
        q, s = hf_fp8_quantize(torch.from_numpy(src[n]))
        sd[n + ".weight"] = q
        sd[n + ".weight_scale_inv"] = s
    save_file(dict(sorted(sd.items())), str(export_dir / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = json.loads((TINY_DIR / "config.json").read_text())
    cfg["quantization_config"] = hf_fp8_config()
    (export_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    del model
    keep, d = write_checkpoint(
        "fp8-block", export_dir, names,
        "transformers' fine-grained FP8 quantizer op (`Fp8Quantize`, the one "
        "`from_pretrained(..., quantization_config=FineGrainedFP8Config())` runs; the loader "
        "itself refuses to quantize without a GPU) on each float32 Linear weight, zero-padded "
        "to whole 128x128 tiles (the op skips other shapes) and cropped back; config.json is "
        "the tiny config plus the `quantization_config` of a published FP8-block checkpoint.")
    deq, rep = {}, {"rule_bytes_match": 0, "lib_vs_round_once": [0, 0]}
    for n in names:
        w, s = keep[n + ".weight"], keep[n + ".weight_scale_inv"]
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert tuple(s.shape) == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        q, sr = fp8_block_quantize(src[n])
        check_equal(n + ".weight", q, np_u8(w))
        check_equal(n + ".weight_scale_inv", sr, np_f32(s))
        rep["rule_bytes_match"] += 1
        a = deq_fp8(np_u8(w), np_f32(s), block=FP8_BLOCK)
        d1 = ulp_diff(hf_fp8_deq(w, s), a)
        rep["lib_vs_round_once"] = [rep["lib_vs_round_once"][0] + d1[0],
                                    max(rep["lib_vs_round_once"][1], d1[1])]
        deq[n + ".weight"] = ({"format": "fp8-block", "sha256": sha256_f32(a),
                               "elements": int(a.size)}, a)
    # end to end: transformers loads the assembled checkpoint (FP8 dequantized on load, no GPU)
    m = AutoModelForCausalLM.from_pretrained(str(assemble_full("fp8-block", tmp)),
                                             dtype=torch.float32)
    loaded = m.state_dict()
    worst = 0
    for n in names:
        t = loaded[n + ".weight"]
        worst = max(worst, ulp_diff(t.float().numpy(), deq[n + ".weight"][1])[1]
                    if t.dtype == torch.float32 else 10**9)
    rep["transformers_load_dtype"] = str(loaded[names[0] + ".weight"].dtype)
    rep["transformers_load_max_ulp"] = worst
    del m
    REPORT["fp8-block"] = rep
    finish_tiny("fp8-block", keep, deq, tok, library=f"transformers {transformers.__version__}")


def finish_tiny(kind: str, keep: dict, deq: dict, tok, library: str) -> None:
    d = OUT / f"tiny-qwen3-{kind}"
    print(f" tiny-qwen3-{kind}:")
    cases = tiny_logprobs({k[:-len(".weight")]: v[1] for k, v in deq.items()}, tok)
    cfg = json.loads((d / "config.json").read_text())
    hfq = (json.loads((d / "hf_quant_config.json").read_text())
           if (d / "hf_quant_config.json").exists() else None)
    write_json(OUT / f"tiny-qwen3-{kind}.json", {
        "model": (f"eval/fixtures/quantized/tiny-qwen3-{kind} (quantized.safetensors) + the "
                  f"embedding and norms of eval/fixtures/tiny-qwen3 (bf16, widened)"),
        "library": library,
        "quantized_safetensors_sha256": sha256_file(d / "quantized.safetensors"),
        "base_safetensors_sha256": sha256_file(TINY_DIR / "model.safetensors"),
        "quantization_config": cfg.get("quantization_config"),
        "hf_quant_config": hfq,
        "tensors": tensor_table(keep),
        "dequantized": {
            "rule": ("sha256 of the little-endian float32 bytes, row-major, of each dequantized "
                     "weight. 'sha256': the WEIGHTS.md formula evaluated left to right, i.e. "
                     "the exact product (quotient for compressed-tensors' inverted global "
                     "scale) rounded once to float32. 'sha256_scale_first' (nvfp4 only): the "
                     "block scale e4m3 * g (or e4m3 / g) rounded to float32 first, then times "
                     "the E2M1 value (the libraries' own order). The logprobs use 'sha256'."),
            "weights": {k: v[0] for k, v in deq.items()},
        },
        "tokenizer": QWEN3_TOKENIZER_SOURCE, "tokenizer_sha256": QWEN3_TOKENIZER_SHA256,
        "dtype": "float32", **versions(), "cases": cases,
    })


def make_tiny(cache: Path, tmp: Path) -> None:
    tok = tiny_tokenizer(cache)
    seqs = [tok(t)["input_ids"] for _, t in TINY_TEXTS]
    for kind in ("modelopt-nvfp4", "modelopt-mixed"):
        t0 = time.perf_counter()
        tiny_modelopt(kind, tok, seqs, tmp)
        print(f"  [{kind}: {time.perf_counter() - t0:.1f} s]")
    t0 = time.perf_counter()
    tiny_ct(tok, seqs, tmp)
    print(f"  [ct-nvfp4: {time.perf_counter() - t0:.1f} s]")
    t0 = time.perf_counter()
    tiny_fp8_block(tok, tmp)
    print(f"  [fp8-block: {time.perf_counter() - t0:.1f} s]")


# ============================================================================================
# SmolLM2
# ============================================================================================


def load_smollm2(d: Path):
    model = AutoModelForCausalLM.from_pretrained(str(d), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    model.eval()
    if not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]
    return model


def make_smollm2(cache: Path, tmp: Path) -> None:
    import modelopt.torch.quantization as mtq

    d = smollm2_dir(cache, tmp)
    tok = AutoTokenizer.from_pretrained(str(d), gguf_file=SMOLLM2_GGUF)
    seqs = [tok(t)["input_ids"] for _, t in TINY_TEXTS]
    model = load_smollm2(d)
    names = linear_names(model)
    src = source_weights(model)
    src_sha = {n + ".weight": sha256_f32(w) for n, w in src.items()}

    # ---- ModelOpt NVFP4 ----
    t0 = time.perf_counter()
    export_dir = tmp / "smollm2-nvfp4"
    modelopt_export(model, mtq.NVFP4_DEFAULT_CFG, calibrator(seqs), export_dir)
    del model
    files = sorted(export_dir.glob("*.safetensors"))
    hfq = json.loads((export_dir / "hf_quant_config.json").read_text())
    table, matched, shared_differs = {}, 0, 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for k in sorted(f.keys()):
                t = f.get_tensor(k)
                table[k] = {"dtype": st_dtype(t), "shape": list(t.shape),
                            "sha256": hashlib.sha256(raw_bytes(t)).hexdigest()}
                if k.endswith(".weight") and k.rsplit(".", 1)[0] in names:
                    assert t.dtype == torch.uint8, k
    with safe_open(str(files[0]), framework="pt") as f:
        for n in names:
            w, ws, ws2 = (f.get_tensor(n + x) for x in (".weight", ".weight_scale", ".weight_scale_2"))
            packed, sc, g = nvfp4_quantize(src[n], shared_amax(src, n))
            check_equal(n + ".weight", packed, np_u8(w))
            check_equal(n + ".weight_scale", sc, np_u8(ws))
            check_equal(n + ".weight_scale_2", np.float32(g).reshape(()), np_f32(ws2))
            matched += 1
            # how often the per-tensor amax would have given other bytes (rule 1 matters)
            own = nvfp4_quantize(src[n], shared_amax(src, n, members=[n]))
            if len(group_of(n)) > 1 and not (np.array_equal(own[0], packed) and
                                              np.array_equal(own[1], sc)):
                shared_differs += 1
    print(f"  ModelOpt NVFP4: independent rules reproduce {matched}/{len(names)} linears "
          f"byte for byte; a per-tensor amax would change {shared_differs} fused tensors "
          f"[{time.perf_counter() - t0:.1f} s]")
    REPORT["smollm2-nvfp4"] = {"rule_bytes_match": matched, "of": len(names),
                               "per_tensor_amax_would_differ": shared_differs,
                               "exclude_modules": hfq["quantization"].get("exclude_modules")}
    write_json(OUT / "smollm2-modelopt-nvfp4-sha256.json", {
        "model": SMOLLM2_SOURCE, "gguf_sha256": SMOLLM2_GGUF_SHA256,
        "source": ("transformers AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., "
                   "dtype=float32) (Q4_1 dequantized by transformers, Q/K un-permuted), then "
                   "ModelOpt quantize(model, NVFP4_DEFAULT_CFG, forward_loop over the tiny "
                   "fixture texts 'prose' and 'mixed_code_zh', one full sequence each) + "
                   "export_hf_checkpoint, on CPU"),
        "library": f"nvidia-modelopt {modelopt_version()}", **versions(),
        "hf_quant_config": hfq,
        "note": ("weight / weight_scale / weight_scale_2 depend only on the source weights "
                 "(WEIGHTS.md rules; this script's numpy implementation reproduces every byte). "
                 "input_scale depends on the calibration texts; the embedding and norms are "
                 "exported unquantized in float32 (the model's dtype)."),
        "source_weight_sha256": src_sha,
        "tensors": table,
    })

    # ---- FP8 block (transformers' Fp8Quantize) ----
    t0 = time.perf_counter()
    table, matched, true_div = {}, 0, 0
    for n in names:
        q, s = hf_fp8_quantize(torch.from_numpy(src[n]))
        qr, sr = fp8_block_quantize(src[n])
        check_equal(n + ".weight", qr, np_u8(q))
        check_equal(n + ".weight_scale_inv", sr, np_f32(s))
        matched += 1
        for suffix, t in ((".weight", q), (".weight_scale_inv", s)):
            table[n + suffix] = {"dtype": st_dtype(t), "shape": list(t.shape),
                                 "sha256": hashlib.sha256(raw_bytes(t)).hexdigest()}
        # what a true f32 division 448 / amax would change (PyTorch computes reciprocal * 448)
        q2, s2 = fp8_block_quantize(src[n], true_division=True)
        if not (np.array_equal(qr, q2) and np.array_equal(sr, s2)):
            true_div += 1
    n_tiles = sum(-(-src[n].shape[0] // FP8_BLOCK) * -(-src[n].shape[1] // FP8_BLOCK) for n in names)
    print(f"  FP8 block: independent rules reproduce {matched}/{len(names)} linears byte for "
          f"byte; a true division 448/amax instead of reciprocal(amax)*448 would change "
          f"{true_div} of them [{time.perf_counter() - t0:.1f} s]")
    REPORT["smollm2-fp8-block"] = {"rule_bytes_match": matched, "of": len(names),
                                   "tiles": n_tiles, "true_division_would_change_tensors": true_div}
    write_json(OUT / "smollm2-fp8-block-sha256.json", {
        "model": SMOLLM2_SOURCE, "gguf_sha256": SMOLLM2_GGUF_SHA256,
        "source": ("transformers' float32 weights from the GGUF (as above); each Linear weight "
                   "quantized by transformers' Fp8Quantize op (FineGrainedFP8Config, "
                   "weight_block_size [128, 128], scale_fmt float) after zero-padding to whole "
                   "128x128 tiles (the op passes other shapes through unquantized), result "
                   "cropped to [O, I]; weight_scale_inv [ceil(O/128), ceil(I/128)]"),
        "library": f"transformers {transformers.__version__}", **versions(),
        "quantization_config": hf_fp8_config(),
        "rule": ("per tile amax (0 -> 1); s = reciprocal(amax) * 448 (PyTorch evaluates "
                 "448 / tensor that way: two float32 roundings); q = e4m3_rne(clamp(w * s, "
                 "+-448)); weight_scale_inv = reciprocal(s) (float32 1 / s). Partial edge "
                 "tiles are tiles of the elements they hold. The embedding (tied head) and "
                 "norms are not quantized and not listed."),
        "true_division_would_change_tensors": true_div, "tiles": n_tiles,
        "source_weight_sha256": src_sha,
        "tensors": dict(sorted(table.items())),
    })


# ============================================================================================


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", default=str(ROOT / "models" / "cache"),
                    help="where the GGUF and the Qwen3 tokenizer are (fetched if missing)")
    ap.add_argument("--only", choices=["tiny", "smollm2"])
    ap.add_argument("--out", help="write DIR/quantized/ instead of eval/fixtures/quantized/")
    args = ap.parse_args()
    global OUT
    if args.out is not None:
        OUT = out_dir(args.out) / "quantized"

    torch.manual_seed(0)
    torch.set_num_threads(TORCH_THREADS)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    cache = Path(args.cache).resolve()
    OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        if args.only in (None, "tiny"):
            make_tiny(cache, tmp)
        if args.only in (None, "smollm2"):
            make_smollm2(cache, tmp)
    print("agreement:", json.dumps(REPORT, indent=1))
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
