"""The kernels' builds, each made here with a compiler as setup.py makes it (semoe/kernels/variants.py):
every build this CPU runs passes the kernel, decode-plan and torch-free runner tests and says which
path it took; a struct changed on the C side only fails at load in one line; and the install goes
on, in one line, without a C compiler or without OpenMP."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from helpers.procs import ROOT, child_env
from semoe.kernels import variants

KERNELS = os.path.join(ROOT, "semoe", "kernels")
SOURCES = tuple(sorted(f for f in os.listdir(KERNELS) if f.endswith(".c")))  # every one is in setup.py's build
TESTS = ("semoe/kernels/test_torch_ops.py", "semoe/decode/test_plan.py", "inference/torch_free/test_runner.py")


def _cc() -> str:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on PATH: the install has no compiled kernels to test")
    return cc


def _build(src_dir: str, variant: variants.Variant, out: str) -> str:
    subprocess.run([_cc(), "-O3", "-fopenmp", "-shared", "-fPIC", *variants.cflags(variant),
                    "-I", sysconfig.get_paths()["include"], *(os.path.join(src_dir, f) for f in SOURCES), "-o", out],
                   check=True)
    return out


@pytest.mark.slow  # a compiler run and the kernel tests once per build
@pytest.mark.parametrize("name", [v.name for v in variants.VARIANTS])
def test_each_build_of_the_kernels_passes_the_kernel_tests(name, tmp_path):
    variant = variants.BY_NAME[name]
    if variant not in variants.buildable():
        pytest.skip(f"the {name} build is x86-64's")
    if variant not in variants.runnable(variants.cpu_flags()):
        pytest.skip(f"this CPU cannot run the {name} build (lacks {sorted(variant.cpu_flags - variants.cpu_flags())})")
    env = child_env(SEMOE_CPU_KERNELS=_build(KERNELS, variant, str(tmp_path / f"kernels-{name}.so")))
    probe = subprocess.run([sys.executable, "-c", "from semoe.kernels import torch_ops; print(torch_ops.isa())"],
                           capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    assert probe.stdout.strip() == name
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                          *(os.path.join(ROOT, "tests", t) for t in TESTS)],
                         capture_output=True, text=True, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert " skipped" not in res.stdout.splitlines()[-1], res.stdout[-2000:]  # every one of them ran


@pytest.mark.slow  # a compiler run and a process that loads its build
def test_a_struct_changed_on_the_c_side_only_fails_at_load_in_one_line(tmp_path):
    src = tmp_path / "kernels"
    shutil.copytree(KERNELS, src)
    header = src / "decode_abi.h"
    text = header.read_text()
    assert text.count("    int64_t kind, O, I, g;\n") == 1
    header.write_text(text.replace("    int64_t kind, O, I, g;\n", "    int64_t kind, O, I, g, flags;\n"))
    lib = _build(str(src), variants.BY_NAME["portable"], str(tmp_path / "kernels-changed.so"))
    res = subprocess.run([sys.executable, "-m", "tools.cli", "env", "--json"], capture_output=True, text=True,
                         env=child_env(SEMOE_CPU_KERNELS=lib), cwd=ROOT, timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"semoe: error: {lib}: struct Lin is 64 bytes") and "but 56 bytes" in lines[0]


def _setup_build(tmp_path, **env: str) -> subprocess.CompletedProcess:
    """setup.py's build_ext into a directory of the test's, with `env` over this one's."""
    return subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
                           "--build-temp", str(tmp_path / "tmp")], capture_output=True, text=True, cwd=ROOT,
                          env=child_env(**env), timeout=600)


def _built(tmp_path) -> list[str]:
    return sorted(f for _, _, fs in os.walk(tmp_path / "lib") for f in fs if f.endswith(".so"))


@pytest.mark.slow  # setup.py in a process of its own
def test_the_install_goes_on_without_a_c_compiler_and_says_so_in_one_line(tmp_path):
    res = _setup_build(tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert res.returncode == 0, res.stderr
    said = [line for line in res.stderr.splitlines() if line.startswith("semoe:")]
    assert said == [f"semoe: compiled CPU kernels are off (no C compiler: {tmp_path}/no-such-cc is not on PATH): "
                    "decoding on CPU runs on torch's ops instead, about 2.4x slower per token, and "
                    "`semoe generate --lean` is unavailable"], res.stderr
    assert _built(tmp_path) == []


@pytest.mark.slow  # setup.py in a process of its own
def test_the_install_goes_on_with_a_compiler_without_openmp(tmp_path):
    cc = tmp_path / "cc-without-openmp"
    cc.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && {{ echo "unsupported: $a" >&2; exit 1; }}; done\n'
                  f'exec {_cc()} "$@"\n')
    cc.chmod(0o755)
    res = _setup_build(tmp_path, CC=str(cc), LDSHARED=f"{cc} -shared")
    assert res.returncode == 0, res.stderr
    said = [line for line in res.stderr.splitlines() if line.startswith("semoe:")]
    assert len(said) == 1 and said[0].startswith(f"semoe: compiled CPU kernels are off (the C compiler {cc} has no "
                                                 "OpenMP)"), res.stderr
    assert _built(tmp_path) == []


@pytest.mark.slow  # setup.py and the compiler
def test_the_install_builds_every_variant_of_this_machine(tmp_path):
    _cc()
    res = _setup_build(tmp_path)
    assert res.returncode == 0, res.stderr
    assert [line for line in res.stderr.splitlines() if line.startswith("semoe:")] == []
    want = sorted(v.module for v in variants.buildable())
    assert [f.split(".")[0] for f in _built(tmp_path)] == want


def test_setup_builds_every_c_file_of_the_kernels():
    """setup.py's source list is the folder's C files (a file left out links with missing symbols, which
    `loader.load` reports only when the library is loaded)."""
    import re

    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        text = f.read()
    listed = re.search(r"SOURCES = \[.*? for f in \((.*?)\)\]", text, re.S)
    assert listed is not None, "setup.py's SOURCES list moved: update this test"
    names = {f"{n}.c" for n in re.findall(r'"(\w+)"', listed.group(1))}
    assert names == set(SOURCES)
