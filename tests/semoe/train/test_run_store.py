"""A run's store opened once per rank: what it answers, and that a trainer opens it once."""

from __future__ import annotations

import json

import pytest
from helpers.store_opens import record_store_opens
from helpers.training import tiny_config

from semoe.checkpoints.model_io import hf_config
from semoe.train.run_store import PIPELINE_FILE, TRAINER_FILE, RunStore
from semoe.train.trainer import Trainer
from semoe.train.config import TrainConfig, TrainingError
from storage.errors import BadInputError
from storage.store import Store


def _store(root, files: dict[str, dict]) -> RunStore:
    s = Store.create(str(root))
    with s.writer() as w:
        w.put_file("config.json", json.dumps(hf_config(tiny_config())).encode())
        for name, content in files.items():
            w.put_file(name, json.dumps(content).encode())
        w.commit()
    return RunStore.open(str(root))


def test_a_run_store_answers_from_its_side_file_and_follows_its_own_commits(tmp_path):
    run = _store(tmp_path / "run", {TRAINER_FILE: {"step": 4, "train_config": {"lr": 0.1, "steps": 10}}})
    assert RunStore.exists(run.root) and not RunStore.exists(str(tmp_path / "elsewhere"))
    assert hf_config(run.model_config()) == hf_config(tiny_config())
    assert run.saved_step(TRAINER_FILE) == 4 and run.state(PIPELINE_FILE) is None
    # the command line's settings win over the saved ones; the rest is kept
    assert run.resume_settings(TRAINER_FILE, {"steps": 20}) == {"lr": 0.1, "steps": 20}
    run.check_resumable(TRAINER_FILE)
    with pytest.raises(BadInputError, match="not a pipeline run; resume it without --pipeline"):
        run.check_resumable(PIPELINE_FILE)
    # a commit through its writer is what the same handle reads next, without opening it again
    with run.writer() as w:
        w.put_file(TRAINER_FILE, json.dumps({"step": 6, "train_config": {}}).encode())
        w.commit()
    assert run.saved_step(TRAINER_FILE) == 6
    assert run.gc(keep=1).versions_dropped == [1]


def test_a_run_store_refuses_a_resume_of_the_wrong_kind(tmp_path):
    pipeline = _store(tmp_path / "pipeline", {PIPELINE_FILE: {"step": 2, "schedule": "gpipe", "train_config": {}}})
    assert pipeline.saved_schedule() == "gpipe"
    with pytest.raises(BadInputError, match="a pipeline run; resume it with --pipeline N"):
        pipeline.check_resumable(TRAINER_FILE)
    model = _store(tmp_path / "model", {})  # a model store, no run in it
    assert model.saved_schedule() is None and model.saved_step(TRAINER_FILE) == 0
    with pytest.raises(TrainingError, match="a store without trainer.json is not a training run"):
        model.check_resumable(TRAINER_FILE)


def test_a_trainer_opens_its_run_store_once(tmp_path, text_file, monkeypatch):
    """A new run, then its resume: each opens the run's store once (the command line and the
    ranks each hand theirs down), however many checkpoints it commits."""
    opened = record_store_opens(monkeypatch)
    for steps in (4, 6):  # a new run with checkpoints at 2 and 4; its resume, with one more at 6
        cfg = TrainConfig(out=str(tmp_path / "run"), data=text_file, steps=steps, batch_size=4, seq_len=32,
                          warmup_steps=2, checkpoint_every=2, expert_states="ssd")
        opened.clear()
        trainer = Trainer(cfg, tiny_config())
        trainer.run()
        assert opened == [cfg.store] if steps == 6 else opened == [], opened
        assert trainer.run_store.saved_step(TRAINER_FILE) == steps  # the handle followed every commit


def test_the_command_line_hands_its_open_store_to_the_trainer(tmp_path, text_file, monkeypatch):
    """`semoe train` in one process: a new run opens no store (it creates one), its resume opens the
    run's store once, a run from `--init-from` opens that store once (read by the command line for
    the resume settings or the model, and by the trainer)."""
    from tools.cli import main

    opened = record_store_opens(monkeypatch)
    run, tiny = tmp_path / "run", ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                                   "--ffn", "128", "--expert-ffn", "96", "--experts", "4", "--top-k", "2"]
    common = ["--batch-size", "2", "--seq-len", "16", "--checkpoint-every", "2", "-q"]
    assert main(["train", "--out", str(run), "--data", text_file, *tiny, "--steps", "2", *common]) == 0
    assert opened == []
    assert main(["train", "--out", str(run), "--resume", "--steps", "4", "-q"]) == 0
    assert opened == [str(run / "store")]
    opened.clear()
    other = tmp_path / "other"
    assert main(["train", "--out", str(other), "--data", text_file, "--init-from", str(run / "store"),
                 "--steps", "2", *common]) == 0
    assert opened == [str(run / "store")]
    assert RunStore.open(str(run / "store")).saved_step(TRAINER_FILE) == 4
