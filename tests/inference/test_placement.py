"""Where `semoe generate` puts the experts when the user names no budget: resident where the model's
bytes fit the memory available, behind an auto-sized CPU cache where they do not; said in one line
on stderr with the decoding path, and the same tokens either way."""

from __future__ import annotations

import json
import math

import pytest
from helpers.hf_models import make_hf_checkpoint
from helpers.kernels import needs_kernels

import inference.placement
from inference.memory_guard import CPU_CACHE_AUTO
from inference.placement import choose, model_bytes
from semoe.checkpoints.hf_convert import import_checkpoint
from semoe.checkpoints.quantize_store import QuantizeConfig, quantize_store
from storage.store import Store
from tools.cli import main


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A bfloat16 transformers checkpoint of qwen3_moe, its store and the store's int8 experts."""
    root = tmp_path_factory.mktemp("placement")
    hf = make_hf_checkpoint("qwen3_moe", root / "hf", dtype="bfloat16", seed=3, hidden_size=64,
                            moe_intermediate_size=64)
    import_checkpoint(str(hf), str(root / "store"))
    quantize_store(str(root / "store"), str(root / "int8"), QuantizeConfig(bits=8))
    return {"hf": str(hf), "store": str(root / "store"), "int8": str(root / "int8")}


def test_model_bytes_count_float_tensors_in_the_compute_dtype_and_compact_ones_as_stored(models):
    """A bfloat16 checkpoint held in float32 takes twice its weights' bytes; int8 experts take their codes
    and scales as stored. The directory and its store count alike."""
    store = Store.open(models["store"])
    numel = sum(math.prod(t.shape) for t in store.manifest.tensors)
    expert_numel = sum(math.prod(t.shape) for t in store.manifest.tensors if t.group == "expert")
    mb = model_bytes(models["store"])
    assert (mb.total, mb.experts) == (4 * numel, 4 * expert_numel)
    assert (mb.stored, mb.stored_experts) == (2 * numel, 2 * expert_numel)  # what a load reads: bfloat16
    assert model_bytes(models["hf"]) == mb
    assert model_bytes(models["store"], compute_itemsize=2).total == 2 * numel
    q = Store.open(models["int8"])
    compact = sum(t.bytes for t in q.manifest.tensors if t.group == "expert")
    assert compact < expert_numel * 2  # one byte a weight and a scale a row
    assert model_bytes(models["int8"]).experts == compact


def test_choose_keeps_the_model_resident_only_where_it_fits_beside_the_reserve(models):
    total = model_bytes(models["store"]).total
    roomy = choose(models["store"], available=lambda: 4 * total + (64 << 20))
    assert roomy.cpu_cache is None and "every expert resident" in roomy.describe()
    short = choose(models["store"], available=lambda: total)  # the reserve does not fit beside it
    assert short.cpu_cache == CPU_CACHE_AUTO and "offloaded" in short.describe()
    kv = choose(models["store"], available=lambda: 4 * total + (64 << 20), keep_bytes=32 << 20)
    assert kv.cpu_cache == CPU_CACHE_AUTO  # a server's KV memory comes out of what is available


@needs_kernels
def test_generate_without_flags_chooses_says_so_and_gives_the_same_tokens(models, monkeypatch, capsys,
                                                                         machine_without_gpu):
    """No flag: resident with the memory this machine has; with MemAvailable made smaller than the model,
    the torch-free runner, or where a flag asks for the engine (here its cache policy), the engine
    offloaded behind an auto CPU cache. Each run prints the one line naming the choice (and, for the
    engine, the decoding path: the fast kernels, qwen3_moe's whole step in one call resident, kernel
    by kernel offloaded, since its experts arrive during the step), and all give the same tokens."""
    args = ["generate", "--model", models["store"], "--prompt-ids", "3,17,5,29", "--max-new-tokens", "6", "--json",
            "--ignore-eos"]
    outs, lines = [], []
    short = model_bytes(models["store"]).total // 2
    for available, extra in ((None, []), (short, ["--cache-policy", "lfu"]), (short, [])):
        if available is not None:
            monkeypatch.setattr(inference.placement, "available_ram_bytes", lambda: available)
        assert main(args + extra) == 0
        out, err = capsys.readouterr()
        outs.append(json.loads(out))
        lines.append([line for line in err.splitlines() if line.startswith("semoe: ")])
    assert len(lines[0]) == 1 and "every expert resident" in lines[0][0]
    assert len(lines[1]) == 1 and "offloaded to the store behind a CPU cache" in lines[1][0]
    assert len(lines[2]) == 1 and "decoding in a process without torch" in lines[2][0]
    assert "semoe's CPU kernels, the whole step in one call" in lines[0][0]
    assert "semoe's CPU kernels, kernel by kernel" in lines[1][0] and "experts not all in memory" in lines[1][0]
    assert "stats" in outs[1] and "stats" not in outs[0]  # the offloaded engine reports its tiers
    assert outs[0]["tokens"] == outs[1]["tokens"] == outs[2]["tokens"]


def test_resident_with_a_budget_flag_is_one_usage_error(models, capsys):
    assert main(["generate", "--model", models["store"], "--prompt-ids", "1,2", "--resident", "--cpu-cache", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert "--resident keeps every expert in memory: --cpu-cache offloads them" in err


@pytest.mark.parametrize("which", ["store", "int8", "hf"])
def test_a_load_reports_every_byte_it_reads(models, which):
    """The progress a resident load reports adds up to the model's bytes as stored: each tensor read once
    (int8 experts' chunks, dense weights quantized block by block as they are read, or a directory's
    tensors)."""
    from semoe.checkpoints.model_io import load_model

    seen: list[int] = []
    load_model(models[which], progress=seen.append)
    assert sum(seen) == model_bytes(models[which]).stored and len(seen) > 1


def test_on_a_gpu_the_choice_weighs_the_free_device_memory(models, monkeypatch):
    """device cuda: what is available is torch.cuda.mem_get_info's free bytes (a fake here, as on a machine
    without a GPU the line that asks it would otherwise run first on a user's GPU)."""
    import torch

    total = model_bytes(models["store"]).total
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: asked.append(dev) or (4 * total + (64 << 20), 1 << 40))
    roomy = choose(models["store"], device="cuda:0")
    assert asked == [torch.device("cuda:0")] and roomy.where == "device memory" and roomy.cpu_cache is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (total // 2, 1 << 40))
    assert choose(models["store"], device="cuda:0").cpu_cache == CPU_CACHE_AUTO
