"""The MoE GPT network, single-device: `config`, `attention` (GQA, MLA, sliding window, sinks), `rope`,
`routing` (routers, capacity, aux and z losses), `experts`, `compact_linear` (weights in their stored
int8/int4/FP8/MXFP4 form), `expert_layout`, `hf_names` (parameter names as HuggingFace writes them) and
the model itself, `moe_gpt`.

May import `semoe.kernels` and `storage`; never checkpoints, decode, evaluation or train."""
