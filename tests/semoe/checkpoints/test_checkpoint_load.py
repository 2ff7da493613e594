"""Loading a model at a narrower dtype allocates its storage once, at that dtype."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from semoe.checkpoints.model_io import _empty_model, load_store, save_store
from semoe.model.config import named_config
from semoe.model.moe_gpt import MoEGPT


class _Allocations(TorchDispatchMode):
    """The dtype and element count of every tensor an op returns off the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.made.append((t.dtype, t.numel()))
        return out


def test_an_empty_bf16_model_never_allocates_float32_weights():
    """Before the cast moved onto the meta device, every weight was first materialised in float32
    (twice the bf16 bytes: an OOM on a GPU holding more than half the model)."""
    config = named_config("tiny")
    with _Allocations() as rec:
        model = _empty_model(config, "cpu", torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters())
    assert not [m for m in rec.made if m[0] == torch.float32], rec.made[:5]
    params = sum(p.numel() for p in model.parameters())
    assert sum(n for d, n in rec.made if d == torch.bfloat16) == params  # each weight allocated once


def test_load_store_as_bf16_matches_the_float32_weights_cast(tmp_path):
    torch.manual_seed(0)
    model = MoEGPT(named_config("tiny")).eval()
    save_store(model, str(tmp_path / "m"))
    loaded = load_store(str(tmp_path / "m"), dtype=torch.bfloat16)
    for (name, p), (_, q) in zip(model.named_parameters(), loaded.named_parameters()):
        assert q.dtype == torch.bfloat16 and torch.equal(q, p.detach().to(torch.bfloat16)), name


def test_skipping_initialisation_while_loading_leaves_other_threads_models_initialised():
    """A model built in one thread while another loads (inside `_SkipInit`) gets its usual random
    weights, and the skipping thread's initialisers pass tensors through untouched."""
    import threading

    from torch import nn

    from semoe.checkpoints.model_io import _SkipInit

    torch.manual_seed(3)
    want = nn.Linear(16, 8).weight.detach().clone()
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def loading():
        with _SkipInit():
            t = torch.full((4,), 7.0)
            seen["skipped"] = torch.equal(nn.init.normal_(t), torch.full((4,), 7.0))
            inside.set()
            done.wait(30)

    loader = threading.Thread(target=loading)
    loader.start()
    try:
        assert inside.wait(30)
        torch.manual_seed(3)
        got = nn.Linear(16, 8).weight.detach()
    finally:
        done.set()
        loader.join(30)
    assert seen["skipped"]
    assert torch.equal(got, want)  # initialised, and the same draw as outside any load
    torch.manual_seed(3)
    assert torch.equal(nn.Linear(16, 8).weight.detach(), want)  # and after the load, as before


def test_loading_leaves_torch_nn_init_as_torch_made_it(tmp_path):
    """Whoever embeds semoe keeps torch's own initialisers: loading patches nothing of torch."""
    from torch import nn

    from semoe.checkpoints.model_io import load_store

    before = {name: getattr(nn.init, name) for name in dir(nn.init) if name.endswith("_")}
    save_store(MoEGPT(named_config("tiny")), str(tmp_path / "m"))
    load_store(str(tmp_path / "m"))
    after = {name: getattr(nn.init, name) for name in before}
    assert after == before
    assert all(f.__module__ == "torch.nn.init" and not hasattr(f, "__wrapped__") for f in after.values()
               if callable(f))


def test_a_model_trained_here_keeps_its_config_json_readable_by_the_previous_release():
    """The config a store of a model trained here carries names only fields a reader before
    `weights_prefix` (the multimodal text model's prefix) knows, and reads back as the same config."""
    from semoe.checkpoints.hf_config import config_from_json
    from semoe.checkpoints.model_io import hf_config

    config = named_config("tiny")
    doc = hf_config(config)
    assert "weights_prefix" not in doc["semoe"]
    assert config_from_json(doc) == config
