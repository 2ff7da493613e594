"""bench/bench_hybrid.py, the GPU check, runs end to end on CPU with --dry-run: every model is made,
imported and decoded with its experts on each side, and the table carries a figure in every column the
dry run can fill. The training part spawns runs of its own: it runs with the slow suite."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)

import bench_hybrid  # noqa: E402


def _run(tmp_path, capsys, parts: str) -> tuple[str, dict]:
    out = tmp_path / "report.json"
    assert bench_hybrid.main(["--workdir", str(tmp_path / "w"), "--dry-run", "--new-tokens", "4", "--threads", "1",
                              "--parts", parts, "--json", str(out)]) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_the_dry_run_decodes_every_model_on_every_side(tmp_path, capsys):
    table, report = _run(tmp_path, capsys, "cuda-tests,decode,accelerate,llama")
    assert report["cuda_tests"] == {"skipped": "dry run: no GPU"}
    assert report["llama_build"] == {"skipped": "dry run: no GPU"}
    assert all(r["skipped"] == "dry run: no GPU" for r in report["runs"] if r["mode"] in ("llama.cpp", "accelerate"))
    runs = [r for r in report["runs"] if r["mode"] in bench_hybrid.MODES]
    assert {(r["model"], r["mode"]) for r in runs} == {(m, mode) for m in bench_hybrid.MODELS
                                                       for mode in bench_hybrid.MODES}
    assert len(runs) == len(bench_hybrid.MODELS) * len(bench_hybrid.MODES) * len(bench_hybrid.DRY_CAPS)
    for r in runs:
        assert r["decode_tok_s"] > 0 and r["prefill_16_tok_s"] > 0 and r["prefill_64_tok_s"] > 0
        if r["mode"] == "device":
            assert "hybrid" not in r["stats"]
        else:
            assert r["bound_tok_s"] > 0 and set(r["bound_parts_s"]) == {"device", "cpu", "link"}
            assert "hybrid decode" in r["path"]
        if r["mode"] == "cpu":
            assert r["stats"]["hybrid"]["cpu_share"] == 1.0
    lines = [line for line in table.splitlines() if line.startswith("| gpt-oss-20b") or line.startswith("| qwen3")]
    assert len(lines) == len(bench_hybrid.MODELS) * len(bench_hybrid.DRY_CAPS) * 3  # decode and two prefills
    assert all(line.count("x |") >= 1 for line in lines)  # the hybrid against the better end, on every row


@pytest.mark.slow  # bench_train.py's runs are processes of their own
def test_the_dry_run_times_the_training_step(tmp_path, capsys):
    table, report = _run(tmp_path, capsys, "train")
    assert report["train"]["rc"] == 0, report["train"]
    assert "states on SSD / in device memory" in table
