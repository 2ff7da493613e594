"""The inference engine: a model, its tokenizer and (when offloaded) its expert tiers behind one API.

`Engine.generate` is what `semoe generate` and `semoe serve` call. With no budgets the model is
fully resident; with budgets the experts stay in the store and flow SSD -> CPU cache -> device
ring (see `inference.offload.expert_ring`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from typing import Callable

import torch

from storage.reader import is_store
from semoe.checkpoints.model_io import load_model, load_model_tokenizer, load_store
from semoe.model.compact_linear import stack_projections
from semoe.decode.plan import DecodePlan
from semoe.decode.support import NotOnFastPath
from semoe.decode.generate import GenerationResult, generate, new_cache
from semoe.decode.loop import SamplingConfig
from semoe.model.attention import KVCache
from semoe.model.moe_gpt import MoEGPT
from semoe.checkpoints.tokenizer import default_stop_ids
from inference.engine_config import EngineConfig
from storage.process_memory import peak_rss_bytes
from storage.store import Store

log = logging.getLogger(__name__)

TokenCallback = Callable[[int, float], None]  # (token id, log-probability), called as each token is chosen


class Engine:
    """One model serving generation requests: `generate` for one, `step` for the batch scheduler's
    packed batches (callers serialise on `lock`)."""

    def __init__(self, model: MoEGPT, tokenizer, *, name: str, config: EngineConfig, offload=None,
                 cleanup: str | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.config = config
        self.offload = offload  # inference.offload.expert_ring.OffloadedExperts when offloaded
        self.lock = threading.Lock()
        self._cleanup = cleanup
        # the model's one decode plan, for `generate` and for `step`'s lone decoding token (None: the
        # model has a part it does not take, `_unplanned` says which); callers serialise on `lock`, so
        # its buffers are shared
        self._plan: DecodePlan | None = None
        self._unplanned = ""
        if config.offloaded and config.hybrid:
            # hybrid decode is the device's path (its modules), on CPU too, where tests run it
            self._unplanned = f"hybrid decode: {offload.describe(model)}"
            return
        try:
            self._plan = DecodePlan(model)
        except NotOnFastPath as e:
            self._unplanned = str(e)

    @classmethod
    def load(cls, path: str | Store, config: EngineConfig | None = None, *,
             progress: Callable[[int], None] | None = None) -> "Engine":
        """Load a HuggingFace directory or a store (its path, or the store opened); offloading needs a
        store (a directory is imported into a temporary one first). `progress` is called with the bytes
        of each weight read while the model loads (the offloaded experts' preload excluded)."""
        config = config or EngineConfig()
        dtype = getattr(torch, config.dtype)
        opened = path if isinstance(path, Store) else None
        path = opened.root if opened is not None else path
        name = os.path.basename(os.path.normpath(path))
        if not config.offloaded:
            # a store once: model and tokenizer read it
            source = opened or (Store.open(path) if is_store(path) else path)
            model = load_model(source, device=config.device, dtype=dtype, dense=config.dense, progress=progress)
            stack_projections(model)  # float q, k and v too: a model that only serves needs no separate ones
            return cls(model, load_model_tokenizer(source, model.config), name=name, config=config)
        from inference.offload.expert_ring import OffloadedExperts

        cleanup = None
        store_path = path
        if not is_store(path):
            from semoe.checkpoints.hf_convert import import_checkpoint

            cleanup = tempfile.mkdtemp(prefix="semoe-store-")
            store_path = os.path.join(cleanup, "store")
            log.warning("%s is not a store: importing it into %s for offloading", path, store_path)
            import_checkpoint(path, store_path)
        store = opened or Store.open(store_path)  # once: the model loader, the ring and the tokenizer read it
        model = load_store(store, device=config.device, dtype=dtype, with_experts=False, dense=config.dense,
                           embedding_in_store=True, progress=progress)
        stack_projections(model)
        if config.hybrid:
            from inference.offload.hybrid import HybridExperts

            offload = HybridExperts.attach(model, store, config)
        else:
            offload = OffloadedExperts.attach(model, store, config)
        if config.preload:
            offload.warm_idle(in_request=False)
            offload.tier.drain()
        return cls(model, load_model_tokenizer(store, model.config), name=name, config=config,
                   offload=offload, cleanup=cleanup)

    def step(self, ids: list[int], caches: list[KVCache], counts: list[int], rows: list[int]) -> torch.Tensor:
        """One packed forward of several sequences (`MoEGPT.forward_packed`: sequence i's `counts[i]`
        tokens of `ids` after `caches[i].length`): logits (len(rows), V) of `rows`. A lone decoding
        token goes through the decode plan's step where it applies, as `generate` does; other steps
        through its batch (`DecodePlan.batch`: the compiled kernels over every row at once, each chosen
        expert once) where the one-call step applies, else the model's modules. The batch scheduler's
        forward; callers serialise on `lock`."""
        if self._plan is not None:
            if counts == [1] and self._plan.takes(caches[0]):
                return self._plan.step(ids[0], caches[0])
            logits = self._plan.batch(ids, caches, counts, rows)
            if logits is not None:
                return logits
        with torch.no_grad():
            ids_N = torch.tensor(ids, device=self.model.embed.weight.device)
            return self.model.forward_packed(ids_N, caches, counts, rows=rows).logits[0]

    def decode_path(self) -> str:
        """How a decoding step runs, in a phrase: the plan's kernels (the whole step in one call, or
        kernel by kernel) or the model's modules, and why."""
        if self.config.offloaded and self.config.hybrid:
            return self._unplanned  # "hybrid decode: ..." (`__init__`)
        if self._plan is None:
            return f"the model's modules on {self.model.embed.weight.device.type} ({self._unplanned})"
        if self._plan.net is not None:
            return "semoe's CPU kernels, the whole step in one call"
        return f"semoe's CPU kernels, kernel by kernel ({self._plan.whole_refusal})"

    def stop_ids(self) -> tuple[int, ...]:
        """Token ids that end generation by default (`default_stop_ids`: the config's EOS first)."""
        return default_stop_ids(self.model.config.eos_token_id, self.tokenizer)

    @property
    def model_config(self):
        """The model's config (its vocabulary, positions, layers)."""
        return self.model.config

    def new_cache(self, prompt: list[int], max_new_tokens: int) -> KVCache:
        """The KV cache of one sequence for `prompt` and up to `max_new_tokens` more (`new_cache`)."""
        return new_cache(self.model, prompt, max_new_tokens)

    def kv_cache_bytes(self, positions: int) -> int:
        """Bytes of the KV cache a request of `positions` tokens (prompt and new) holds while it generates:
        `generate` allocates it whole at the start."""
        return KVCache.bytes_for(self.model.config, 1, positions, self.model.embed.weight.dtype)

    def storage_read_bytes(self) -> int:
        """Bytes read from storage so far (the offloaded experts' SSD tier; 0 for a resident model)."""
        return self.offload.tier.stats().ssd_bytes if self.offload is not None else 0

    def generate(self, prompt: list[int], sampling: SamplingConfig, *, on_token: TokenCallback | None = None
                 ) -> GenerationResult:
        """Generate after `prompt`; `result.stats` carries the offload counters of this request."""
        with self.lock:
            if self.offload is not None:
                self.offload.begin_request()
            res = generate(self.model, prompt, sampling, on_token=on_token, plan=self._plan)
            if self.offload is not None:
                res.stats = self.offload.request_stats(tokens=len(res.tokens) + len(prompt))
            res.stats["peak_rss_bytes"] = peak_rss_bytes()
            return res

    def close(self) -> None:
        """Stop I/O threads and remove a temporary store."""
        if self.offload is not None:
            self.offload.close()
        if self._cleanup:
            shutil.rmtree(self._cleanup, ignore_errors=True)
