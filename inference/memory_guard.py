"""Giving CPU-cache memory back when the process starts re-reading its own pages from storage.

With memory short, a CPU cache sized a little too large for what the machine has left makes the
kernel evict the pages of the code the process runs (torch's and the interpreter's, file-backed),
which every forward step then faults back in from disk: decode slows by an order of magnitude while
the cache itself looks healthy. The guard reads the process's major page faults once per step; after
`hot_steps` steps in a row with at least `faults_per_step` each, it lowers the cache's budget by a
sixteenth (at least `step_bytes`, one expert), never below `floor_bytes`. A cold start faults its
code in once and stops; thrashing repeats every step, so it is what the guard answers.
"""

from __future__ import annotations

import logging
from typing import Callable

from storage.envinfo import major_faults
from storage.tiered import TieredExpertStore

log = logging.getLogger(__name__)

FAULTS_PER_STEP = 32  # major faults of one step that count it as hot (a healthy warm decode makes none)
HOT_STEPS = 3  # hot steps in a row before the cache shrinks, and again after each shrink


class MemoryGuard:
    """Shrinks a tier's CPU cache while forward steps keep faulting the process's pages in."""

    def __init__(self, tier: TieredExpertStore, *, floor_bytes: int, step_bytes: int,
                 faults: Callable[[], int] = major_faults, faults_per_step: int = FAULTS_PER_STEP,
                 hot_steps: int = HOT_STEPS) -> None:
        self.tier = tier
        self.floor_bytes = floor_bytes
        self.step_bytes = step_bytes
        self.faults = faults
        self.faults_per_step = faults_per_step
        self.hot_steps = hot_steps
        self._last = faults()
        self._hot = 0
        self.shrinks = 0  # how many times the cache was lowered

    def step(self) -> int:
        """Call once per forward step, before it runs; returns the bytes the cache was lowered by."""
        now = self.faults()
        faulted, self._last = now - self._last, now
        self._hot = self._hot + 1 if faulted >= self.faults_per_step else 0
        capacity = self.tier.cache.capacity_bytes
        if self._hot < self.hot_steps or capacity <= self.floor_bytes:
            return 0
        self._hot = 0
        target = max(self.floor_bytes, capacity - max(self.step_bytes, capacity // 16))
        self.tier.shrink(target)
        self.shrinks += 1
        log.warning("offload: the process is reading its own pages back from storage (%d major page faults in "
                    "the last step): CPU cache lowered from %.0f to %.0f MiB", faulted, capacity / 2**20,
                    target / 2**20)
        return capacity - target

