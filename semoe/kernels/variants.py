"""The builds of the compiled CPU kernels (semoe/kernels/*.c), one shared library per instruction
set: a portable one, AVX2 with FMA, and AVX-512 with VNNI. The install builds every one its
compiler can (setup.py reads this file without importing the package); the loader
(`semoe.kernels.loader`) takes the best one that this CPU's flags say it runs, so an environment built on
one CPU runs on another without an illegal instruction, and a build this CPU cannot run is never
loaded. Torch-free and import-free: setup.py runs it before anything is installed.
"""

from __future__ import annotations

import platform
from typing import NamedTuple

X86_64 = ("x86_64", "AMD64", "amd64")


class Variant(NamedTuple):
    """One build of the kernels: its name (what `semoe env` and `torch_ops.isa()` say), the
    extension module it is installed as, its compiler flags on x86-64 (besides -O3 -fopenmp), and
    the CPU flags (as /proc/cpuinfo spells them) a CPU needs to run it."""
    name: str
    module: str
    x86_cflags: tuple[str, ...]
    cpu_flags: frozenset[str]


# F16C: the FP8 kernel widens codes through half precision
_AVX2 = ("-march=x86-64", "-mavx2", "-mfma", "-mf16c")
# best first: the loader takes the first one the CPU runs
VARIANTS = (
    Variant("avx512-vnni", "_kernels_avx512_vnni",
            _AVX2 + ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vbmi", "-mavx512vnni"),
            frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512vbmi", "avx512_vnni"})),
    Variant("avx2", "_kernels_avx2", _AVX2, frozenset({"avx2", "fma", "f16c"})),
    Variant("portable", "_kernels_portable", ("-march=x86-64",), frozenset()),
)
BY_NAME = {v.name: v for v in VARIANTS}


def buildable(machine: str | None = None) -> tuple[Variant, ...]:
    """The variants an install on `machine` (platform.machine()) builds: all three on x86-64, the
    portable one elsewhere."""
    machine = machine or platform.machine()
    return VARIANTS if machine in X86_64 else (BY_NAME["portable"],)


def cflags(variant: Variant, machine: str | None = None) -> list[str]:
    """The compiler flags of `variant` on `machine` (the vector flags are x86-64's only)."""
    return list(variant.x86_cflags) if (machine or platform.machine()) in X86_64 else []


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """This CPU's feature flags as Linux reports them (the kernel leaves out what the OS does not
    enable, such as AVX-512 state it does not save); empty where they cannot be read, which leaves
    the portable build only."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def runnable(flags: frozenset[str], machine: str | None = None) -> list[Variant]:
    """The variants a CPU with these flags runs, best first: those built on `machine` whose
    required flags it all has (the portable build needs none)."""
    return [v for v in buildable(machine) if v.cpu_flags <= flags]
