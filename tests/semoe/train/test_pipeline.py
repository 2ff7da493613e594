"""Pipeline parallelism: stages chained by hand equal the whole model (router gradients included),
and `semoe train --pipeline 2` gives the single-rank trainer's losses and store, in GPipe and 1F1B
order, with expert states on SSD or on the device.

Tolerances (float32): losses 1e-5 relative; stores per kind, stated at each comparison (one stage
does the trainer's arithmetic in its order: bit for bit; two stages run on fewer threads each, which
splits matmuls' sums differently)."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.training import (SHAPE, SHAPE_FLAGS, Tol, assert_stores_close, checkpoint_step, cli, kill_mid_run,
                              log_losses, store_tensors)
from torch import nn
from torch.utils.checkpoint import checkpoint

from semoe.model.config import named_config
from semoe.train.expert_states import init_expert
from semoe.model.moe_gpt import MoEGPT
from semoe.train.pipeline import (PipelineConfig, PipelineTrainer, RouterLossMeter, StageModule, attach_loss,
                                  split_stages)
from semoe.train.trainer import Trainer, init_dense
from semoe.train.config import TrainConfig
from storage.errors import BadInputError
from storage.store import Store

SHAPE4 = {**SHAPE, "num_layers": 4}
FLAGS4 = [*SHAPE_FLAGS, "--layers", "4"]  # the last --layers wins
TRAIN = ["--batch-size", "8", "--seq-len", "32", "--steps", "12", "--checkpoint-every", "6", "--lr", "3e-3", "-q"]


def config4(**kw):
    return named_config("gpt-moe-small", **{**SHAPE4, **kw})


# -- pieces -------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers, stages, want", [
    (4, 2, [(0, 2), (2, 4)]), (5, 2, [(0, 3), (3, 5)]), (7, 3, [(0, 3), (3, 5), (5, 7)]),
    (3, 3, [(0, 1), (1, 2), (2, 3)]), (4, 1, [(0, 4)])])
def test_split_stages_is_contiguous_with_extra_layers_first(layers, stages, want):
    got = split_stages(config4(num_layers=layers), stages)
    assert [(r.start, r.stop) for r in got] == want


@pytest.mark.parametrize("stages", [0, 5])
def test_split_stages_rejects_more_stages_than_layers(stages):
    with pytest.raises(BadInputError, match=rf"--pipeline must be in 1\.\.4 .*got {stages}"):
        split_stages(config4(), stages)


def test_attach_loss_passes_the_gradient_and_scales_the_loss():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn((), requires_grad=True)
    y = attach_loss(x, w * 2.0, 0.25)
    assert torch.equal(y, x)
    dy = torch.randn(3, 4)
    y.backward(dy)
    assert torch.equal(x.grad, dy)
    assert float(w.grad) == 0.5  # d(w * 2)/dw times 0.25


def _resident_model(config, seed=0) -> MoEGPT:
    model = MoEGPT(config)
    init_dense(model, seed)
    with torch.no_grad():
        for ffn in model.moe_layers():
            for e in range(config.num_experts):
                for dst, src in zip((ffn.experts.w_gate, ffn.experts.w_up, ffn.experts.w_down),
                                    init_expert(config, seed, ffn.layer, e)):
                    dst[e].copy_(src)
    return model.train()


def _recompute(layer: int, block: nn.Module) -> nn.Module:
    """An executor's wrap that recomputes the block in backward (what mpress's "recompute" does)."""

    class Recomputed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = block

        def forward(self, *args):
            return checkpoint(self.block, *args, use_reentrant=False)

    return Recomputed()


@pytest.mark.parametrize("wrap", [None, _recompute], ids=["plain", "recompute"])
def test_two_stages_by_hand_equal_the_whole_model(wrap):
    """Stage 0 then stage 1, the activation's gradient carried back by hand, over two micro-batches:
    the same loss, router losses and gradient of every parameter (routers and experts included)
    as `(ce + aux_coef * aux + z_coef * z) / 2` of the whole model, summed over the micro-batches."""
    config = config4()
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (4, 16))
    tgt = torch.randint(0, config.vocab_size, (4, 16))
    M = 2
    whole = _resident_model(config)
    ref_ce, ref_aux = [], []
    for mb_ids, mb_tgt in zip(ids.chunk(M), tgt.chunk(M)):
        out = whole(mb_ids)
        ce = F.cross_entropy(out.logits.reshape(-1, config.vocab_size), mb_tgt.reshape(-1))
        ((ce + config.aux_loss_coef * out.aux_loss + config.z_loss_coef * out.z_loss) / M).backward()
        ref_ce.append(float(ce.detach()))
        ref_aux.append(float(out.aux_loss.detach()))
    ref_grads = {n: p.grad.clone() for n, p in whole.named_parameters()}

    model = _resident_model(config)
    meters = [RouterLossMeter(), RouterLossMeter()]
    ranges = split_stages(config, 2)
    stages = [StageModule(model, ranges[s], first=s == 0, last=s == 1, loss_scale=1 / M, meter=meters[s], wrap=wrap)
              for s in range(2)]
    ce_sum = 0.0
    for mb_ids, mb_tgt in zip(ids.chunk(M), tgt.chunk(M)):
        h = stages[0](mb_ids)
        h_in = h.detach().requires_grad_()
        logits = stages[1](h_in)
        ce = F.cross_entropy(logits.reshape(-1, config.vocab_size), mb_tgt.reshape(-1))
        (ce / M).backward()
        h.backward(h_in.grad)
        ce_sum += float(ce.detach())
    assert ce_sum / M == pytest.approx(sum(ref_ce) / M, rel=1e-6)
    aux = [m.take()[0] for m in meters]
    assert all(a > 0 for a in aux)  # each stage saw its own MoE layers' losses
    assert sum(aux) / M == pytest.approx(sum(ref_aux) / M, rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    # the store names come from the stages' own parameter names: the model's, whatever the wrapper
    names = {n for s in stages for n, _ in s.named_parameters()}
    assert names == set(ref_grads)


def test_one_stage_with_a_plan_wraps_every_block_and_matches_the_trainer(tmp_path, text_file):
    """A plan is handed to the executor factory once per stage, every block is wrapped (here:
    recomputed in backward), and a one-stage pipeline gives the single-rank trainer's numbers."""
    common = dict(data=text_file, steps=4, batch_size=4, seq_len=32, warmup_steps=2, micro_batches=2,
                  expert_states="device", checkpoint_every=4)
    want = [(x.loss, x.aux_loss) for x in Trainer(TrainConfig(out=str(tmp_path / "one"), **common), config4()).run()]
    calls, wrapped = [], []

    class FakeExecutor:
        def __init__(self, plan, stage, device):
            calls.append((plan, stage, device))

        def wrap(self, layer, block):
            wrapped.append(layer)
            return _recompute(layer, block)

    plan = object()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        trainer = PipelineTrainer(TrainConfig(out=str(tmp_path / "pipe"), **common), config4(),
                                  PipelineConfig(schedule="gpipe", plan=plan), executor_factory=FakeExecutor)
        got = [(x.loss, x.aux_loss) for x in trainer.run()]
    finally:
        dist.destroy_process_group()
    assert calls == [(plan, 0, torch.device("cpu"))] and wrapped == [0, 1, 2, 3]
    assert [x[0] for x in got] == pytest.approx([x[0] for x in want], rel=1e-5)
    assert [x[1] for x in got] == pytest.approx([x[1] for x in want], rel=1e-5)
    # one stage accumulates the micro-batches in the trainer's order and recomputation replays the
    # same float32 ops: every kind is bit for bit
    exact = Tol(rtol=0, atol=0)
    assert_stores_close(store_tensors(str(tmp_path / "pipe" / "store")), store_tensors(str(tmp_path / "one" / "store")),
                        {"weight": exact, "adam_m": exact, "adam_v": exact})


def test_a_stage_rejects_tied_embeddings():
    model = MoEGPT(config4(tie_embeddings=True))
    with pytest.raises(BadInputError, match="untied embeddings"):
        StageModule(model, range(0, 2), first=True, last=False)


# -- the command line: two real ranks -------------------------------------------------------------


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory, text_file):
    """The single-rank trainer's run directory with --micro-batches M (made once per M)."""
    runs = {}

    def get(M: int):
        if M not in runs:
            out = tmp_path_factory.mktemp(f"single{M}")
            cli("train", *FLAGS4, "--data", text_file, *TRAIN, "--micro-batches", str(M),
                "--out", str(out / "run"), "--log-json", str(out / "log"))
            runs[M] = out
        return runs[M]

    return get


@pytest.mark.parametrize("schedule, M, states", [("gpipe", 2, "ssd"), ("1f1b", 4, "ssd"), ("1f1b", 2, "device")])
@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_two_stages_match_one_rank(tmp_path, text_file, single_rank, schedule, M, states):
    """Same seed, float32: the per-step losses of the single-rank trainer with the same micro-batches,
    a store holding the same tensors (dense from both stages, experts of all layers with their
    moments), the loss falling, and `semoe generate` serving the store."""
    ref = single_rank(M)  # expert states on SSD and on the device give identical numbers (test_train)
    out = tmp_path / "pipe"
    cli("train", *FLAGS4, "--data", text_file, *TRAIN, "--micro-batches", str(M), "--pipeline", "2",
        "--schedule", schedule, "--expert-states", states, "--out", str(out), "--log-json", str(tmp_path / "log"))
    one, two = log_losses(str(ref / "log")), log_losses(str(tmp_path / "log"))
    assert len(one) == len(two) == 12
    assert two == pytest.approx(one, rel=1e-5)
    assert sum(two[-3:]) / 3 < two[0] - 0.5, two
    with open(tmp_path / "log", encoding="utf-8") as f:
        entry = json.loads(f.readline())
    assert entry["aux_loss"] > 0 and entry["schedule"] == schedule and entry["stages"] == 2
    a, b = store_tensors(str(ref / "run" / "store")), store_tensors(str(out / "store"))
    assert any(k[1] == "adam_v" for k in a)
    # Each stage's process computes with half the cores' threads, the single rank with all of them,
    # so matmuls split their sums differently (on one thread everywhere the stores are identical).
    # Worst measured over the three schedules: weight 9.5e-8 absolute, adam_m 3.6 ulps of its
    # tensor's largest, adam_v 7e-6 relative.
    tolerances = {
        # Adam scales a near-zero gradient's rounding up to a fraction of lr (3e-3), whatever the weight
        "weight": Tol(rtol=1e-5, atol=3e-7),
        # a sum of gradients that cancel is off by ulps of its largest term, not of itself
        "adam_m": Tol(rtol=1e-5, ulps_of_max=12),
        # squares do not cancel: relative only, as the values span 1e-13..1e-6
        "adam_v": Tol(rtol=2e-5),
    }
    assert_stores_close(b, a, tolerances)
    args = ["--prompt", "def main(", "--max-new-tokens", "8", "--json"]
    gen = json.loads(cli("generate", "--model", str(out / "store"), *args).stdout)
    want = json.loads(cli("generate", "--model", str(ref / "run" / "store"), *args).stdout)
    assert len(gen["tokens"]) == 8 and gen["tokens"] == want["tokens"]


def _optimizer_states(store) -> dict:
    import io

    return torch.load(io.BytesIO(Store.open(str(store)).read_file("pipeline_optimizer.pt")), weights_only=False)


@pytest.mark.parametrize("states", ["ssd", "device"])
@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_sigkill_then_resume_a_pipeline_run_is_bit_exact(tmp_path, text_file, states):
    common = ["train", *FLAGS4, "--data", text_file, "--batch-size", "8", "--seq-len", "32", "--steps", "12",
              "--checkpoint-every", "2", "--lr", "3e-3", "-q", "--pipeline", "2", "--schedule", "gpipe",
              "--micro-batches", "2", "--expert-states", states]
    straight = tmp_path / "straight"
    cli(*common, "--out", str(straight))
    killed = tmp_path / "killed"
    stopped_at = kill_mid_run(common, killed, "pipeline.json", after_step=4, timeout_s=240)
    assert 4 <= stopped_at < 12, f"the run was not killed mid-way (checkpoint at step {stopped_at})"
    assert Store.open(str(killed / "store")).verify() == []
    cli("train", "--out", str(killed), "--resume", "--pipeline", "2", "-q")  # the run's own settings
    assert checkpoint_step(killed / "store", "pipeline.json") == 12
    a, b = store_tensors(str(straight / "store")), store_tensors(str(killed / "store"))
    assert a.keys() == b.keys() and any(k[1] == "adam_v" for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    oa, ob = _optimizer_states(straight / "store"), _optimizer_states(killed / "store")
    for sa, sb in zip(oa["stages"], ob["stages"]):
        for i, s in sa["state"].items():
            for name in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(s[name], sb["state"][i][name]), (i, name)
    # resuming with another number of stages, or without --pipeline, is refused in one line
    for flags, message in ((["--pipeline", "3"], "trained with --pipeline 2"),
                           ([], "a pipeline run; resume it with --pipeline N")):
        p = cli("train", "--out", str(killed), "--resume", "--steps", "14", *flags, check=False)
        assert p.returncode == 2 and message in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert checkpoint_step(killed / "store", "pipeline.json") == 12


@pytest.mark.parametrize("flags, message", [
    (["--pipeline", "2", "--nproc", "2"], "--pipeline and --nproc > 1 cannot be combined"),
    (["--pipeline", "2", "--resume"], r"--resume: .* has no checkpoint to resume from"),
    (["--schedule", "gpipe"], "--schedule and --stage-memory apply to pipeline runs only"),
    (["--pipeline", "5"], r"--pipeline must be in 1\.\.4"),
    (["--pipeline", "2", "--micro-batches", "1"], "--schedule 1f1b needs --micro-batches >= the 2 stages, got 1"),
    (["--pipeline", "2", "--micro-batches", "3", "--schedule", "gpipe"], "--batch-size 8 must divide by"),
])
@pytest.mark.slow  # starts processes
def test_bad_pipeline_flags_are_one_line_errors(tmp_path, text_file, flags, message):
    p = cli("train", *FLAGS4, "--data", text_file, *TRAIN, *flags, "--out", str(tmp_path / "run"), check=False)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("semoe: error: "), p.stderr
    assert re.search(message, lines[0]), lines[0]
    assert not (tmp_path / "run" / "store").exists()
