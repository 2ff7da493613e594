"""Shared fixtures: tiny HuggingFace MoE checkpoints written by transformers itself."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# spawned ranks import test modules as `tests.<package>.<module>`: the repository root must be on
# the path they inherit, whichever way pytest was started
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers.hf_models import make_hf_checkpoint  # noqa: E402

# matplotlib lists the system's fonts with `fc-list` (a process) the first time it is imported on a
# machine without its font cache, then caches them. Importing it here, as the session is set up and
# before any test's process guard (below) is in force, builds that cache on a fresh machine, so the
# tests that plot stay one process and the guard stays strict.
import matplotlib.font_manager  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    """Skip tests marked `cuda` on a machine without a CUDA device (torch is imported only then)."""
    marked = [item for item in items if item.get_closest_marker("cuda")]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in marked:
        item.add_marker(skip)


@pytest.fixture
def machine_without_gpu(monkeypatch):
    """The test's machine as one without a GPU: `--device auto` resolves to cpu and the placement
    finds no GPU driver, so that what is chosen for CPU memory is tested on a GPU machine too."""
    import torch

    import inference.placement

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(inference.placement, "gpu_present", lambda: False)


@pytest.fixture(scope="session")
def arch_stores(tmp_path_factory):
    """(arch, format) -> a store of a small random checkpoint of `arch` (helpers/arch_stores.py), made
    once a session: the kernels' tests and the servers' take the same ones."""
    from helpers.arch_stores import store_maker

    return store_maker(tmp_path_factory)


@pytest.fixture(scope="session")
def hf_mixtral_sharded_bf16(tmp_path_factory):
    """A Mixtral checkpoint in bfloat16, sharded into several files with an index."""
    return make_hf_checkpoint("mixtral", tmp_path_factory.mktemp("hf") / "mixtral", dtype="bfloat16",
                              max_shard_size="40KB")


@pytest.fixture(scope="session")
def hf_qwen2_moe(tmp_path_factory):
    """A Qwen2-MoE checkpoint (shared expert with its gate) in float32, one file."""
    return make_hf_checkpoint("qwen2_moe", tmp_path_factory.mktemp("hf") / "qwen2_moe")


@pytest.fixture(scope="session")
def hf_olmoe(tmp_path_factory):
    """An OLMoE checkpoint in float32, one file."""
    return make_hf_checkpoint("olmoe", tmp_path_factory.mktemp("hf") / "olmoe")


@pytest.fixture(autouse=True)
def _processes_only_in_slow_tests(request, monkeypatch):
    """A test outside the `slow` mark that starts a process fails at once, naming the call: the
    default suite stays one process (CI runs `-m slow` for the rest). `tests/test_structure.py`
    finds such tests from their sources; this finds them as they run, helpers and libraries
    included."""
    if request.node.get_closest_marker("slow"):
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process without the slow mark")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
