"""Checkpoints in and out: HuggingFace configs (`hf_config`, torch-free) and safetensors directories
converted to stores and back (`hf_convert`), a store loaded as a model (`model_io`), tokenizers, and
stores rewritten in compact formats (`quantize_store`).

May import `semoe.model`, `semoe.kernels` and `storage`; never decode, evaluation or train."""
