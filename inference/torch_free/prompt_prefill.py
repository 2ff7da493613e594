"""The torch-free runner's prompt pass (`prefill`): the prompt's positions through the model a layer
at a time (`semoe.decode.prompt_pass`), its chosen experts read from storage into the runner's cache
once a layer for the whole prompt. Logits come out of the last position only, as decoding's first
step needs them."""

from __future__ import annotations

from typing import Callable

import numpy as np

from semoe.decode.prompt_pass import Target, run, sequences
from storage.errors import BadInputError


def prefill(seq, tokens: list[int], on_layer: Callable[[int, int], None] | None = None) -> np.ndarray:
    """Run `tokens` through the model at the next positions of `seq` (an `inference.torch_free.runner.LeanSequence`);
    the logits (V,) of the last (a view, valid until the next step). `on_layer(done, layers)` after each
    layer: a long prompt's progress."""
    m, pos0, T = seq.model, seq.length, len(tokens)
    if not tokens:
        raise BadInputError("the prompt is empty: give at least one token")
    if pos0 + T > seq.capacity:
        raise BadInputError(f"a prompt of {T} tokens at position {pos0}: the sequence holds {seq.capacity}")
    if seq._work is None:
        raise BadInputError("the sequence is closed")
    x = advance(seq, tokens, on_layer)
    seq.x[:] = x[-1]
    if seq.keep_rows:  # a drafter's input (`inference.torch_free.mtp`)
        seq.rows = (pos0, x)
    m.lib.decode_head(seq._net, seq._work, seq._p[0], seq._p[1], m.settings.threads)
    return seq.logits


def advance(seq, tokens: list[int], on_layer: Callable[[int, int], None] | None = None) -> np.ndarray:
    """`tokens` through every layer at the next positions of `seq`, without the head (the caller checked
    that they fit); the residual stream after the last layer (T, D; with hyper-connections its streams, T
    by N D). The sequence advances by them."""
    m, c, pos0, T = seq.model, seq.model.config, seq.length, len(tokens)
    x, cos, sin = m.inputs(tokens, list(range(pos0, pos0 + T)))
    kc, vc, segs = sequences([seq.addresses], [seq.capacity], [pos0], [T])
    run(Target(m.lib, seq._net, kc, vc, segs, m.settings.threads, c.top_k, m.moe, m, c.index_topk or 0,
               np.array(tokens, np.int64), c.hc_mult), x, cos, sin, on_layer)
    seq.length = pos0 + T
    return x
