"""Pins the CPU kernels PyTorch uses, so that a generator writes the committed bytes on the
kind of CPU its fixtures were made on. Call it before torch is imported, with the script's
profile:

    if __name__ == "__main__":
        from cpu_pins import pin_cpu
        pin_cpu("avx512")  # before `import torch`

Why: PyTorch picks its kernels at run time from the CPU, in two places: its own vectorized
operators (ATen: AVX2 or AVX-512) and Intel MKL's matrix products (SSE4.2 up to AVX-512/AMX
on Intel CPUs, its own kernels on AMD ones). Each choice sums or rounds in its own order, so
float32 results differ in the last bits (random normals too), and the tiny models' 20-30 Adam
steps turn that into other weights (Adam moves a weight by about lr * sign(gradient), so one
flipped sign of a near-zero gradient moves it by a whole step). The committed fixtures were
made on two kinds of 2-vCPU machines, so each script pins the kernels of its own kind
(README.md, "Reproducing the bytes", has the measurements):

  avx512  an Intel Xeon with AVX-512: ATEN_CPU_CAPABILITY=avx512 and MKL_CBWR=AVX512 (MKL's
          conditional-numerical-reproducibility branch: the same bits as MKL's default on
          that Xeon, and the same on any CPU with AVX-512 whatever newer extensions it has).
          make_hybrid_fixtures.py, make_weight_fixtures.py, make_kld_fixture.py.
  zen3    an AMD EPYC Zen 3 (AVX2, no AVX-512): ATEN_CPU_CAPABILITY=avx2, MKL left alone (on
          an AMD CPU MKL runs its own kernels; MKL_CBWR=AVX2 would select Intel's AVX2 path,
          which gives other bits). make_fixtures.py, make_moe_fixtures.py. These reproduce
          only on such a CPU: no setting makes an Intel CPU run MKL's AMD kernels.
  avx2    ATEN_CPU_CAPABILITY=avx2 only; for make_kv_fixtures.py, which uses no MKL, so any
          CPU with AVX2 reproduces it (an AVX-512 one included: ATen can be held below what
          the CPU has).

The generators also call torch.set_num_threads(2) (1 or 4 threads give other bits too). The
values are forced: the caller's environment cannot change the bytes, except through
NINFER_FIXTURE_CPU=native|avx512|zen3|avx2, for diagnosis only (`native`: pin nothing).

`python cpu_pins.py --check PROFILE...` says whether this CPU is of a profile's kind
(check-fixtures.sh runs it first).
"""

from __future__ import annotations

import os
import sys

PROFILES = {
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "AVX512"},
    "zen3": {"ATEN_CPU_CAPABILITY": "avx2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
}
AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}  # what ATen's AVX-512 kernels need
KINDS = {
    "avx512": "a CPU with AVX-512",
    "zen3": "an AMD CPU with AVX2 and without AVX-512 (the AMD EPYC Zen 3 the files were made on)",
    "avx2": "a CPU with AVX2",
}
OVERRIDE = "NINFER_FIXTURE_CPU"


def pin_cpu(profile: str) -> str:
    """Sets the environment of `profile` (or of NINFER_FIXTURE_CPU when set) and returns the
    profile in force. Both variables are read when torch loads its kernels, hence the check."""
    if "torch" in sys.modules:
        raise RuntimeError("pin_cpu() must run before torch is imported")
    chosen = os.environ.get(OVERRIDE) or profile
    if chosen != "native":
        if chosen not in PROFILES:
            raise SystemExit(f"{OVERRIDE}={chosen}: one of native, {', '.join(PROFILES)}")
        for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS"):
            os.environ.pop(k, None)
        os.environ.update(PROFILES[chosen])
        if not can_run(chosen):
            print(f"cpu_pins: WARNING: this is not {KINDS[chosen]}; the files this script "
                  f"writes will not reproduce the committed ones byte for byte",
                  file=sys.stderr)
    if chosen != profile:
        print(f"cpu_pins: {OVERRIDE}={chosen} instead of this script's {profile}: the output "
              f"is not expected to match the committed files", file=sys.stderr)
    return chosen


def cpuinfo() -> tuple[str, set[str]]:
    """(vendor_id, flags) of the first CPU in /proc/cpuinfo; empty when unreadable."""
    vendor, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("vendor_id") and not vendor:
                    vendor = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return vendor, flags


def can_run(profile: str) -> bool:
    """Whether this CPU is of the kind the profile's files were made on."""
    vendor, flags = cpuinfo()
    if profile == "avx512":
        return AVX512 <= flags
    if profile == "zen3":
        return vendor == "AuthenticAMD" and "avx2" in flags and not AVX512 <= flags
    return "avx2" in flags


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--check"]
    if "--check" not in sys.argv[1:] or not args:
        print(__doc__)
        return
    ok = True
    vendor, _ = cpuinfo()
    for p in args:
        pins = ", ".join(f"{k}={v}" for k, v in PROFILES[p].items())
        if can_run(p):
            print(f"cpu_pins: {p}: this CPU ({vendor or 'unknown vendor'}) is {KINDS[p]}: "
                  f"expected to reproduce ({pins}, 2 threads)")
        else:
            ok = False
            print(f"cpu_pins: {p}: this CPU ({vendor or 'unknown vendor'}) is not {KINDS[p]}: "
                  f"its files are not expected to reproduce here")
    if os.environ.get(OVERRIDE):
        print(f"cpu_pins: {OVERRIDE}={os.environ[OVERRIDE]} is set: every generator uses it "
              f"instead of its own profile")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
