"""`semoe store ...` run as a real subprocess: outputs, JSON, exit codes and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.hf_models import assert_bit_exact, load_safetensors_dir
from helpers.procs import ROOT, child_env



def semoe(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = child_env()
    res = subprocess.run([sys.executable, "-m", "tools.cli", *args], capture_output=True, text=True, env=env,
                         cwd=ROOT)
    if check and res.returncode != 0:
        raise AssertionError(f"semoe {' '.join(args)} exited {res.returncode}: {res.stderr}")
    return res


@pytest.fixture(scope="module")
def store(hf_mixtral_sharded_bf16, tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "store"
    res = semoe("store", "import", str(hf_mixtral_sharded_bf16), str(path), "--json")
    info = json.loads(res.stdout)
    assert info["version"] == 1 and info["experts_per_layer"] == {"0": 4, "1": 4}
    return path


@pytest.mark.slow  # starts processes
def test_import_export_round_trip(store, hf_mixtral_sharded_bf16, tmp_path):
    semoe("store", "export", str(store), str(tmp_path / "out"))
    assert_bit_exact(load_safetensors_dir(hf_mixtral_sharded_bf16), load_safetensors_dir(tmp_path / "out"))


@pytest.mark.slow  # CLI runs of several seconds: CI runs them
def test_info_and_ls(store):
    info = json.loads(semoe("store", "info", str(store), "--json").stdout)
    assert info["architecture"] == "MixtralForCausalLM" and info["layers"] == 2 and info["moe_layers"] == 2
    assert info["dtypes"] == ["BF16"] and info["expert_bytes"] > 0 and info["dense_bytes"] > 0
    listing = json.loads(semoe("store", "ls", str(store), "--json").stdout)
    experts = [t for t in listing["tensors"] if t["group"] == "expert"]
    assert len(experts) == 2 * 4 * 3
    assert {(t["layer"], t["expert"]) for t in experts} == {(l, e) for l in range(2) for e in range(4)}
    text = semoe("store", "info", str(store)).stdout
    assert "MixtralForCausalLM" in text and "version       1" in text


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_verify_ok_then_names_the_bad_tensor(store, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    res = semoe("store", "verify", str(copy), "--json")
    assert json.loads(res.stdout)["ok"] is True
    listing = json.loads(semoe("store", "ls", str(copy), "--json").stdout)["tensors"]
    victim = next(t for t in listing if t["name"].endswith("layers.1.block_sparse_moe.experts.2.w3.weight"))
    entry_offset = next(t for t in json.loads((copy / "manifest.json").read_text())["tensors"]
                        if t["name"] == victim["name"])["offset"]
    with open(copy / victim["file"], "r+b") as f:
        f.seek(entry_offset + 3)
        b = f.read(1)
        f.seek(entry_offset + 3)
        f.write(bytes([b[0] ^ 1]))
    res = semoe("store", "verify", str(copy), "--json", check=False)
    assert res.returncode == 1
    out = json.loads(res.stdout)
    assert out["ok"] is False and [p["tensor"] for p in out["problems"]] == [victim["name"]]
    res = semoe("store", "verify", str(copy), check=False)
    assert res.returncode == 1 and f"BAD {victim['name']}: checksum mismatch" in res.stderr


@pytest.mark.slow  # CLI runs of several seconds: CI runs them
def test_gc_after_import_removes_nothing_needed(store):
    res = json.loads(semoe("store", "gc", str(store), "--json").stdout)
    assert res["version"] == 1
    assert json.loads(semoe("store", "verify", str(store), "--json").stdout)["ok"] is True


@pytest.mark.slow  # CLI runs of several seconds: CI runs them
def test_bench_reads_every_expert_file_once_per_reader(store):
    """The throughputs are timings (bench/bench_store.py's business); what can be checked is that
    the bench read exactly the expert chunk files: 2 layers x 4 experts, as large as they are on disk."""
    from storage.read_throughput import _direct_ok
    from storage.store import Store

    files = {c.file for c in Store.open(str(store)).manifest.chunks}
    on_disk = sum(os.path.getsize(store / f) for f in files)
    for extra in ([], ["--cold"]):
        out = json.loads(semoe("store", "bench", str(store), "--json", "--repeats", "1", *extra).stdout)
        assert out["files"] == len(files) == 8 and out["bytes"] == on_disk
        assert out["store_gbps"] > 0 and out["raw_gbps"] > 0 and out["tensorstore_gbps"] > 0
        assert out["cold"] is bool(extra) and out["mode"] == ("direct" if extra else "cached")
        assert out["verified"] is True and out["repeats"] == 1
        # cold, the hot path is held to the faster of the two plain reads (buffered, and O_DIRECT as dd)
        if extra and _direct_ok(str(store / next(iter(files)))):
            assert out["raw_direct_gbps"] > 0 and out["raw_direct_one_buffer_gbps"] > 0
        else:  # warm, or a file system without O_DIRECT
            assert out["raw_direct_gbps"] is None and out["raw_direct_one_buffer_gbps"] is None
        assert out["ratio"] == pytest.approx(out["store_gbps"] / max(out["raw_gbps"], out["raw_direct_gbps"] or 0))


@pytest.mark.slow  # CLI runs of several seconds: CI runs them
def test_cache_sim(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"layer": 0, "experts": e} for e in ([0, 1], [2, 0], [1, 3], [0, 2], [0, 1], [3, 2])]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = json.loads(semoe("store", "cache-sim", "--trace", str(trace), "--capacity", "3", "--json").stdout)
    assert sorted(out) == ["belady", "lfu", "lfu-aging", "lru", "next-use"]
    for r in out.values():
        assert r["hits"] + r["misses"] == 12 and r["hit_rate"] == pytest.approx(r["hits"] / 12)
    assert out["belady"]["hits"] >= max(r["hits"] for r in out.values())
    one = json.loads(semoe("store", "cache-sim", "--trace", str(trace), "--capacity", "3", "--policy", "lru",
                           "--json").stdout)
    assert list(one) == ["lru"] and one["lru"] == out["lru"]


@pytest.mark.parametrize("args, message", [
    (["store", "info", "{tmp}"], "not a semoe store (no manifest.json)"),
    (["store", "import", "{tmp}", "{tmp}/s"], "config.json: missing"),
    (["store", "cache-sim", "--trace", "{tmp}/nope.jsonl", "--capacity", "2"], "nope.jsonl"),
    (["store", "cache-sim", "--trace", "{tmp}/t.jsonl", "--capacity", "2", "--policy", "fifo"], "--policy must be"),
])
@pytest.mark.slow  # starts processes
def test_bad_input_gives_one_line_and_exit_2(tmp_path, args, message):
    (tmp_path / "t.jsonl").write_text('{"layer": 0, "experts": [1]}\n')
    res = semoe(*[a.format(tmp=tmp_path) for a in args], check=False)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("semoe: error: ") and message in lines[0], res.stderr
    assert res.stdout == ""


@pytest.mark.slow  # starts processes
def test_import_refuses_an_unsupported_architecture_in_one_line(tmp_path):
    (tmp_path / "ck").mkdir()
    for config, message in (({"model_type": "mamba"}, "unknown architecture model_type='mamba'; supported: "),
                            # a model type it takes, from a config without the fields it is built from
                            ({"model_type": "qwen3_next"}, "field 'num_hidden_layers' is missing")):
        (tmp_path / "ck" / "config.json").write_text(json.dumps(config))
        res = semoe("store", "import", str(tmp_path / "ck"), str(tmp_path / "s"), check=False)
        assert res.returncode == 2 and res.stdout == ""
        lines = res.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"semoe: error: {tmp_path / 'ck' / 'config.json'}: ")
        assert message in lines[0], lines
        assert not (tmp_path / "s").exists()


@pytest.mark.slow  # starts processes
def test_import_into_non_empty_target_is_refused(hf_olmoe, tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "mine.txt").write_text("x")
    res = semoe("store", "import", str(hf_olmoe), str(tmp_path / "s"), check=False)
    assert res.returncode == 2 and "target directory is not empty" in res.stderr
    assert os.listdir(tmp_path / "s") == ["mine.txt"]


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_help_explains_every_subcommand():
    for sub in ("import", "export", "ls", "info", "verify", "gc", "bench", "cache-sim"):
        res = semoe("store", sub, "--help")
        assert "usage: semoe store " + sub in res.stdout
