"""Hybrid decode: each routed expert computed where it costs least, on the device or on the CPU.

On a machine with one GPU whose memory does not hold the model, streaming every missing expert across
PCIe caps decode at the link's rate, while the CPU can compute the same expert where its bytes already
are at its memory's rate. `HybridExperts` is the ring's provider (`inference.offload.expert_ring`)
with a second side:

- The ring's slots in device memory are the **device cache**: an expert it holds runs on the device.
  Experts enter it on demand (a step that sends one to the device) or by admission
  (`hybrid_placement.DeviceAdmission`: recent, frequent use, a few a step), and leave by the ring's
  own eviction.
- Every other routed expert runs where `hybrid_placement.Placement` says it costs less, from rates
  measured at load (`measure_rates`): on the CPU through semoe's compiled kernels, over the CPU cache
  and the store behind it, in the expert's stored format; or copied to the device (its rows make
  the copy worth it: a prompt, a large batch).
- The two sides run at the same time. The rows for the CPU cross to the host on the copy stream
  after an event recorded behind the layer's compute; a worker thread waits for that copy, computes
  the CPU's experts and copies their outputs back on the copy stream; the device's experts are
  queued meanwhile, and compute waits for the outputs' copy by its event only. The thread that
  queues device compute never synchronises with the device for this (`syncs_by_thread` of the
  CUDA-semantics fake stream pins it in the tests).
- Read-ahead of the next layer's predicted experts goes to the CPU cache only: a guess is worth a
  read from SSD in the disk's idle time, not a copy across the link.

`experts_on="cpu"` computes every routed expert on the CPU, `"device"` is the ring alone (every expert
streamed): both ends stay selectable, for benchmarks and users. On CPU the same code runs with the
copy stream of a CPU device (tests install one with CUDA's hazards).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from inference.engine_config import EngineConfig
from inference.offload.expert_ring import OffloadedExperts
from inference.offload.hybrid_placement import DeviceAdmission, HybridRates, Placement
from semoe.model.expert_layout import expert_weights
from semoe.model.experts import ExpertWeights
from semoe.model.moe_gpt import MoEGPT
from storage.io_queue import Priority
from storage.keys import ExpertKey
from storage.store import Store
from storage.streams import CopyHandle

log = logging.getLogger(__name__)

__all__ = ["HybridExperts", "HybridCounters", "measure_rates"]


@dataclass
class HybridCounters:
    """One request's split of expert uses between the sides."""

    cpu_uses: int = 0  # experts computed on the CPU
    device_hits: int = 0  # run on the device, which held them
    device_copies: int = 0  # copied to the device for their rows and run there
    cpu_rows: int = 0
    device_rows: int = 0
    cpu_bytes: int = 0  # expert bytes the CPU's kernels read (as stored)
    device_hit_bytes: int = 0  # expert bytes the device read from its cache
    admitted: int = 0  # copied into the device cache for later steps


@dataclass
class _CpuJob:
    """The CPU side of one layer call: its experts in order, their row counts, and the future that
    yields the copy of their outputs to the device."""

    experts: list[int]
    counts: list[int]
    future: Future


class HybridExperts(OffloadedExperts):
    """The expert provider of hybrid decode (one instance serves every MoE layer)."""

    ALWAYS_COPIES = True  # the ring's slots are device memory, on CPU too (the device cache)

    def __init__(self, model: MoEGPT, store: Store, settings: EngineConfig, **kwargs) -> None:
        super().__init__(model, store, settings, **kwargs)
        c = model.config
        self.mode = settings.experts_on if settings.experts_on != "auto" else "hybrid"
        self.pin = self.device.type == "cuda"
        # multiply-adds of one row through one expert, twice (multiply and add): its weights' elements
        self.flops_per_row = 2 * 3 * c.hidden_size * c.moe_ffn_size
        self.device_bytes = {k: sum(t.nbytes for t in self.compute_slices[k]) for k in self.layouts}
        self.admission = DeviceAdmission()
        self.hybrid = HybridCounters()
        # one thread computes the CPU's experts (the kernels spread over their own threads)
        self._cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybrid-cpu")
        self.rates = settings.hybrid_rates or measure_rates(self)
        self.placement = Placement(self.rates)
        log.info("hybrid: %s", self.rates.describe())

    # -- the provider's second call: compute on rows ---------------------------------------------
    def run(self, layer: int, inputs: list[tuple[int, torch.Tensor]], x_ND: torch.Tensor) -> dict[int, torch.Tensor]:
        """The outputs of `inputs`' experts ((expert, its rows) pairs, each expert once) of one layer:
        those the device holds, or whose rows make the copy worth it, on the device; the rest on
        the CPU at the same time. `x_ND`: the layer's routed input (the next layer's prediction)."""
        if layer == self.moe_layers[0]:
            self.admission.step()
        with self._cond:
            held = {e for e, _ in inputs if (r := self.book.get(ExpertKey(layer, e))) is not None and r.usable}
        on_device: dict[int, torch.Tensor] = {}
        on_cpu: list[tuple[int, torch.Tensor]] = []
        keys = [ExpertKey(layer, e) for e, _ in inputs]
        if self.mode == "hybrid":
            sides = self.placement.assign([(self.chunk_bytes[k], self.device_bytes[k], self.flops_per_row,
                                            rows.shape[0], k.expert in held) for k, (_, rows) in zip(keys, inputs)])
        else:
            sides = [self.mode] * len(inputs)
        for key, (e, rows), side in zip(keys, inputs, sides):
            self.admission.used(key)
            if side == "device":
                on_device[e] = rows
                self.hybrid.device_rows += rows.shape[0]
                if e in held:
                    self.hybrid.device_hits += 1
                    self.hybrid.device_hit_bytes += self.device_bytes[key]
                else:
                    self.hybrid.device_copies += 1
            else:
                on_cpu.append((e, rows))
                self.hybrid.cpu_rows += rows.shape[0]
                self.hybrid.cpu_uses += 1
                self.hybrid.cpu_bytes += self.chunk_bytes[key]
        job = self._submit_cpu(layer, on_cpu) if on_cpu else None
        out: dict[int, torch.Tensor] = {}
        try:
            # the ring's own call: the device's experts as they become usable, and the next layer's
            # prediction (read ahead into the CPU cache, `_stage_guesses`)
            for e, w in self.stream(layer, sorted(on_device), x_ND):
                out[e] = w.apply(on_device[e])
        finally:
            if job is not None:
                out.update(self._collect(job))
        if self.mode == "hybrid":
            self._admit(layer, [e for e, _ in on_cpu])
        return out

    def _submit_cpu(self, layer: int, items: list[tuple[int, torch.Tensor]]) -> _CpuJob:
        """Start the CPU's share: the rows cross to the host behind the compute that made them, and a
        worker computes and copies the outputs back."""
        copier = self.memory.copier
        x_RD = torch.cat([rows for _, rows in items])  # its own memory: nothing writes it before the copy
        host_x = torch.empty(x_RD.shape, dtype=x_RD.dtype, pin_memory=self.pin)
        to_host = copier.copy(x_RD, host_x, after=copier.record_compute())
        experts, counts = [e for e, _ in items], [rows.shape[0] for _, rows in items]
        future = self._cpu.submit(self._compute_on_cpu, layer, experts, counts, to_host, x_RD.dtype)
        return _CpuJob(experts, counts, future)

    def _compute_on_cpu(self, layer: int, experts: list[int], counts: list[int], to_host: CopyHandle,
                        dtype: torch.dtype) -> CopyHandle:
        """On the CPU worker: wait for the rows, compute each expert from the CPU cache (read from the
        store where it is not there), and issue the outputs' copy to the device."""
        to_host.synchronize()  # this worker waits for the copy; compute's thread never does
        x_RD = to_host.tensor
        out = torch.empty(x_RD.shape, dtype=dtype, pin_memory=self.pin)
        start = 0
        for e, n in zip(experts, counts):
            key = ExpertKey(layer, e)
            host = self.tier.get(key)
            try:
                w = self._weights_in_place(key, host)
                out[start:start + n] = w.apply(x_RD[start:start + n].to(_input_dtype(w))).to(dtype)
            finally:
                host.release()
            start += n
        return self.memory.copier.copy(out)

    def _collect(self, job: _CpuJob) -> dict[int, torch.Tensor]:
        """The CPU's outputs on the device, compute ordered after their copy (by its event only)."""
        y_RD = job.future.result().wait()
        return dict(zip(job.experts, y_RD.split(job.counts)))

    def _admit(self, layer: int, computed_on_cpu: list[int]) -> None:
        """Copy into the device cache, in the background, the CPU's experts used often enough lately."""
        for e in computed_on_cpu:
            key = ExpertKey(layer, e)
            with self._cond:
                cached = key in self.book
            if self.admission.admit(key, cached=cached):
                self.hybrid.admitted += 1
                self._request(key, Priority.IDLE, demand=False)

    def _stage_guesses(self, nxt: int, picked: list[int], cached: dict[int, bool], speculate: bool) -> None:
        """Read the next MoE layer's guessed experts ahead into the CPU cache (not into the device's)."""
        keys = [ExpertKey(nxt, e) for e in picked if not cached[e]]
        if speculate and keys:
            started = self.tier.prefetch(keys, priority=Priority.NEXT, speculative=True)
            with self._cond:
                self.guesses.read_ahead.update(started)

    # -- reporting --------------------------------------------------------------------------------
    def begin_request(self) -> None:
        super().begin_request()
        self.hybrid = HybridCounters()

    def request_stats(self, *, tokens: int) -> dict:
        stats = super().request_stats(tokens=tokens)
        h, uses = self.hybrid, self.hybrid.cpu_uses + self.hybrid.device_hits + self.hybrid.device_copies
        stats["hybrid"] = {"experts_on": self.mode, "cpu_share": h.cpu_uses / uses if uses else 0.0,
                           "device_hit_share": h.device_hits / uses if uses else 0.0,
                           "device_copy_share": h.device_copies / uses if uses else 0.0,
                           "cpu_rows": h.cpu_rows, "device_rows": h.device_rows, "admitted": h.admitted,
                           "cpu_bytes_per_token": h.cpu_bytes / max(tokens, 1),
                           "device_hit_bytes_per_token": h.device_hit_bytes / max(tokens, 1)}
        return stats

    def describe(self, model: MoEGPT | None = None) -> str:
        """What is where, in a phrase (the engine's stderr line): the dense part on the device (its bytes,
        with `model`), how many experts the device cache holds, and the CPU side's kernels."""
        from semoe.kernels import loader

        experts = len(self.layouts)
        dense = "" if model is None else \
            f" ({sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30:.1f} GiB)"
        where = {"hybrid": "each routed expert where it costs less", "cpu": "every routed expert on the CPU",
                 "device": "every routed expert streamed to the device"}[self.mode]
        kernels = loader.chosen()
        kernels = f"{loader.status().split(' (')[0]} kernels" if kernels is not None else "torch's ops"
        return (f"dense and attention on {self.device}{dense}; {min(self.ring_slots, experts):,} of {experts:,} "
                f"experts in device memory; the rest on CPU ({kernels}, {torch.get_num_threads()} threads) behind a "
                f"CPU cache of {self.tier.cache.capacity_bytes / 2**30:.2f} GiB; {where}")

    @staticmethod
    def least_cpu_cache(slots: int, top_k: int, biggest: int, *, copies: bool) -> int:
        """The smallest CPU cache hybrid decode works with: each device slot's source pinned until its
        copy lands (the ring's floor), and beside them the CPU side's expert and a layer's reads."""
        return (slots + top_k) * biggest

    @classmethod
    def default_slots(cls, store: Store, config: EngineConfig, dtype: torch.dtype, top_k: int) -> int:
        """The device cache with no budget given: on a GPU, the free device memory less a reserve for
        activations and KV caches (an eighth of it, at least 1 GiB, and `keep_bytes`), in slots, at
        most one per expert; elsewhere the ring's default."""
        device = torch.device(config.device)
        if device.type != "cuda":
            return super().default_slots(store, config, dtype, top_k)
        free, _ = torch.cuda.mem_get_info(device)
        experts = sum(1 for c in store.manifest.chunks if c.kind == "weight")
        return cls.cache_slots(free, config.keep_bytes, cls.slot_bytes(store, dtype), experts)

    @staticmethod
    def cache_slots(free: int, keep: int, slot: int, experts: int) -> int:
        """Slots of `slot` bytes in `free` bytes of device memory less the reserve (an eighth, at least
        1 GiB) and `keep`: at least 2, at most one per expert."""
        room = free - max(free // 8, 1 << 30) - keep
        return max(2, min(experts, room // slot))

    def close(self) -> None:
        self._cpu.shutdown(wait=True)
        super().close()


def _input_dtype(w: ExpertWeights) -> torch.dtype:
    """The dtype the CPU computes `w` in: its plain weights' (bfloat16 experts take bfloat16 rows in
    torch's products, float32 ones in the kernels'), float32 for compact weights (the kernels')."""
    for p in w.parts:
        if isinstance(p, torch.Tensor) and p.dim() >= 2 and p.dtype.is_floating_point:
            return p.dtype
    return torch.float32


def measure_rates(experts: HybridExperts, *, rows: int = 32, rounds: int = 3) -> HybridRates:
    """The machine's rates for `experts`' model, measured once at load on its first expert: a copy of
    32 MiB to the device, and one expert on each side at one row and at `rows` rows (the best of
    `rounds`)."""
    device, copier = experts.device, experts.memory.copier
    host = torch.empty(32 << 20, dtype=torch.uint8, pin_memory=experts.pin)
    h2d = _best(lambda: copier.copy(host).synchronize(), rounds)
    key = min(experts.layouts)
    entry = experts.tier.get(key)
    try:
        cpu_w = experts._weights_in_place(key, entry)
        dtype = _input_dtype(cpu_w)
        x1, xr = (torch.randn(n, experts.config.hidden_size).to(dtype) for n in (1, rows))
        cpu_1 = _best(lambda: cpu_w.apply(x1), rounds)
        cpu_r = _best(lambda: cpu_w.apply(xr), rounds)
        for h in experts.memory.fill(0, entry.raw, experts.layouts[key], experts.compute_slices[key]):
            h.synchronize()
    finally:
        entry.release()
    dev_w = expert_weights(experts.memory.buffers[0], experts.layouts[key], experts.compute_slices[key], experts.mlp)
    d1, dr = (torch.randn(n, experts.config.hidden_size, device=device, dtype=experts.dtype) for n in (1, rows))

    def on_device(x: torch.Tensor) -> None:
        dev_w.apply(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    dev_1, dev_r = _best(lambda: on_device(d1), rounds), _best(lambda: on_device(dr), rounds)
    experts.memory.read_done(0)
    f = experts.flops_per_row
    return HybridRates(h2d_bytes_s=host.numel() / h2d, cpu_bytes_s=experts.chunk_bytes[key] / cpu_1,
                       cpu_flops_s=rows * f / cpu_r, device_bytes_s=experts.device_bytes[key] / dev_1,
                       device_flops_s=rows * f / dev_r)


def _best(fn, rounds: int) -> float:
    """The least of `rounds` timings of `fn` after one untimed call (seconds, at least 1 ns)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return max(best, 1e-9)

