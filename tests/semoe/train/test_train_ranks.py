"""Two gloo ranks in process: gradient accumulation over micro-batches with several ranks gives
the numbers of one rank accumulating the same global batch, and every collective gets its
tensors where the trainer computes (on the device, which NCCL needs) or, for host numbers and
objects, on the CPU."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.distributed as dist

from helpers.dist import run_ranks

from semoe.model.config import named_config
from semoe.train.trainer import Trainer
from semoe.train.config import TrainConfig

SHAPE = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_size=128, moe_ffn_size=96,
             num_experts=4, max_position=256)
STEPS = 3
GLOBAL_BATCH = 8
# float32, and the only difference between the runs is the order of reductions (all-reduce of
# averaged dense gradients, per-rank sums of expert gradients): relative 1e-4 per step.
REL = 1e-4


def _config(out: str, small_corpus: str, micro_batches: int) -> TrainConfig:
    return TrainConfig(out=out, data=small_corpus, steps=STEPS, batch_size=GLOBAL_BATCH, seq_len=32, warmup_steps=2,
                       lr=3e-3, micro_batches=micro_batches, checkpoint_every=100, expert_states="device")


_COLLECTIVES = ("all_reduce", "all_to_all_single", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")


def _guard_collectives(device: torch.device, seen: list[str]) -> None:
    """Wrap torch.distributed's tensor collectives: each tensor must be on `device`, except those
    sent over a gloo side group for host numbers (never the trainer's default NCCL group)."""
    for name in _COLLECTIVES:
        real = getattr(dist, name)

        def checked(*args, _real=real, _name=name, **kwargs):
            group = kwargs.get("group")
            host = group is not None and "gloo" in dist.get_backend_config(group)
            for t in list(args) + list(kwargs.values()):
                if isinstance(t, torch.Tensor):
                    want = torch.device("cpu") if host else device
                    if t.device != want:
                        raise AssertionError(f"{_name}: a tensor on {t.device}, the trainer computes on {want}")
            seen.append(_name)
            return _real(*args, **kwargs)

        setattr(dist, name, functools.wraps(real)(checked))


def _rank_worker(rank: int, out: str, small_corpus: str, log_path: str) -> None:
    cfg = _config(out, small_corpus, micro_batches=2)
    seen: list[str] = []
    _guard_collectives(torch.device(cfg.device), seen)
    trainer = Trainer(cfg, named_config("gpt-moe-small", **SHAPE))
    logs = trainer.run()
    assert {"all_reduce", "all_to_all_single"} <= set(seen), seen
    if rank == 0:
        with open(log_path, "w", encoding="utf-8") as f:
            json.dump([[x.loss, x.grad_norm] for x in logs], f)


@pytest.mark.slow  # two spawned ranks and a third run: about 20 s on two cores
def test_two_ranks_of_two_micro_batches_equal_one_rank_of_four(tmp_path, small_corpus):
    """The same global batch of 8: 2 ranks x 2 micro-batches x 2 sequences against 1 rank x 4 x 2.
    Dense gradients averaged over ranks must not be divided again (they were, by the world size,
    whenever micro-batches > 1, which shrank the gradient norm by half here)."""
    log_path = str(tmp_path / "two.json")
    run_ranks(_rank_worker, str(tmp_path / "two"), small_corpus, log_path)
    with open(log_path, encoding="utf-8") as f:
        two = json.load(f)
    trainer = Trainer(_config(str(tmp_path / "one"), small_corpus, micro_batches=4), named_config("gpt-moe-small", **SHAPE))
    one = [[x.loss, x.grad_norm] for x in trainer.run()]
    assert len(one) == len(two) == STEPS
    for step, ((loss1, norm1), (loss2, norm2)) in enumerate(zip(one, two), 1):
        assert loss2 == pytest.approx(loss1, rel=REL), f"step {step}: loss"
        assert norm2 == pytest.approx(norm1, rel=REL), f"step {step}: grad_norm"
