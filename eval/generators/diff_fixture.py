#!/usr/bin/env python3
"""Says how two versions of a fixture file differ, in one line (check-fixtures.sh calls it
for every file that is not byte-identical).

    python diff_fixture.py COMMITTED GENERATED

* .safetensors: the header (names, dtypes, shapes, metadata) and, tensor by tensor, how many
  elements differ and by how many units in the last place at most (ULPs of the stored dtype:
  bf16, f16, f32, f64, e4m3; raw bytes for the rest), worst tensors first;
* .json: how many leaf values differ, the first few paths, and the largest absolute
  difference between numbers;
* anything else: the size of each and the first differing byte.

Standard library only, plus numpy for .safetensors.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path


def first_diff(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def read_st(path: Path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", None)
    base = 8 + n
    data = {k: raw[base + v["data_offsets"][0]:base + v["data_offsets"][1]] for k, v in header.items()}
    return header, meta, data


# dtype -> (numpy integer type of the same width, signed-magnitude float?)
ULP_DTYPES = {"BF16": "<u2", "F16": "<u2", "F32": "<u4", "F64": "<u8", "F8_E4M3": "u1"}


def ulps(dtype: str, a: bytes, b: bytes):
    """(elements that differ, max distance in representable steps) for float dtypes."""
    import numpy as np

    if dtype not in ULP_DTYPES:
        x, y = np.frombuffer(a, "u1"), np.frombuffer(b, "u1")
        return int((x != y).sum()), None
    t = np.dtype(ULP_DTYPES[dtype])
    x = np.frombuffer(a, t).astype(np.int64)
    y = np.frombuffer(b, t).astype(np.int64)
    bits = t.itemsize * 8
    sign = np.int64(1) << (bits - 1)

    def ordered(v):  # sign-magnitude -> a line where neighbouring floats are 1 apart
        return np.where(v & sign, -(v & (sign - 1)), v)

    d = np.abs(ordered(x) - ordered(y))
    return int((d != 0).sum()), int(d.max(initial=0))


def diff_safetensors(a: Path, b: Path) -> str:
    ha, ma, da = read_st(a)
    hb, mb, db = read_st(b)
    notes = []
    if set(ha) != set(hb):
        notes.append(f"tensor names differ ({len(set(ha) ^ set(hb))} not in both)")
    if ma != mb:
        notes.append("metadata differs")
    rows = []
    for k in sorted(set(ha) & set(hb)):
        if ha[k]["dtype"] != hb[k]["dtype"] or ha[k]["shape"] != hb[k]["shape"]:
            notes.append(f"{k}: {ha[k]['dtype']}{ha[k]['shape']} vs {hb[k]['dtype']}{hb[k]['shape']}")
            continue
        if da[k] == db[k]:
            continue
        n, worst = ulps(ha[k]["dtype"], da[k], db[k])
        rows.append((worst or 0, n, k, ha[k]["dtype"], len(da[k]) // max(1, _size(ha[k]["dtype"]))))
    rows.sort(reverse=True)
    total = len(set(ha) & set(hb))
    elems = sum(r[1] for r in rows)
    out = f"{len(rows)}/{total} tensors differ ({elems} elements)"
    if rows:
        out += ", max " + ", ".join(
            f"{k} {n}/{size} el. <= {w} ulp {dt}" for w, n, k, dt, size in rows[:4])
        if len(rows) > 4:
            out += ", ..."
    return "; ".join([out] + notes)


def _size(dtype: str) -> int:
    return {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "U8": 1, "I8": 1,
            "I32": 4, "I64": 8}.get(dtype, 1)


def leaves(v, path="$"):
    if isinstance(v, dict):
        for k, x in v.items():
            yield from leaves(x, f"{path}.{k}")
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from leaves(x, f"{path}[{i}]")
    else:
        yield path, v


def diff_json(a: Path, b: Path) -> str:
    try:
        ja, jb = json.loads(a.read_text(encoding="utf-8")), json.loads(b.read_text(encoding="utf-8"))
    except ValueError as e:
        return f"not JSON ({e})"
    la, lb = dict(leaves(ja)), dict(leaves(jb))
    paths = [p for p in la if p not in lb or la[p] != lb[p]] + [p for p in lb if p not in la]
    if not paths:
        return "same values, other formatting"
    worst = 0.0
    for p in paths:
        x, y = la.get(p), lb.get(p)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and \
                not isinstance(x, bool) and not isinstance(y, bool):
            worst = max(worst, abs(x - y))
    return (f"{len(paths)} of {len(la)} values differ (max |d| {worst:.3g} between numbers), "
            f"first: {', '.join(paths[:3])}")


def main() -> None:
    a, b = Path(sys.argv[1]), Path(sys.argv[2])
    if not b.exists():
        print("not generated")
        return
    ra, rb = a.read_bytes(), b.read_bytes()
    if ra == rb:
        print("same")
        return
    if a.suffix == ".safetensors":
        print(diff_safetensors(a, b))
    elif a.suffix == ".json":
        print(diff_json(a, b))
    else:
        print(f"{len(ra)} vs {len(rb)} bytes, first difference at byte {first_diff(ra, rb)}")


if __name__ == "__main__":
    main()
