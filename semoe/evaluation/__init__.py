"""Measuring a model: perplexity and KL divergence on text (`perplexity`) and the record of which
experts the routers chose (`routing_trace`).

May import `semoe.model`, `semoe.decode`, `semoe.checkpoints`, `semoe.kernels` and `storage`; never
train."""
