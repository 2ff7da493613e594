"""What a training step asks of its device, checked on CPU: precision by device, checkpoints
loaded to the host, one host read per step, the bf16 autocast path, gradient norms."""

from __future__ import annotations

import io

import pytest
import torch

from helpers.expert_states import RecordingStates

from semoe.train.collectives import Collectives
from semoe.model.config import named_config
from semoe.train.expert_states import _ExpertFFN, sum_of_squares
from semoe.model.experts import swiglu
from semoe.train.trainer import Trainer
from semoe.train.config import Precision, TrainConfig, training_precision
from storage.errors import BadInputError
from storage.host_sync_counter import HostSyncCounter

SHAPE = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_size=128, moe_ffn_size=96,
             num_experts=4, max_position=256)


def tiny_config():
    return named_config("gpt-moe-small", **SHAPE)


def _trainer(tmp_path, small_corpus, name: str, **kw) -> Trainer:
    cfg = TrainConfig(out=str(tmp_path / name), data=small_corpus, steps=kw.pop("steps", 4), batch_size=4, seq_len=32,
                      warmup_steps=2, checkpoint_every=100, **kw)
    return Trainer(cfg, tiny_config())


# -- precision and devices ------------------------------------------------------------------------


@pytest.mark.parametrize("precision, device, want", [
    ("auto", "cuda", Precision(autocast_dtype=torch.bfloat16, tf32=True)),
    ("auto", "cuda:1", Precision(autocast_dtype=torch.bfloat16, tf32=True)),
    ("auto", "cpu", Precision(autocast_dtype=None, tf32=False)),
    ("fp32", "cuda", Precision(autocast_dtype=None, tf32=False)),
    ("bf16", "cpu", Precision(autocast_dtype=torch.bfloat16, tf32=False)),
])
def test_training_precision_is_bf16_with_tf32_on_cuda_and_float32_on_cpu(precision, device, want):
    assert training_precision(precision, device) == want


@pytest.mark.parametrize("field, value, message", [
    ("device", "gpu", "--device must be cpu, cuda or cuda:N, got 'gpu'"),
    ("device", "mps", "--device must be cpu, cuda or cuda:N, got 'mps'"),
    ("device", "cuda:x", "--device must be cpu, cuda or cuda:N, got 'cuda:x'"),
    ("precision", "fp16", "--precision must be one of auto, bf16, fp32, got 'fp16'"),
])
def test_bad_device_or_precision_is_one_line_naming_the_flag(field, value, message):
    with pytest.raises(BadInputError) as e:
        TrainConfig(out="unused", **{field: value})
    assert str(e.value) == message


class _FakeStore:
    def __init__(self, blob: dict) -> None:
        buf = io.BytesIO()
        torch.save(blob, buf)
        self.data = buf.getvalue()

    def read_file(self, name: str) -> bytes:
        return self.data


def _adam_state() -> dict:
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([p], foreach=False)
    p.grad = torch.ones(3)
    opt.step()
    return opt.state_dict()


def test_resume_loads_rng_and_optimizer_state_to_the_cpu():
    """`torch.set_rng_state` takes a CPU ByteTensor only, and AdamW's step counters on a GPU would
    cost a sync each: whatever the trainer's device (meta stands in for a GPU here), a checkpoint's
    optimizer file is loaded to the CPU."""
    from semoe.train.pipeline import PipelineTrainer

    rng = torch.get_rng_state()
    trainer = Trainer.__new__(Trainer)
    trainer.device = torch.device("meta")
    opt, got = trainer._saved_optimizer(_FakeStore({"dense_optimizer": _adam_state(), "rng": rng}))
    assert got.device.type == "cpu" and got.dtype == torch.uint8 and torch.equal(got, rng)
    assert opt["state"][0]["step"].device.type == "cpu" and opt["state"][0]["exp_avg"].device.type == "cpu"

    stage = PipelineTrainer.__new__(PipelineTrainer)
    stage.device, stage.rank = torch.device("meta"), 1
    opt, got = stage._saved_optimizer(_FakeStore({"stages": [{}, _adam_state()], "rng": [rng, rng]}))
    assert got.device.type == "cpu" and got.dtype == torch.uint8
    assert opt["state"][0]["step"].device.type == "cpu"


# -- the host syncs of a step -------------------------------------------------------------------


@pytest.mark.parametrize("states", ["device", "ssd"])
def test_a_training_step_reads_the_device_once_besides_routing(tmp_path, small_corpus, states):
    """The budget of host syncs in one step (forward and optimizer; a TorchFunctionMode does not see
    backward, whose expert function reads nothing on the host):
      nonzero, tolist  per MoE layer and micro-batch: routing's data-dependent sizes, inherent
      tolist           + 1: the step's one read of losses and gradient norm (clipping and the
                       loss check need them on the host)
      item             per dense parameter: torch AdamW reads its step counter, a CPU tensor
                       (no device wait; checkpoints are loaded to the CPU to keep it there)
      numpy            host buffers of the expert store (`.numpy()` refuses device tensors)
    Gradient norms once read a float per tensor: hundreds of syncs per step."""
    M = 2
    trainer = _trainer(tmp_path, small_corpus, states, expert_states=states, micro_batches=M)
    try:
        trainer.train_step()  # the optimizers' states exist from here on
        with HostSyncCounter() as c:
            trainer.train_step()
        layers = len(trainer.config.moe_layer_ids)
        counts = dict(c.counts)
        counts.pop("numpy", None)
        assert counts == {"nonzero": layers * M, "tolist": layers * M + 1, "item": len(trainer.dense)}
    finally:
        trainer.close()


def test_sum_of_squares_is_the_float64_sum_over_devices_and_dtypes():
    torch.manual_seed(0)
    ts = [torch.randn(7, 5), torch.randn(3), torch.randn(4, 4, dtype=torch.float64), torch.randn(0)]
    got = sum_of_squares(ts, torch.device("cpu"))
    want = sum(float(t.double().pow(2).sum()) for t in ts)
    assert got.dtype == torch.float64 and got.shape == ()
    assert float(got) == pytest.approx(want, rel=1e-6)  # per-tensor norms are taken in their own dtype
    assert float(sum_of_squares([], torch.device("cpu"))) == 0.0


# -- bf16 autocast --------------------------------------------------------------------------------


def test_expert_function_under_bf16_autocast_matches_autograd():
    """Forward under autocast runs in bf16; backward (which autocast does not reach) must run in
    the dtype forward used and hand float32 weight gradients to the states. Reference: autograd
    through `swiglu` under the same autocast; bf16 tolerance rtol 2e-2, atol 2e-2."""
    torch.manual_seed(1)
    w = [torch.randn(12, 8) * 0.3, torch.randn(12, 8) * 0.3, torch.randn(8, 12) * 0.3]
    x = torch.randn(5, 8, requires_grad=True)
    rec = RecordingStates(w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = _ExpertFFN.apply(x, *w, rec, 0, 3)
    assert y.dtype == torch.bfloat16
    dy = torch.randn(y.shape).to(y.dtype)
    (dx,) = torch.autograd.grad(y, x, dy)
    leaves = [t.clone().requires_grad_() for t in w]
    x2 = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y2 = swiglu(x2, *leaves)
    ref = torch.autograd.grad(y2, [x2, *leaves], dy)
    assert dx.dtype == torch.float32
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, y2, **tol)
    torch.testing.assert_close(dx, ref[0], **tol)
    for got, want in zip(rec.grads[(0, 3)], ref[1:]):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want.float(), **tol)


def test_bf16_training_on_cpu_follows_float32(tmp_path, small_corpus):
    """--precision bf16 runs the autocast path (the CUDA default) on CPU: float32 weights and
    states, and losses within 2% of the float32 run's over 4 steps."""
    runs = {}
    for precision in ("fp32", "bf16"):
        trainer = _trainer(tmp_path, small_corpus, precision, expert_states="device", precision=precision, lr=3e-3)
        try:
            runs[precision] = [trainer.train_step().loss for _ in range(4)]
            assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
            assert all(t.dtype == torch.float32 for ws in trainer.states.w.values() for t in ws)
        finally:
            trainer.close()
    assert runs["bf16"] == pytest.approx(runs["fp32"], rel=2e-2)
    assert runs["bf16"] != runs["fp32"]  # the bf16 path really ran


# -- object collectives ---------------------------------------------------------------------------


def test_objects_get_a_gloo_group_when_the_default_group_has_no_cpu_backend(monkeypatch):
    import torch.distributed as dist

    from semoe.train.collectives import object_group

    made = []
    monkeypatch.setattr(dist, "new_group", lambda backend=None, **kw: made.append(backend) or "gloo group")
    for config, want in (("cpu:gloo,cuda:nccl", None), ("gloo", None), ("cuda:nccl", "gloo group")):
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None, _c=config: _c)
        assert object_group() == want, config
    assert made == ["gloo"]


def test_checkpoint_gathering_and_barriers_use_the_object_group(monkeypatch):
    """Under NCCL, gather_object would pickle every stage's weights and optimizer into CUDA tensors
    (rank 0 allocating world x the largest); they go through the gloo object group instead."""
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "gather_object", lambda obj, out, dst=0, group=None: calls.append(("gather", group)))
    monkeypatch.setattr(dist, "broadcast_object_list", lambda box, src=0, group=None: calls.append(("broadcast", group)))
    monkeypatch.setattr(dist, "barrier", lambda group=None, **kw: calls.append(("barrier", group)))
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None, **kw: calls.append(("all_reduce", group, t.device.type)))
    comm = Collectives(0, 2, group := object())  # a trainer's (`Trainer.comm`)
    comm.gather({"x": 1})
    comm.broadcast(3)
    comm.barrier()
    comm.sum([1.0, 2.0])
    assert calls == [("gather", group), ("broadcast", group), ("barrier", group), ("all_reduce", group, "cpu")]
