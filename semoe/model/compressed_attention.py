"""DeepSeek-V4's attention: one shared key-value head over a sliding window, and compressed entries of the
whole sequence beside it on most layers.

Each layer projects the query through a low rank (`wq_a`, its norm `q_norm`, `wq_b`), normalises each
head without a weight, and projects one key, which is also the value (`wkv`, its norm `norm`); the last
`rope_dim` dims of both rotate by interleaved pairs. A query sees the keys of its last `sliding_window`
positions (itself included) and, on compressed layers, compressed entries of the sequence before it:

- HCA (heavily compressed attention): every m' tokens (128) make one entry, the tokens' projections
  (`compressor.wkv`) summed under a softmax over the window of their gates (`compressor.wgate` plus a
  learnt bias per slot, `ape`), normed and rotated at the window's first position. A query reads every
  entry whose window it has passed.
- CSA (compressed sparse attention): every m tokens (4) make one entry from 2m of them: each token
  projects two halves, the second for its own window's entry and the first for the next one's, and the
  softmax runs over both. A lightning indexer (`indexer`: its own compressor at `index_head_dim`, query
  heads from the query's low rank, `weights_proj`) scores the entries, sum over heads of weight x
  ReLU(q . k), and the query reads only its `index_topk` best among those it has passed (the earliest
  among equal scores).

Attention has a learnt sink per head (`attn_sink`); the output's rotated dims are rotated back at the
query's position (the value carried the key's rotation), and the heads go out through the grouped
low-rank projection (`wo_a` per group, `wo_b`; `semoe.model.attention.grouped_output`).

Per sequence the layer keeps a `CompressedState`: the window's last keys, the entries so far, and the
tokens waiting to fill the next entry (with CSA's half of the last full window). Its size grows by one
entry per m tokens, not per token. Shapes: B batch, T tokens, H heads, Dh head dim, n entries.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from semoe.model import rope
from semoe.model.attention import RMSNorm, grouped_output, unit_rms
from semoe.model.compact_linear import Linear
from semoe.model.compressed_state import Compression, CompressedState
from semoe.model.config import MoEConfig


def rotate_pairs(x: torch.Tensor, positions_T: torch.Tensor, inv_freq_r: torch.Tensor, scale: float,
                 inverse: bool = False) -> torch.Tensor:
    """x (..., T, [H,] D) with its last 2r dims rotated by interleaved pairs at `positions_T` (float32 math,
    x's dtype out); `inverse` rotates back. `x` is (B, T, D) or (B, T, H, D)."""
    r = inv_freq_r.shape[0]
    angles = positions_T.float()[:, None] * inv_freq_r  # (T, r)
    cos, sin = angles.cos() * scale, angles.sin() * scale
    if inverse:
        sin = -sin
    if x.dim() == 4:
        cos, sin = cos[:, None], sin[:, None]
    keep, rot = x[..., :-2 * r], x[..., -2 * r:].float()
    even, odd = rot[..., 0::2], rot[..., 1::2]
    turned = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((keep, turned.to(x.dtype)), dim=-1)


class Compressor(nn.Module):
    """Entries of every `rate` tokens at `dim` (the checkpoint's `wkv`, `wgate`, `ape`, `norm`); `overlap`:
    CSA's, each entry from its window and the one before (2 dim projected per token)."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.wkv = Linear(hidden, width, bias=False)
        self.wgate = Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(rate, width))
        self.norm = RMSNorm(dim, eps)

    def empty(self, batch: int, like: torch.Tensor) -> Compression:
        width = 2 * self.dim if self.overlap else self.dim
        z = lambda n, d: like.new_zeros(batch, n, d)  # noqa: E731
        return Compression(z(0, self.dim), z(0, width), z(0, width))

    def forward(self, x_BTD: torch.Tensor, state: Compression, rotate) -> Compression:
        """The state after x's tokens: the entries their full windows close, rotated by `rotate(entries,
        positions)` at each window's first position."""
        B, m, d = x_BTD.shape[0], self.rate, self.dim
        kv = torch.cat((state.kv, self.wkv(x_BTD)), dim=1)
        gate = torch.cat((state.gate, self.wgate(x_BTD)), dim=1)
        usable = kv.shape[1] // m * m
        out = Compression(state.entries, kv[:, usable:], gate[:, usable:], state.overlap_kv, state.overlap_gate)
        if not usable:
            return out
        n = usable // m
        ckv = kv[:, :usable].view(B, n, m, -1)
        cgate = gate[:, :usable].view(B, n, m, -1) + self.ape
        if self.overlap:  # slots 0..m-1: the window before's first halves; m..2m-1: this window's second halves
            wkv = ckv.new_zeros(B, n, 2 * m, d)
            wgate = cgate.new_full((B, n, 2 * m, d), float("-inf"))
            wkv[:, :, m:], wgate[:, :, m:] = ckv[..., d:], cgate[..., d:]
            wkv[:, 1:, :m], wgate[:, 1:, :m] = ckv[:, :-1, :, :d], cgate[:, :-1, :, :d]
            if state.overlap_kv is not None:
                wkv[:, 0, :m], wgate[:, 0, :m] = state.overlap_kv, state.overlap_gate
            out.overlap_kv, out.overlap_gate = ckv[:, -1, :, :d].clone(), cgate[:, -1, :, :d].clone()
            ckv, cgate = wkv, wgate
        pooled = (ckv * cgate.softmax(dim=2, dtype=torch.float32).to(ckv.dtype)).sum(dim=2)
        first = state.entries.shape[1]
        positions = torch.arange(first, first + n, device=x_BTD.device) * m
        out.entries = torch.cat((state.entries, rotate(self.norm(pooled), positions)), dim=1)
        return out


class Indexer(nn.Module):
    """CSA's lightning indexer: its compressor at `index_head_dim`, query heads from the query's low rank
    (`wq_b`), per-head weights from the layer's input (`weights_proj`)."""

    def __init__(self, c: MoEConfig) -> None:
        super().__init__()
        self.heads, self.dim, self.topk = c.index_heads, c.index_head_dim, c.index_topk
        self.compressor = Compressor(c.hidden_size, c.index_head_dim, c.compress_rates[0], True, c.rms_norm_eps)
        self.wq_b = Linear(c.q_lora_rank, c.index_heads * c.index_head_dim, bias=False)
        self.weights_proj = Linear(c.hidden_size, c.index_heads, bias=False)

    def choose(self, x_BTD: torch.Tensor, q_res: torch.Tensor, entries_BnD: torch.Tensor, positions_T: torch.Tensor,
               rotate) -> torch.Tensor:
        """Which entries each query reads (B, T, n) bool: its `topk` best by score among the entries whose
        windows end at or before it."""
        B, T, _ = x_BTD.shape
        n = entries_BnD.shape[1]
        q = rotate(self.wq_b(q_res).view(B, T, self.heads, self.dim), positions_T)
        scores = torch.einsum("bthd,bnd->bthn", q.float(), entries_BnD.float()).relu() * self.dim ** -0.5
        weights = self.weights_proj(x_BTD).float() * self.heads ** -0.5
        score_BTn = (scores * weights[..., None]).sum(dim=2)
        passed_Tn = torch.arange(n, device=x_BTD.device)[None] < ((positions_T + 1) // self.compressor.rate)[:, None]
        score_BTn = score_BTn.masked_fill(~passed_Tn, float("-inf"))
        chosen = torch.zeros(B, T, n, dtype=torch.bool, device=x_BTD.device)
        if n:  # among equal scores (ReLU's zeros tie often) the earliest entries, as the kernels choose
            top = score_BTn.sort(dim=-1, descending=True, stable=True).indices[..., :min(self.topk, n)]
            chosen.scatter_(-1, top, True)
        return chosen & passed_Tn


class CompressedAttention(nn.Module):
    """One DeepSeek-V4 attention layer (the module docstring); its tensors under the checkpoint's names."""

    def __init__(self, config: MoEConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.config, self.layer, self.kind = c, layer, c.kind(layer)
        H, Dh = c.num_heads, c.head_dim
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = Linear(c.q_lora_rank, H * Dh, bias=False)
        self.wkv = Linear(c.hidden_size, Dh, bias=False)
        self.norm = RMSNorm(Dh, c.rms_norm_eps)
        self.wo_a = Linear(H * Dh // c.o_groups, c.o_groups * c.o_lora_rank, bias=False)
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        self.compressor = self.indexer = None
        if self.kind != "sliding":
            csa = self.kind == "csa"
            self.compressor = Compressor(c.hidden_size, Dh, c.compress_rates[0 if csa else 1], csa, c.rms_norm_eps)
            if csa:
                self.indexer = Indexer(c)
        # sliding layers rotate with the main base, compressed ones (and their entries, and the indexer's
        # queries) with the compressed layers' base
        spec = SimpleNamespace(rope_dim=c.rope_dim, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling)
        if self.kind != "sliding":
            spec = SimpleNamespace(rope_dim=c.rope_dim, rope_theta=c.compress_rope_theta,
                                   rope_scaling=c.compress_rope_scaling)
        # numpy, not buffers: a model built on the meta device and then loaded fills parameters only
        self.inv_freq, self.rope_scale = rope.inv_freq(spec)
        self.index_inv_freq, self.index_scale = rope.inv_freq(SimpleNamespace(
            rope_dim=c.rope_dim, rope_theta=c.compress_rope_theta, rope_scaling=c.compress_rope_scaling))
        self._on_device: dict[tuple[str, torch.device], torch.Tensor] = {}

    def empty_state(self, batch: int, like: torch.Tensor) -> CompressedState:
        """The state before a sequence's first token."""
        return CompressedState(like.new_zeros(batch, 0, self.config.head_dim),
                               None if self.compressor is None else self.compressor.empty(batch, like),
                               None if self.indexer is None else self.indexer.compressor.empty(batch, like))

    def _freqs(self, which: str, device: torch.device) -> torch.Tensor:
        """The inverse frequencies `which` names ("inv_freq", "index_inv_freq") as a tensor on `device`, made
        once per device (a decoding step rotates four times a layer)."""
        key = (which, device)
        cached = self._on_device.get(key)
        if cached is None:
            cached = self._on_device[key] = torch.from_numpy(getattr(self, which)).to(device)
        return cached

    def _rotate(self, x: torch.Tensor, positions_T: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return rotate_pairs(x, positions_T, self._freqs("inv_freq", x.device), self.rope_scale, inverse)

    def _rotate_index(self, x: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        return rotate_pairs(x, positions_T, self._freqs("index_inv_freq", x.device), self.index_scale)

    def forward(self, x_BTD: torch.Tensor, state: CompressedState | None, start: int
                ) -> tuple[torch.Tensor, CompressedState]:
        """The layer's output for T tokens at positions start.. after `state` (None: a sequence's start),
        and the state after them."""
        c = self.config
        B, T, _ = x_BTD.shape
        H, Dh, W = c.num_heads, c.head_dim, c.sliding_window
        state = self.empty_state(B, x_BTD) if state is None else state
        positions = torch.arange(start, start + T, device=x_BTD.device)
        q_res = self.q_norm(self.wq_a(x_BTD))
        q = self._rotate(unit_rms(self.wq_b(q_res).view(B, T, H, Dh), c.rms_norm_eps), positions)
        kv = self._rotate(self.norm(self.wkv(x_BTD)), positions)
        keys = torch.cat((state.window, kv), dim=1)  # positions start - L .. start + T - 1
        key_pos = torch.arange(start - state.window.shape[1], start + T, device=x_BTD.device)
        seen_TS = (key_pos[None] <= positions[:, None]) & (positions[:, None] - key_pos[None] < W)
        new = CompressedState(keys[:, max(keys.shape[1] - (W - 1), 0):].clone())
        if self.compressor is not None:
            new.compressor = self.compressor(x_BTD, state.compressor, self._rotate)
            entries = new.compressor.entries
            n = entries.shape[1]
            if self.indexer is not None:
                new.indexer = self.indexer.compressor(x_BTD, state.indexer, self._rotate_index)
                reads = self.indexer.choose(x_BTD, q_res, new.indexer.entries, positions, self._rotate_index)
            else:  # every entry whose window the query has passed
                reads = (torch.arange(n, device=x_BTD.device)[None] <
                         ((positions + 1) // self.compressor.rate)[:, None]).expand(B, T, n)
            keys = torch.cat((keys, entries), dim=1)
            seen = torch.cat((seen_TS.expand(B, T, -1), reads), dim=-1)[:, None]  # (B, 1, T, S + n)
        else:
            seen = seen_TS[None, None]
        logits = torch.einsum("bthd,bsd->bhts", q, keys).float() * Dh ** -0.5
        logits = logits.masked_fill(~seen, float("-inf"))
        sink = self.attn_sink.float().view(1, H, 1, 1).expand(B, H, T, 1)
        both = torch.cat((logits, sink), dim=-1)
        probs = torch.softmax(both - both.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
        out = torch.einsum("bhts,bsd->bthd", probs.to(keys.dtype), keys)
        out = self._rotate(out, positions, inverse=True)
        return grouped_output(out, self.wo_a.weight.view(c.o_groups, c.o_lora_rank, -1), self.wo_b), new
