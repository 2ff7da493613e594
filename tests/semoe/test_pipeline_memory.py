"""MPress in pipeline training: a plan (recompute, host swap, D2D swap into the peer stage's shared
memory) changes where activations live, never the numbers; a budget is planned for and kept."""

from __future__ import annotations

import json
import os

import pytest
from helpers.dist import run_ranks

from mpress.profile import Decision, Plan, Stripe
from semoe.config import named_config
from tests.semoe.test_train import SHAPE, SHAPE_FLAGS, cli, log_losses, text_file  # noqa: F401

SHAPE4 = {**SHAPE, "num_layers": 4}
FLAGS4 = [*SHAPE_FLAGS[:SHAPE_FLAGS.index("--layers")], "--layers", "4",
          *SHAPE_FLAGS[SHAPE_FLAGS.index("--layers") + 2:]]
STEPS = 3


def _worker(rank: int, out: str, data: str, plan_json: str | None) -> None:
    from semoe.pipeline import PipelineConfig, PipelineTrainer
    from semoe.train_config import TrainConfig

    cfg = TrainConfig(out=out, data=data, steps=STEPS, batch_size=8, seq_len=32, micro_batches=4, warmup_steps=1)
    plan = Plan.from_json(plan_json) if plan_json else None
    trainer = PipelineTrainer(cfg, named_config("gpt-moe-small", **SHAPE4), PipelineConfig(schedule="gpipe", plan=plan))
    stats = None
    logs = []
    try:
        while trainer.step < cfg.steps:
            logs.append(trainer.train_step().loss)
            if trainer.executor is not None:
                stats = trainer.executor.stats()
    finally:
        trainer.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"losses": logs, "stats": stats.__dict__ if stats else None}, f)


def _run(tmp_path, name: str, text_file: str, plan: Plan | None) -> list[dict]:
    out = str(tmp_path / name)
    run_ranks(_worker, out, text_file, plan.to_json() if plan else None)
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]


def test_every_technique_in_a_two_stage_pipeline_keeps_the_numbers(tmp_path, text_file):
    plan = Plan(decisions=[
        Decision(stage=0, layer=0, technique="host"),
        Decision(stage=0, layer=1, technique="d2d", stripes=[Stripe(device=1, bytes=1)]),
        Decision(stage=1, layer=2, technique="recompute"),
        Decision(stage=1, layer=3, technique="d2d", stripes=[Stripe(device=0, bytes=1)]),
    ])
    plain = _run(tmp_path, "plain", text_file, None)
    planned = _run(tmp_path, "planned", text_file, plan)
    losses = [r["losses"] for r in plain if r["losses"]]
    assert losses and losses[0] == [r["losses"] for r in planned if r["losses"]][0]  # bit for bit
    s0, s1 = planned[0]["stats"], planned[1]["stats"]
    assert s0["host_bytes"] > 0 and s0["peer_bytes"] > 0  # stage 0 really swapped to host and to stage 1
    assert s1["recomputed"] > 0 and s1["peer_bytes"] > 0


def test_stage_memory_is_planned_for_and_changes_nothing(tmp_path, text_file):
    common = ["train", *FLAGS4, "--data", text_file, "--batch-size", "8", "--seq-len", "32", "--steps", "8",
              "--pipeline", "2", "--micro-batches", "4", "--schedule", "gpipe", "-q"]
    cli(*common, "--out", str(tmp_path / "free"), "--log-json", str(tmp_path / "free.log"))
    p = cli("-v", *common, "--out", str(tmp_path / "tight"), "--log-json", str(tmp_path / "tight.log"),
            "--stage-memory", "700KiB")
    assert "plan ['recompute']" in p.stderr or "plan ['host'" in p.stderr or "plan ['d2d'" in p.stderr, p.stderr
    free, tight = log_losses(str(tmp_path / "free.log")), log_losses(str(tmp_path / "tight.log"))
    assert free == tight and tight[-1] < tight[0] - 0.3


def test_a_budget_no_plan_fits_is_one_line_and_leaves_no_store(tmp_path, text_file):
    out = tmp_path / "run"
    p = cli("train", *FLAGS4, "--data", text_file, "--batch-size", "8", "--seq-len", "32", "--steps", "2",
            "--pipeline", "2", "--micro-batches", "4", "--schedule", "gpipe", "--stage-memory", "300KiB", "-q",
            "--out", str(out), check=False)
    assert p.returncode == 2
    errors = [line for line in p.stderr.splitlines() if line.startswith("semoe: error:")]
    assert errors and all("--stage-memory" in e and "no plan fits" in e for e in errors), p.stderr
    assert not (out / "store").exists()


@pytest.mark.parametrize("flags", [["--stage-memory", "1GiB"]])
def test_stage_memory_needs_a_pipeline(tmp_path, text_file, flags):
    p = cli("train", *FLAGS4, "--data", text_file, *flags, "--out", str(tmp_path / "r"), check=False)
    assert p.returncode == 2 and "--stage-memory" in p.stderr
