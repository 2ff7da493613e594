"""What bench_train.py measures semoe's training against: the same model, written by transformers'
own class, trained by transformers with `torch.optim.AdamW`, on the batches semoe's run took.

The checkpoint is made once in WORKDIR (`hf/`, transformers' `save_pretrained`) and imported into a
store (`store/`), which `semoe train --init-from` starts from, so both begin from the same weights.
The peer then takes semoe's run's own batches (its token shards and sampler, step by step) and the
learning rate semoe logged for each step, and optimises the objective semoe's trainer does:
cross-entropy plus `aux_loss_coef` times the load-balancing loss and `z_loss_coef` times the router
z-loss, each the mean over MoE layers of the router logits transformers returns. AdamW with the
same betas, eps and weight decay on every parameter, the global gradient norm clipped as semoe
clips it. Timed per step (forward, backward, clipping, the optimizer step) with a perf counter.
"""

from __future__ import annotations

import os
import sys
import time

# A Mixtral-shaped model of bench_train's default size: semoe's byte tokenizer needs a vocabulary
# of at least 259, max_position covers the longest sequence measured.
MIXTRAL = dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
               intermediate_size=512, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=1024)
# qwen3_moe and gpt_oss at the same width, for the fine-tuning runs (`--finetune`)
SHAPES = {
    "mixtral": ("MixtralConfig", MIXTRAL),
    "qwen3_moe": ("Qwen3MoeConfig", dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                         num_key_value_heads=4, head_dim=32, intermediate_size=768,
                                         moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
                                         norm_topk_prob=True, decoder_sparse_step=1, max_position_embeddings=1024)),
    "gpt_oss": ("GptOssConfig", dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                     num_key_value_heads=4, head_dim=32, intermediate_size=256, num_local_experts=32,
                                     num_experts_per_tok=4, sliding_window=128, max_position_embeddings=1024)),
}


def make_checkpoint(workdir: str, arch: str = "mixtral", seed: int = 0) -> tuple[str, str]:
    """WORKDIR/hf (transformers' float32 checkpoint of `arch`) and WORKDIR/store (its import), each
    made once."""
    import torch
    import transformers

    from semoe.checkpoints.hf_convert import import_checkpoint

    hf, store = os.path.join(workdir, "hf"), os.path.join(workdir, "store")
    if not os.path.exists(os.path.join(hf, "config.json")):
        cls, fields = SHAPES[arch]
        print(f"making a {arch} checkpoint with transformers ...", file=sys.stderr, flush=True)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**fields))
        model.save_pretrained(hf)
        del model
    if not os.path.exists(os.path.join(store, "manifest.json")):
        import_checkpoint(hf, store)
    return hf, store


def run_batches(run_dir: str, batch: int, seq: int, seed: int, steps: int) -> list[tuple]:
    """The (ids, targets) semoe's run in `run_dir` took at each step (its shards, its sampler)."""
    from semoe.train.data import BatchSampler, ShardSet

    sampler = BatchSampler(ShardSet.open(os.path.join(run_dir, "data", "train")), batch, seq, seed=seed)
    return [sampler.batch(step) for step in range(steps)]


def objective(logits, targets, router_logits, top_k: int, aux_coef: float, z_coef: float):
    """(loss to minimise, cross-entropy): semoe's training objective on transformers' outputs."""
    import torch
    import torch.nn.functional as F

    from semoe.model.routing import load_balancing_loss, router_z_loss

    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    aux = z = torch.zeros((), dtype=ce.dtype)
    for r in router_logits:
        r = r.float()
        probs = torch.softmax(r, dim=-1)
        aux = aux + load_balancing_loss(probs, probs.topk(top_k, dim=-1).indices, r.shape[-1])
        z = z + router_z_loss(r)
    n = max(1, len(router_logits))
    return ce + aux_coef * aux / n + z_coef * z / n, ce


def train_transformers(hf: str, batches: list[tuple], lrs: list[float], *, betas: tuple[float, float], eps: float,
                       weight_decay: float, grad_clip: float, aux_coef: float, z_coef: float) -> list[dict]:
    """Train transformers' model from `hf` on `batches` at learning rates `lrs`; per step its
    cross-entropy and seconds."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).train()
    top_k = model.config.num_experts_per_tok
    opt = torch.optim.AdamW(model.parameters(), lr=lrs[0], betas=betas, eps=eps, weight_decay=weight_decay)
    out = []
    for (ids, tgt), lr in zip(batches, lrs):
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        res = model(input_ids=ids, output_router_logits=True, use_cache=False)
        router = res.router_logits or ()
        loss, ce = objective(res.logits, tgt, router, top_k, aux_coef, z_coef)
        # experts no token chose: semoe leaves them as they are (sparse AdamW), torch's AdamW on the
        # stacked expert tensors still moves them by their momentum and weight decay
        idle = sum(int((torch.bincount(r.topk(top_k, dim=-1).indices.reshape(-1), minlength=r.shape[-1]) == 0).sum())
                   for r in router)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        out.append({"loss": float(ce.detach()), "step_s": time.perf_counter() - t0, "idle_experts": idle})
    return out


def first_loss(hf: str, ids, tgt) -> float:
    """transformers' cross-entropy of its model from `hf` on one batch, before any update."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1)))
