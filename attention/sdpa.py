"""PyTorch's own fused attention, the peer the Triton kernels are measured against.

torch picks among its FlashAttention-2, cuDNN, memory-efficient and math kernels;
bench.py pins each one in turn with torch.nn.attention.sdpa_kernel. Its is_causal is this
package's causal rule (eager.py).
"""
import torch.nn.functional as F

from .inputs import check_inputs


def sdpa_attention(q, k, v, is_causal=False):
    check_inputs(q, k, v, is_causal)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
