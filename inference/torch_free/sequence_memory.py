"""What a sequence of the torch-free runner (`inference.torch_free.runner`) takes beside the model: its KV cache,
its step's buffers and its prompt pass's, counted before the model is loaded so that an auto cache
leaves them free (`LeanConfig.keep_bytes`), and the KV cache's type where `--kv-cache auto` chooses."""

from __future__ import annotations

from semoe.kernels import loader

KV16_SHARE = 8  # `auto_kv_cache`: float16 where a float32 cache would take more than this share of memory


def sequence_bytes(c, prompt_tokens: int, capacity: int, kv_cache: str = "f32") -> int:
    """The most bytes a sequence of `capacity` positions takes beside the model (config `c`): its KV
    cache (of `kv_cache` values) and step buffers, and, while its prompt of `prompt_tokens` goes through
    (`lean_prefill`), the pass's rows (embeddings, residuals, choices) and one layer's buffers of
    PREFILL_ROWS rows, or the prompt's where fewer (with latent attention's expanded keys and values
    where they are within the kernels' limit). An auto cache leaves them free (`LeanConfig.keep_bytes`):
    decoding allocates them after the cache."""
    return sum(sequence_parts(c, prompt_tokens, capacity, kv_cache).values())


def auto_kv_cache(c, prompt_tokens: int, capacity: int, available: int) -> str:
    """`--kv-cache auto`: "f16" where a float32 KV cache of `capacity` positions would take more than
    1/KV16_SHARE of the `available` bytes (a long prompt where memory is short: as llama.cpp by default,
    half the bytes), else "f32" (the engine's values); "f32" for latent attention, whose cache the runner
    keeps in float32."""
    if c.attention == "mla":
        return "f32"
    return "f16" if sequence_parts(c, prompt_tokens, capacity)["kv"] * KV16_SHARE > available else "f32"


def sequence_plan(c, prompt_tokens: int, new_tokens: int, kv_cache: str, available: int) -> tuple[str, int]:
    """What `semoe generate` takes for a prompt of `prompt_tokens` and `new_tokens` more with no budget
    flag: the KV cache's type (`kv_cache`, "auto" chosen by `auto_kv_cache` against `available` bytes)
    and the bytes the sequence takes (`sequence_bytes`), which its auto cache leaves free."""
    positions = prompt_tokens + new_tokens
    if kv_cache == "auto":
        kv_cache = auto_kv_cache(c, prompt_tokens, positions, available)
    return kv_cache, sequence_bytes(c, prompt_tokens, positions, kv_cache)


def sequence_parts(c, prompt_tokens: int, capacity: int, kv_cache: str = "f32") -> dict[str, int]:
    """`sequence_bytes` by part: the KV cache ("kv"), the step's buffers ("step"), the prompt pass's rows
    ("rows"; these three numpy's) and one layer's buffers in the kernels ("layer")."""
    f, T, S = 4, prompt_tokens, capacity
    M = min(T, loader.PREFILL_ROWS)  # the rows of a block a prompt fills
    D, H, G = c.hidden_size, c.num_heads, c.num_kv_heads
    Dh, R, K, E = c.head_dim or D // H, c.rope_dim or 0, max(c.top_k, 1), max(c.num_experts, 1)
    F = max(c.ffn_size, c.moe_ffn_size, c.shared_expert_size)
    if c.attention == "mla":
        kv = c.kv_bytes(1, S, f)
        Dk, dv = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        expand = H * S * (Dk + dv) * f
        att = expand + M * H * Dk * f if expand <= loader.EXPAND_LIMIT else \
            M * H * (c.qk_nope_head_dim + c.qk_rope_head_dim + 2 * c.kv_lora_rank + dv) * f
        qkv, heads = M * ((c.q_lora_rank or 0) + H * Dk + c.kv_lora_rank + R) * f, H * dv
    else:
        kv, att = c.kv_bytes(1, S, 2 if kv_cache == "f16" else f), 0
        qkv, heads = 2 * M * (H + 2 * G) * Dh * f, H * Dh
    step = S * H * f + (3 * D + heads + 3 * F + E + 3 * c.vocab_size) * f  # the logits and the loop's copies
    step += 3 * S * f if c.index_topk else 0  # DeepSeek sparse attention's scores, their copy and the choice
    # lean_prefill's and prompt_pass's (with DeepSeek sparse attention's choices, int32 a position a row)
    rows = T * (5 * D + 2 * R) * f + T * (K * 20 + 12) + T * (c.index_topk or 0) * 4
    layer = M * (5 * D + 2 * heads + 3 * F + E) * f + qkv + att + loader.ROW_GROUP * H * S * f
    return {"kv": kv, "step": step, "rows": rows, "layer": layer}
