"""An importance matrix from calibration text (`semoe store quantize --kquant --calibrate FILE`), as
llama.cpp's `llama-imatrix` collects one.

The float model runs teacher-forced over the text in windows; for every weight the quantizer fits, each
input column's activations are squared and averaged over the rows that reached it: over every token for
the dense linears (attention, lm_head, dense and shared feed-forwards), over the tokens routed to that
expert for an expert's weights (its gate and up see the expert's input, its down the activation
between). `storage.kquants` then weighs each column's squared error by that mean: the expected squared
error of the product for inputs like the text's.

An expert no calibration token reached borrows the mean of its layer's experts that were reached (its
weights are still fitted for inputs like its layer's); the count of such experts is reported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from semoe.checkpoints.model_io import load_model
from semoe.evaluation.perplexity import window_bounds
from semoe.model.compact_linear import dense_linear_names
from semoe.model.experts import ExpertWeights, ResidentExperts
from semoe.model.hf_names import hf_name
from storage.errors import BadInputError
from storage.store import Store

log = logging.getLogger(__name__)


@dataclass
class Importance:
    """Mean squared input activation per column: by a dense weight's stored name, and by (layer, expert,
    index of the weight among the expert's tensors in its variant's order)."""

    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    experts: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)
    tokens: int = 0
    unreached: int = 0  # experts no calibration token was routed to

    def expert(self, layer: int, expert: int, part: int) -> torch.Tensor | None:
        got = self.experts.get((layer, expert, part))
        if got is not None:
            return got
        seen = [v for (lay, _, p), v in self.experts.items() if lay == layer and p == part]
        return torch.stack(seen).mean(0) if seen else None


class _Sums:
    def __init__(self) -> None:
        self.sum: dict = {}
        self.rows: dict = {}

    def add(self, key, x: torch.Tensor) -> None:
        x = x.detach().to(torch.float32).reshape(-1, x.shape[-1])
        s = (x * x).sum(0)
        if key in self.sum:
            self.sum[key] += s
            self.rows[key] += x.shape[0]
        else:
            self.sum[key], self.rows[key] = s, x.shape[0]

    def means(self) -> dict:
        return {k: v / self.rows[k] for k, v in self.sum.items()}


@dataclass(frozen=True)
class _Recorded(ExpertWeights):
    """An expert that adds its inputs' squares to the sums before computing as it would."""

    key: tuple[int, int] = (0, 0)
    sums: _Sums | None = None

    def apply(self, x_MD: torch.Tensor) -> torch.Tensor:
        mats = [i for i, p in enumerate(self.parts) if p.dim() == 2]
        for i in mats[:-1]:
            self.sums.add((*self.key, i), x_MD)  # the weights applied to the expert's input
        # the last weight's input: the expert computed with that weight the identity and its bias zero
        last = mats[-1]
        hidden = self.parts[last].shape[-1 if not self.mlp.in_out else 0]
        parts = list(self.parts)
        parts[last] = torch.eye(hidden, dtype=x_MD.dtype)
        for i in range(last + 1, len(parts)):
            parts[i] = torch.zeros(hidden, dtype=x_MD.dtype)
        # (composed of its products: the one-call kernels take no such shapes, and are left when a gradient is wanted)
        with torch.enable_grad():
            hidden_MF = self.mlp.apply(x_MD.detach().requires_grad_(True), tuple(parts)).detach()
        self.sums.add((*self.key, last), hidden_MF)
        return super().apply(x_MD)


def collect_importance(store_path: str, ids: list[int], *, seq_len: int = 512,
                       progress: Callable[[int], None] | None = None) -> Importance:
    """The importance matrix of the float store at `store_path` over the token ids `ids` (calibration text as
    its tokenizer reads it), in windows of `seq_len`."""
    store = Store.open(store_path)
    if store.is_compact():
        raise BadInputError(f"{store_path}: calibrate on the float store its quantization starts from")
    if len(ids) < 2:
        raise BadInputError(f"calibration text of {len(ids)} token(s); need some text to calibrate on")
    model = load_model(store, device="cpu", dtype=torch.float32, dense="float")
    model.eval()
    config = model.config
    if max(ids) >= config.vocab_size:
        raise BadInputError(f"calibration token id {max(ids)} is outside the model's vocabulary of {config.vocab_size}")
    sums = _Sums()
    hooks = []
    modules = dict(model.named_modules())
    for name in dense_linear_names(model):
        key = hf_name(config, f"{name}.weight")
        hooks.append(modules[name].register_forward_pre_hook(lambda mod, args, key=key: sums.add(key, args[0])))
    providers = []
    for ffn in model.moe_layers():
        ex = ffn.experts
        if not isinstance(ex, ResidentExperts):
            raise BadInputError(f"layer {ffn.layer}: calibration needs the experts resident")

        def stream(layer, experts, x_ND, ex=ex):
            for e, w in ResidentExperts.stream(ex, layer, experts, x_ND):
                yield e, _Recorded(w.parts, w.mlp, key=(layer, e), sums=sums)

        providers.append((ex, stream))
        object.__setattr__(ex, "stream", stream)
    seq = min(seq_len, config.max_position)
    try:
        with torch.no_grad():
            for s, e in window_bounds(len(ids), seq, len(ids)):
                # every window's tokens as input; a 1-token window would take the decoding path's shortcut
                window = ids[s:max(e, s + 2)]
                model(torch.tensor([window]))
                if progress:
                    progress(len(window))
    finally:
        for h in hooks:
            h.remove()
        for ex, _ in providers:
            del ex.stream
    means = sums.means()
    imp = Importance(tokens=len(ids))
    for k, v in means.items():
        (imp.experts if isinstance(k, tuple) else imp.dense)[k] = v
    for ffn in model.moe_layers():
        imp.unreached += sum(1 for e in range(config.num_experts) if (ffn.layer, e, 0) not in imp.experts)
    log.info("importance from %d tokens; %d experts no token reached borrow their layer's mean", imp.tokens,
             imp.unreached)
    return imp
