"""Speculative decoding on the torch-free runner: k drafted tokens verified in one pass of k + 1 rows.

With memory short, a decoding step is bound by reading the experts it misses. The verification pass is
the prompt pass (`semoe.decode.prompt_pass`, its experts read into the runner's cache as chosen): each
layer's chosen experts are read once for all its rows, so k + 1 tokens cost the union of their experts,
which is far less than k + 1 tokens' worth where consecutive tokens route alike (trained models), and
about as much where they do not (random weights: the bench says which). The tokens are
`semoe.decode.loop.run_speculative`'s: greedy decoding's, each row's argmax up to the first row that
differs from its draft.

`verify` runs the rows and keeps an undo record; `keep(n)` keeps the first n of its positions: attention's
caches by the sequence's length alone (what is past it is written over), a state that holds every token
at once restored from before the pass and run over the kept tokens again: the linear layers' (Qwen3-Next's)
whole, DeepSeek-V4's fixed part (its window, its compressors' pending tokens; an entry a rejected row closed
lies past the kept ones, written over when its window closes again). Where the sequence keeps its rows
(`keep_rows`: a multi-token-prediction drafter reads them, `inference.torch_free.mtp`), `seq.rows` is then the
kept positions' residual rows. This module imports no torch.
"""

from __future__ import annotations

import numpy as np

from inference.torch_free.prompt_prefill import advance
from semoe.decode.prompt_pass import packed
from storage.errors import BadInputError


def verify(seq, tokens: list[int]) -> np.ndarray:
    """`tokens` through the model at the next positions of `seq` (an `inference.torch_free.runner.LeanSequence`)
    in one pass; each row's logits (len(tokens), V). The sequence holds them until `keep` says otherwise.
    One token (no draft) is a plain decoding step."""
    m, c, pos0, T = seq.model, seq.model.config, seq.length, len(tokens)
    if not tokens or pos0 + T > seq.capacity:
        raise BadInputError(f"{T} rows at position {pos0}: the sequence holds {seq.capacity}")
    if T == 1:  # nothing to undo
        seq.undo = (pos0, list(tokens), [])
        logits = seq.step(tokens[0])[None]
        if seq.keep_rows:
            seq.rows = (pos0, seq.x[None].copy())
        return logits
    saved = [(lay, k.copy(), v.copy() if c.is_linear(lay) else None) for lay, (k, v) in enumerate(seq.caches)
             if c.is_linear(lay) or c.attention == "compressed"]
    seq.undo = (pos0, list(tokens), saved)
    x, cos, sin = m.inputs(tokens, list(range(pos0, pos0 + T)))
    logits = np.empty((T, m.head.O), np.float32)
    packed(m.lib, seq._net, [seq.addresses], [seq.capacity], [pos0], [T], x, cos, sin, list(range(T)), logits,
           threads=m.settings.threads, top_k=c.top_k, moe=m.moe, reader=m, index_topk=c.index_topk or 0,
           tokens=tokens, streams=c.hc_mult)
    seq.length = pos0 + T
    if seq.keep_rows:  # the residual rows, a drafter's input once `keep` says which stand
        seq.rows = (pos0, x)
    return logits


def keep(seq, n: int) -> None:
    """Keep the first n positions of the last `verify`'s rows (1 <= n <= its rows)."""
    pos0, tokens, saved = seq.undo
    if not 1 <= n <= len(tokens):
        raise ValueError(f"keep {n} of {len(tokens)} rows")
    seq.length = pos0 + n
    if seq.keep_rows and seq.rows is not None:
        seq.rows = (pos0, seq.rows[1][:n])
    if n == len(tokens) or not saved:
        return
    for lay, k0, v0 in saved:
        k, v = seq.caches[lay]
        k[...] = k0
        if v0 is not None:
            v[...] = v0
    seq.length = pos0
    x = advance(seq, tokens[:n])
    if seq.keep_rows:
        seq.rows = (pos0, x)
