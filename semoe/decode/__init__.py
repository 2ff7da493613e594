"""The decoding core shared by every front-end: what each path takes (`support`), the step as a plan of
kernel calls (`plan`), the prompt pass (`prompt_pass`), the generation loop (`loop`), the torch
generation (`generate`) and the per-step profile (`profile`).

May import `semoe.model`, `semoe.kernels` and `storage`; never checkpoints, evaluation or train."""
