"""Every path of semoe/kernels/*.c against the same references: the install builds only the one for
this machine's CPU (-march=native), so the others are built here and the kernel tests (and the decode
plan's, which run the one-call step) run on each.

Portable loops (a baseline x86-64 build), AVX2 and FMA, and AVX-512 VNNI where this CPU runs it; each
build must say which path it took."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from helpers.procs import ROOT, child_env

SOURCES = [os.path.join(ROOT, "semoe", "kernels", f) for f in ("gemv.c", "gemv_float.c", "decode_step.c")]
FLAGS = {  # path -> compiler flags (besides -O3 -fopenmp -shared -fPIC)
    "portable": ["-march=x86-64"],
    "avx2": ["-march=x86-64", "-mavx2", "-mfma"],
    "avx512-vnni": ["-march=x86-64", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl",
                    "-mavx512vbmi", "-mavx512vnni"],
}
CPU_FLAGS = {"avx2": {"avx2", "fma"},
             "avx512-vnni": {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512vbmi", "avx512_vnni"}}


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return {w for line in f if line.startswith("flags") for w in line.split(":", 1)[1].split()}


@pytest.mark.slow  # a compiler run and the kernel tests once per path
@pytest.mark.parametrize("path", list(FLAGS))
def test_each_path_of_the_kernels_passes_the_kernel_tests(path, tmp_path):
    if not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
        pytest.skip("the kernels' vector paths are x86-64's")
    if not CPU_FLAGS.get(path, set()) <= _cpu_flags():
        pytest.skip(f"this CPU cannot run the {path} path")
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    assert cc, "no C compiler: the install builds the kernels with one"
    lib = str(tmp_path / f"kernels-{path}.so")
    subprocess.run([cc, "-O3", "-fopenmp", "-shared", "-fPIC", *FLAGS[path], "-I", sysconfig.get_paths()["include"],
                    *SOURCES, "-o", lib], check=True)
    env = child_env(SEMOE_CPU_KERNELS=lib)
    probe = subprocess.run([sys.executable, "-c", "from semoe import cpu_kernels; print(cpu_kernels.isa())"],
                           capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    assert probe.stdout.strip() == path
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *(os.path.join(ROOT, "tests", "semoe", t) for t in ("test_cpu_kernels.py", "test_decode_plan.py"))],
                         capture_output=True, text=True, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
