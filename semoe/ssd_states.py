"""Expert training states on SSD: the store behind the LFU CPU cache, written back copy-on-write.

Every expert has up to three chunk files in the store (`weight`, `adam_m`, `adam_v`; a missing
moment is zeros). Weights are read through `TieredExpertStore` (its CPU cache, prefetch queue and
checked direct reads), so forward and backward pay SSD reads only for cache misses. Gradients
accumulate in host memory up to `grad_budget_bytes`; beyond that they spill to files in
`spill_dir` and are read back by the optimizer.

The optimizer step streams experts tile by tile (a tile is one expert's three states): the tiles
ahead are being read by the prefetch queue while this one is updated in place in its cache buffer,
and the tiles behind are being written by a writer pool. Writes go into the staged version of the
store (`begin_version`), never over a committed file, so a crash at any moment leaves the last
checkpoint intact; the trainer's checkpoint adopts the written entries and commits them.

The overlay manifest: this rank's private copy of the committed manifest, updated as chunks are
written, so reads always find the newest file of each expert.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from semoe.checkpoint import hf_expert_names
from semoe.config import MoEConfig
from semoe.expert_states import AdamWConfig, ExpertStates, Held, Key, adamw_
from storage.errors import CacheFullError
from storage.fileio import ALIGN
from storage.pool import aligned_empty
from storage.manifest import ChunkEntry, Manifest, TensorEntry
from storage.store import ExpertTensor, Store, chunk_layout, write_expert_chunk
from storage.tiered import ExpertHandle, TieredExpertStore, TieredStoreConfig

log = logging.getLogger(__name__)

STATE_KINDS = ("weight", "adam_m", "adam_v")


def expert_array_rel(version: int, layer: int, kind: str) -> str:
    """Store-relative path of a version's expert array (as `StoreWriter.expert_array` names it)."""
    return os.path.join("arrays", f"v{version:08d}", "experts", f"L{layer:04d}.{kind}")


class ChunkFormat:
    """How one expert's three float32 tensors are packed in a chunk file."""

    def __init__(self, config: MoEConfig) -> None:
        D, Fh = config.hidden_size, config.moe_ffn_size
        self.config = config
        self.shapes = [(Fh, D), (Fh, D), (D, Fh)]
        self.offsets, self.nbytes = chunk_layout([(torch.float32, s) for s in self.shapes])

    def names(self, layer: int, expert: int) -> tuple[str, str, str]:
        return hf_expert_names(self.config, layer, expert)

    def views(self, raw: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of the three tensors in a chunk's bytes (uint8, at least `nbytes`)."""
        out = []
        for off, shape in zip(self.offsets, self.shapes):
            n = 4 * shape[0] * shape[1]
            out.append(raw[off:off + n].view(torch.float32).view(shape))
        return out

    def pack(self, tensors: list[torch.Tensor]) -> np.ndarray:
        buf = np.zeros(self.nbytes, dtype=np.uint8)
        for view, t in zip(self.views(torch.from_numpy(buf)), tensors):
            view.copy_(t)
        return buf

    def meta(self, layer: int, expert: int) -> list[ExpertTensor]:
        return [ExpertTensor(name=n, tensor=torch.empty(s, device="meta")) for n, s in
                zip(self.names(layer, expert), self.shapes)]

    def write(self, root: str, version: int, layer: int, expert: int, kind: str, buf: np.ndarray
              ) -> tuple[list[TensorEntry], ChunkEntry]:
        """Write one chunk file into a staged version; returns its manifest entries."""
        return write_expert_chunk(root, expert_array_rel(version, layer, kind), version, layer, expert, kind,
                                  self.meta(layer, expert), buf, self.offsets)


class SSDExpertStates(ExpertStates):
    """Local experts' states in the store at `root`, behind a CPU cache of `cpu_cache_bytes`."""

    @staticmethod
    def transient_bytes(config: MoEConfig, prefetch_depth: int = 1, write_threads: int = 1) -> int:
        """Moment buffers in flight: the tiles read ahead, the one updated, the ones being written."""
        return (prefetch_depth + 1 + write_threads) * 2 * ChunkFormat(config).nbytes

    @staticmethod
    def min_cache_bytes(config: MoEConfig, prefetch_depth: int = 1, write_threads: int = 1) -> int:
        """The smallest budget that works: the moments in flight, plus weights for the tiles being
        updated and written and one more."""
        return (SSDExpertStates.transient_bytes(config, prefetch_depth, write_threads)
                + (write_threads + 2) * ChunkFormat(config).nbytes)

    def __init__(self, config: MoEConfig, experts: range, device: torch.device, *, root: str,
                 cpu_cache_bytes: int, spill_dir: str, grad_budget_bytes: int | None = None,
                 read_mode: str = "direct", prefetch_depth: int = 1, write_threads: int = 1,
                 layers: list[int] | None = None) -> None:
        super().__init__(config, experts, device, layers)
        self.root = root
        self.format = ChunkFormat(config)
        committed = Store.open(root).manifest
        self.overlay = Manifest.from_json(committed.to_json(), source=f"{root} (overlay)")
        self.view = Store(root, self.overlay)
        # moments stream past the cache: the tiles read ahead and those being written come off the budget
        transient = self.transient_bytes(config, prefetch_depth, write_threads)
        if cpu_cache_bytes - transient < (write_threads + 2) * self.format.nbytes:
            raise ValueError(f"cpu_cache_bytes={cpu_cache_bytes} is below the minimum of "
                             f"{self.min_cache_bytes(config, prefetch_depth, write_threads)} for these experts")
        self.tier = TieredExpertStore(self.view, TieredStoreConfig(cpu_cache_bytes=cpu_cache_bytes - transient,
                                                                   read_mode=read_mode))
        self.spill_dir = spill_dir
        self.grad_budget = cpu_cache_bytes if grad_budget_bytes is None else grad_budget_bytes
        self.prefetch_depth = prefetch_depth
        self.write_depth = write_threads
        self.version: int | None = None  # the staged version writes go to
        self.written: dict[tuple[int, int, str], tuple[list[TensorEntry], ChunkEntry]] = {}
        self.g: dict[Key, list[torch.Tensor]] = {}
        self.spilled: set[Key] = set()
        self.grad_bytes = 0
        self._lock = threading.Lock()
        self._writers = ThreadPoolExecutor(write_threads, thread_name_prefix="semoe-expert-write")
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="semoe-moment-read")
        self._bytes_written = self._moment_bytes = 0
        self._cond = threading.Condition()
        self._pending: set[Key] = set()  # experts whose update is in flight
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None
        self._gen = 0  # optimizer steps started: names the spill folder

    # -- versions -----------------------------------------------------------------------------
    def begin_version(self, version: int) -> None:
        """Write from now on into staged `version` (whose arrays the trainer has created)."""
        self.version = version
        self.written = {}

    def written_entries(self) -> tuple[list[TensorEntry], list[ChunkEntry]]:
        """Entries of every chunk written into the staged version, for the checkpoint to adopt."""
        self.wait_idle()
        tensors = [t for entries, _ in self.written.values() for t in entries]
        return tensors, [c for _, c in self.written.values()]

    # -- forward and backward -----------------------------------------------------------------
    def _get(self, layer: int, expert: int, kind: str) -> ExpertHandle:
        """Pin a state in the cache; when prefetches in flight hold all the room, wait for them."""
        for _ in range(1000):
            try:
                return self.tier.get(layer, expert, kind)
            except CacheFullError:
                self.tier.drain()  # finished prefetches are unpinned and can be evicted
                time.sleep(0.001)
        raise CacheFullError(f"CPU cache of {self.tier.config.cpu_cache_bytes} bytes stays full of pinned "
                             f"expert states; give --cpu-cache more room")

    def fetch(self, layer: int, expert: int) -> Held:
        self._wait_updated((layer, expert))
        h = self._get(layer, expert, "weight")
        ws = self.format.views(h.raw)
        if self.device.type != "cpu":  # staged to the device; the host copy may be evicted now
            ws = [w.to(self.device, non_blocking=True) for w in ws]
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            h.release()
            return Held(*ws)
        return Held(*ws, release=h.release)

    def prefetch(self, layer: int, experts: list[int], priority: float = 0.0) -> None:
        self.tier.prefetch([(layer, e, "weight") for e in experts if e in self.experts], priority=priority)

    def add_grad(self, layer: int, expert: int, grads: tuple[torch.Tensor, ...]) -> None:
        key = (layer, expert)
        grads = [g.detach().to("cpu", torch.float32) for g in grads]
        if self.grad_scale != 1.0:
            grads = [g * self.grad_scale for g in grads]
        if key in self.g:
            for acc, g in zip(self.g[key], grads):
                acc.add_(g)
            return
        if key in self.spilled:
            old = self._read_spill(key)
            self._write_spill(key, [a + g for a, g in zip(old, grads)])
            return
        size = sum(g.numel() * 4 for g in grads)
        if self.grad_bytes + size > self.grad_budget:
            self._write_spill(key, grads)
            self.spilled.add(key)
        else:
            self.g[key] = grads
            self.grad_bytes += size

    def _spill_path(self, key: Key, gen: int | None = None) -> str:
        gen = self._gen if gen is None else gen
        return os.path.join(self.spill_dir, f"step{gen % 2}", f"L{key[0]:04d}.E{key[1]:05d}.grad")

    def _write_spill(self, key: Key, grads: list[torch.Tensor]) -> None:
        path = self._spill_path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        buf = self.format.pack(grads)
        with open(path, "wb") as f:
            f.write(memoryview(buf))

    def _read_spill(self, key: Key, gen: int | None = None) -> list[torch.Tensor]:
        with open(self._spill_path(key, gen), "rb") as f:
            raw = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
        return [t.clone() for t in self.format.views(raw)]

    def _grads(self, key: Key) -> list[torch.Tensor]:
        return self.g[key] if key in self.g else self._read_spill(key)

    # -- the optimizer ------------------------------------------------------------------------
    def touched(self) -> list[Key]:
        return sorted(set(self.g) | self.spilled)

    def discard_grads(self) -> None:
        super().discard_grads()
        for key in self.spilled:
            os.unlink(self._spill_path(key))
        self.g, self.spilled, self.grad_bytes = {}, set(), 0

    def grad_sq_norm(self) -> float:
        return float(sum(float(g.double().pow(2).sum()) for key in self.touched() for g in self._grads(key)))

    def _read_moment(self, key: Key, kind: str) -> torch.Tensor:
        """A moment's chunk bytes, read past the cache (a moment is used once a step, so caching it
        would only push weights out), or zeros for one never written."""
        if not self.overlay.has_chunk(key[0], key[1], kind):
            return torch.zeros(self.format.nbytes, dtype=torch.uint8)
        chunk = self.overlay.chunk(key[0], key[1], kind)
        _, buf = aligned_empty(chunk.bytes, alignment=ALIGN, pin=False)  # the view keeps its base alive
        crcs = self.tier.reader.read_many([self.view.chunk_request(chunk, memoryview(buf.numpy()))])[0]
        self.view.check_crcs(chunk, crcs)
        with self._lock:
            self._moment_bytes += chunk.bytes
        return buf

    def _read_moments(self, key: Key) -> tuple[torch.Tensor, torch.Tensor]:
        return self._read_moment(key, "adam_m"), self._read_moment(key, "adam_v")

    def step(self, lr: float, cfg: AdamWConfig, clip_coef: float = 1.0) -> None:
        """Start the expert optimizer step in the background and return.

        Experts are updated in layer order, so the next step's forward, which waits in `fetch` only
        for the experts it needs, overlaps with the updates of later layers and with every write."""
        self.wait_idle()
        if self.version is None:
            raise RuntimeError("SSDExpertStates.step before begin_version: no staged version to write into")
        keys = self.touched()
        grads, spilled, gen = self.g, self.spilled, self._gen
        self.g, self.spilled, self.grad_bytes = {}, set(), 0
        self._gen += 1  # the next step spills into its own folder
        with self._cond:
            self._pending = set(keys)
        self._worker = threading.Thread(target=self._update_all, name="semoe-expert-adam", daemon=True,
                                        args=(keys, grads, spilled, gen, lr, cfg, clip_coef))
        self._worker.start()

    @torch.no_grad()
    def _update_all(self, keys: list[Key], grads: dict[Key, list[torch.Tensor]], spilled: set[Key], gen: int,
                    lr: float, cfg: AdamWConfig, clip_coef: float) -> None:
        try:
            moments: dict[Key, Future] = {}
            writes: deque[Future] = deque()
            for i, key in enumerate(keys):
                for ahead in keys[i:i + 1 + self.prefetch_depth]:  # read the next tiles meanwhile
                    if ahead not in moments:
                        moments[ahead] = self._readers.submit(self._read_moments, ahead)
                        self.tier.prefetch([(ahead[0], ahead[1], "weight")])
                m_raw, v_raw = moments.pop(key).result()
                h = self._get(key[0], key[1], "weight")
                try:
                    g = grads.pop(key) if key in grads else self._read_spill(key, gen)
                    n = self.next_adam_step(key)
                    for w, gt, m, v in zip(self.format.views(h.raw), g, self.format.views(m_raw),
                                           self.format.views(v_raw)):
                        if clip_coef != 1.0:
                            gt.mul_(clip_coef)
                        adamw_(w, gt, m, v, step=n, lr=lr, cfg=cfg)
                except BaseException:
                    h.release()
                    raise
                with self._cond:  # usable now; the write below reads the same bytes
                    self._pending.discard(key)
                    self._cond.notify_all()
                writes.append(self._writers.submit(self._write_tile, key, [(h, h.raw), (None, m_raw), (None, v_raw)]))
                while len(writes) > self.write_depth:  # bounded: tiles being written stay pinned
                    writes.popleft().result()
            while writes:
                writes.popleft().result()
            for key in spilled:
                os.unlink(self._spill_path(key, gen))
        except BaseException as e:  # surfaced by the next fetch, step or checkpoint
            log.debug("expert optimizer step failed", exc_info=True)
            with self._cond:
                self._error = e
                self._pending.clear()
                self._cond.notify_all()

    def wait_idle(self) -> None:
        """Wait for the optimizer step in flight (updates and writes); raise what it raised."""
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _wait_updated(self, key: Key) -> None:
        with self._cond:
            while key in self._pending and self._error is None:
                self._cond.wait()
        self._raise_error()

    def _write_tile(self, key: Key, held: list[tuple[ExpertHandle | None, torch.Tensor]]) -> None:
        """Write one expert's updated states into the staged version, then unpin them."""
        try:
            for kind, (_, raw) in zip(STATE_KINDS, held):
                buf = raw.numpy()
                entries, chunk = self.format.write(self.root, self.version, key[0], key[1], kind, buf)
                with self._lock:
                    self.overlay.upsert(tensors=entries, chunks=[chunk])
                    self.written[(key[0], key[1], kind)] = (entries, chunk)
                    self._bytes_written += buf.nbytes
        finally:
            for h, _ in held:
                if h is not None:
                    h.release()

    # -- reporting and shutdown ---------------------------------------------------------------
    def stats(self) -> dict:
        s = self.tier.stats()
        with self._lock:
            return {"cpu_hit_rate": s.hit_rate, "ssd_read_bytes": s.ssd_bytes + self._moment_bytes,
                    "ssd_written_bytes": self._bytes_written,
                    "cpu_hits": s.hits, "cpu_misses": s.misses}

    def close(self) -> None:
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        self.tier.close()
