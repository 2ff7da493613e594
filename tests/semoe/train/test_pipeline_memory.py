"""MPress in pipeline training: a plan (recompute, host swap, D2D swap into the peer stage's shared
memory) changes where activations live, never the numbers; a budget is planned for and kept."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.dist import run_ranks
from helpers.training import SHAPE, SHAPE_FLAGS, cli, log_entries, log_losses, store_tensors

from mpress.profile import Decision, ModelDataDecision, Plan, Stripe
from semoe.model.config import named_config
from semoe.train.config import training_precision

SHAPE4 = {**SHAPE, "num_layers": 4}
FLAGS4 = [*SHAPE_FLAGS[:SHAPE_FLAGS.index("--layers")], "--layers", "4",
          *SHAPE_FLAGS[SHAPE_FLAGS.index("--layers") + 2:]]
STEPS = 3


def _worker(rank: int, out: str, data: str, plan_json: str | None) -> None:
    from semoe.train.pipeline import PipelineConfig, PipelineTrainer
    from semoe.train.config import TrainConfig

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
        trainer.checkpoint()  # every stage's final weights and moments, into one store
    finally:
        trainer.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"losses": logs, "stats": stats.__dict__ if stats else None}, f)


def _run(tmp_path, name: str, text_file: str, plan: Plan | None) -> list[dict]:
    out = str(tmp_path / name)
    run_ranks(_worker, out, text_file, plan.to_json() if plan else None)
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_every_technique_in_a_two_stage_pipeline_keeps_the_numbers(tmp_path, text_file):
    plan = Plan(decisions=[
        Decision(stage=0, layer=0, technique="host"),
        Decision(stage=0, layer=1, technique="d2d", stripes=[Stripe(device=1, bytes=1)]),
        Decision(stage=1, layer=2, technique="recompute"),
        Decision(stage=1, layer=3, technique="d2d", stripes=[Stripe(device=0, bytes=1)]),
    ])
    # losses, both stages' final weights and moments and the dense optimizer's states, bit for
    # bit: swaps are copies, recomputation replays the ops
    planned = _same_numbers_as_plain(tmp_path, text_file, plan)
    a = store_tensors(str(tmp_path / "planned" / "store"))
    assert {k[1] for k in a} == {"weight", "adam_m", "adam_v"}
    assert {name for name, _ in a if ".layers.0." in name} and {name for name, _ in a if ".layers.3." in name}
    assert any(r["losses"] for r in planned)
    s0, s1 = planned[0]["stats"], planned[1]["stats"]
    assert s0["host_bytes"] > 0 and s0["peer_bytes"] > 0  # stage 0 really swapped to host and to stage 1
    assert s1["recomputed"] > 0 and s1["peer_bytes"] > 0


def _stage_optimizers(store: str) -> list[dict]:
    import io

    from semoe.train.run_store import PIPELINE_OPTIMIZER_FILE
    from storage.store import Store

    blob = Store.open(store).read_file(PIPELINE_OPTIMIZER_FILE)
    return torch.load(io.BytesIO(blob), weights_only=False)["stages"]


def _same_numbers_as_plain(tmp_path, text_file: str, plan: Plan) -> list[dict]:
    """Runs the plain and the planned pipeline; asserts their losses, every weight and every moment
    are the same bit for bit; returns the planned ranks' results."""
    plain = _run(tmp_path, "plain", text_file, None)
    planned = _run(tmp_path, "planned", text_file, plan)
    assert [r["losses"] for r in plain] == [r["losses"] for r in planned]
    a, b = store_tensors(str(tmp_path / "plain" / "store")), store_tensors(str(tmp_path / "planned" / "store"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = _stage_optimizers(str(tmp_path / "plain" / "store")), _stage_optimizers(str(tmp_path / "planned" / "store"))
    for stage_a, stage_b in zip(oa, ob):
        assert stage_a["state"].keys() == stage_b["state"].keys() and stage_a["state"]
        for i, st in stage_a["state"].items():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(st[key], stage_b["state"][i][key]), (i, key)
    return planned


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_model_data_in_host_memory_and_in_the_peer_keeps_the_numbers(tmp_path, text_file):
    """Stage 0 keeps block 0's AdamW moments in host memory and stripes block 1's into stage 1's
    segment; stage 1 keeps block 2's in host memory, stepped there, and block 3's on the device;
    with a host swap of activations beside them. Losses, every weight and every moment (read back from where
    they live for the checkpoint) are the plain run's, bit for bit."""
    plan = Plan(decisions=[Decision(stage=1, layer=3, technique="host")], model_data=[
        ModelDataDecision(stage=0, layer=0, technique="host"),
        ModelDataDecision(stage=0, layer=1, technique="d2d", stripes=[Stripe(device=1, bytes=1)]),
        ModelDataDecision(stage=1, layer=2, technique="host", step_on="host"),
    ])
    planned = _same_numbers_as_plain(tmp_path, text_file, plan)
    s0, s1 = planned[0]["stats"], planned[1]["stats"]
    # each step moved the moments out: stage 0 to host and to stage 1, stage 1 to host
    assert s0["model_bytes"] > 0 and s0["host_bytes"] >= s0["model_bytes"] // 2 and s0["peer_bytes"] > 0
    assert s1["model_bytes"] > 0


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_streamed_weights_in_host_memory_keep_the_numbers(tmp_path, text_file):
    """Stage 0 streams block 1's weights from host memory (its gradients summed there, AdamW on
    the host); stage 1 streams block 2's, whose activations are also recomputed, and block 3's,
    whose activations go to host memory. Losses, every weight (read from host memory for the
    checkpoint) and every moment are the plain run's, bit for bit, gradient clipping included."""
    streamed = [ModelDataDecision(stage=s, layer=i, technique="host", step_on="host", weights="host")
                for s, i in ((0, 1), (1, 2), (1, 3))]
    plan = Plan(decisions=[Decision(stage=1, layer=2, technique="recompute"),
                           Decision(stage=1, layer=3, technique="host")], model_data=streamed)
    planned = _same_numbers_as_plain(tmp_path, text_file, plan)
    s0, s1 = planned[0]["stats"], planned[1]["stats"]
    assert s0["weight_bytes"] > 0 and s1["weight_bytes"] > s0["weight_bytes"]  # stage 1 streams two blocks


def _assert_planned_and_kept(mem: dict, budget: int) -> None:
    """A step's `memory` record under `--stage-memory budget`: the plan places activations off the
    device (recompute, host or D2D swap), each stage's executor did so, and its peak of activations
    and streamed weights stayed within what the budget leaves beside the stage's model data."""
    assert mem["budget_bytes"] == budget and len(mem["stages"]) == 2, mem
    assert set(mem["plan"]) & {"recompute", "host", "d2d"}, mem
    assert any(st["recomputed"] or st["host_bytes"] or st["peer_bytes"] for st in mem["stages"]), mem
    for st in mem["stages"]:
        kept = st["model_data_bytes"] - st["moved_state_bytes"] - st["streamed_bytes"]
        assert 0 < st["peak_bytes"] <= budget - kept, (st, budget)


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_stage_memory_is_planned_for_and_changes_nothing(tmp_path, text_file):
    common = ["train", *FLAGS4, "--data", text_file, "--batch-size", "8", "--seq-len", "32", "--steps", "8",
              "--pipeline", "2", "--micro-batches", "4", "--schedule", "gpipe", "-q"]
    cli(*common, "--out", str(tmp_path / "free"), "--log-json", str(tmp_path / "free.log"))
    # four steps, then a resume to eight under the same budget (the checkpoint's optimizer state is
    # loaded once the plan is installed)
    cli(*common, "--steps", "4", "--checkpoint-every", "2", "--out", str(tmp_path / "tight"),
        "--log-json", str(tmp_path / "tight.log"),
        "--stage-memory", "1700KiB")  # the head's logits of 4 micro-batches take most of the last stage's
    cli("train", "--out", str(tmp_path / "tight"), "--resume", "--steps", "8", "--pipeline", "2", "-q",
        "--log-json", str(tmp_path / "tight.log"), "--stage-memory", "1700KiB")
    runs = log_entries(str(tmp_path / "tight.log"))
    assert len(runs) == 8
    for entry in (runs[3], runs[7]):  # the first run's last step and the resumed run's
        _assert_planned_and_kept(entry["memory"], 1700 * 1024)
    # a budget with room for everything: the plan keeps all, and the resumed run loads the
    # optimizer state onto the device as an unplanned one does
    roomy = ["--out", str(tmp_path / "roomy"), "--log-json", str(tmp_path / "roomy.log"), "--stage-memory", "64MiB"]
    cli(*common, "--steps", "4", "--checkpoint-every", "2", *roomy)
    mem = log_entries(str(tmp_path / "roomy.log"))[-1]["memory"]
    assert mem["plan"] == [] and mem["model_data"] == [], mem
    assert all(st["host_bytes"] == st["peer_bytes"] == st["recomputed"] == 0 for st in mem["stages"]), mem
    cli("train", "--resume", "--steps", "8", "--pipeline", "2", "-q", *roomy)
    free, tight = log_losses(str(tmp_path / "free.log")), log_losses(str(tmp_path / "tight.log"))
    assert log_losses(str(tmp_path / "roomy.log")) == free
    assert free == tight and tight[-1] < tight[0] - 0.3
    a, b = store_tensors(str(tmp_path / "free" / "store")), store_tensors(str(tmp_path / "tight" / "store"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # every stage, bit for bit


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_a_plan_under_bf16_autocast_changes_nothing(tmp_path, text_file):
    """bf16 autocast (the GPU default): the stage is profiled under it (bf16 activations, the
    weights' bf16 copies as model data), the plan fits the budget, and the losses are the
    unbudgeted bf16 run's, bit for bit."""
    common = ["train", *FLAGS4, "--data", text_file, "--batch-size", "8", "--seq-len", "32", "--steps", "4",
              "--pipeline", "2", "--micro-batches", "4", "--schedule", "gpipe", "--precision", "bf16", "-q"]
    cli(*common, "--out", str(tmp_path / "free"), "--log-json", str(tmp_path / "free.log"))
    cli(*common, "--out", str(tmp_path / "tight"), "--log-json", str(tmp_path / "tight.log"),
        "--stage-memory", "1700KiB")
    _assert_planned_and_kept(log_entries(str(tmp_path / "tight.log"))[-1]["memory"], 1700 * 1024)
    free, tight = log_losses(str(tmp_path / "free.log")), log_losses(str(tmp_path / "tight.log"))
    assert free == tight and len(free) == 4


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_a_budget_below_the_model_data_trains_by_moving_it(tmp_path, text_file):
    """A stage budget below what the last stage's parameters, gradients and optimizer states take
    (activations aside): no placement of activations can fit it, the plan moves optimizer states
    to host memory, and the run trains with the unbudgeted run's losses; with 90% of that budget
    the plan streams weights too, with the same losses."""
    flags8 = [*FLAGS4[:FLAGS4.index("--layers")], "--layers", "8", *FLAGS4[FLAGS4.index("--layers") + 2:]]
    common = ["train", *flags8, "--data", text_file, "--batch-size", "8", "--seq-len", "32", "--steps", "8",
              "--pipeline", "2", "--micro-batches", "4", "--schedule", "gpipe", "-q"]
    cli(*common, "--out", str(tmp_path / "free"), "--log-json", str(tmp_path / "free.log"))
    cli(*common, "--steps", "1", "--out", str(tmp_path / "probe"), "--stage-memory", "64MiB",
        "--log-json", str(tmp_path / "probe.log"))
    static = [st["model_data_bytes"] for st in log_entries(str(tmp_path / "probe.log"))[0]["memory"]["stages"]]
    assert len(static) == 2 and min(static) > 0, static
    budget = max(static) - 4096
    # four steps, then a resume to eight: the checkpoint read the moved moments where they lived,
    # and the resumed run moves them off the device again before its first step
    cli(*common, "--steps", "4", "--checkpoint-every", "2", "--out", str(tmp_path / "tight"),
        "--log-json", str(tmp_path / "tight.log"), "--stage-memory", str(budget))
    mem = log_entries(str(tmp_path / "tight.log"))[-1]["memory"]
    assert mem["model_data"] == ["host"], mem
    assert max(st["moved_state_bytes"] for st in mem["stages"]) > 0 and max(st["model_bytes"] for st in mem["stages"]) > 0
    cli("train", "--out", str(tmp_path / "tight"), "--resume", "--steps", "8", "--pipeline", "2", "-q",
        "--log-json", str(tmp_path / "tight.log"), "--stage-memory", str(budget))
    free, tight = log_losses(str(tmp_path / "free.log")), log_losses(str(tmp_path / "tight.log"))
    assert tight == free and tight[-1] < tight[0] - 0.3
    # 90% of it: with every block's moments moved and every block recomputed, the last stage
    # still holds 99% (its parameters and gradients, the head's moments and the logits the loss
    # keeps), and with every block's weights streamed as well 83%: only streaming fits, planned
    # from the budget
    cli(*common, "--steps", "4", "--out", str(tmp_path / "streamed"), "--log-json",
        str(tmp_path / "streamed.log"), "--stage-memory", str(max(static) * 90 // 100))
    mem = log_entries(str(tmp_path / "streamed.log"))[-1]["memory"]
    streams = [st["streamed_bytes"] for st in mem["stages"]]
    assert len(streams) == 2 and max(streams) > 0, mem  # the last stage's, at least
    assert max(st["weight_bytes"] for st in mem["stages"]) > 0, mem  # and its executor streamed them
    assert log_losses(str(tmp_path / "streamed.log")) == free[:4]


@pytest.mark.slow  # several processes or CLI runs: CI runs it with -m slow
def test_a_budget_no_plan_fits_is_one_line_and_leaves_no_store(tmp_path, text_file):
    out = tmp_path / "run"
    p = cli("train", *FLAGS4, "--data", text_file, "--batch-size", "8", "--seq-len", "32", "--steps", "2",
            "--pipeline", "2", "--micro-batches", "4", "--schedule", "gpipe", "--stage-memory", "300KiB", "-q",
            "--out", str(out), check=False)
    assert p.returncode == 2
    errors = [line for line in p.stderr.splitlines() if line.startswith("semoe: error:")]
    assert errors and all("--stage-memory" in e and "no plan fits" in e for e in errors), p.stderr
    assert not (out / "store").exists()


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("flags", [["--stage-memory", "1GiB"]])
def test_stage_memory_needs_a_pipeline(tmp_path, text_file, flags):
    p = cli("train", *FLAGS4, "--data", text_file, *flags, "--out", str(tmp_path / "r"), check=False)
    assert p.returncode == 2 and "--stage-memory" in p.stderr


@pytest.mark.parametrize("schedule, in_flight", [("gpipe", 4), ("1f1b", 1)])
def test_the_budget_counts_the_embedding_and_the_head(schedule, in_flight):
    import types

    import torch
    import torch.nn.functional as F

    from semoe.model.moe_gpt import MoEGPT
    from semoe.train.pipeline import StageModule
    from semoe.train.pipeline_memory import _fixed_bytes
    from semoe.train.config import TrainConfig

    config = named_config("gpt-moe-small", **SHAPE4)
    model = MoEGPT(config)
    cfg = TrainConfig(out="unused", data="unused", batch_size=8, seq_len=32, micro_batches=4)
    B, T, V = 2, 32, config.vocab_size
    x = torch.randn(B, T, config.hidden_size)

    def trainer(first: bool, last: bool):
        stage = StageModule(model, range(0, 2) if first else range(2, 4), first=first, last=last)
        loss = lambda logits, tgt: F.cross_entropy(logits.reshape(-1, V).float(), tgt.reshape(-1)) / 4  # noqa: E731
        return types.SimpleNamespace(model=stage, cfg=cfg, pipeline=types.SimpleNamespace(schedule=schedule),
                                     loss=loss, precision=training_precision("fp32", "cpu"))

    embed = model.embed.weight
    assert _fixed_bytes(trainer(True, False), x) == 4 * embed.numel() * 4  # weight, grad and two moments
    head = sum(p.numel() * 4 for p in (*model.norm.parameters(), *model.lm_head.parameters()))
    last = _fixed_bytes(trainer(False, True), x)
    logits = B * T * V * 4  # the loss keeps log-softmax of the logits, as large as the logits
    assert last >= 4 * head + in_flight * logits
    assert last <= 4 * head + in_flight * (3 * logits + 2 * B * T * config.hidden_size * 4)


def test_the_heads_weight_copy_under_autocast_counts_once():
    """Under bf16 autocast the LM head's matmul saves autocast's bf16 copy of the head weight: one
    copy for the whole step, however many micro-batches are in flight (and the fp32 weight, saved
    too, is counted with the parameters, never per micro-batch)."""
    import types

    import torch
    import torch.nn.functional as F

    from semoe.model.moe_gpt import MoEGPT
    from semoe.train.pipeline import StageModule
    from semoe.train.pipeline_memory import _fixed_bytes
    from semoe.train.config import TrainConfig

    config = named_config("gpt-moe-small", **SHAPE4)
    model = MoEGPT(config)
    x = torch.randn(2, 32, config.hidden_size)
    V = config.vocab_size
    fixed = {}
    for schedule in ("gpipe", "1f1b"):  # 4 micro-batches in flight, or 1
        stage = StageModule(model, range(2, 4), first=False, last=True)
        fixed[schedule] = _fixed_bytes(types.SimpleNamespace(
            model=stage, cfg=TrainConfig(out="unused", data="unused", batch_size=8, seq_len=32, micro_batches=4),
            pipeline=types.SimpleNamespace(schedule=schedule), precision=training_precision("bf16", "cpu"),
            loss=lambda logits, tgt: F.cross_entropy(logits.reshape(-1, V).float(), tgt.reshape(-1))), x)
    per_micro_batch = (fixed["gpipe"] - fixed["1f1b"]) // 3
    assert fixed["gpipe"] - fixed["1f1b"] == 3 * per_micro_batch > 0
    head = sum(p.numel() * 4 for p in (*model.norm.parameters(), *model.lm_head.parameters()))
    assert fixed["1f1b"] - per_micro_batch == 4 * head + model.lm_head.weight.numel() * 2  # and one bf16 copy


# -- wiring: peer memory, budgets and the GPU topology, without training ----------------------------


def shm_worker(rank: int, name: str, out: str) -> None:
    import types

    import torch

    import mpress.peer_memory
    from semoe.train.pipeline_memory import make_peers
    from storage.errors import BadInputError

    mpress.peer_memory.shm_free_bytes = lambda directory: 64 << 20  # Docker's default /dev/shm
    trainer = types.SimpleNamespace(device=torch.device("cpu"), rank=rank, world=2)
    try:
        make_peers(trainer, 1 << 30, name)
        message = None
    except BadInputError as exc:
        message = str(exc)
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(repr(message))


@pytest.mark.slow  # starts processes
def test_a_small_dev_shm_is_one_line_naming_the_remedy(tmp_path):
    import uuid

    from mpress.peer_memory import segment_path

    name = f"test-pm-{uuid.uuid4().hex[:12]}"
    run_ranks(shm_worker, name, str(tmp_path))
    shm = os.path.dirname(segment_path(name, 0))
    want = (f"{shm} has 67108864 bytes free, D2D swap needs 2147483648; enlarge it (docker --shm-size) or raise "
            f"--stage-memory (less is then swapped to peers)")
    assert [open(tmp_path / f"rank{r}.txt").read() for r in range(2)] == [repr(want)] * 2
    assert not any(name in f for f in os.listdir(shm))


def test_peer_memory_on_the_device_comes_off_the_activation_budget():
    import types

    from semoe.train.pipeline_memory import budget_after_peers
    from storage.errors import BadInputError

    on_gpu = types.SimpleNamespace(device_bytes=(64 << 20) + (500 << 20))  # segment + one peer's context
    assert budget_after_peers(2 << 30, on_gpu, 0) == (2 << 30) - (564 << 20)
    assert budget_after_peers(2 << 30, types.SimpleNamespace(device_bytes=0), 0) == 2 << 30  # /dev/shm
    assert budget_after_peers(2 << 30, None, 0) == 2 << 30 and budget_after_peers(None, on_gpu, 0) is None
    with pytest.raises(BadInputError, match=r"^stage 1: peer memory for D2D swap takes 591396864 bytes of the "
                                            r"device .* more than the 1000 bytes left for activations"):
        budget_after_peers(1000, on_gpu, 1)


def test_gpu_ranks_are_planned_on_their_own_gpus(monkeypatch):
    import types

    import torch

    import semoe.train.pipeline_memory
    from semoe.train.pipeline_memory import _topology

    asked = []
    monkeypatch.setattr(semoe.train.pipeline_memory, "from_nvml", lambda devices=None: asked.append(devices) or "nvml")
    trainer = types.SimpleNamespace(device=torch.device("cuda", 0), world=2)
    pci = [(0, 0x41, 0), (0, 0x0A, 0)]  # each rank's cuda:0, under different CUDA_VISIBLE_DEVICES
    assert _topology(trainer, 1 << 30, pci) == "nvml" and asked == [pci]


def test_the_profile_times_the_experts_step_where_the_backend_steps_in_memory():
    from types import SimpleNamespace

    from semoe.train.pipeline_memory import _expert_step_seconds

    class InMemory:
        experts = range(4)

        def sample_weights(self):
            return [torch.randn(96, 64), torch.randn(64, 96)]

    class OnSSD(InMemory):
        def sample_weights(self):
            return None  # bound by reads and writes: not modelled

    assert _expert_step_seconds(SimpleNamespace(states=InMemory())) > 0
    assert _expert_step_seconds(SimpleNamespace(states=OnSSD())) == 0.0
