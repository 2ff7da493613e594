"""bench/bench_offload.py's arithmetic: the bound each offloaded run is held to (at the rate the store's
reader reached around it, and at the disk's plain rate), each front-end against its own compute, and
the configurations it refuses."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
sys.path.insert(0, BENCH)

import bench_offload as bo  # noqa: E402


def _run(tok_s: float, *, read: float, waited: float, gbps: float, warm: float | None = None) -> dict:
    r = {"decode_tok_s": tok_s, "ttft_s": 0.5, "ssd_bytes_per_token": read, "decode_ssd_bytes_per_token": read,
         "decode_wait_s_per_token": waited, "reader_gbps": gbps, "peak_rss_bytes": 1 << 30}
    if warm:
        r["warm_decode_tok_s"] = warm
    return r


def test_each_front_end_is_held_to_its_own_compute_and_the_readers_rate(capsys):
    results = {
        "disk": {"raw_gbps": 1.0, "direct_gbps": 2.0},
        "ours-100": _run(20.0, read=0, waited=0.0, gbps=2.0, warm=25.0),  # compute 40 ms a token
        "ours-25": _run(5.0, read=150e6, waited=0.120, gbps=2.5),  # 200 ms a token, 60 ms of reads at 2.5 GB/s
        "lean-100": _run(25.0, read=0, waited=0.0, gbps=2.0, warm=40.0),  # compute 25 ms a token
        "lean-25": _run(10.0, read=20e6, waited=0.05, gbps=2.0),  # 100 ms a token, reads 10 ms: compute-bound
    }
    bo.report(results, as_json=True)
    out = json.loads(capsys.readouterr().out)
    ours, lean = out["configs"]["ours-25"], out["configs"]["lean-25"]
    assert ours["reader_bound_s_per_token"] == pytest.approx(0.060)
    assert ours["vs_reader_bound"] == pytest.approx(0.200 / 0.060)
    assert ours["vs_bound"] == pytest.approx(0.200 / 0.150)  # 150 MB at the plain 1 GB/s
    assert ours["exposed_compute_s_per_token"] == pytest.approx(0.080)
    assert lean["reader_bound_s_per_token"] == pytest.approx(0.025)  # its own compute, not the engine's
    assert lean["vs_reader_bound"] == pytest.approx(0.100 / 0.025)
    assert out["lean_compute_s_per_token"] == pytest.approx(0.025)


@pytest.mark.parametrize("configs", ["lean-25-replay", "ours-0", "ours-125", "lean", "gpu-25"])
def test_an_unknown_configuration_is_refused_in_one_line(configs, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    monkeypatch.setattr(sys, "argv", ["bench_offload.py", "--workdir", str(work), "--configs", configs])
    with pytest.raises(SystemExit) as e:
        bo.main()
    assert e.value.code == 2
    assert f"unknown configuration {configs!r}" in capsys.readouterr().err
    assert not work.exists()  # refused before anything is made
