"""Where a decoded token's time goes: attention, router, experts, dense feed-forward, lm_head, the rest.

`DecodeProfile` hooks a model's modules for the span of a `with` block and times every decoding step
(a forward of one new token per sequence; prefill is left out). Per part it also counts the bytes
of weights the step touched (every attention, router, dense and lm_head weight; only the routed
experts, as the provider holds them: compact ones compact) so that the report gives each part's
effective GB/s beside the machine's measured memory read rate: the gap to the memory bound, part
by part. On CUDA each hook synchronises the device, so the timings are exact but the profiled run
is slower than an unprofiled one. On CPU the hooks also keep the steps on the module path: an
unprofiled decode takes `semoe.decode.plan`'s run of kernel calls where it applies, the same kernels
for the same parts with less per-call overhead in between (the profile's "rest" and part of each
part's time).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from semoe.model.compact_linear import weight_bytes
from semoe.decode.generate import sync
from semoe.model.moe_gpt import DenseFFN, MoEFeedForward, MoEGPT


@dataclass
class _Step:
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def expert_bytes(provider: object, layer: int, expert: int) -> int:
    """Bytes one expert's weights take where its provider keeps them (0 when it cannot say)."""
    nbytes = getattr(provider, "expert_nbytes", None)
    return int(nbytes(layer, expert)) if nbytes is not None else 0


class DecodeProfile:
    """Per-step timings and weight bytes of a model's decoding steps, while the `with` block lasts."""

    def __init__(self, model: MoEGPT) -> None:
        self.model = model
        self.device = model.embed.weight.device
        self.steps: list[_Step] = []
        self._current: _Step | None = None
        self._started: dict[int, float] = {}
        self._handles: list = []

    # -- hooks --------------------------------------------------------------------------------
    def _now(self) -> float:
        sync(self.device)  # on CUDA the work queued so far belongs to the part that queued it
        return time.perf_counter()

    def _timed(self, module: nn.Module, part: str, nbytes: int | None) -> None:
        def pre(_m, _args):
            if self._current is not None:
                self._started[id(module)] = self._now()

        def post(_m, _args, out):
            if self._current is not None and id(module) in self._started:
                self._current.seconds[part] += self._now() - self._started.pop(id(module))
                if nbytes is not None:
                    self._current.bytes[part] += nbytes
                if part == "experts":
                    self._count_experts(module, out)

        self._handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def _count_experts(self, ffn: MoEFeedForward, out) -> None:
        ids = out[1].ids_NK.unique().tolist()
        self._current.bytes["experts"] += sum(expert_bytes(ffn.experts, ffn.layer, e) for e in ids)

    def _root_pre(self, _m, args) -> None:
        ids = args[0]
        if ids.shape[-1] == 1:  # one new token per sequence: a decoding step
            self._current = _Step()
            self._started[id(self.model)] = self._now()

    def _root_post(self, _m, _args, _out) -> None:
        if self._current is None:
            return
        step, self._current = self._current, None
        step.seconds["total"] = self._now() - self._started.pop(id(self.model))
        self.steps.append(step)

    def __enter__(self) -> "DecodeProfile":
        # raw keys: a MoE layer's time ("moe") holds its router's and shared expert's; `report` splits it
        m = self.model
        for block in m.layers:
            self._timed(block.attn, "attention", weight_bytes(block.attn))
            ffn = block.ffn
            if isinstance(ffn, MoEFeedForward):
                self._timed(ffn.router, "router", weight_bytes(ffn.router))
                if hasattr(ffn, "shared"):
                    self._timed(ffn.shared, "shared", weight_bytes(ffn.shared))
                self._timed(ffn, "experts", None)
            elif isinstance(ffn, DenseFFN):
                self._timed(ffn, "dense", weight_bytes(ffn))
        self._timed(m.lm_head, "lm_head", weight_bytes(m.lm_head))
        self._handles += [m.register_forward_pre_hook(self._root_pre), m.register_forward_hook(self._root_post)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- report -------------------------------------------------------------------------------
    def report(self, memory_gbps: float | None = None) -> dict:
        """Mean milliseconds and weight bytes per decoded token and part, their GB/s, and the whole
        step's against `memory_gbps` (the machine's read rate, when measured)."""
        n = len(self.steps)
        if n == 0:
            return {"steps": 0}
        sec = {k: sum(st.seconds.get(k, 0.0) for st in self.steps) for k in
               ("attention", "router", "experts", "shared", "dense", "lm_head", "total")}
        nb = {k: sum(st.bytes.get(k, 0) for st in self.steps) for k in
              ("attention", "router", "experts", "shared", "dense", "lm_head")}
        split = {  # part -> (seconds, bytes)
            "attention": (sec["attention"], nb["attention"]),
            "router": (sec["router"], nb["router"]),
            "experts": (sec["experts"] - sec["router"] - sec["shared"], nb["experts"]),
            "dense_ffn": (sec["dense"] + sec["shared"], nb["dense"] + nb["shared"]),
            "lm_head": (sec["lm_head"], nb["lm_head"]),
            "rest": (sec["total"] - sec["attention"] - sec["experts"] - sec["dense"] - sec["lm_head"], 0),
        }
        parts = {part: {"ms_per_token": 1e3 * s / n, "mb_per_token": b / n / 1e6,
                        "gbps": b / s / 1e9 if s > 0 and b else None} for part, (s, b) in split.items()}
        total_s = sum(st.seconds["total"] for st in self.steps) / n
        total_b = sum(sum(st.bytes.values()) for st in self.steps) / n
        out = {"steps": n, "ms_per_token": 1e3 * total_s, "mb_per_token": total_b / 1e6,
               "gbps": total_b / total_s / 1e9, "parts": parts, "memory_gbps": memory_gbps}
        if memory_gbps:
            # the time the weights alone would take at the machine's read rate, and how far from it we are
            out["bound_ms_per_token"] = 1e3 * total_b / (memory_gbps * 1e9)
            out["vs_bound"] = out["ms_per_token"] / out["bound_ms_per_token"]
        return out


def memory_read_gbps(nbytes: int = 512 << 20, repeats: int = 3) -> float:
    """The machine's memory read rate with torch's threads: the best of `repeats` sums over a buffer
    larger than any cache."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def format_report(r: dict) -> list[str]:
    """The report as lines for a terminal."""
    if not r.get("steps"):
        return ["decode profile: no decoding step ran"]
    lines = [f"decode profile (through the modules) over {r['steps']} tokens: {r['ms_per_token']:.2f} ms/token, weights "
             f"{r['mb_per_token']:.1f} MB/token at {r['gbps']:.1f} GB/s"
             + (f"; memory reads {r['memory_gbps']:.1f} GB/s here, so the weights alone take "
                f"{r['bound_ms_per_token']:.2f} ms ({r['vs_bound']:.2f}x the bound)" if r.get("memory_gbps") else "")]
    for part, p in r["parts"].items():
        gb = f"{p['gbps']:6.1f} GB/s" if p["gbps"] else "          "
        lines.append(f"  {part:10} {p['ms_per_token']:8.2f} ms {100 * p['ms_per_token'] / r['ms_per_token']:5.1f}%  "
                     f"{p['mb_per_token']:8.1f} MB  {gb}")
    return lines
