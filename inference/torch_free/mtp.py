"""Drafting with a checkpoint's own multi-token-prediction (MTP) layer, on the torch-free runner's kernels.

DeepSeek-V3/V3.2, GLM-4.5/5, Qwen3-Next and Qwen3.5 ship a layer past the model's last, trained to predict
the token after next: row i takes the model's last hidden state at position i (after its final norm, h_i)
and the embedding of the token at i + 1, each normed (`hnorm`, `enorm`), concatenates them (embedding first),
projects them back to the hidden size (`eh_proj`), runs one decoder layer (attention over its own cache,
a MoE with its own experts) rotating at position i + 1, norms the result (`post_norm`) and scores it with the
model's head. Chained, the normed output and the drafted token make the next row (one layer drafts k tokens).
The arithmetic is transformers' `MtpModel`'s (the tests' oracle); the names are `semoe.model.hf_names.mtp_name`'s.

Here the layer is one more layer of the runner's Net (`LeanModel.parts` and the MTP layer, whose norm is
`post_norm` and whose head is the model's): its rows run through the prompt pass (`semoe.decode.prompt_pass.run`
over that layer alone), its experts read into the runner's cache like the model's (chunks of layer
`num_layers`). Its cache is a full-attention (or latent) layer's: a row written at a position is right once
the model's row there is, so a rejected draft's rows are written over by the next pass, with nothing to undo.

`Drafter` is `semoe.decode.loop.run_speculative`'s draft for one sequence: each call first runs the rows the
model kept since the last (`LeanSequence.rows`; those of calls that asked for no draft too, held until one
does: `loop.Paying`'s plain passes) to bring the layer's cache level with them, the last of them drafting
the first token, then chains. This module imports no torch.
"""

from __future__ import annotations

import ctypes

import numpy as np

from semoe.decode.loop import PromptLookup
from semoe.decode.prompt_pass import Target, run, sequences
from semoe.decode.support import NotOnFastPath
from semoe.kernels import loader
from semoe.model.hf_names import hf_name, mtp_name
from storage.errors import BadInputError


def mtp_layers(store) -> list[int]:
    """The multi-token-prediction layers a store holds (import keeps them: `hf_convert.open_checkpoint`)."""
    return list((store.manifest.model.get("mtp") or {}).get("layers") or [])


def mtp_refusal(store) -> str | None:
    """Why the store's multi-token-prediction layer does not draft (None: it does): none is held, or its
    model's kind or its tensors' names are not the ones `MTP` reads."""
    from semoe.checkpoints.hf_config import store_model_config

    layers = mtp_layers(store)
    if not layers:
        return "the store holds no multi-token-prediction layer"
    c = store_model_config(store)
    if c.hc_mult > 1 or c.attention == "compressed":
        return f"{c.arch}'s multi-token-prediction layer (with hyper-connections) does not draft yet"
    if c.index_topk:  # (its indexer's positions, or a shared one's from a layer the draft does not run)
        return f"{c.arch}'s multi-token-prediction layer (DeepSeek sparse attention) does not draft yet"
    missing = [n for n in (mtp_name(c, layers[0], p) for p in ("enorm", "hnorm", "eh_proj", "post_norm"))
               if not store.manifest.has_tensor(n)]
    if missing:
        return f"{c.arch}'s multi-token-prediction layer is not laid out as drafting reads it (no {missing[0]})"
    return None


def default_draft(model, seq, prompt: list[int]):
    """Speculative decoding's default draft for a runner's sequence `seq` (after `prompt`): the checkpoint's
    own multi-token-prediction layer where it drafts (`mtp_refusal`), else lookup in the prompt and the
    tokens so far (`semoe.decode.loop.PromptLookup`)."""
    if mtp_refusal(model.store) is not None:
        return PromptLookup(prompt)
    if model._mtp is None:
        model._mtp = MTP(model)
    return model._mtp.drafter(seq, prompt)


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of rows x (n, D) by w (D,), float32."""
    x = x.astype(np.float32, copy=False)
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))) * w


class MTP:
    """A runner's (`inference.torch_free.runner.LeanModel`) first multi-token-prediction layer, made into a
    Net it can run; `drafter(seq, prompt)` drafts for one of its sequences."""

    def __init__(self, model) -> None:
        c, store = model.config, model.store
        why = mtp_refusal(store)
        if why:
            raise (BadInputError if not mtp_layers(store) else NotOnFastPath)(f"{store.root}: {why}")
        layers = mtp_layers(store)
        L = layers[0]
        self.model, self.layer = model, L

        def vector(name: str) -> np.ndarray:
            a = model._read_1d(name) + np.float32(1 if c.norm_plus_one else 0)
            model.held.append(a)
            return a

        self.enorm, self.hnorm = vector(mtp_name(c, L, "enorm")), vector(mtp_name(c, L, "hnorm"))
        self.norm = vector(hf_name(c, "norm.weight"))  # the model's final norm: the hidden state it hands over
        self.post = post = vector(mtp_name(c, L, "post_norm"))
        self.proj = model._linear([], model.dense, bias=False, name=mtp_name(c, L, "eh_proj"))
        if (self.proj.O, self.proj.I) != (c.hidden_size, 2 * c.hidden_size):
            raise BadInputError(f"{store.root}: {mtp_name(c, L, 'eh_proj')} is {self.proj.O}x{self.proj.I}; expected "
                                f"{c.hidden_size}x{2 * c.hidden_size}")
        self.net, self.arr = loader.build_net(c, [*model.parts, model._layer(L, model.dense)], post.ctypes.data,
                                              c.rms_norm_eps, model.head, kv16=model.settings.kv_cache == "f16")
        self._net = ctypes.byref(self.net)
        self.moe = frozenset({L}) if L in model._parts else frozenset()

    def drafter(self, seq, prompt: list[int]) -> "Drafter":
        return Drafter(self, seq, prompt)

    def rows(self, cache, capacity: int, hidden: np.ndarray, tokens: list[int], first: int
             ) -> tuple[np.ndarray, np.ndarray]:
        """The layer over rows (hidden[j], tokens[j]): hidden (n, D) the model's (or the layer's, chained)
        normed hidden states at positions first + j, tokens the ones at first + j + 1, where the rows
        rotate; their keys written into `cache` (k, v) at first + j (the layer's cache starts with the
        row of position 1, as transformers' does). The last row's logits (V,) and its normed output (D,),
        the next chained row's hidden state."""
        m, c, L, n = self.model, self.model.config, self.layer, len(tokens)
        e, cos, sin = m.inputs(tokens, list(range(first + 1, first + 1 + n)))
        both = np.ascontiguousarray(np.concatenate([rms(e, self.enorm, c.rms_norm_eps),
                                                    rms(hidden, self.hnorm, c.rms_norm_eps)], axis=1))
        x = np.empty((n, c.hidden_size), np.float32)
        m.lib.lin_rows(ctypes.byref(self.proj), both.ctypes.data, n, x.ctypes.data, m.settings.threads)
        addr = ([0] * L + [cache[0].ctypes.data], [0] * L + [cache[1].ctypes.data])
        kc, vc, segs = sequences([addr], [capacity], [first], [n])
        run(Target(m.lib, self._net, kc, vc, segs, m.settings.threads, c.top_k, self.moe, m, c.index_topk or 0,
                   np.array(tokens, np.int64)), x, cos, sin, layers=[L])
        logits = np.empty(m.head.O, np.float32)
        last = np.ascontiguousarray(x[-1:])
        m.lib.prefill_head(self._net, last.ctypes.data, 1, logits.ctypes.data, m.settings.threads)
        return logits, rms(last, self.post, c.rms_norm_eps)[0]


class Drafter:
    """`run_speculative`'s draft for one sequence of the runner (`seq`, after `prompt`), with the layer:
    up to n greedy tokens to follow the ones generated so far."""

    def __init__(self, mtp: MTP, seq, prompt: list[int]) -> None:
        c = mtp.model.config
        self.mtp, self.seq, self.prompt = mtp, seq, list(prompt)
        seq.keep_rows = True
        # its cache, of one full-attention (or latent) layer; a position past the last the model writes
        # holds a chained row's
        (_, *k), (_, *v) = c.kv_shapes(1, seq.capacity)
        kv = np.float16 if mtp.model.settings.kv_cache == "f16" else np.float32
        if c.attention == "mla":  # the head axis of one dropped, float32
            self.cache = (np.zeros(k[1:], np.float32), np.zeros(v[1:], np.float32))
        else:
            self.cache = (np.zeros(k, kv), np.zeros(v, kv))
        self.drafted = 0
        self.pending: list[tuple[int, np.ndarray]] = []  # rows not run yet: (first position, rows), in order

    def feed(self, pos0: int, rows: np.ndarray) -> None:
        """The model's residual rows (n, D) of positions pos0.., kept: run when next drafting. Rows that do
        not follow the last fed (a server's request resumed, or after a step it did not see) start
        again from them: the layer's cache then lacks the positions between, which costs drafts' quality,
        not tokens."""
        if self.pending and self.pending[-1][0] + len(self.pending[-1][1]) != pos0:
            self.pending.clear()
        self.pending.append((pos0, rows))

    def __call__(self, generated: list[int], n: int) -> list[int]:
        seq, mtp = self.seq, self.mtp
        if seq.rows is not None:  # the rows the model kept since the last call, run when next drafting
            self.feed(*seq.rows)
            seq.rows = None
        if n < 1 or not self.pending:
            return []
        pos0 = self.pending[0][0]
        rows = np.concatenate([r for _, r in self.pending]) if len(self.pending) > 1 else self.pending[0][1]
        self.pending = []
        full = self.prompt + list(generated)  # full[p]: the token at position p (the last one not yet run)
        last = pos0 + len(rows)  # the position of the token the model chose last
        if last + n > seq.capacity or len(full) != last + 1:
            return []
        eps = mtp.model.config.rms_norm_eps
        logits, hidden = mtp.rows(self.cache, seq.capacity, rms(rows, mtp.norm, eps), full[pos0 + 1:last + 1], pos0)
        out = [int(np.argmax(logits))]
        while len(out) < n:  # the row of position last + j - 1: the layer's output there, the token drafted after
            logits, hidden = mtp.rows(self.cache, seq.capacity, hidden[None], [out[-1]], last + len(out) - 1)
            out.append(int(np.argmax(logits)))
        self.drafted += len(out)
        return out
