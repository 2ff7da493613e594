"""What each CPU decoding path takes, in one place, and the one error for a model a path does not take.

There are two paths on CPU, both over semoe's compiled kernels (semoe/kernels):

- the plan (`semoe.decode.plan.DecodePlan`), kernel call by kernel call with a little torch between
  them: every architecture the model implements (`ARCHITECTURES`) but the parts `plan_refusal`
  names, in float32 activations, with weights float32/bfloat16, int8/int4, FP8 or MXFP4;
- the one-call step (`decode_step.c`), the whole step in one C call: what `one_call_refusal` does not name
  (where the plan's kernel-by-kernel step does not take a model, `step_refusal`, its experts must all be in
  memory);
- the torch-free runner (`inference.torch_free.runner`), which calls the same C code in three parts: the
  same models.

This module imports no torch: the torch-free runner checks its models here too.
"""

from __future__ import annotations

from storage.errors import BadInputError

# the model types the plan knows (every one `semoe.checkpoints.hf_config` builds; `plan_refusal` names the parts
# it does not take yet)
ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss",
                 "minimax_m2", "dots1", "ernie4_5_moe", "hunyuan_v1_moe", "llama4_text",
                 "deepseek_v32", "glm_moe_dsa", "qwen3_next", "qwen3_5_moe_text",
                 "deepseek_v4")


MAX_GROUPS = 256  # a grouped router's groups the one-call step takes (decode_step.c's `route`)


class NotOnFastPath(BadInputError):
    """A model has a part a decoding path does not take; the message names the part."""


def plan_refusal(c) -> str | None:
    """What in config `c` no fast path takes yet (neither the plan's kernel-by-kernel step, nor the
    one-call step, nor the torch-free runner), in a phrase naming the parts; None where they take it.
    The modules run those models. (DeepSeek-V4 the plan takes in the one-call step alone: `step_refusal`.)"""
    return None  # every part of every architecture semoe loads is on a fast path


def step_refusal(c) -> str | None:
    """What in config `c` the plan's kernel-by-kernel step (offloaded experts) does not take, in a phrase."""
    if c.attention == "compressed":
        return f"{c.arch}'s compressed attention and hyper-connections with experts offloaded"
    return None


def one_call_refusal(c) -> str | None:
    """What in config `c` (a `semoe.model.config.MoEConfig`) the one-call step does not take, in a phrase;
    None where it takes it all."""
    why = plan_refusal(c)
    if why is not None:
        return why
    if c.num_experts and c.router == "grouped" and c.router_scores not in ("softmax", "sigmoid", "sqrtsoftplus"):
        return f"a router of {c.router_scores} scores"
    if c.num_experts and c.router == "grouped" and c.n_group > MAX_GROUPS:
        return f"a grouped router of {c.n_group} groups (at most {MAX_GROUPS})"
    return None
