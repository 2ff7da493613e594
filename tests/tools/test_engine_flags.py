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
