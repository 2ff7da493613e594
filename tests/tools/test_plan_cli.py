"""`semoe plan`: the MPress plan of a model described on the command line, as JSON and as a trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test runs the command in a process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT = ["--arch", "gpt", "--layers", "32", "--hidden", "4096", "--heads", "32", "--seq", "2048", "--micro-batch", "1",
       "--micro-batches", "16", "--vocab", "50257", "--gpus", "8", "--topology", "dgx1"]


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.cli", "plan", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_json_holds_every_field_and_the_plan_fits_the_memory(tmp_path):
    trace = tmp_path / "step.json"
    p = plan(*GPT, "--gpu-memory", "32GiB", "--json", "--trace", str(trace))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert {"step_time_s", "peak_bytes", "recompute_bytes", "host_swap_bytes", "d2d_swap_bytes", "mapping",
            "fits"} <= out.keys()
    assert out["fits"] is True and len(out["peak_bytes"]) == 8 and sorted(out["mapping"]) == list(range(8))
    assert max(out["peak_bytes"]) <= 32 * 2**30
    assert out["recompute_bytes"] + out["host_swap_bytes"] + out["d2d_swap_bytes"] > 0  # 32 GiB needs compaction
    doc = json.loads(trace.read_text())
    events = doc["traceEvents"]
    assert any(e["ph"] == "X" and e["dur"] > 0 for e in events) and any(e["ph"] == "C" for e in events)
    assert {e["pid"] for e in events if e["ph"] == "X"} == set(range(8))
    assert (tmp_path / "step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_roomy_gpus_need_no_compaction_and_moe_is_accepted():
    p = plan(*GPT, "--gpu-memory", "1000GiB", "--experts", "8", "--top-k", "2", "--schedule", "gpipe", "--json")
    out = json.loads(p.stdout)
    assert p.returncode == 0 and out["fits"]
    assert out["recompute_bytes"] == out["host_swap_bytes"] == out["d2d_swap_bytes"] == 0


def test_a_model_that_cannot_fit_says_why_and_exits_1():
    p = plan(*GPT, "--gpu-memory", "1GiB", "--json")
    out = json.loads(p.stdout)
    assert p.returncode == 1 and out["fits"] is False and "device" in out["reason"]


def test_bad_flags_are_one_line_errors():
    for args, flag in ((["--gpu-memory", "lots"], "--gpu-memory"), (["--gpu-memory", "32GiB", "--experts", "2", "--top-k", "3"],
                                                                      "--top-k")):
        p = plan(*GPT, *args)
        assert p.returncode == 2 and flag in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_trace_slices_on_one_thread_never_partly_overlap(tmp_path):
    """Perfetto keeps only slices that nest on a thread: overlapping transfers get lanes of their own."""
    trace = tmp_path / "t.json"
    p = plan(*GPT, "--gpu-memory", "24GiB", "--json", "--trace", str(trace))
    assert p.returncode in (0, 1), p.stderr
    by_thread: dict = {}
    for e in json.loads(trace.read_text())["traceEvents"]:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    assert by_thread
    for spans in by_thread.values():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end - 1e-3
