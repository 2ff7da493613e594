"""DeepSeek-V4's manifold-constrained hyper-connections: N residual streams instead of one.

Each token carries N streams (B, T, N, D) through the decoder. Around each block (attention, or the
feed-forward) one `HyperConnection` (its tensors as the published checkpoints name them: `fn`, `base`,
`scale`) reads all N streams, RMS-normalised without a weight and flattened, through one linear map, and
derives three mixing weights per token:

- pre (N): how the streams collapse into the block's one input, sigmoid + eps;
- post (N): how the block's one output spreads back over the streams, 2 sigmoid;
- comb (N x N): how the input streams carry over to the output streams, a softmax made doubly
  stochastic by Sinkhorn-Knopp's alternate column and row normalisations, so that mixing never grows
  the residual's norm.

Then out_streams = post * block(collapsed) + comb^T @ in_streams. `HyperHead` collapses the last streams
into one before the final norm. All of the weights' arithmetic is float32, whatever the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x over its root mean square (no weight), the mean taken in float32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(m: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`m` (..., N, N), positive, made doubly stochastic: columns normalised, then `iters` - 1 rounds of
    rows then columns (the published models' order and count)."""
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


class HyperConnection(nn.Module):
    """The mixing weights around one block, from its N input streams."""

    def __init__(self, hidden: int, streams: int, sinkhorn_iters: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.n, self.iters, self.eps, self.norm_eps = streams, sinkhorn_iters, eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + streams) * streams, streams * hidden))
        self.base = nn.Parameter(torch.zeros((2 + streams) * streams))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams_BTND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(post (B, T, N), comb (B, T, N, N), the block's input (B, T, D)); the weights in float32."""
        B, T, N, _ = streams_BTND.shape
        mixes = F.linear(_unit_rms(streams_BTND.reshape(B, T, -1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([N, N, N * N], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([N, N, N * N])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(B, T, N, N) * s_comb + comb_b.view(N, N), dim=-1) + self.eps
        collapsed = (pre[..., None] * streams_BTND).sum(dim=2).to(streams_BTND.dtype)
        return post, sinkhorn(comb, self.iters, self.eps), collapsed

    @staticmethod
    def merge(post_BTN: torch.Tensor, comb_BTNN: torch.Tensor, block_BTD: torch.Tensor, streams_BTND: torch.Tensor
              ) -> torch.Tensor:
        """The streams after a block: its output spread by `post`, plus the input streams carried by `comb`
        (summed over its first axis: comb^T @ streams)."""
        dtype = streams_BTND.dtype
        return post_BTN.to(dtype)[..., None] * block_BTD[..., None, :] + \
            comb_BTNN.to(dtype).transpose(-1, -2) @ streams_BTND


class HyperHead(nn.Module):
    """The last streams collapsed into one (`hc_fn`, `hc_base`, `hc_scale`), before the final norm."""

    def __init__(self, hidden: int, streams: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(streams, streams * hidden))
        self.hc_base = nn.Parameter(torch.zeros(streams))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams_BTND: torch.Tensor) -> torch.Tensor:
        B, T, _, _ = streams_BTND.shape
        mixes = F.linear(_unit_rms(streams_BTND.reshape(B, T, -1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre[..., None] * streams_BTND).sum(dim=2).to(streams_BTND.dtype)

