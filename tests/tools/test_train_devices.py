"""Where `semoe train` puts its ranks, with a fake `torch.cuda`: one GPU per rank from LOCAL_RANK
(torchrun) or the spawn rank, made the current device; more ranks than GPUs and GPUs that do not
exist refused in one line; NCCL with gloo beside it for host tensors."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tools import train_cmd
from tools.cli import build_parser
from tools.cli_output import UsageError
from tools.train_cmd import claim_rank_device, process_group_backend, rank_device

TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--expert-ffn", "96",
        "--experts", "4", "--batch-size", "4", "--seq-len", "32", "--steps", "1", "-q"]


@pytest.fixture
def gpus(monkeypatch):
    """`gpus(n)`: torch.cuda reports n devices (0: none); returns the list set_device records."""
    current: list[int] = []

    def fake(n: int) -> list[int]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(torch.device(d).index))
        return current

    return fake


def test_process_group_keeps_a_cpu_backend_beside_nccl():
    assert process_group_backend("cuda") == process_group_backend("cuda:1") == "cpu:gloo,cuda:nccl"
    assert process_group_backend("cpu") == "gloo"


@pytest.mark.parametrize("count", [1, 2])
def test_a_lone_rank_runs_on_the_gpu_named(gpus, count):
    current = gpus(count)
    assert claim_rank_device("cuda", 0, 1) == "cuda:0"
    assert claim_rank_device(f"cuda:{count - 1}", 0, 1) == f"cuda:{count - 1}"
    assert current == [0, count - 1]
    assert claim_rank_device("cpu", 0, 1) == "cpu" and current == [0, count - 1]


def test_each_local_rank_takes_its_own_gpu(gpus):
    current = gpus(2)
    assert [claim_rank_device("cuda", r, 2) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert current == [0, 1]  # never two ranks on cuda:0
    assert rank_device("cuda:1", 0, 2) == "cuda:0"  # with several ranks the index is the rank's


@pytest.mark.parametrize("device, local_ranks, count, flag, message", [
    ("cuda", 2, 1, "--nproc", "--nproc 2 needs one GPU per rank, but this machine has 1; give --nproc 1 or less, "
                              "or --device cpu"),
    ("cuda", 3, 2, "--pipeline", "--pipeline 3 needs one GPU per rank, but this machine has 2; give --pipeline 2 "
                                 "or less, or --device cpu"),
    ("cuda:2", 1, 2, "--nproc", "--device cuda:2: this machine has 2 GPU(s), cuda:0 to cuda:1"),
    ("cuda", 1, 0, "--nproc", "--device cuda: CUDA is not available on this machine"),
])
def test_missing_gpus_are_refused_in_one_line(gpus, device, local_ranks, count, flag, message):
    current = gpus(count)
    with pytest.raises(UsageError) as e:
        claim_rank_device(device, 0, local_ranks, flag=flag)
    assert str(e.value) == message
    assert current == []


def test_under_torchrun_a_rank_takes_the_gpu_of_its_local_rank(gpus, monkeypatch, tmp_path):
    """LOCAL_RANK 1 of 2: cuda:1 is made current before the process group starts, the trainer is
    given cuda:1, and the group has gloo beside NCCL (the trainer's host numbers and objects)."""
    current = gpus(2)
    for k, v in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    started: list[str] = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend=None, **kw: started.append((backend, list(current))))
    given = []
    import semoe.train.trainer

    monkeypatch.setattr(semoe.train.trainer, "run_rank",
                        lambda cfg, model_cfg, quiet=False, source=None: given.append(cfg.device) or [])
    args = build_parser().parse_args(["train", "--out", str(tmp_path / "run"), "--device", "cuda", *TINY])
    assert train_cmd.run(args) == 0
    assert started == [("cpu:gloo,cuda:nccl", [1])]
    assert given == ["cuda:1"]


def test_spawning_more_ranks_than_gpus_is_refused_before_any_starts(gpus, monkeypatch, tmp_path):
    gpus(1)
    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "start_processes", lambda *a, **kw: pytest.fail("ranks were started"))
    args = build_parser().parse_args(["train", "--out", str(tmp_path / "run"), "--device", "cuda", "--nproc", "2",
                                      *TINY])
    with pytest.raises(UsageError, match=r"^--nproc 2 needs one GPU per rank, but this machine has 1;"):
        train_cmd.run(args)
    assert not os.path.exists(tmp_path / "run")
