"""Where a routed expert runs in hybrid decode: on the device, or on the CPU through the compiled kernels.

Plain Python, no threads and no tensors: the decisions `inference.offload.hybrid` carries out.

- `HybridRates`: the machine's rates, measured once at load (`inference.offload.hybrid.measure_rates`):
  host-to-device copies, the CPU's kernels on one expert (bytes a second with one row, multiply-adds a
  second with many) and the device's on the same expert.
- `Placement.side`: per expert and per step, from the rows routed to it, whether it is cheaper to
  compute it on the CPU (where its bytes are) or to copy it to the device and compute it there. An
  expert the device cache holds runs on the device. Many rows (a prompt, a large batch) make the
  copy worth its time; one decoding row rarely does. No fixed row threshold: the crossing point
  follows the rates, so it moves with the link, the CPU and the expert's format.
- `Placement.assign`: a layer's experts together. The two sides run at once, so an expert cheaper on
  the busy side may still be better on the idle one: experts move while that shortens the layer.
- `DeviceAdmission`: which experts computed on the CPU earn a place in the device cache. Uses are
  counted with aging, an expert is admitted after `min_uses` recent uses, and at most
  `per_step` experts are admitted a step: a burst of new experts (one prompt's) does not flush the
  cache of the experts decoding keeps using.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# where offloaded routed experts run (`EngineConfig.experts_on`, `--experts-on`): auto (hybrid on a GPU,
# the ring on CPU), hybrid (per expert per step, `Placement`), every routed expert on the CPU, every routed
# expert on the device (streamed through its ring, SE-MoE's design)
EXPERTS_ON = ("auto", "hybrid", "cpu", "device")


@dataclass(frozen=True)
class HybridRates:
    """Rates of one machine for one model's experts (bytes and multiply-adds a second)."""

    h2d_bytes_s: float  # host-to-device copies of expert bytes
    cpu_bytes_s: float  # the CPU kernels reading an expert's weights (one row: bound by memory)
    cpu_flops_s: float  # the CPU kernels' multiply-adds with many rows (bound by arithmetic)
    device_bytes_s: float  # the device reading an expert's weights
    device_flops_s: float  # the device's multiply-adds

    def __post_init__(self) -> None:
        for name in ("h2d_bytes_s", "cpu_bytes_s", "cpu_flops_s", "device_bytes_s", "device_flops_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HybridRates.{name} must be > 0, got {getattr(self, name)}")

    def describe(self) -> str:
        """The rates in a phrase."""
        return (f"host to device {self.h2d_bytes_s / 1e9:.1f} GB/s, CPU kernels {self.cpu_bytes_s / 1e9:.1f} GB/s "
                f"and {self.cpu_flops_s / 1e9:.0f} GFLOP/s, device {self.device_bytes_s / 1e9:.1f} GB/s and "
                f"{self.device_flops_s / 1e9:.0f} GFLOP/s")


@dataclass(frozen=True)
class Placement:
    """The cost model: seconds for one expert of `host_bytes` as stored (`device_bytes` once placed on
    the device) and `flops_per_row` (2 x its weights' elements) on `rows` rows, on each side."""

    rates: HybridRates

    def cpu_seconds(self, host_bytes: int, flops_per_row: int, rows: int) -> float:
        """On the CPU, where the expert's bytes are: its weights read once, or its arithmetic."""
        r = self.rates
        return max(host_bytes / r.cpu_bytes_s, rows * flops_per_row / r.cpu_flops_s)

    def device_seconds(self, device_bytes: int, flops_per_row: int, rows: int, *, resident: bool) -> float:
        """On the device: the copy across the link unless the device cache holds it, then the compute."""
        r = self.rates
        copy = 0.0 if resident else device_bytes / r.h2d_bytes_s
        return copy + max(device_bytes / r.device_bytes_s, rows * flops_per_row / r.device_flops_s)

    def side(self, host_bytes: int, device_bytes: int, flops_per_row: int, rows: int, *, resident: bool) -> str:
        """"device" where the device holds the expert or copying and computing it there takes less time
        than computing it on the CPU; else "cpu"."""
        if resident:
            return "device"
        on_device = self.device_seconds(device_bytes, flops_per_row, rows, resident=False)
        return "device" if on_device < self.cpu_seconds(host_bytes, flops_per_row, rows) else "cpu"

    def assign(self, experts: list[tuple[int, int, int, int, bool]]) -> list[str]:
        """The side of each of one layer's experts ((host bytes, device bytes, flops a row, rows, resident)
        each), for the least time of the layer: both sides run at once, so the layer takes the longer
        side's total. Each expert starts on its cheaper side (`side`); then, while it shortens the layer,
        the expert whose move to the other side leaves the longer total least is moved there. Never
        longer than every expert on its cheaper side, nor than either side alone (the ends)."""
        # each expert's seconds on each side
        cost = [{"cpu": self.cpu_seconds(h, f, n), "device": self.device_seconds(d, f, n, resident=r)}
                for h, d, f, n, r in experts]
        sides = ["device" if r or c["device"] < c["cpu"] else "cpu" for c, (*_, r) in zip(cost, experts)]  # `side`'s
        total = {side: sum(c[side] for c, s in zip(cost, sides) if s == side) for side in ("cpu", "device")}
        while True:
            busy = max(total, key=total.get)
            idle = "device" if busy == "cpu" else "cpu"
            best, best_i = total[busy], None
            for i, s in enumerate(sides):
                after = max(total[busy] - cost[i][busy], total[idle] + cost[i][idle]) if s == busy else best
                if after < best - 1e-15:
                    best, best_i = after, i
            if best_i is None:
                return sides
            total[busy] -= cost[best_i][busy]
            total[idle] += cost[best_i][idle]
            sides[best_i] = idle

    def crossing_rows(self, host_bytes: int, device_bytes: int, flops_per_row: int, limit: int = 1 << 16) -> int | None:
        """The fewest rows at which an expert not on the device is copied there (None: not up to `limit`)."""
        lo, hi = 1, limit
        if self.side(host_bytes, device_bytes, flops_per_row, hi, resident=False) == "cpu":
            return None
        while lo < hi:  # the device's side gains with rows: the first row count where it wins
            mid = (lo + hi) // 2
            if self.side(host_bytes, device_bytes, flops_per_row, mid, resident=False) == "device":
                hi = mid
            else:
                lo = mid + 1
        return lo


@dataclass
class DeviceAdmission:
    """Which experts computed elsewhere are copied into the device cache (keys are any hashable)."""

    min_uses: float = 2.0  # aged uses before an expert is admitted
    per_step: int = 1  # admissions a step at most
    decay: float = 0.9  # each step's aging of every count
    prune_below: float = 0.05  # counts aged below this are forgotten
    uses: dict = field(default_factory=dict)
    _admitted_this_step: int = 0

    def step(self) -> None:
        """A new step: age every count, and open the step's admissions."""
        self.uses = {k: u * self.decay for k, u in self.uses.items() if u * self.decay >= self.prune_below}
        self._admitted_this_step = 0

    def used(self, key) -> None:
        """One use of `key` (on either side)."""
        self.uses[key] = self.uses.get(key, 0.0) + 1.0

    def admit(self, key, *, cached: bool) -> bool:
        """Whether to copy `key` into the device cache now: it is not there, has been used often enough
        lately, and the step's admissions are not spent."""
        if cached or self._admitted_this_step >= self.per_step or self.uses.get(key, 0.0) < self.min_uses:
            return False
        self._admitted_this_step += 1
        return True
