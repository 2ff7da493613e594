"""Giving CPU-cache memory back when the process starts re-reading its own pages from storage.

With memory short, a CPU cache sized a little too large for what the machine has left makes the
kernel evict the pages of the code the process runs (torch's and the interpreter's, file-backed),
which every forward step then faults back in from disk: decode slows by an order of magnitude while
the cache itself looks healthy. The guard reads the process's major page faults once per step; after
`hot_steps` steps in a row with at least `faults_per_step` each, it lowers the cache's budget by a
sixteenth (at least `step_bytes`, one expert), never below `floor_bytes`. A cold start faults its
code in once and stops; thrashing repeats every step, so it is what the guard answers.

`--cpu-cache auto` starts from `auto_cpu_cache_bytes`: the memory the kernel can hand out (its
MemAvailable) once the dense weights are loaded, less a reserve for the code the process runs, its
KV caches and the rest of the machine. Loading's own transient buffers are still held then, and
memory other processes give back comes later, so the guard also grows such a cache by a quarter (at
least one expert) after `calm_steps` steps without faults, as far as MemAvailable beyond the same
reserve allows, up to `ceiling_bytes` (every expert). It keeps the reserve even though the kernel
could take more from the process's own cold code pages: a cache grown until MemAvailable read 0
stalled the whole process in reclaim (0.08 tok/s) rather than in faults the guard would see. The
first time faults make it shrink, the level it shrank to becomes the ceiling.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from storage.process_memory import available_ram_bytes, major_faults

if TYPE_CHECKING:  # the placement's choice imports this module in a process that may never load torch
    from storage.tiered_experts import TieredExpertStore

log = logging.getLogger(__name__)

FAULTS_PER_STEP = 32  # major faults of one step that count it as hot (a healthy warm decode makes none)
HOT_STEPS = 3  # hot steps in a row before the cache shrinks, and again after each shrink
# `--cpu-cache auto` leaves this much of the available memory, or a sixteenth of it where that is
# more: a warm decoding step touches about 7 MiB of code (torch's, the interpreter's; measured with
# /proc/self/clear_refs on the bench model), and the kernel reads code back in 8 MiB read-ahead windows
AUTO_RESERVE_BYTES = 48 << 20
CPU_CACHE_AUTO = "auto"  # EngineConfig.cpu_cache_bytes and --cpu-cache: size the cache from the memory left
CALM_STEPS = 2  # steps in a row with at most CALM_FAULTS major faults before an auto cache grows
CALM_FAULTS = 2


def auto_cpu_cache_bytes(expert_bytes: int, *, keep_bytes: int = 0, available: Callable[[], int] | None = None) -> int:
    """`--cpu-cache auto`: every expert where they fit, else the available memory (`available`, by
    default the kernel's MemAvailable) less the reserve and `keep_bytes` (memory the process will
    take later: a server's KV caches); 0 where nothing is left (the caller raises it to what its ring
    needs)."""
    return max(0, min(expert_bytes, spare_bytes((available or available_ram_bytes)(), keep_bytes)))


def cpu_cache_size(requested: int | str | None, *, expert_bytes: int, least_bytes: int, keep_bytes: int = 0,
                   available: Callable[[], int] | None = None, flag: str = "--cpu-cache") -> int:
    """The CPU cache's bytes, the one rule of every path that decodes over one (the engine's ring, the
    torch-free runner): `requested` None holds every expert; CPU_CACHE_AUTO takes `auto_cpu_cache_bytes`;
    a number is taken as given, 0 meaning the least. Never under `least_bytes`, the least the path
    decodes with: a smaller size named by `flag` is raised to it, and a warning says so."""
    if requested is None:
        size = expert_bytes
    elif requested == CPU_CACHE_AUTO:
        size = auto_cpu_cache_bytes(expert_bytes, keep_bytes=keep_bytes, available=available)
    else:
        size = int(requested)
        if 0 < size < least_bytes:
            log.warning("%s %d bytes is under the %d bytes decoding needs (the experts a step may use at once); "
                        "taking %d", flag, size, least_bytes, least_bytes)
    return max(size, least_bytes)


def reserve_bytes(free: int) -> int:
    """What `--cpu-cache auto` leaves of `free` bytes available: AUTO_RESERVE_BYTES or a sixteenth."""
    return max(AUTO_RESERVE_BYTES, free // 16)


def spare_bytes(free: int, keep_bytes: int) -> int:
    """What a model or a cache may take of `free` bytes available: the reserve and `keep_bytes` left."""
    return free - reserve_bytes(free) - keep_bytes


class MemoryGuard:
    """Shrinks a tier's CPU cache while forward steps keep faulting the process's pages in."""

    def __init__(self, tier: "TieredExpertStore", *, floor_bytes: int, step_bytes: int,
                 faults: Callable[[], int] = major_faults, faults_per_step: int = FAULTS_PER_STEP,
                 hot_steps: int = HOT_STEPS, ceiling_bytes: int | None = None,
                 available: Callable[[], int] | None = None, calm_steps: int = CALM_STEPS,
                 keep_bytes: int = 0) -> None:
        self.tier = tier
        self.floor_bytes = floor_bytes
        self.step_bytes = step_bytes
        self.faults = faults
        self.faults_per_step = faults_per_step
        self.hot_steps = hot_steps
        # an auto cache grows up to this (None: a fixed budget, which only ever shrinks)
        self.ceiling_bytes = ceiling_bytes
        self.available = available or available_ram_bytes
        self.calm_steps = calm_steps
        self.keep_bytes = keep_bytes  # left free beside the reserve (auto_cpu_cache_bytes)
        self._last = faults()
        self._hot = self._calm = 0
        self.shrinks = 0  # how many times the cache was lowered
        self.grows = 0  # and raised

    def step(self) -> int:
        """Call once per forward step, before it runs; returns the bytes the cache was lowered by
        (negative: raised by)."""
        now = self.faults()
        faulted, self._last = now - self._last, now
        self._hot = self._hot + 1 if faulted >= self.faults_per_step else 0
        self._calm = self._calm + 1 if faulted <= CALM_FAULTS else 0
        capacity = self.tier.cache.capacity_bytes
        if self._calm >= self.calm_steps and self.ceiling_bytes is not None and capacity < self.ceiling_bytes:
            return -self._grow(capacity)
        if self._hot < self.hot_steps or capacity <= self.floor_bytes:
            return 0
        self._hot = 0
        target = max(self.floor_bytes, capacity - max(self.step_bytes, capacity // 16))
        self.tier.shrink(target)
        self.shrinks += 1
        if self.ceiling_bytes is not None:
            self.ceiling_bytes = target  # the limit is found: stay below it
        log.warning("offload: the process is reading its own pages back from storage (%d major page faults in "
                    "the last step): CPU cache lowered from %.0f to %.0f MiB", faulted, capacity / 2**20,
                    target / 2**20)
        return capacity - target

    def _grow(self, capacity: int) -> int:
        """Raise an auto cache by a quarter (at least one expert), within what MemAvailable shows beyond
        the reserve `auto_cpu_cache_bytes` keeps; the bytes added."""
        self._calm = 0
        spare = spare_bytes(self.available(), self.keep_bytes)
        target = min(self.ceiling_bytes, capacity + min(max(self.step_bytes, capacity // 4), spare))
        if target - capacity < min(self.step_bytes, self.ceiling_bytes - capacity):
            return 0
        self.tier.grow(target)
        self.grows += 1
        log.info("offload: CPU cache raised from %.0f to %.0f MiB (memory available, no faults)",
                 capacity / 2**20, target / 2**20)
        return target - capacity
