"""A PipelineProfile from a model's shape alone, for planning before anything runs (`semoe plan`).

Legend: b micro-batch size, s sequence length, h hidden size, a attention heads, V vocabulary,
E experts (0: dense), k experts each token runs (top-k), d bytes per activation element.

Saved activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4.1: without recomputation or sequence parallelism a layer keeps
s*b*h*(34 + 5*a*s/h) bytes with 2-byte activations and 1-byte dropout masks. Counted per element
that is s*b*h*(16*d + 2) + a*s*s*b*(2*d + 1): 16 activation values and 2 mask bytes per token and
hidden unit, 2 values and 1 mask byte per attention score. Biases, layer-norm weights and the
capacity padding of MoE dispatch are left out.

Flops (forward, per layer) are 24*b*s*h^2 + 4*b*s^2*h for a dense layer; an MoE layer keeps the
attention (8*b*s*h^2 + 4*b*s^2*h), runs k expert FFNs per token (16*b*s*h^2 each) and a router
(2*b*s*h*E). Backward costs twice the forward.

Model data per parameter: `dtype_bytes` of weight and of gradient, which every forward and
backward touch, and the rest of `optimizer_bytes_per_param` as optimizer states (12 under mixed
precision: fp32 master weight and two moments), which only the optimizer step reads. The step is
memory-bound: on the device it reads the gradient and the states and writes the states and the
weight, at `device_memory_bw`; on the host, CPU Adam runs at `host_adam_params_per_s` (fused,
vectorised, all cores).
"""

from __future__ import annotations

from mpress.profile import SCHEDULES, LayerProfile, PipelineProfile, SavedTensor, StageProfile

ARCHS = ("gpt", "bert")
MASK_BYTES = 1  # a dropout mask element
TOKEN_ID_BYTES = 8  # int64 token ids, kept by the embedding for its backward
BERT_CLASSES = 2  # "bert" ends in a pooler and a sequence classifier with this many classes
DEVICE_MEMORY_BW = 900e9  # V100 HBM2
HOST_ADAM_PARAMS_PER_S = 1e9  # fused CPU Adam on a two-socket server


def layer_saved(*, hidden: int, heads: int, seq: int, micro_batch: int, dtype_bytes: int = 2,
                experts: int = 0, top_k: int = 1) -> list[SavedTensor]:
    """What one transformer layer keeps for backward per micro-batch (Korthikanti et al. 2022)."""
    d, tokens = dtype_bytes, seq * micro_batch
    sbh = tokens * hidden
    saved = [
        SavedTensor(name="attn.norm", bytes=d * sbh),  # layer-norm input
        SavedTensor(name="attn.qkv", bytes=4 * d * sbh),  # projection input, then Q, K and V
        # softmax output, its dropout mask and the dropped-out probabilities, per head
        SavedTensor(name="attn.scores", bytes=heads * seq * seq * micro_batch * (2 * d + MASK_BYTES)),
        SavedTensor(name="attn.out", bytes=(d + MASK_BYTES) * sbh),  # output-projection input, dropout mask
        SavedTensor(name="mlp.norm", bytes=d * sbh),
    ]
    # every token runs k experts (a dense FFN is one expert every token runs)
    ffn_copies = top_k if experts else 1
    if experts:
        saved.append(SavedTensor(name="moe.router", bytes=d * tokens * experts))  # routing probabilities
    saved += [
        SavedTensor(name="mlp.in", bytes=ffn_copies * d * sbh),  # first linear's input
        SavedTensor(name="mlp.act", bytes=ffn_copies * 8 * d * sbh),  # GeLU input and output (4h wide)
        SavedTensor(name="mlp.out", bytes=MASK_BYTES * sbh),  # dropout mask
    ]
    return saved


def layer_flops(*, hidden: int, seq: int, micro_batch: int, experts: int = 0, top_k: int = 1) -> float:
    """Forward flops of one transformer layer for one micro-batch."""
    b, s, h = micro_batch, seq, hidden
    attention = 8 * b * s * h * h + 4 * b * s * s * h
    if not experts:
        return float(attention + 16 * b * s * h * h)
    return float(attention + 16 * b * s * h * h * top_k + 2 * b * s * h * experts)


def layer_params(*, hidden: int, experts: int = 0) -> int:
    """Parameters of one transformer layer: attention 4h^2, FFN 8h^2 per expert, router h*E."""
    h = hidden
    if not experts:
        return 12 * h * h
    return 4 * h * h + experts * 8 * h * h + h * experts


def split_layers(layers: int, stages: int) -> list[int]:
    """Transformer layers per stage, as even as possible; earlier stages take the extra ones."""
    base, extra = divmod(layers, stages)
    return [base + (stage < extra) for stage in range(stages)]


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _validate(arch: str, layers: int, hidden: int, heads: int, seq: int, micro_batch: int,
              micro_batches: int, vocab: int, experts: int, top_k: int, stages: int, schedule: str,
              flops: float, dtype_bytes: int, optimizer_bytes_per_param: int) -> None:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    for name, value in (("hidden", hidden), ("heads", heads), ("seq", seq), ("micro_batch", micro_batch),
                        ("micro_batches", micro_batches), ("vocab", vocab), ("top_k", top_k),
                        ("stages", stages), ("dtype_bytes", dtype_bytes)):
        _check_int(name, value, 1)
    _check_int("experts", experts, 0)
    _check_int("optimizer_bytes_per_param", optimizer_bytes_per_param, 0)
    _check_int("layers", layers, stages)  # every stage runs at least one transformer layer
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
    if experts and top_k > experts:
        raise ValueError(f"top_k must be <= experts ({experts}), got {top_k}")
    if isinstance(flops, bool) or not isinstance(flops, (int, float)) or not flops > 0:
        raise ValueError(f"flops must be > 0 (sustained flop/s of one device), got {flops!r}")


def analytic_profile(*, arch: str = "gpt", layers: int, hidden: int, heads: int, seq: int, micro_batch: int,
                     micro_batches: int, vocab: int, experts: int = 0, top_k: int = 1, stages: int,
                     schedule: str = "1f1b", flops: float, dtype_bytes: int = 2,
                     optimizer_bytes_per_param: int = 16, device_memory_bw: float = DEVICE_MEMORY_BW,
                     host_adam_params_per_s: float = HOST_ADAM_PARAMS_PER_S) -> PipelineProfile:
    """The profile of a GPT (or BERT encoder) of `layers` layers split over `stages` stages.

    The embedding is an extra first layer of stage 0; the head an extra last layer of the last
    stage: an LM head ("gpt") or a pooler and a `BERT_CLASSES`-way classifier ("bert"). Every
    transformer layer is an MoE layer when `experts` > 0. `flops` is one device's sustained
    flop/s; `optimizer_bytes_per_param` 16 is mixed-precision Adam (fp16 weight and gradient,
    fp32 master weight and two moments).
    """
    _validate(arch, layers, hidden, heads, seq, micro_batch, micro_batches, vocab, experts, top_k,
              stages, schedule, flops, dtype_bytes, optimizer_bytes_per_param)
    for name, value in (("device_memory_bw", device_memory_bw), ("host_adam_params_per_s", host_adam_params_per_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    b, s, h, d = micro_batch, seq, hidden, dtype_bytes
    hidden_bytes = b * s * h * d  # one (b, s, h) activation: a layer's output
    update = min(2 * d, optimizer_bytes_per_param)  # weight and gradient, per parameter
    state = optimizer_bytes_per_param - update
    touched = update + 2 * state  # the device step reads the gradient and states, writes states and weight

    def make(index: int, name: str, forward_flops: float, saved: list[SavedTensor], params: int,
             output_bytes: int) -> LayerProfile:
        forward_s = forward_flops / flops
        return LayerProfile(index=index, name=name, forward_s=forward_s, backward_s=2 * forward_s,
                            saved=saved, param_bytes=params * optimizer_bytes_per_param,
                            output_bytes=output_bytes, state_bytes=params * state, update_bytes=params * update,
                            state_tensors=3 if state else 0,  # master weight and two moments, one tensor each
                            step_s=params * touched / device_memory_bw,
                            host_step_s=params / host_adam_params_per_s if state else 0.0)

    # a lookup: no flops to speak of; backward needs the token ids and the dropout mask
    embedding = make(0, "embedding", 0.0, [SavedTensor(name="embed.ids", bytes=b * s * TOKEN_ID_BYTES),
                                           SavedTensor(name="embed.mask", bytes=b * s * h * MASK_BYTES)],
                     vocab * h, hidden_bytes)
    shape = dict(hidden=h, seq=s, micro_batch=b, experts=experts, top_k=top_k)
    blocks = [make(1 + i, f"layer{i}", layer_flops(**shape), layer_saved(heads=heads, dtype_bytes=d, **shape),
                   layer_params(hidden=h, experts=experts), hidden_bytes) for i in range(layers)]
    if arch == "gpt":
        # final layer norm and the vocabulary projection, whose logits the loss keeps
        head = make(1 + layers, "lm_head", 2 * b * s * h * vocab,
                    [SavedTensor(name="head.norm", bytes=hidden_bytes),
                     SavedTensor(name="head.in", bytes=hidden_bytes),
                     SavedTensor(name="head.logits", bytes=b * s * vocab * d)],
                    vocab * h, b * s * vocab * d)
    else:
        # pooler (h x h dense on the first token) and classifier
        head = make(1 + layers, "pooler", 2 * b * h * h + 2 * b * h * BERT_CLASSES,
                    [SavedTensor(name="pooler.in", bytes=b * h * d),
                     SavedTensor(name="classifier.in", bytes=b * h * d)],
                    h * h + h * BERT_CLASSES, b * BERT_CLASSES * d)

    stage_layers, start = [], 0
    for count in split_layers(layers, stages):
        stage_layers.append(blocks[start:start + count])
        start += count
    stage_layers[0].insert(0, embedding)
    stage_layers[-1].append(head)
    return PipelineProfile(stages=[StageProfile(stage=i, layers=ls) for i, ls in enumerate(stage_layers)],
                           micro_batches=micro_batches, schedule=schedule, boundary_bytes=hidden_bytes)
