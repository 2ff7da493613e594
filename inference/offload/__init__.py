"""Experts bigger than device memory: the ring of expert slots refilled on a copy stream
(`expert_ring`), its bookkeeping (`ring_bookkeeping`, plain Python) and the guess of the next layer's
experts (`next_layer_predictor`); and hybrid decode (`hybrid`), the ring's slots as a device cache beside
experts computed on the CPU, placed per expert and step by `hybrid_placement` (plain Python)."""
