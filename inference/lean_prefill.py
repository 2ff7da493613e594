"""The torch-free runner's prompt pass (`LeanSequence.prefill`): the prompt's positions go through
the model one layer at a time, so that each expert the prompt chose in a layer is read from storage
once for the whole prompt and computed over all the positions that chose it at once.

Per layer: each position's attention and router in turn (`decode_attend`, as a decoding step runs
them: position t writes its k and v before t + 1 attends), then the feed-forward of all positions
(semoe/kernels/prefill.c): the union of the experts they chose, read in as many groups as the expert
cache holds at once (one group where it holds the layer's union: every expert read at most once a
layer), each expert's rows computed together, the weighted outputs summed per position, and the
shared expert on all rows. Token by token, a prompt of T positions asked the cache for each expert
up to T times a layer; with memory short, most of those were reads.

The residual stream, its normed copy and the experts' sum are held for all T positions (3 * T *
hidden_size float32: 17 MiB for 512 positions of gpt-oss-20b) beside the KV cache the sequence
already has. Logits come out of the last position only, as decoding's first step needs them."""

from __future__ import annotations

import ctypes

import numpy as np

from storage.errors import BadInputError


def _p(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def prefill(seq, tokens: list[int]) -> np.ndarray:
    """Run `tokens` through the model at the next positions of `seq` (an `inference.lean.LeanSequence`);
    the logits (V,) of the last (a view, valid until the next step)."""
    m, c, pos0, T = seq.model, seq.model.config, seq.length, len(tokens)
    if not tokens:
        raise BadInputError("the prompt is empty: give at least one token")
    if pos0 + T > seq.capacity:
        raise BadInputError(f"a prompt of {T} tokens at position {pos0}: the sequence holds {seq.capacity}")
    if seq._work is None:
        raise BadInputError("the sequence is closed")
    lib, net, work, threads = m.lib, seq._net, seq._work, m.settings.threads
    D, K = c.hidden_size, max(c.top_k, 1)
    x, h, s = (np.empty((T, D), np.float32) for _ in range(3))
    for t, token in enumerate(tokens):
        m._embed(token, x[t])
    R = seq.cos.shape[0]
    cos, sin = np.empty((T, R), np.float32), np.empty((T, R), np.float32)
    for t in range(T):
        m.rope(pos0 + t, cos[t], sin[t])
    ids, w = np.zeros((T, K), np.int64), np.zeros((T, K), np.float32)
    dense_ids, dense_w = np.zeros(T, np.int64), np.ones(T, np.float32)
    xs = [_p(x[t]) for t in range(T)]
    trig = [(_p(cos[t]), _p(sin[t])) for t in range(T)]
    picks = [(_p(ids[t]), _p(w[t])) for t in range(T)]
    for lay, (kp, vp) in enumerate(seq._kv):
        if lib.prefill_attend(net, lay, _p(x), T, kp, vp, seq.capacity, pos0, _p(cos), _p(sin), R, _p(ids), _p(w), K,
                              threads):  # latent attention: position by position
            for t in range(T):
                lib.decode_attend(net, work, lay, xs[t], kp, vp, seq.capacity, pos0 + t, *trig[t], *picks[t], threads)
        lib.prefill_norm(net, lay, _p(x), _p(h), T)
        s.fill(0.0)
        if lay in m._parts:
            used = sorted(set(ids.ravel().tolist()))
            for i in range(0, len(used), m.cache.n):  # as many as the cache holds at once
                group = used[i:i + m.cache.n]
                for e, slot in zip(group, m.cache.ensure(lay, group)):
                    m._point(lay, e, slot)
                chosen = np.array(group, np.int64)
                lib.prefill_experts(net, lay, _p(h), _p(s), T, _p(ids), _p(w), _p(chosen), len(group), threads)
        else:  # a dense feed-forward: expert 0, weight 1, for every position (decode_attend's choice)
            lib.prefill_experts(net, lay, _p(h), _p(s), T, _p(dense_ids), _p(dense_w), _p(dense_ids), 1, threads)
        lib.prefill_finish(net, lay, _p(x), _p(h), _p(s), T, threads)
    seq.length = pos0 + T
    seq.x[:] = x[-1]
    lib.decode_head(net, work, seq._p[0], seq._p[1], threads)
    return seq.logits
