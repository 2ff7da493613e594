"""What MPress knows about a pipeline-parallel training step: the plain-data contract between the
profiler (measured) or the analytic model (`semoe plan`), the planner, the simulator and the executor.

Legend: a *stage* is one pipeline stage (one rank, one device); a *layer* is one transformer block
(or the embedding / head, which count as layers of the first / last stage); a *saved tensor* is an
activation autograd keeps from a layer's forward until that layer's backward, once per micro-batch.
Times are seconds, sizes bytes, bandwidths bytes per second.

*Model data* are a layer's parameters, gradients and optimizer states. The part only the optimizer
step reads (`state_bytes`: fp32 master weights and Adam moments under mixed precision, the moments
in float32 training) may live off the device between steps: in host memory or in peers' spare
memory (`MODEL_TECHNIQUES`). The weights and gradients that every forward and backward touch
(`update_bytes`) may live in host memory too (`WEIGHTS`): streamed to the device for each use.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

SCHEDULES = ("gpipe", "1f1b")
TECHNIQUES = ("keep", "recompute", "host", "d2d")
MODEL_TECHNIQUES = ("keep", "host", "d2d")  # where a layer's optimizer states live between steps
STEP_ON = ("device", "host")  # where a layer's optimizer step runs
WEIGHTS = ("keep", "host")  # where a layer's weights and gradients live between their uses


@dataclass(kw_only=True)
class SavedTensor:
    """One activation saved for backward by one layer (per micro-batch)."""

    name: str  # unique within its layer, e.g. "attn.qkv" or "saved3"
    bytes: int
    producer: str = ""  # the op that made it (profiled: autograd node name)
    consumer: str = ""  # the backward op that reads it


@dataclass(kw_only=True)
class LayerProfile:
    """One layer of one stage: compute times per micro-batch and what it saves for backward."""

    index: int  # global layer index, 0 = first layer of stage 0
    name: str
    forward_s: float
    backward_s: float
    saved: list[SavedTensor] = field(default_factory=list)
    # parameters + gradients + optimizer states resident on the device, and under autocast the
    # low-precision copies of the weights it caches for the step
    param_bytes: int = 0
    output_bytes: int = 0  # the layer's output (the input of the next), per micro-batch
    # what the layer keeps per micro-batch when it is recomputed: the inputs its replay reads
    # (0: unknown, taken to be the previous layer's output)
    replay_bytes: int = 0
    # model data: the part of param_bytes only the optimizer step reads (may move off the device),
    # and the weights + gradients a step on the host copies (gradients out, weights back)
    state_bytes: int = 0
    update_bytes: int = 0
    state_tensors: int = 0  # how many tensors state_bytes is (each is placed, and aligned, alone)
    step_s: float = 0.0  # the layer's optimizer step on its device
    host_step_s: float = 0.0  # the same step on the host CPU
    # what swapping the layer's saved tensors (host or peers) adds to its forward and its backward
    # on the compute stream, per micro-batch, beyond the copies themselves: the runtime's work per
    # tensor, and on a CPU, whose cores do the copies, the cycles the copies take from compute
    swap_forward_s: float = 0.0
    swap_backward_s: float = 0.0

    @property
    def saved_bytes(self) -> int:
        return sum(t.bytes for t in self.saved)


@dataclass(kw_only=True)
class StageProfile:
    """The layers one pipeline stage runs."""

    stage: int
    layers: list[LayerProfile]
    # memory of the stage outside its planned layers, counted as held all step: the embedding's or
    # the LM head's parameters, gradients and optimizer states, and what their backward keeps for
    # every micro-batch in flight (the logits of the loss, the inputs of the head)
    fixed_bytes: int = 0

    @property
    def static_bytes(self) -> int:
        """Parameters, gradients and optimizer states, and the fixed part: held all step long."""
        return self.fixed_bytes + sum(layer.param_bytes for layer in self.layers)

    @property
    def forward_s(self) -> float:
        return sum(layer.forward_s for layer in self.layers)

    @property
    def backward_s(self) -> float:
        return sum(layer.backward_s for layer in self.layers)


@dataclass(kw_only=True)
class PipelineProfile:
    """A whole step: stages in pipeline order, the schedule and its micro-batches."""

    stages: list[StageProfile]
    micro_batches: int
    schedule: str = "1f1b"
    boundary_bytes: int = 0  # activation sent from one stage to the next per micro-batch (and its grad back)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if not self.stages:
            raise ValueError("a pipeline needs at least one stage")
        for st in self.stages:
            for lp in st.layers:
                if not 0 <= lp.state_bytes <= lp.param_bytes:
                    raise ValueError(f"layer {lp.index}: state_bytes {lp.state_bytes} must be in 0..param_bytes "
                                     f"({lp.param_bytes})")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "PipelineProfile":
        d = json.loads(text)
        stages = [StageProfile(stage=s["stage"], layers=[
            LayerProfile(**{**lp, "saved": [SavedTensor(**t) for t in lp["saved"]]}) for lp in s["layers"]])
            for s in d["stages"]]
        return cls(stages=stages, micro_batches=d["micro_batches"], schedule=d["schedule"],
                   boundary_bytes=d.get("boundary_bytes", 0))


@dataclass(kw_only=True)
class Stripe:
    """A piece of a D2D-swapped tensor kept on a peer device."""

    device: int
    bytes: int


@dataclass(kw_only=True)
class Decision:
    """What happens to one layer's saved tensors in one stage between its forward and its backward.

    The unit is the layer: recomputation replays a layer's forward (a checkpointed segment), and
    swapping moves all of a layer's saved tensors together. `stripes` (d2d only) say how many bytes
    of each micro-batch's tensors go to which peer device.
    """

    stage: int
    layer: int  # global layer index
    technique: str = "keep"
    stripes: list[Stripe] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.technique not in TECHNIQUES:
            raise ValueError(f"technique must be one of {TECHNIQUES}, got {self.technique!r}")


@dataclass(kw_only=True)
class ModelDataDecision:
    """Where one layer's optimizer states (`LayerProfile.state_bytes`) live between optimizer steps
    and where its step runs.

    keep: on the device, stepped there. host: in host memory; stepped on the device (the states
    are brought in ahead of the layer's step and sent back after it) or on the host (`step_on`:
    the gradients go out, the updated weights come back). d2d: striped over peers' spare memory
    (`stripes`, in proportion to link bandwidth), brought back for a step on the device.

    `weights` host (with states in host memory, stepped there): the layer's weights live in host
    memory, where the host's step updates them, and come to the device for each forward and each
    backward of a micro-batch only (the next layer's are fetched while one computes); its
    gradients leave the device after each backward and add up in host memory (ZeRO-Offload's
    placement, per layer).
    """

    stage: int
    layer: int
    technique: str = "keep"
    stripes: list[Stripe] = field(default_factory=list)
    step_on: str = "device"
    weights: str = "keep"

    def __post_init__(self) -> None:
        if self.technique not in MODEL_TECHNIQUES:
            raise ValueError(f"model-data technique must be one of {MODEL_TECHNIQUES}, got {self.technique!r}")
        if self.step_on not in STEP_ON or (self.step_on == "host" and self.technique != "host"):
            raise ValueError(f"layer {self.layer}: the optimizer step runs on the host only for states in host "
                             f"memory, got technique {self.technique!r} with step_on {self.step_on!r}")
        if self.weights not in WEIGHTS or (self.weights == "host" and self.step_on != "host"):
            raise ValueError(f"layer {self.layer}: weights live in host memory only for a layer stepped on the "
                             f"host, got weights {self.weights!r} with step_on {self.step_on!r}")


@dataclass(kw_only=True)
class Plan:
    """Decisions for every (stage, layer) whose activations or model data are not kept, and the
    stage -> device mapping."""

    decisions: list[Decision] = field(default_factory=list)
    mapping: list[int] = field(default_factory=list)  # mapping[stage] = device; empty: identity
    model_data: list[ModelDataDecision] = field(default_factory=list)

    def decision(self, stage: int, layer: int) -> Decision:
        for d in self.decisions:
            if d.stage == stage and d.layer == layer:
                return d
        return Decision(stage=stage, layer=layer)

    def model_decision(self, stage: int, layer: int) -> ModelDataDecision:
        for d in self.model_data:
            if d.stage == stage and d.layer == layer:
                return d
        return ModelDataDecision(stage=stage, layer=layer)

    def device_of(self, stage: int) -> int:
        return self.mapping[stage] if self.mapping else stage

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        return cls(decisions=[Decision(**{**x, "stripes": [Stripe(**s) for s in x["stripes"]]})
                              for x in d["decisions"]], mapping=list(d.get("mapping", [])),
                   model_data=[ModelDataDecision(**{**x, "stripes": [Stripe(**s) for s in x["stripes"]]})
                               for x in d.get("model_data", [])])
