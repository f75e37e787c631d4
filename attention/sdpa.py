"""PyTorch's own fused attention, the peer the Triton kernels are measured against.

torch picks among its FlashAttention-2, cuDNN, memory-efficient and math kernels; bench.py pins
each one in turn with torch.nn.attention.sdpa_kernel. Its is_causal is this package's causal
rule (masks.py) and its enable_gqa our grouped-query heads. It has no window: a window goes in
as a boolean mask (masks.visible_keys), which keeps it off the FlashAttention-2 and cuDNN kernels
and costs an N_q x N_k mask in memory; FlexAttention would be torch's way to skip its tiles.
"""
import torch.nn.functional as F

from .inputs import check_inputs
from .masks import UNBOUNDED, visible_keys, window_bounds


def sdpa_attention(q, k, v, is_causal=False, window_size=(-1, -1)):
    check_inputs(q, k, v, is_causal, window_size)
    enable_gqa = q.dim() > 2 and q.shape[-3] != k.shape[-3]
    left, right = window_bounds(is_causal, window_size)
    if left == UNBOUNDED and right in (0, UNBOUNDED):  # causal or full: sdpa's own paths
        return F.scaled_dot_product_attention(q, k, v, is_causal=right == 0, enable_gqa=enable_gqa)
    visible = visible_keys((q.shape[-2], k.shape[-2], left, right), q.device)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=enable_gqa)
    return o.masked_fill(~visible.any(-1, keepdim=True), 0.0)  # a query that sees no key: 0, not NaN
