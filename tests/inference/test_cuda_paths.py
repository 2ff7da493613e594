"""The CUDA paths, run on a GPU machine: `bash tools/run.sh test -m cuda` (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from storage.streams import CudaCopyStream, make_copy_stream

pytestmark = pytest.mark.cuda


def test_copy_stream_round_trips_a_pinned_tensor():
    src = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    with make_copy_stream("cuda") as stream:
        assert isinstance(stream, CudaCopyStream)
        on_device = stream.copy_to_device(src).wait()
        assert on_device.is_cuda
        back = on_device.to("cpu")  # on the compute stream, ordered after the copy by wait()
    torch.testing.assert_close(back, src, rtol=0, atol=0)
