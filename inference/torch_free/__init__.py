"""Decoding in a process without torch (`semoe generate --lean`): the model over the compiled kernels
(`runner`), its expert cache in fixed slots (`expert_slots`), the prompt pass (`prompt_prefill`) and
what a sequence takes beside the model (`sequence_memory`).

Nothing here may import torch, directly or through another module: tests/test_structure.py checks it."""
