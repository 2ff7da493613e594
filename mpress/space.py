"""The swap space a plan needs, and how a swap is cut: pure functions of a profile and a plan (bytes
out), which the pipeline's set-up calls before any executor exists, to size host pools and peers'
segments.
"""

from __future__ import annotations

import collections
import itertools

from mpress.peer_memory import ALIGNMENT as PEER_ALIGNMENT
from mpress.profile import LayerProfile, PipelineProfile, Plan
from mpress.schedule import in_flight_peak
from storage.host_buffers import round_up

MIN_SWAP_BYTES = 4096
HOST_ALIGNMENT = 4096  # bytes; every host buffer is rounded up to this
# Pools and segments hold what the profile says the plan swaps, plus a quarter: an MoE layer's
# saved tensors change size with the routing of each micro-batch.
SLACK_FRACTION = 4


class SwapSpaceError(RuntimeError):
    """The host pool or a peer's segment has no room for a swapped tensor, or a plan needs more
    host memory than allowed."""


def split_bytes(nbytes: int, weights: list[int]) -> list[int]:
    """Cut `nbytes` into pieces proportional to `weights`, each within one byte of its share."""
    total = sum(weights)
    if total <= 0 or any(w < 0 for w in weights):
        raise ValueError(f"split_bytes: weights={weights} must be >= 0 with a positive sum")
    cuts = [nbytes * cum // total for cum in itertools.accumulate(weights)]
    return [b - a for a, b in zip([0, *cuts], cuts)]


def stage_on_device(plan: Plan, device: int) -> int | None:
    """The stage (and so the rank) that runs on `device`; with the identity mapping, `device`."""
    if not plan.mapping:
        return device
    return next((stage for stage, d in enumerate(plan.mapping) if d == device), None)


# -- swap space a plan needs (pure: profile and plan in, bytes out) ------------------------------


def _planned_layer(profile: PipelineProfile, stage: int, layer: int) -> LayerProfile:
    stages = [s for s in profile.stages if s.stage == stage]
    found = [lp for s in stages for lp in s.layers if lp.index == layer]
    if not found:
        raise ValueError(f"the plan swaps layer {layer} of stage {stage}, which the profile does not have")
    return found[0]


def _swapped(layer: LayerProfile, min_swap_bytes: int) -> list[int]:
    """Bytes of each tensor of `layer` the executor swaps (smaller ones are kept)."""
    return [t.bytes for t in layer.saved if t.bytes >= min_swap_bytes]


def _in_flight(profile: PipelineProfile, stage: int) -> int:
    return in_flight_peak(profile.schedule, stage, len(profile.stages), profile.micro_batches)


def host_swap_bytes(profile: PipelineProfile, plan: Plan, stage: int, *,
                    min_swap_bytes: int = MIN_SWAP_BYTES) -> int:
    """Host memory `stage`'s host swaps hold at its peak: each swapped tensor of its host layers,
    rounded to the pool's alignment, once per micro-batch in flight (a buffer is held from the
    forward until the layer's backward)."""
    per_micro_batch = sum(round_up(b, HOST_ALIGNMENT)
                          for d in plan.decisions if d.stage == stage and d.technique == "host"
                          for b in _swapped(_planned_layer(profile, stage, d.layer), min_swap_bytes))
    return _in_flight(profile, stage) * per_micro_batch


def host_pool_bytes_for(profile: PipelineProfile, plan: Plan, stage: int, *, limit_bytes: int | None = None,
                        min_swap_bytes: int = MIN_SWAP_BYTES) -> int:
    """Capacity of `stage`'s host pool: what its host swaps hold at the peak plus slack, at most
    `limit_bytes`. Raises SwapSpaceError when the peak alone exceeds `limit_bytes`."""
    need = host_swap_bytes(profile, plan, stage, min_swap_bytes=min_swap_bytes)
    if limit_bytes is not None and need > limit_bytes:
        layers = sorted(d.layer for d in plan.decisions if d.stage == stage and d.technique == "host")
        raise SwapSpaceError(
            f"stage {stage}: the plan swaps layers {layers} to host memory, {need} bytes at the peak, more "
            f"than the {limit_bytes} bytes of host memory allowed")
    capacity = need + need // SLACK_FRACTION
    return capacity if limit_bytes is None else min(capacity, limit_bytes)


def model_host_bytes(profile: PipelineProfile, plan: Plan, stage: int) -> int:
    """Host memory the model data `plan` puts in host memory for `stage` take all step, each
    tensor rounded to the pool's alignment: optimizer states; for streamed layers their weights
    and gradient sums, and room for two layers' gradients on their way out (a layer has at most
    as many parameters as state tensors)."""
    total = staging = 0
    for d in plan.model_data:
        if d.stage != stage or d.technique != "host":
            continue
        lp = _planned_layer(profile, stage, d.layer)
        total += round_up(lp.state_bytes, HOST_ALIGNMENT) + lp.state_tensors * HOST_ALIGNMENT
        if d.weights == "host":
            half = round_up(lp.update_bytes // 2, HOST_ALIGNMENT) + lp.state_tensors * HOST_ALIGNMENT
            total += 2 * half
            staging = max(staging, half)
    return total + 2 * staging


def moved_model_bytes(profile: PipelineProfile, plan: Plan, stage: int) -> tuple[int, int]:
    """Bytes of `stage`'s model data `plan` takes off its device between uses: (optimizer states,
    streamed weights and gradients). The executor's budget meter counts streamed weights and
    gradients while they are on the device; the rest of the stage's `static_bytes` stays there."""
    states = streamed = 0
    for d in plan.model_data:
        if d.stage != stage or d.technique == "keep":
            continue
        lp = _planned_layer(profile, stage, d.layer)
        states += lp.state_bytes
        streamed += lp.update_bytes if d.weights == "host" else 0
    return states, streamed


def peer_capacity_bytes_for(profile: PipelineProfile, plan: Plan, *, min_swap_bytes: int = MIN_SWAP_BYTES) -> int:
    """`capacity_bytes` every rank's PeerMemory needs for `plan` (0: no D2D swap). A segment has one
    equal slice per writer, so each slice must hold the most any stage writes into any one peer at
    its peak (every micro-batch in flight, plus the optimizer states it keeps there all step),
    stripes rounded to the peer alignment, plus slack."""
    most = 0
    for st in profile.stages:
        s = st.stage
        model: collections.Counter[int] = collections.Counter()
        for d in plan.model_data:
            if d.stage != s or d.technique != "d2d":
                continue
            lp = _planned_layer(profile, s, d.layer)
            peers = [stage_on_device(plan, x.device) for x in d.stripes]
            if None in peers or not d.stripes:
                raise ValueError(f"stage {s}, layer {d.layer} (model-data d2d): stripes {d.stripes} name a "
                                 f"device no stage runs on")
            for peer, piece in zip(peers, split_bytes(lp.state_bytes, [x.bytes for x in d.stripes])):
                model[peer] += piece + max(lp.state_tensors, 1) * PEER_ALIGNMENT
        per_peer: collections.Counter[int] = collections.Counter()
        for d in plan.decisions:
            if d.stage != s or d.technique != "d2d":
                continue
            peers = [stage_on_device(plan, x.device) for x in d.stripes]
            if None in peers or not d.stripes:
                raise ValueError(f"stage {s}, layer {d.layer} (d2d): stripes {d.stripes} name a device "
                                 f"no stage runs on")
            weights = [x.bytes for x in d.stripes]
            for nbytes in _swapped(_planned_layer(profile, s, d.layer), min_swap_bytes):
                for peer, piece in zip(peers, split_bytes(nbytes, weights)):
                    if piece:
                        per_peer[peer] += round_up(piece, PEER_ALIGNMENT)
        most = max(most, max((_in_flight(profile, s) * per_peer[p] + model[p] for p in per_peer.keys() | model.keys()),
                             default=0))
    if not most:
        return 0
    return len(profile.stages) * round_up(most + most // SLACK_FRACTION, PEER_ALIGNMENT)
