"""The server's engine over the runner's model (`inference.torch_free.runner.LeanModel`): where memory is short,
`semoe serve` steps its batches through the compiled kernels, the experts read from the store into
the runner's slots as the step chooses them.

A step is the prompt pass over every row the scheduler packed (`semoe.decode.prompt_pass`, as the
resident engine's `DecodePlan.batch`): the products over all rows at once, each row's attention over
its own sequence, the union of the experts the rows chose read once a layer (in groups, the next
read while one computes) and each computed over the rows that chose it, then the head over the rows
whose logits are asked for. A row's arithmetic does not depend on the rows beside it.

The scheduler's KV caches are the engine's (`semoe.model.attention.KVCache`, float32 on CPU), laid out as
the kernels read them, so prefix reuse, growth and preemption work as they do for the engine."""

from __future__ import annotations

import ctypes
import threading

import torch

from inference.torch_free.runner import LeanModel
from semoe.model.attention import KVCache
from semoe.decode import prompt_pass
from semoe.decode.generate import check_prompt


class LeanEngine:
    """`inference.engine.Engine`'s serving side (what the batch scheduler and the HTTP server call)
    over a `LeanModel`, which it owns: `close` frees it."""

    offload = None  # the ring engine's counters; this engine's reads are `storage_read_bytes`

    def __init__(self, model: LeanModel, *, name: str) -> None:
        if model.settings.kv_cache != "f32":
            raise ValueError("the server's KV caches are float32: build the LeanModel with kv_cache='f32'")
        self.lean = model
        self.name = name
        self.tokenizer = model.tokenizer
        self.model_config = model.config
        self.lock = threading.Lock()
        self._net = ctypes.byref(model.net)
        self._moe = model.moe
        self.rows = None  # the last step's residual rows (T, D), kept where a drafter reads them (`drafter`)
        self._drafting = False

    def new_cache(self, prompt: list[int], max_new_tokens: int) -> KVCache:
        """The KV cache of one sequence for `prompt` and up to `max_new_tokens` more."""
        check_prompt(self.model_config, prompt, max_new_tokens)
        return KVCache.empty(self.model_config, 1, len(prompt) + max_new_tokens)

    def kv_cache_bytes(self, positions: int) -> int:
        return KVCache.bytes_for(self.model_config, 1, positions, torch.float32)

    def step(self, ids: list[int], caches: list[KVCache], counts: list[int], rows: list[int]) -> torch.Tensor:
        """One packed step of several sequences (sequence i's `counts[i]` tokens of `ids` at its cache's
        next positions; each cache advances by them): the logits (len(rows), V) of `rows`. Callers
        serialise on `lock`."""
        m, c = self.lean, self.model_config
        starts = [k.length for k in caches]  # a step past a cache's capacity is refused before anything runs
        x, cos, sin = m.inputs(ids, [pos for p, n in zip(starts, counts) for pos in range(p, p + n)])
        logits = torch.empty(len(rows), m.head.O)
        prompt_pass.packed(m.lib, self._net, [k.addresses() for k in caches], [k.capacity for k in caches], starts,
                           counts, x, cos, sin, rows, logits.numpy(), threads=m.settings.threads, top_k=c.top_k,
                           moe=self._moe, reader=m, index_topk=c.index_topk or 0, tokens=ids, streams=c.hc_mult)
        for k, p, n in zip(caches, starts, counts):
            k.length = p + n
        self.rows = x if self._drafting else None
        return logits

    def drafter(self, prompt: list[int], positions: int):
        """A request's draft (`BatchScheduler._drafts`) from the checkpoint's multi-token-prediction layer
        (`inference.torch_free.mtp.Drafter`, its own cache of `positions`), fed the rows of each step
        (`rows`, split by the scheduler); None where the store holds no such layer."""
        from types import SimpleNamespace

        from inference.torch_free import mtp

        if mtp.mtp_refusal(self.lean.store) is not None:
            return None
        if self.lean._mtp is None:
            self.lean._mtp = mtp.MTP(self.lean)
        self._drafting = True
        return mtp.Drafter(self.lean._mtp, SimpleNamespace(rows=None, capacity=positions, keep_rows=True), prompt)

    def decode_path(self) -> str:
        return (f"semoe's CPU kernels over the runner's expert cache ({self.lean.cache.n} slots, "
                f"{self.lean.cache.n * self.lean.slot_bytes / 2**30:.2f} GiB), every step's rows at once")

    def stop_ids(self) -> tuple[int, ...]:
        return self.lean.stop_ids()

    def storage_read_bytes(self) -> int:
        return self.lean.cache.read_bytes

    def close(self) -> None:
        self.lean.close()
