"""Training on a GPU with expert states on SSD: `bash tools/run.sh test -m cuda` (skipped without CUDA).

The CPU suite runs the SSD backend's copy path through a CUDA-like stream; here the same path runs
through CUDA's own streams, pinned buffers and device tensors."""

from __future__ import annotations

import pytest
import torch
from helpers.training import store_tensors, tiny_config

from semoe.train.ssd_states import SSDExpertStates
from semoe.train.trainer import Trainer
from semoe.train.config import TrainConfig

pytestmark = pytest.mark.cuda

GRAD_BYTES = 3 * 96 * 64 * 4  # one expert's (gate, up, down) gradient in float32: the rest spill
STEPS = 4


@pytest.fixture
def deterministic_cuda():
    """Sums whose order CUDA would otherwise leave to atomics (the index backward of the experts'
    rows) taken in a fixed order, so two runs can be compared bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before)


def _run(tmp_path, name, text_file, **kw):
    cfg = TrainConfig(out=str(tmp_path / name), data=text_file, steps=STEPS, batch_size=4, seq_len=32,
                      warmup_steps=2, checkpoint_every=2, micro_batches=2, grad_clip=0.5, device="cuda",
                      precision="fp32", **kw)
    trainer = Trainer(cfg, tiny_config())
    try:
        logs = trainer.run()
    finally:
        trainer.close()
    return trainer, [(x.loss, x.aux_loss, x.grad_norm) for x in logs]


def test_ssd_states_on_cuda_equal_host_states_bit_for_bit(tmp_path, text_file, deterministic_cuda):
    """A cache too small for the experts and gradients that spill, on CUDA: losses, gradient norms
    and every final weight and moment equal those of expert states held in host memory ("cpu"), whose
    AdamW also runs on the host, exactly. Against states on the GPU ("device", AdamW in CUDA kernels
    that may fuse multiply-adds the host does not): losses and norms within 1e-5 relative, weights
    within 1e-5 absolute after four steps of lr 2e-3."""
    cpu, cpu_logs = _run(tmp_path, "cpu", text_file, expert_states="cpu")
    ssd, ssd_logs = _run(tmp_path, "ssd", text_file, expert_states="ssd",
                         cpu_cache_bytes=SSDExpertStates.min_cache_bytes(tiny_config()),
                         grad_budget_bytes=GRAD_BYTES)
    device, device_logs = _run(tmp_path, "device", text_file, expert_states="device")
    assert ssd_logs == cpu_logs
    a, b = store_tensors(cpu.cfg.store), store_tensors(ssd.cfg.store)
    assert a.keys() == b.keys() and {k[1] for k in b} == {"weight", "adam_m", "adam_v"}
    for k in a:
        assert torch.equal(a[k], b[k]), k
    stats = ssd.states.stats()
    assert stats["cpu_misses"] > 0  # the cache really was too small
    torch.testing.assert_close(torch.tensor(device_logs, dtype=torch.float64),
                               torch.tensor(ssd_logs, dtype=torch.float64), rtol=1e-5, atol=0)
    c = store_tensors(device.cfg.store)
    for k in a:
        if k[1] == "weight":
            torch.testing.assert_close(c[k], b[k], rtol=0, atol=1e-5, msg=str(k))
