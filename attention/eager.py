"""Eager attention: the whole N_q x N_k score matrix in memory, softmax, then P @ V.

This is the definition every other backend is checked against (the tests run it in
float64), and the memory-hungry baseline FlashAttention is measured against: autograd
keeps the N_q x N_k probabilities of every layer for the backward pass.

Causal convention (all backends): query i sees key j when j <= i, counting both from the
start of their sequences ("top-left", as torch's scaled_dot_product_attention does).
With N_q != N_k this is not the decoding convention; a single new query against a KV
cache sees every cached key up to its own, which decode.py's decode_attention handles.
"""
import math

import torch

from .inputs import check_inputs


def causal_mask(n_q, n_k, device=None):
    """(n_q, n_k) bool, True where query i may see key j: the causal convention above."""
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril()


def eager_attention_with_lse(q, k, v, is_causal=False):
    """O = softmax(Q K^T / sqrt(D)) V and lse = logsumexp of the scaled scores (natural log),
    q (..., N_q, D), k and v (..., N_k, D); see masked_attention_with_lse."""
    visible = causal_mask(q.shape[-2], k.shape[-2], q.device) if is_causal else None
    return masked_attention_with_lse(q, k, v, visible)


def masked_attention_with_lse(q, k, v, visible=None):
    """O and lse as eager_attention_with_lse, with the scores of keys where the bool mask
    visible (broadcast to the (..., N_q, N_k) scores) is False set to -inf; None: every key.
    The causal mask is one such mask; decode.py's count of cached keys is another.

    The scores Q K^T and the softmax run in float32 (or float64 for float64 inputs): float16
    scores overflow past 65504 and round near-ties apart long before that, which the kernels
    avoid by keeping their score tiles in float32. Autocast is switched off for that product, or
    it would cast it back to 16 bits. P is cast to V's dtype for the product with V, as the
    kernels do. lse is float32 (float64 for float64 inputs), shape q.shape[:-1].
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    softmax_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.autocast(q.device.type, enabled=False):
        scores = (q.to(softmax_dtype) @ k.to(softmax_dtype).transpose(-2, -1)) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    return probs.to(v.dtype) @ v, lse


def eager_attention(q, k, v, is_causal=False):
    check_inputs(q, k, v, is_causal)
    return eager_attention_with_lse(q, k, v, is_causal)[0]
