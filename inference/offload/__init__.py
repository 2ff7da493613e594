"""Experts bigger than device memory: the ring of expert slots refilled on a copy stream
(`expert_ring`), its bookkeeping (`ring_bookkeeping`, plain Python) and the guess of the next layer's
experts (`next_layer_predictor`)."""
