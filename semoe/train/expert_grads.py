"""One step's expert gradients on the host, summed in the order they arrive (the SSD backend's).

A gradient is held in memory while the budget has room; beyond it, it goes to a spill file of its
own and comes back when its expert is stepped; one whose products are small beside it may be kept
as those (`GradFactors`) and made again then. The norm of every gradient is known without reading
a spilled one back: taken as it was written, or made.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from semoe.train.expert_states import ChunkFormat, GradFactors, Key
from storage.errors import StorageError


class GradAccumulator:
    """One step's expert gradients, summed in the order they arrive: in host memory while they fit
    in `budget_bytes`, beyond that in one spill file per expert under `folder`."""

    def __init__(self, fmt: ChunkFormat, budget_bytes: int, folder: str, scratch: torch.Tensor | None = None,
                 on_io: Callable[[str, int], None] | None = None) -> None:
        """`scratch`: uint8 memory of at least one chunk that spilled gradients are read back into
        and gradients are made in from their products (allocated here where not given)."""
        self.format = fmt
        self.on_io = on_io  # told ("read" or "written", bytes) of each spill file read or written
        self.budget_bytes = budget_bytes
        self.folder = folder
        self.held: dict[Key, list[torch.Tensor]] = {}
        self.spilled: set[Key] = set()
        self.nbytes = 0  # of `held`
        self._releases: list[Callable[[], None]] = []  # of the memory the held sums live in
        self._norms: dict[Key, list[torch.Tensor]] = {}  # of each spilled or factored sum, taken as it is made
        self.factors: dict[Key, GradFactors] = {}  # gradients kept as their products (counted in `nbytes`)
        self._scratch = torch.empty(fmt.nbytes, dtype=torch.uint8) if scratch is None else scratch

    def add(self, key: Key, grads: list[torch.Tensor], release: Callable[[], None] | None = None,
            raw: torch.Tensor | None = None) -> None:
        """Add one gradient (host float32). A first one that fits is kept as the sum itself, and
        `release` (which frees the memory of `grads`) is called by `discard`; otherwise at once.
        `raw`: the chunk-format bytes `grads` are views of, written as they are if it spills."""
        kept = False
        if key in self.factors:  # a second gradient: the first made now, then this one added to it, in order
            f = self.factors.pop(key)
            self.nbytes -= f.nbytes
            del self._norms[key]
            self.add(key, list(f.grads()))
        if key in self.held:
            for acc, g in zip(self.held[key], grads):
                acc.add_(g)
        elif key in self.spilled:
            self._write(key, [a + g for a, g in zip(self._read(key), grads)])
        else:
            size = sum(g.numel() * g.element_size() for g in grads)
            if self.nbytes + size > self.budget_bytes:
                self._write(key, grads, raw)
                self.spilled.add(key)
            else:
                self.held[key] = list(grads)
                self.nbytes += size
                kept = True
        if release is not None and kept:
            self._releases.append(release)
        elif release is not None:
            release()

    def has(self, key: Key) -> bool:
        return key in self.held or key in self.spilled or key in self.factors

    def room_for(self, nbytes: int) -> bool:
        return self.nbytes + nbytes <= self.budget_bytes

    def add_factors(self, key: Key, factors: GradFactors, norms: list[torch.Tensor]) -> None:
        """A first gradient of `key` kept as its products, with the norms of the gradient they make."""
        if self.has(key):
            raise ValueError(f"expert {key}: a gradient is held already; add() sums a second one")
        self.factors[key] = factors
        self._norms[key] = norms
        self.nbytes += factors.nbytes

    def keys(self) -> list[Key]:
        """Every expert with a gradient, in update order (layer, then expert)."""
        return sorted(set(self.held) | self.spilled | set(self.factors))

    def grads(self, key: Key) -> list[torch.Tensor]:
        """The summed gradient of `key`; read back if spilled or made from its products, into memory
        the next call reuses."""
        if key in self.held:
            return self.held[key]
        if key in self.factors:
            return list(self.factors[key].grads(self.scratch_views()))
        return self._read(key)

    def norms(self, key: Key) -> list[torch.Tensor]:
        """The float32 norm of each tensor of `key`'s sum, as `torch._foreach_norm` gives it (a
        spilled sum's were taken when it was written: it is not read back for them)."""
        return list(torch._foreach_norm(self.held[key])) if key in self.held else self._norms[key]

    def scratch_views(self) -> list[torch.Tensor]:
        """The scratch chunk's float32 views, valid until the next `grads`, `scratch_views` or spill read."""
        return self.format.views(self._scratch)

    def path(self, key: Key) -> str:
        return os.path.join(self.folder, f"L{key[0]:04d}.E{key[1]:05d}.grad")

    def discard(self) -> None:
        """Forget every gradient and remove the spill files."""
        for key in self.spilled:
            os.unlink(self.path(key))
        for release in self._releases:
            release()
        self.held, self.spilled, self.nbytes, self._releases, self._norms = {}, set(), 0, [], {}
        self.factors = {}

    def _write(self, key: Key, grads: list[torch.Tensor], raw: torch.Tensor | None = None) -> None:
        os.makedirs(self.folder, exist_ok=True)
        self._norms[key] = list(torch._foreach_norm(grads))
        with open(self.path(key), "wb") as f:
            f.write(memoryview(raw.numpy() if raw is not None else self.format.pack(grads)))
        if self.on_io is not None:
            self.on_io("written", self.format.nbytes)

    def _read(self, key: Key) -> list[torch.Tensor]:
        with open(self.path(key), "rb") as f:
            if f.readinto(memoryview(self._scratch.numpy())) != self.format.nbytes:
                raise StorageError(f"{self.path(key)}: spilled gradient is shorter than {self.format.nbytes} bytes")
        if self.on_io is not None:
            self.on_io("read", self.format.nbytes)
        return self.format.views(self._scratch)
