"""SE-MoE training: the trainer and its config, data, run directories, expert states in memory or on SSD
(`expert_states`, `ssd_states`, `state_schedule`, `expert_grads`), sharded dense states, expert
parallelism, fused communication and the pipeline trainer with its memory compaction.

The top room of semoe/: may import every other subpackage, `mpress` and `storage`."""
