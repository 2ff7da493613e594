"""`pip install .` (not editable) into a fresh virtual environment gives a working `semoe`: every
subpackage and the compiled kernels land in the wheel, and the installed command trains, stores,
generates offloaded and decodes without torch from a directory that holds no source."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from helpers.procs import ROOT


def _fresh_venv(path) -> str:
    """A new environment without pip whose dependencies come from this one's site-packages through a
    path file (plain paths: that directory's own .pth files, the editable install's among them, are
    not read), so nothing is downloaded and nothing of the checkout is importable."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = str(path / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "semoe_test_deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.mark.slow  # a wheel build with the kernels, and three processes of the installed command
def test_a_non_editable_install_into_a_fresh_venv_runs(tmp_path):
    python = _fresh_venv(tmp_path / "venv")
    # pip builds in the source folder (build/, *.egg-info): a copy of the checkout's sources keeps
    # the checkout clean and shows the install needs nothing it left behind
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                             "*.so", ".pytest_cache"))
    res = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
                          "--no-build-isolation", "--disable-pip-version-check", str(src)],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    semoe = str(tmp_path / "venv" / "bin" / "semoe")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SEMOE_CPU_KERNELS")}
    probe = "import semoe.decode.plan, inference.torch_free.runner as r; print(r.__file__)"
    where = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path,
                           check=True).stdout
    assert where.startswith(str(tmp_path / "venv")), where  # the installed copy, not a source tree

    info = json.loads(subprocess.run([semoe, "env", "--json"], capture_output=True, text=True, env=env, cwd=tmp_path,
                                     check=True, timeout=300).stdout)
    assert info["cpu_kernels"] is not None, info["cpu_kernels_status"]  # the wheel carries a build

    work = tmp_path / "demo"
    res = subprocess.run([semoe, "demo", "--steps", "4", "--batch-size", "2", "--seq-len", "32",
                          "--max-new-tokens", "4", "--workdir", str(work), "--json"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout)["generate"]["tokens"] == 4

    store = next(p.parent for p in work.rglob("manifest.json"))
    res = subprocess.run([semoe, "generate", "--model", str(store), "--prompt-ids", "100,101,102,32",
                          "--max-new-tokens", "4", "--lean", "--json"], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(json.loads(res.stdout)["tokens"]) == 4, res.stdout
