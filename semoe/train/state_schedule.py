"""When a training step uses each expert's weights next: the SSD backend's forecast for its CPU cache.

A step uses an expert's weights in a fixed order: forward up the layers, backward down them, the
optimizer's update up again, and the next step's forward of a layer follows that layer's update
(the optimizer thread and the next forward run side by side). One position per layer visit, with
L the backend's layers and i a layer's index among them:

    forward of layer i in step g     g*P + i
    backward                          g*P + L + (L-1-i)
    update                            g*P + 2L + i
    next step's forward               (g+1)*P + i,   P = 2L + 1

At every use the backend tells the cache's `ScheduledPolicy` when that expert's next use comes (after
a forward use its backward, after a backward use its update, after its update the next forward), and
where the main thread is. The cache then evicts the weight needed furthest ahead: a layer the
optimizer just updated stays for the forward that follows, instead of going, as under LFU or LRU,
to make room for layers the current pass has long finished with. Micro-batches repeat forward and
backward at the same positions.
"""

from __future__ import annotations

from storage.keys import ExpertKey
from storage.policies import ScheduledPolicy

FORWARD, BACKWARD, UPDATE = "forward", "backward", "update"
_NEXT = {FORWARD: (BACKWARD, 0), BACKWARD: (UPDATE, 0), UPDATE: (FORWARD, 1)}  # phase -> next use, steps on


class StepSchedule:
    """The positions above for `layers` (the ids of the backend's MoE layers), and the policy they drive."""

    def __init__(self, layers: list[int]) -> None:
        self._index = {layer: i for i, layer in enumerate(layers)}
        self.layers = len(layers)
        self.policy = ScheduledPolicy(period=2 * self.layers + 1)

    def position(self, phase: str, step: int, layer: int) -> int:
        n, i = self.layers, self._index[layer]
        offset = {FORWARD: i, BACKWARD: n + (n - 1 - i), UPDATE: 2 * n + i}[phase]
        return step * (2 * n + 1) + offset

    def at(self, phase: str, step: int, layer: int) -> None:
        """The main thread has reached `layer` in `phase` of `step`."""
        self.policy.advance(self.position(phase, step, layer))

    def expect(self, key: ExpertKey, phase: str, step: int) -> None:
        """`key` will be used in `phase` of `step` (read ahead for it)."""
        self.policy.expect(key, self.position(phase, step, key.layer))

    def used(self, key: ExpertKey, phase: str, step: int) -> None:
        """`key` is being used in `phase` of `step`: its next use is the following phase's."""
        nxt, later = _NEXT[phase]
        self.expect(key, nxt, step + later)
