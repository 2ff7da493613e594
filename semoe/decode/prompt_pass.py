"""A prompt's pass through the model one layer at a time, for the torch-free runner
(`inference.torch_free.prompt_prefill.prefill`, its experts read from storage into its cache as chosen) and the
engine's resident CPU model (`semoe.decode.plan.DecodePlan.prefill`, every expert in memory): each
expert the prompt chose in a layer is read once for the whole prompt and computed over all the
positions that chose it at once.

Per layer (semoe/kernels/prefill.c): the positions' attention and router (`prefill_attend`: the
norms and products over many rows at once, then each row's attention over the positions up to its
own, its k and v (or latent and rotary key) written first), then their feed-forward: the union of
the experts they chose, read in groups of half the expert cache (a group is computed while the next
is read; the groups split the union, so each expert is read once a layer), each expert's rows
computed together, the weighted outputs summed per position, and the shared expert on all rows.
Where the prompt is long enough to choose nearly every expert of a layer, the next MoE layer's
experts are read while this one computes. Token by token, a prompt of T positions asked the cache
for each expert up to T times a layer; with memory short, most of those were reads.

The residual stream, its normed copy and the experts' sum are held for all T positions (3 * T *
hidden_size float32: 17 MiB for 512 positions of gpt-oss-20b) beside the sequence's KV cache; latent
attention's layers hold their positions' expanded keys and values while they run, up to 256 MiB
(`prefill_expand_limit`; past it they attend in decoding's absorbed form, which needs none).

This module imports no torch."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable

import numpy as np


def _p(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


@dataclass
class Target:
    """Where a pass runs: the kernels `lib`, decode_step.c's `net` (a reference), the threads, the routed
    experts' top_k and which layers route (`moe`), and the sequences whose rows it computes
    (`sequences`): per layer, their k and v caches' addresses (`kc`, `vc`: ctypes arrays, one address a
    sequence), and `segs` (n, 3) int64, each sequence's capacity, first position and rows, its rows
    following the one before's in x. A prompt is one sequence; a batch of decoding ones a row each.
    `reader`: the torch-free runner's model (`inference.torch_free.runner.LeanModel`), whose routed experts are read
    from storage into its cache as the pass chooses them; None where `net` points at every expert in
    memory (the engine's resident model, `semoe.decode.plan.DecodePlan`)."""

    lib: ctypes.CDLL
    net: object
    kc: list
    vc: list
    segs: np.ndarray
    threads: int
    top_k: int
    moe: frozenset
    reader: object = None
    index_topk: int = 0  # DeepSeek sparse attention's positions a row reads (0: none)
    tokens: np.ndarray | None = None  # the rows' token ids (int64), for a layer that routes by them (DeepSeek-V4)
    streams: int = 1  # the residual's streams a row (DeepSeek-V4's hyper-connections: x is (T, streams * D))


def sequences(caches: list[tuple[list[int], list[int]]], capacities: list[int], positions: list[int],
              counts: list[int]) -> tuple[list, list, np.ndarray]:
    """A `Target`'s (kc, vc, segs) for sequences whose layers' k and v caches are at the addresses
    `caches[i]` (two lists of a layer's each) of `capacities[i]` positions, their rows `counts[i]` from
    `positions[i]`."""
    n, layers = len(caches), len(caches[0][0])
    for cap, pos, k in zip(capacities, positions, counts):
        if k < 1 or pos + k > cap:
            raise ValueError(f"{k} rows at position {pos} of a cache of {cap} positions")
    kc = [(ctypes.c_void_p * n)(*(c[0][lay] for c in caches)) for lay in range(layers)]
    vc = [(ctypes.c_void_p * n)(*(c[1][lay] for c in caches)) for lay in range(layers)]
    return kc, vc, np.array([capacities, positions, counts], np.int64).T.copy()


def run(target: Target, x: np.ndarray, cos: np.ndarray, sin: np.ndarray,
        on_layer: Callable[[int, int], None] | None = None, layers: list[int] | None = None) -> None:
    """The T rows of target's sequences through every layer: x (T, D) float32, their embeddings, becomes
    the residual stream after the last layer (the head's input; with hyper-connections x is (T, N D), each
    row's embedding in its first D, and becomes its N streams); cos and sin (T, R) their rotary tables;
    their k and v written into their sequences' caches at their positions. `on_layer(done, layers)`
    after each layer. `layers`: these of the Net's alone (a multi-token-prediction layer past the model's), else
    all in turn."""
    if int(target.segs[:, 2].sum()) != len(x):
        raise ValueError(f"{len(x)} rows for sequences of {target.segs[:, 2].tolist()}")
    p = _Pass(target, x, cos, sin)
    cache = None if target.reader is None else target.reader.cache
    ahead = None  # the next MoE layer's experts, read while this one computes
    try:
        for lay in range(len(target.kc)) if layers is None else layers:
            p.attend(lay)
            ahead = p.feed_forward(lay, ahead)
            if on_layer is not None:
                on_layer(lay + 1, len(target.kc))
    finally:
        if ahead is not None:
            cache.end(ahead)


def packed(lib: ctypes.CDLL, net: object, caches: list[tuple[list[int], list[int]]], capacities: list[int],
           starts: list[int], counts: list[int], x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rows: list[int],
           logits: np.ndarray, *, threads: int, top_k: int, moe: frozenset, reader: object = None,
           index_topk: int = 0, tokens: list[int] | None = None, streams: int = 1) -> None:
    """A server's step: sequence i's `counts[i]` rows of x (their embeddings; cos and sin their rotary
    tables) at its cache's positions from `starts[i]` (`sequences`' caches and capacities) through every
    layer (`run`), then the head over `rows` of the residual stream into logits (len(rows), V). `tokens`:
    the rows' ids (hash routing); `streams`: `run`'s. The engine's resident model (`DecodePlan.batch`) and the
    runner's cache (`inference.serving.torch_free_engine`, with `reader`) step so."""
    kc, vc, segs = sequences(caches, capacities, starts, counts)
    ids = None if tokens is None else np.array(tokens, np.int64)
    run(Target(lib, net, kc, vc, segs, threads, top_k, moe, reader, index_topk, ids, streams), x, cos, sin)
    h = np.ascontiguousarray(x[rows])
    lib.prefill_head(net, _p(h), len(rows), _p(logits), threads)


class _Pass:
    """The prompt pass's buffers: the residual stream x (the caller's; with hyper-connections its streams), the
    feed-forward's normed input h and the experts' sum s (T, D), the rotary tables (T, R), each position's choice ids and w (T, K)."""

    def __init__(self, target: Target, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
        T, D = x.shape[0], x.shape[1] // target.streams
        K = max(target.top_k, 1)
        self.t, self.T, self.K = target, T, K
        self.x, self.cos, self.sin, self.R = x, cos, sin, cos.shape[1]
        self.h, self.s = np.empty((T, D), np.float32), np.empty((T, D), np.float32)
        # each row's chosen positions under DeepSeek sparse attention, kept from a layer with an indexer
        # for the shared layers after it
        self.choices = np.empty((T, target.index_topk), np.int32) if target.index_topk else None
        self.ids, self.w = np.zeros((T, K), np.int64), np.zeros((T, K), np.float32)
        self.dense_ids, self.dense_w = np.zeros(T, np.int64), np.ones(T, np.float32)

    def attend(self, lay: int) -> None:
        t, T, K = self.t, self.T, self.K
        rc = t.lib.prefill_attend(t.net, lay, _p(self.x), T, t.kc[lay], t.vc[lay], _p(t.segs), len(t.segs),
                                  _p(self.cos), _p(self.sin), self.R, _p(self.ids), _p(self.w), K,
                                  None if self.choices is None else _p(self.choices),
                                  None if t.tokens is None else _p(t.tokens), _p(self.h), t.threads)
        if rc != 0:
            raise MemoryError(f"layer {lay}: the prompt pass's attention could not allocate its buffers for {T} rows")

    def feed_forward(self, lay: int, ahead):
        """Layer lay's feed-forward of every position; the next MoE layer's read-ahead (a
        `lean_slots.Pending`, to `end` there), or None. `ahead`: this layer's, or None."""
        t, T = self.t, self.T
        lib, net, threads = t.lib, t.net, t.threads
        x, h, s = _p(self.x), _p(self.h), _p(self.s)
        if t.streams == 1:  # (with hyper-connections `attend` wrote the feed-forward's input)
            lib.prefill_norm(net, lay, x, h, T)
        self.s.fill(0.0)
        if lay not in t.moe:  # a dense feed-forward: expert 0, weight 1, for every position
            lib.prefill_experts(net, lay, h, s, T, _p(self.dense_ids), _p(self.dense_w), _p(self.dense_ids), 1,
                                threads)
            lib.prefill_finish(net, lay, x, h, s, T, threads)
            return ahead
        used = sorted(set(self.ids.ravel().tolist()))
        if t.reader is None:  # every expert in memory: all of them in one call
            chosen = np.array(used, np.int64)
            lib.prefill_experts(net, lay, h, s, T, _p(self.ids), _p(self.w), _p(chosen), len(used), threads)
            lib.prefill_finish(net, lay, x, h, s, T, threads)
            return ahead
        m, cache = t.reader, t.reader.cache
        if ahead is not None and ahead.layer == lay:
            cache.end(ahead)  # what it read ahead is in the cache: hits below
            ahead = None
        size = max(1, cache.n // 2)  # one group computed while the next is read
        overlap = cache.n >= 2 * size  # else (one slot: top-1 routing at its least cache) one after the other
        groups = [used[i:i + size] for i in range(0, len(used), size)]
        pending = cache.begin(lay, groups[0])
        for i, group in enumerate(groups):
            done = pending
            for e, slot in zip(group, cache.end(done, keep=True)):
                m._point(lay, e, slot)
            if not overlap:
                pending = None
            try:
                if i + 1 < len(groups):
                    if overlap:
                        pending = cache.begin(lay, groups[i + 1])
                elif ahead is None:
                    ahead = self._read_ahead(lay, cache.n - len(group))
                chosen = np.array(group, np.int64)
                lib.prefill_experts(net, lay, h, s, T, _p(self.ids), _p(self.w), _p(chosen), len(group), threads)
            except BaseException:
                for started in (pending, ahead):
                    if started is not None and started is not done:
                        cache.end(started)  # its reads land before their slots can be given again
                raise
            finally:
                cache.release(done)
            if not overlap and i + 1 < len(groups):
                pending = cache.begin(lay, groups[i + 1])
        lib.prefill_finish(net, lay, x, h, s, T, threads)
        return ahead

    def _read_ahead(self, lay: int, room: int):
        """Start reading every expert of the next MoE layer where the prompt's picks (positions times
        top_k) would choose nearly all of them (four picks an expert leave (1 - 1/E)^(4E) < 2% of them
        unused: the bytes read stay within a few percent of the experts' the prompt uses) and `room`
        slots hold them; None otherwise. Speculative: what goes unused is evicted first."""
        m = self.t.reader
        later = [lay2 for lay2 in sorted(self.t.moe) if lay2 > lay]
        E = m.config.num_experts
        if not later or self.T * self.K < 4 * E or E > room:
            return None
        return m.cache.begin(later[0], list(range(E)), speculative=True)
