"""`--device` resolution for generate and serve, with a fake torch.cuda standing in for GPUs."""

from __future__ import annotations

import pytest
import torch

from tools.engine_flags import resolve_device
from tools.cli_output import UsageError


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_a_cuda_ordinal_past_the_gpus_is_one_usage_error(two_gpus):
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("auto").type == "cuda"
    with pytest.raises(UsageError, match=r"--device cuda:2: this machine has 2 GPU\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")


def test_cuda_without_cuda_and_a_bad_name_are_usage_errors(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(UsageError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(UsageError, match="--device must be"):
        resolve_device("gpu0")


@pytest.mark.parametrize("flags, message", [
    (["--dense", "int4"], "--lean {how}: --dense int4 is the engine's (drop --lean)"),
    (["--cache-policy", "lru"], "--lean {how}: --cache-policy lru is the engine's (drop --lean)"),
    (["--ring-slots", "2"], "--lean {how}: --ring-slots is the engine's (drop --lean)"),
    (["--dtype", "bfloat16"], "--lean {how}: --dtype bfloat16 is the engine's (drop --lean)"),
    (["--resident"], "--resident is the engine's: --lean reads experts from the store as they are chosen"),
])
def test_generate_and_serve_refuse_the_same_flags_with_lean_in_the_same_words(tmp_path, flags, message):
    """One check (`refuse_for_lean`) for both commands: the same flag gets the same line, after the
    command's own phrase of what --lean does; a directory that is no store is refused too."""
    from tools.cli import build_parser
    from tools.engine_flags import refuse_for_lean

    parser = build_parser()
    store = tmp_path / "store"
    store.mkdir()
    (store / "manifest.json").write_text("{}")  # what `is_store` looks for; nothing is read
    for command, how in ((["generate", "--prompt", "x"], "decodes"), (["serve"], "serves")):
        args = parser.parse_args([*command, "--model", str(store), "--lean", *flags])
        with pytest.raises(UsageError) as e:
            refuse_for_lean(args, how)
        assert str(e.value) == message.format(how=how)
    args = parser.parse_args(["serve", "--model", str(tmp_path), "--lean"])
    with pytest.raises(UsageError, match=f"--lean reads a store; {tmp_path} is not one"):
        refuse_for_lean(args, "serves")
