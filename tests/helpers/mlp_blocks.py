"""The executor's test model: a few pre-norm MLP blocks with fixed weights and inputs.

Legend: T tokens per micro-batch, D model width, H hidden width.
"""

from __future__ import annotations

import torch
from torch import nn

T, D, H = 32, 64, 128
LAYERS = 4


class Block(nn.Module):
    """A pre-norm MLP block with a residual: saves 8 KiB inputs and 16 KiB hidden activations."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)
        self.drop = nn.Dropout(dropout)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return x_TD + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x_TD)))))


def make_layers(dropout: float = 0.0) -> list[nn.Module]:
    """LAYERS blocks, the same weights every call."""
    torch.manual_seed(0)
    return [Block(dropout) for _ in range(LAYERS)]


def make_input(micro_batch: int = 0) -> torch.Tensor:
    """Micro-batch `micro_batch`'s input (T, D), the same every call."""
    return torch.randn(T, D, generator=torch.Generator().manual_seed(10 + micro_batch))


def cuda_step(layers, params, micro_batches: int = 2):
    """Loss per micro-batch and accumulated gradients (forwards first, then backwards: GPipe) on the
    GPU the layers are on."""
    for p in params:
        p.grad = None
    device = params[0].device
    torch.manual_seed(1234)
    losses = []
    for m in range(micro_batches):
        x_TD = make_input(m).to(device)
        for layer in layers:
            x_TD = layer(x_TD)
        losses.append(x_TD.square().mean())
    for loss in losses:
        loss.backward()
    return [loss.detach() for loss in losses], [p.grad.clone() for p in params]
