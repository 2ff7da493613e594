"""DeepSeek-V4's per-sequence state (`semoe.model.compressed_attention`): the modules' view of it
(`CompressedState`, its `Compression`s) and its layout in a KV cache (`CompressedBuffers`), which the
compiled kernels update in place."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from semoe.model.config import MoEConfig


@dataclass
class Compression:
    """One compressor's running state for a batch: its entries so far (B, n, D), the projections and gates
    of the tokens since the last entry (B, r < m, width), and, for CSA, the first halves of the last full
    window (B, m, D) that the next entry also reads (None before there is one)."""

    entries: torch.Tensor
    kv: torch.Tensor
    gate: torch.Tensor
    overlap_kv: torch.Tensor | None = None
    overlap_gate: torch.Tensor | None = None

    def clone(self) -> "Compression":
        copy = lambda t: None if t is None else t.clone()  # noqa: E731
        return Compression(self.entries.clone(), self.kv.clone(), self.gate.clone(), copy(self.overlap_kv),
                           copy(self.overlap_gate))

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.entries, self.kv, self.gate, self.overlap_kv, self.overlap_gate)
                   if t is not None)


@dataclass
class CompressedState:
    """A DeepSeek-V4 layer's state for a batch after some tokens: the sliding window's last keys (B, <= W-1,
    Dh), and its compressor's and indexer's `Compression` (None where the layer has none)."""

    window: torch.Tensor
    compressor: Compression | None = None
    indexer: Compression | None = None

    def clone(self) -> "CompressedState":
        return CompressedState(self.window.clone(), *(None if c is None else c.clone()
                                                      for c in (self.compressor, self.indexer)))

    def nbytes(self) -> int:
        return self.window.nbytes + sum(c.nbytes() for c in (self.compressor, self.indexer) if c is not None)


class CompressedBuffers:
    """A DeepSeek-V4 layer's state for a batch in the compiled kernels' layout (decode_abi.h's `Compressed`),
    for up to `capacity` positions: `fixed` (B, F) holds the window's W keys by position modulo W, then
    each compressor's tokens since its last entry (projections, gates: m of its width each) and, with
    overlap, the first halves of its last full window (projections, gates with `ape` added: m of dim
    each), the indexer's compressor after the layer's; `entries` (B, capacity // m, Dh + Di) each entry
    with its indexer key after it. The modules read and write it as a `CompressedState` (`to_state`,
    `store`); the kernels update it in place."""

    def __init__(self, fixed: torch.Tensor, entries: torch.Tensor, geometry: tuple) -> None:
        self.fixed, self.entries, self.geometry = fixed, entries, geometry

    @classmethod
    def empty(cls, c: MoEConfig, layer: int, batch: int, capacity: int, device=None) -> "CompressedBuffers":
        fixed, row, comps = c.compressed_layout(layer)
        rows = capacity // comps[0][0] if comps else 0
        z = lambda *shape: torch.zeros(shape, device=device, dtype=torch.float32)  # noqa: E731
        return cls(z(batch, fixed), z(batch, rows, row), (c.sliding_window, c.head_dim, comps))

    def clone(self) -> "CompressedBuffers":
        return CompressedBuffers(self.fixed.clone(), self.entries.clone(), self.geometry)

    def nbytes(self) -> int:
        return self.fixed.nbytes + self.entries.nbytes

    def grow(self, capacity: int) -> None:
        """Room for the entries of `capacity` positions, those held copied."""
        comps = self.geometry[2]
        rows = capacity // comps[0][0] if comps else 0
        if rows > self.entries.shape[1]:
            bigger = self.entries.new_zeros(self.entries.shape[0], rows, self.entries.shape[2])
            bigger[:, :self.entries.shape[1]] = self.entries
            self.entries = bigger

    def _parts(self):
        """Views of `fixed`: the window (B, W, Dh), then per compressor (kv, gate, overlap kv, overlap gate)."""
        W, Dh, comps = self.geometry
        B, at = self.fixed.shape[0], W * Dh
        win, parts = self.fixed[:, :at].view(B, W, Dh), []
        for m, d, overlap in comps:
            width = (2 if overlap else 1) * d
            kv, gate = (self.fixed[:, at + i * m * width:at + (i + 1) * m * width].view(B, m, width) for i in (0, 1))
            at += 2 * m * width
            okv = og = None
            if overlap:
                okv, og = (self.fixed[:, at + i * m * d:at + (i + 1) * m * d].view(B, m, d) for i in (0, 1))
                at += 2 * m * d
            parts.append((kv, gate, okv, og))
        return win, parts

    def to_state(self, length: int) -> CompressedState:
        """The `CompressedState` after `length` tokens (the modules' view; its tensors are copies)."""
        W, Dh, comps = self.geometry
        win, parts = self._parts()
        held = min(length, W - 1)
        slots = [p % W for p in range(length - held, length)]
        state = CompressedState(win[:, slots].clone())
        cols = (slice(0, Dh), slice(Dh, None))
        for (m, d, overlap), (kv, gate, okv, og), col in zip(comps, parts, cols):
            n, r = length // m, length % m
            comp = Compression(self.entries[:, :n, col].clone(), kv[:, :r].clone(), gate[:, :r].clone())
            if overlap and n:
                comp.overlap_kv, comp.overlap_gate = okv.clone(), og.clone()
            if col.start == 0:
                state.compressor = comp
            else:
                state.indexer = comp
        return state

    @torch.no_grad()
    def store(self, state: CompressedState, before: int, length: int) -> None:
        """Take `state`, the state after `length` tokens that followed the `before` this one held."""
        W, Dh, comps = self.geometry
        win, parts = self._parts()
        held = state.window.shape[1]
        win[:, [p % W for p in range(length - held, length)]] = state.window.float()
        cols = (slice(0, Dh), slice(Dh, None))
        for (m, d, overlap), (kv, gate, okv, og), col, comp in zip(comps, parts, cols,
                                                                   (state.compressor, state.indexer)):
            first, n = before // m, length // m
            self.entries[:, first:n, col] = comp.entries[:, first:n].float()
            r = comp.kv.shape[1]
            kv[:, :r], gate[:, :r] = comp.kv.float(), comp.gate.float()
            if overlap and comp.overlap_kv is not None:
                okv.copy_(comp.overlap_kv), og.copy_(comp.overlap_gate)
