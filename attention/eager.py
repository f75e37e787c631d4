"""Eager attention: the definition every other backend is checked against.

    O = softmax(Q K^T / sqrt(D), over the keys each query sees) V

The whole N_q x N_k score matrix is in memory, and autograd keeps the probabilities for the
backward pass: the memory FlashAttention saves. The tests run this in float64.

Which keys a query sees, causal or in a window (left, right), is masks.py's. Grouped-query
attention: q has H heads, k and v have H_kv, a divisor of H. Query head h reads kv head
h // (H // H_kv), as sdpa's enable_gqa does; H_kv = 1 is multi-query attention. A query that
sees no key (a window past the last key, or N_k = 0) gets O = 0, lse = -inf.
"""
import math

import torch

from .inputs import check_inputs
from .masks import UNBOUNDED, visible_keys, window_bounds


def group_queries(q, k):
    """GQA as an index map: q (..., H, N, D) as (..., H_kv, G, N, D) and k (..., H_kv, N, D) as
    (..., H_kv, 1, N, D), views that broadcast query head h = kv * G + g against kv head kv."""
    if q.dim() == 2:  # one head
        return q[None, None], k[None, None]
    return q.unflatten(-3, (k.shape[-3], -1)), k.unsqueeze(-3)


def masked_attention_with_lse(q, k, v, visible=None):
    """O and lse of q (..., H, N_q, D) against k, v (..., H_kv, N_k, D), where the bool mask
    visible (broadcast to the (..., N_q, N_k) scores) says which keys each query sees; None: all.

    The scores and the softmax run in float32 (float64 for float64 inputs): float16 scores
    overflow past 65504 and round near-ties apart long before that, which the kernels avoid by
    keeping their score tiles in float32. Autocast is switched off for that product, or it would
    cast it back to 16 bits. P is cast to V's dtype for the product with V, as the kernels do.
    lse (q.shape[:-1]) is the natural-log logsumexp of each query's scaled scores."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    softmax_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_groups, k_groups = group_queries(q, k)
    _, v_groups = group_queries(q, v)
    with torch.autocast(q.device.type, enabled=False):
        scores = (q_groups.to(softmax_dtype) @ k_groups.to(softmax_dtype).transpose(-2, -1)) * scale
    if visible is not None:
        visible = visible.unsqueeze(-3) if visible.dim() >= 3 else visible  # the group dim
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if visible is not None:  # a query that sees no key: softmax gives NaN, the definition 0
        probs = probs.masked_fill(~visible.any(-1, keepdim=True), 0.0)
    o = probs.to(v.dtype) @ v_groups
    return o.reshape(q.shape[:-1] + v.shape[-1:]), lse.reshape(q.shape[:-1])


def eager_attention_with_lse(q, k, v, is_causal=False, window_size=(-1, -1)):
    left, right = window_bounds(is_causal, window_size)
    visible = None
    if (left, right) != (UNBOUNDED, UNBOUNDED):
        visible = visible_keys((q.shape[-2], k.shape[-2], left, right), q.device)
    return masked_attention_with_lse(q, k, v, visible)


def eager_attention(q, k, v, is_causal=False, window_size=(-1, -1)):
    check_inputs(q, k, v, is_causal, window_size)
    return eager_attention_with_lse(q, k, v, is_causal, window_size)[0]
