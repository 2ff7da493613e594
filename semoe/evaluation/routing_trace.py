"""Record a model's expert routing as a JSONL trace that `semoe store cache-sim` replays.

A record is what `storage.cache_sim.read_trace` reads: `{"layer": L, "experts": [e, ...]}`, the set
of experts one MoE layer needs at once. One record is written per forward call and MoE layer, in
the order the layers run (layer-major: all of a call's tokens go through layer 0, then layer 1,
...), and its experts are the union over the call's tokens, ascending. That is what the offload
ring asks its tiers for: `MoEFeedForward.forward` streams each routed expert of the layer once
per call, whatever number of the call's tokens chose it, and `cache_sim.simulate` likewise pins a
record's experts together and counts each once. Decoding runs one token per call, so there a record
is one token's routing; a prompt's prefill or an evaluation window is one record per layer, and
a cache must hold its whole union (cache-sim refuses a smaller capacity).

Records are written by forward hooks on every `MoEFeedForward` (so a model run resident, offloaded
or split into pipeline stages is traced alike), flushed after each forward of the whole model, and
the file is opened in append mode, so several runs can add to one trace.

Shape legend: N tokens of one forward call (batch x positions), K experts per token.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from typing import IO

import torch
from torch import nn

from semoe.model.moe_gpt import MoEFeedForward, MoEGPT

log = logging.getLogger(__name__)


def routing_record(layer: int, ids_NK: torch.Tensor) -> dict[str, object]:
    """The trace record of one MoE layer's call: its layer and the union of the experts its tokens chose."""
    return {"layer": int(layer), "experts": torch.unique(ids_NK.detach()).tolist()}


class RoutingTraceRecorder:
    """Appends one record per forward call and MoE layer of `model` to a JSONL file until closed."""

    def __init__(self, model: MoEGPT, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.records = 0  # written by this recorder
        self._lock = threading.Lock()  # the server runs forwards on a worker thread
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")
        self._hooks = [m.register_forward_hook(self._on_layer) for m in model.modules()
                       if isinstance(m, MoEFeedForward)]
        self._hooks.append(model.register_forward_hook(self._on_forward))
        log.info("recording routing of %d MoE layers to %s", len(self._hooks) - 1, self.path)

    def _on_layer(self, module: nn.Module, inputs: tuple, output: tuple) -> None:
        line = json.dumps(routing_record(module.layer, output[1].ids_NK)) + "\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)
                self.records += 1

    def _on_forward(self, module: nn.Module, inputs: tuple, output: object) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        """Remove the hooks and close the file (idempotent)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> "RoutingTraceRecorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def routing_trace(model: MoEGPT, path: str | os.PathLike[str] | None) -> Iterator[RoutingTraceRecorder | None]:
    """Record `model`'s routing to `path` for the duration of the block; nothing when `path` is None."""
    if path is None:
        yield None
        return
    with RoutingTraceRecorder(model, path) as recorder:
        yield recorder
