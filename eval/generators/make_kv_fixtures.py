#!/usr/bin/env python3
"""Reference fixtures for the quantized KV formats (int8, fp8, nvfp4) of src/kv: the seed
engine's (NInfer's) Int8Group64, Fp8E4M3Row256 and Nvfp4Group16, and its Hadamard rotation.

Format rules (docs/kv-formats.md): int8 has one FP16 scale fp16(amax/127) per 64 elements,
codes round(x * (1/scale)) clamped to +-127; fp8 one FP16 scale
fp16(clamp(amax/448, 2^-24, 65504)) per vector, codes e4m3(x * (1/scale)) saturating; nvfp4
one e4m3 scale e4m3(clamp(amax/6, 2^-9, 448)) per 16 elements and no other scale, codes
e2m1(x / scale). The rotation is the Sylvester Hadamard matrix over sqrt(n); its fixtures hold
the exact product (float64) of the matrix with each input, which the Rust butterfly (f32)
must reproduce to within its rounding.

The expected codes and values are computed here independently of the Rust code, with
PyTorch's own conversions where PyTorch has them:
  * e4m3fn: tensor.to(torch.float8_e4m3fn) on inputs clamped to [-448, 448] first (the format
    saturates; clamping first makes the result independent of how a given torch release
    treats out-of-range values);
  * e2m1: torch has the dtype float4_e2m1fn_x2 but (checked at run time, recorded in the
    index) no conversion into it, so the e2m1 reference is an explicit table of the 8
    magnitudes: nearest by distance, ties to the even code. It is cross-checked, when it can
    be loaded, against torch's internal test helper `_f32_to_floatx_unpacked`;
  * int8: torch.round (half to even) and clamp;
  * FP16 scales: tensor.to(torch.float16) (round to nearest even, subnormals kept).
All arithmetic is float32 with divisions between tensors of the same shape (no reciprocal
multiplication by a scalar fast path) and denormals kept; the reciprocals 1/scale that int8
and fp8 multiply by are such divisions too.

Output: eval/fixtures/kv/index.json and little-endian .bin arrays next to it.
Run: eval/.venv/bin/python eval/generators/make_kv_fixtures.py [--out DIR]
(--out DIR writes DIR/kv/ instead of eval/fixtures/kv/.)
"""

if __name__ == "__main__":  # before torch: the CPU kernels this script's committed files need
    from cpu_pins import pin_cpu
    pin_cpu("avx2")

import argparse
import ast
import json
import math
import pathlib
import struct

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "eval" / "fixtures" / "kv"  # DIR/kv with --out DIR
SEED = 20261130
HEAD_DIMS = [8, 33, 64, 80, 128]
PER_KIND = 8  # vectors of each random kind per (format, head_dim)

E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

torch.set_flush_denormal(False)
F32 = torch.float32


# ----------------------------------------------------------------------------- helpers

def f32(vals):
    return torch.tensor(vals, dtype=F32)


def bits_to_f32(bits):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(F32)


def next_up(x):
    return torch.nextafter(x, torch.full_like(x, math.inf))


def next_down(x):
    return torch.nextafter(x, torch.full_like(x, -math.inf))


def e4m3_codes(x):
    """float32 tensor -> uint8 e4m3fn codes, RNE, saturating to +-448."""
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_values(codes):
    return codes.view(torch.float8_e4m3fn).to(F32)


def e2m1_codes_table(v):
    """float32 tensor -> e2m1 codes (0..15): nearest magnitude, ties to even code, saturate."""
    # Saturation: everything above 6 is nearest to 6; bounding the magnitude first keeps the
    # float64 distances exact (for huge inputs they would all round to the same value).
    a = v.abs().to(torch.float64).clamp(max=7.0).unsqueeze(-1)
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    dist = (a - grid).abs()
    best = dist.min(dim=-1, keepdim=True).values
    is_best = dist == best
    # Among the (at most two adjacent) nearest grid points prefer the even code.
    pref = is_best.to(torch.int64) * torch.tensor([2, 1, 2, 1, 2, 1, 2, 1])
    mag = pref.argmax(dim=-1).to(torch.uint8)
    sign = torch.signbit(v).to(torch.uint8) * 8
    return mag | sign


def e2m1_values(codes):
    table = torch.tensor(E2M1_GRID + [-g for g in E2M1_GRID], dtype=F32)
    return table[codes.to(torch.int64)]


def load_torch_floatx():
    """torch's internal float -> floatx reference (copied there from torchao), loaded from its
    source without importing the test-only module it lives in. None when unavailable."""
    try:
        import torch.testing._internal as ti

        path = pathlib.Path(ti.__file__).parent / "common_quantized.py"
        tree = ast.parse(path.read_text())
        wanted = {"_n_ones", "_f32_to_floatx_unpacked"}
        body = []
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in wanted:
                body.append(node)
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Tuple | ast.Name) and "F32" in ast.unparse(t) for t in node.targets
            ):
                body.append(node)
        ns = {"torch": torch, "Tensor": torch.Tensor}
        exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), ns)
        fn = ns["_f32_to_floatx_unpacked"]
        return lambda v: fn(v.contiguous(), 2, 1)
    except Exception as e:  # noqa: BLE001 - a missing helper only skips the cross-check
        print(f"note: torch's floatx helper unavailable ({e}); e2m1 not cross-checked")
        return None


TORCH_FLOATX = load_torch_floatx()
CROSS_CHECKED = 0


def cross_check_e2m1(v, codes):
    """Compare the table reference with torch's helper where both are defined (not NaN)."""
    global CROSS_CHECKED
    if TORCH_FLOATX is None:
        return
    other = TORCH_FLOATX(v.reshape(-1)).reshape(codes.shape)
    # The helper keeps the sign of zero the same way (sign bit copied); compare everything.
    bad = (other != codes).nonzero()
    if len(bad):
        i = tuple(bad[0].tolist())
        raise SystemExit(f"e2m1 mismatch vs torch helper at {i}: v={v[i].item()!r} "
                         f"table={codes[i].item()} torch={other[i].item()}")
    CROSS_CHECKED += codes.numel()


def probe_float4():
    info = {"dtype_exists": hasattr(torch, "float4_e2m1fn_x2"), "conversion_from_float32": False}
    if info["dtype_exists"]:
        try:
            torch.zeros(2, dtype=F32).to(torch.float4_e2m1fn_x2)
            info["conversion_from_float32"] = True
        except Exception as e:  # noqa: BLE001
            info["conversion_error"] = str(e).splitlines()[0]
    return info


# ----------------------------------------------------------------------------- writing

FILES = {}


def write(name, t):
    t = t.contiguous()
    data = t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.uint8 else t.numpy().tobytes()
    (OUT / name).write_bytes(data)
    FILES[name] = len(data)
    return name


# ----------------------------------------------------------------------------- scalars

def scalar_sets():
    sets = []

    # e4m3: every finite bfloat16 value (all 65536 patterns minus inf/NaN).
    pats = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(F32)
    x = pats[torch.isfinite(pats)]
    sets.append(("e4m3_all_bf16", "e4m3", x, e4m3_codes(x)))

    # e4m3: every midpoint between neighbouring e4m3 values, one f32 ulp either side,
    # the values themselves and one ulp either side, the saturation region, f32 subnormals,
    # and random finite f32 bit patterns.
    pos = e4m3_values(torch.arange(0, 0x7F, dtype=torch.uint8))  # 0 .. 448
    mids = (pos[:-1].double() + pos[1:].double()) / 2
    mids = mids.to(F32)
    assert torch.equal(mids.double(), (pos[:-1].double() + pos[1:].double()) / 2)
    sat = f32([448.0, 456.0, 464.0, 472.0, 480.0, 500.0, 1e4, 3.0e38, float(torch.finfo(F32).max)])
    subn = bits_to_f32([1, 2, 3, 0x400, 0x7FFFFF, 0x800000])
    g = torch.Generator().manual_seed(SEED)
    rnd_bits = torch.randint(0, 2**31 - 1, (4000,), generator=g, dtype=torch.int64)
    rnd = bits_to_f32(rnd_bits.tolist())
    rnd = rnd[torch.isfinite(rnd)]
    # random values concentrated in the e4m3 range
    rng = (torch.rand(4000, generator=g, dtype=torch.float64) * 30 - 18).exp2().to(F32)
    parts = [mids, next_up(mids), next_down(mids), pos, next_up(pos), next_down(pos[1:]),
             sat, next_up(sat), next_down(sat), subn, rnd, rng]
    x = torch.cat(parts)
    x = torch.cat([x, -x])
    sets.append(("e4m3_edges_f32", "e4m3", x, e4m3_codes(x)))

    # e2m1: every grid value, every midpoint, one ulp either side of both, saturation,
    # tiny values, random values.
    grid = f32(E2M1_GRID)
    mids = (grid[:-1] + grid[1:]) / 2  # exact
    extra = f32([6.5, 7.0, 8.0, 100.0, 1e30, float(torch.finfo(F32).max), 0.1, 1e-30])
    rnd = torch.rand(2000, generator=g, dtype=F32) * 16 - 8
    x = torch.cat([grid, next_up(grid), next_down(grid[1:]), mids, next_up(mids), next_down(mids),
                   extra, subn, rnd])
    x = torch.cat([x, -x])
    codes = e2m1_codes_table(x)
    cross_check_e2m1(x, codes)
    sets.append(("e2m1_edges_f32", "e2m1", x, codes))
    return sets


# ----------------------------------------------------------------------------- vectors

def random_vectors(n, g):
    """A mix of vector kinds, each PER_KIND times; returns (count, n) float32."""
    rows = []

    def gauss():
        return torch.randn(n, generator=g, dtype=F32)

    def pow2(lo, hi):
        return float(2.0 ** torch.randint(lo, hi + 1, (1,), generator=g).item())

    for _ in range(PER_KIND):
        rows.append(gauss() * pow2(-20, 20))  # plain, assorted magnitudes
        v = gauss()
        v[torch.randint(0, n, (1,), generator=g)] = 1e4 * (1 if torch.rand(1, generator=g) < 0.5 else -1)
        rows.append(v)  # one huge outlier
        v = gauss() * 1e-3
        v[torch.randint(0, n, (1,), generator=g)] = 3e5
        rows.append(v)  # a single spike over tiny values: most nvfp4 blocks round to 0
        v = gauss()
        m = torch.rand(n, generator=g) < 0.4
        v[m] = 0.0
        v[torch.rand(n, generator=g) < 0.2] = -0.0
        if n >= 32:
            v[16:32] = 0.0  # a whole zero block
        rows.append(v)  # zeros and negative zeros
        rows.append(gauss() * 1e-39)  # subnormal inputs (scales underflow or are subnormal)
        rows.append(gauss() * 1e-33)  # normal inputs, subnormal nvfp4 global scale
        sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
        rows.append(sign * (torch.rand(n, generator=g) * 40 - 30).exp2())  # wide dynamic range
        rows.append(gauss().to(torch.bfloat16).to(F32) * 3)  # bf16-valued
    rows.append(torch.zeros(n))
    rows.append(torch.full((n,), -0.0))
    v = torch.zeros(n)
    v[n // 2] = -7.5
    rows.append(v)  # one non-zero value
    rows.append(torch.full((n,), 1.25))  # constant
    fmax = torch.finfo(F32).max
    for big in (fmax, -fmax, float(next_down(f32([fmax])))):
        v = gauss()
        v[n // 3] = big
        rows.append(v)  # amax at the top of f32: the decoded product would overflow
    return torch.stack(rows).to(F32)


def tie_vectors_int8(n, g):
    """x / scale lands exactly on k + 1/2: amax = 127·s with s = c·2^j (c odd small), so
    scale = s exactly and (k + 1/2)·s is exact."""
    rows = []
    for c, j in [(1, 0), (1, -7), (3, 2), (5, -20), (7, 9), (1, -100)]:
        s = c * 2.0 ** j
        k = torch.randint(-127, 127, (n,), generator=g).to(torch.float64)
        v = ((k + 0.5) * s).to(F32)
        v[0] = 127 * s if c % 2 else -127 * s
        v[n - 1] = -127 * s
        rows.append(v)
        w = v.clone()
        w[1:-1] = next_up(v[1:-1])
        rows.append(w)
        w = v.clone()
        w[1:-1] = next_down(v[1:-1])
        rows.append(w)
    return torch.stack(rows)


def tie_vectors_fp8(n, g):
    """amax = 448·2^j makes scale = 2^j exactly; the other values are e4m3 midpoints ·2^j."""
    pos = e4m3_values(torch.arange(0, 0x7F, dtype=torch.uint8)).double()
    mids = ((pos[:-1] + pos[1:]) / 2)
    rows = []
    for j in [0, -6, 5, -40]:
        s = 2.0 ** j
        idx = torch.randint(0, len(mids), (n,), generator=g)
        sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
        v = (mids[idx] * sign * s).to(F32)
        v[0] = 448 * s
        rows.append(v)
        w = v.clone()
        w[1:] = next_up(v[1:])
        rows.append(w)
    return torch.stack(rows)


def tie_vectors_nvfp4(n, g):
    """g = 2^j exactly (an element of 2688·2^j); each block's amax is 6·S·g for an e4m3 value
    S (so its scale is exactly S) or 6·m·g for an e4m3 midpoint m (a tie in the block scale);
    the other values are e2m1 midpoints and grid points times S·g."""
    e4 = e4m3_values(torch.arange(1, 0x7F, dtype=torch.uint8)).double()
    e4mid = (e4[:-1] + e4[1:]) / 2
    gridm = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 3.0, 4.0], dtype=torch.float64)
    rows = []
    for j in [0, -10, 7]:
        for tie_scale in (False, True):
            gs = 2.0 ** j
            v = torch.zeros(n, dtype=torch.float64)
            for b0 in range(0, n, 16):
                b1 = min(b0 + 16, n)
                if tie_scale:
                    S = e4mid[torch.randint(0, len(e4mid), (1,), generator=g)].item()
                else:
                    S = e4[torch.randint(0, len(e4), (1,), generator=g)].item()
                k = torch.randint(0, len(gridm), (b1 - b0,), generator=g)
                sign = torch.where(torch.rand(b1 - b0, generator=g) < 0.5, -1.0, 1.0).double()
                v[b0:b1] = gridm[k] * S * gs * sign
                v[b0] = 6 * S * gs
            v[0] = 2688 * gs
            rows.append(v.to(F32))
    # g with a full mantissa, so that S·g is inexact: values 0.25·d with d = f32(S·g) are
    # exact ties of x / d (to code 0) that a different order, (x / g) / S, would miss.
    for _ in range(4):
        g0 = float(torch.rand(1, generator=g, dtype=torch.float64) + 0.5)
        amax = f32([2688 * g0])
        gs = amax / f32([2688.0])
        v = torch.zeros(n, dtype=F32)
        for b0 in range(0, n, 16):
            b1 = min(b0 + 16, n)
            S = e4[torch.randint(40, len(e4), (1,), generator=g)].to(F32)
            d = S * gs
            k = torch.randint(0, 5, (b1 - b0,), generator=g)
            mult = f32([0.25, 0.5, 1.0, 2.0, 4.0])[k]
            sign = torch.where(torch.rand(b1 - b0, generator=g) < 0.5, -1.0, 1.0)
            v[b0:b1] = mult * d * sign  # exact: powers of two times d
            v[b0] = (f32([6.0]) * S) * gs
        v[0] = amax[0]
        rows.append(v)
    return torch.stack(rows)


def ref_int8(x):
    cnt, n = x.shape
    ng = (n + 63) // 64
    xp = torch.zeros(cnt, ng * 64, dtype=F32)
    xp[:, :n] = x
    amax = xp.view(cnt, ng, 64).abs().amax(dim=2)  # (cnt, ng)
    sh = (amax / torch.full_like(amax, 127.0)).to(torch.float16)
    s = sh.to(F32)
    se = s.unsqueeze(2).expand(cnt, ng, 64).reshape(cnt, ng * 64)[:, :n].contiguous()
    nz = se != 0
    r = torch.full_like(se, 1.0) / torch.where(nz, se, 1.0)
    q = torch.where(nz, torch.round(x * r).clamp(-127, 127), 0.0).to(torch.int8)
    dec = q.to(F32) * se
    return {"codes": q, "scales": sh.reshape(-1), "decoded": dec}


def ref_fp8(x):
    amax = x.abs().amax(dim=1, keepdim=True)
    sh = (amax / torch.full_like(amax, 448.0)).clamp(2.0 ** -24, 65504.0).to(torch.float16)
    sh = torch.where(amax == 0, torch.zeros_like(sh), sh)
    se = sh.to(F32).expand_as(x).contiguous()
    nz = se != 0
    r = torch.full_like(se, 1.0) / torch.where(nz, se, 1.0)
    q = torch.where(nz, e4m3_codes(x * r), torch.zeros_like(x, dtype=torch.uint8))
    dec = e4m3_values(q) * se
    return {"codes": q, "scales": sh.reshape(-1), "decoded": dec}


def ref_nvfp4(x):
    cnt, n = x.shape
    nb = (n + 15) // 16
    xp = torch.zeros(cnt, nb * 16, dtype=F32)
    xp[:, :n] = x
    amax_b = xp.view(cnt, nb, 16).abs().amax(dim=2)  # (cnt, nb)
    s_codes = e4m3_codes((amax_b / torch.full_like(amax_b, 6.0)).clamp(2.0 ** -9, 448.0))
    s_codes = torch.where(amax_b == 0, torch.zeros_like(s_codes), s_codes)
    S = e4m3_values(s_codes)
    Se = S.unsqueeze(2).expand(cnt, nb, 16).reshape(cnt, nb * 16)[:, :n].contiguous()
    nz = Se != 0
    v = x / torch.where(nz, Se, 1.0)
    codes = torch.where(nz, e2m1_codes_table(v), torch.zeros_like(x, dtype=torch.uint8))
    cross_check_e2m1(v[nz], codes[nz])
    dec = e2m1_values(codes) * Se
    cp = torch.zeros(cnt, 2 * ((n + 1) // 2), dtype=torch.uint8)
    cp[:, :n] = codes
    packed = cp[:, 0::2] | (cp[:, 1::2] << 4)
    return {"codes": packed, "block_scales": s_codes, "decoded": dec}


def sylvester(n):
    """The n x n Sylvester Hadamard matrix (entries +-1), float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rotation_sets(g):
    """Inputs and their exact rotations H x / sqrt(n) (float64) for the power-of-two sizes."""
    sets = []
    for n in [2, 8, 64, 128, 256]:
        h = sylvester(n)
        r = torch.arange(n).unsqueeze(1)
        c = torch.arange(n).unsqueeze(0)
        parity = torch.zeros(n, n, dtype=torch.int64)
        rc = r & c
        while bool((rc > 0).any()):
            parity ^= rc & 1
            rc = rc >> 1
        assert torch.equal(h, 1.0 - 2.0 * parity.double()), "entry (r, c) = (-1)^popcount(r & c)"
        x = torch.cat([torch.randn(12, n, generator=g, dtype=F32) * 3,
                       torch.eye(n, dtype=F32)[: min(n, 4)],
                       (torch.randint(-9, 10, (4, n), generator=g)).to(F32)])
        exact = (x.double() @ h.T) / math.sqrt(n)
        sets.append((n, x, exact))
    return sets


REFS = {"int8": (ref_int8, tie_vectors_int8), "fp8": (ref_fp8, tie_vectors_fp8),
        "nvfp4": (ref_nvfp4, tie_vectors_nvfp4)}


def main():
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write DIR/kv/ instead of eval/fixtures/kv/")
    args = ap.parse_args()
    if args.out is not None:
        OUT = pathlib.Path(args.out).resolve() / "kv"
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.bin"):
        old.unlink()
    g = torch.Generator().manual_seed(SEED)
    index = {
        "version": 2,
        "generator": "eval/generators/make_kv_fixtures.py",
        "torch": torch.__version__,
        "torch_float4_e2m1fn_x2": probe_float4(),
        "endianness": "little",
        "scalar": [],
        "vectors": [],
    }
    for name, kind, x, codes in scalar_sets():
        index["scalar"].append({
            "name": name, "kind": kind, "n": x.numel(),
            "input": write(f"{name}.in.f32.bin", x),
            "codes": write(f"{name}.codes.u8.bin", codes),
        })
    for fmt, (ref, ties) in REFS.items():
        for n in HEAD_DIMS + ([24] if fmt == "nvfp4" else []):
            x = torch.cat([random_vectors(n, g), ties(n, g)])
            if fmt == "int8":
                # Past 127 * 65504 the FP16 scale is infinite and decodes to NaN (tested in
                # Rust by name); keep the reference finite.
                x = x[x.abs().amax(dim=1) < 127 * 65504]
            r = ref(x)
            base = f"{fmt}_hd{n}"
            entry = {
                "name": base, "format": fmt, "head_dim": n, "count": x.shape[0],
                "input": write(f"{base}.in.f32.bin", x),
                "codes": write(f"{base}.codes.{'i8' if fmt == 'int8' else 'u8'}.bin", r["codes"]),
                "scales": write(f"{base}.scales.f16.bin", r["scales"]) if "scales" in r else None,
                "block_scales": write(f"{base}.block_scales.u8.bin", r["block_scales"]) if "block_scales" in r else None,
                "decoded": write(f"{base}.decoded.f32.bin", r["decoded"]),
            }
            assert torch.isfinite(r["decoded"]).all(), base
            index["vectors"].append(entry)
    index["rotations"] = []
    for n, x, exact in rotation_sets(g):
        index["rotations"].append({
            "n": n, "count": x.shape[0],
            "input": write(f"hadamard_{n}.in.f32.bin", x),
            "exact": write(f"hadamard_{n}.exact.f64.bin", exact),
        })
    index["e2m1_reference"] = (
        "tabulated grid, nearest by distance, ties to the even code; "
        + (f"agrees with torch.testing._internal.common_quantized._f32_to_floatx_unpacked(x, 2, 1) "
           f"on all {CROSS_CHECKED} checked values" if TORCH_FLOATX else "not cross-checked")
    )
    index["total_bytes"] = sum(FILES.values())
    (OUT / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    print(f"wrote {len(FILES)} files, {index['total_bytes']} bytes, to {OUT}")
    print(index["torch_float4_e2m1fn_x2"])
    print(index["e2m1_reference"])


if __name__ == "__main__":
    main()
