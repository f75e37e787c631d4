"""Attention for one decoding step against a static KV cache, on every backend.

    from attention import decode_attention
    o = decode_attention(q, k_cache, v_cache, n_keys, backend="triton")

q is (B, H, 1, D): one new query per sequence. k_cache and v_cache are (B, H, S, D): the whole
preallocated cache, S = block_size, of which sequence b's query sees keys [0, n_keys[b]) (its
own key among them, written into the cache before the call; every cached key is in its past,
so there is no causal mask). n_keys is an integer tensor on q's device, of shape (B,) or ()
(one count for every sequence), with 1 <= n_keys <= S.

Why the whole cache and a count on the device, rather than k_cache[:, :, :n]: the step then has
the same shapes whatever the cache holds, so torch.compile compiles it once, a CUDA graph can
replay it, and no backend meets a new shape (a new kernel plan, a new tuning) at each token.
eager and sdpa mask keys past n_keys; tiled and triton stop at them.
"""
import math

import torch
import torch.nn.functional as F

from .eager import masked_attention_with_lse
from .inputs import check_inputs, check_triton_inputs
from .tiled import online_softmax_update
from .triton_decode import triton_decode_attention


def check_decode_inputs(q, k_cache, v_cache, n_keys):
    check_inputs(q, k_cache, v_cache, False)
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q must have shape (B, H, 1, D), one new query per sequence, got shape {tuple(q.shape)}")
    if not isinstance(n_keys, torch.Tensor) or n_keys.is_floating_point() or n_keys.is_complex():
        raise ValueError(f"n_keys must be an integer torch.Tensor (the keys each query sees), got {n_keys!r}")
    if n_keys.device != q.device:
        raise ValueError(f"n_keys is on {n_keys.device} but q is on {q.device}: keep it on q's device, so that the "
                         "step never copies from the host")
    if n_keys.shape not in ((), (q.shape[0],)):
        raise ValueError(f"n_keys must have shape () or (B,) = ({q.shape[0]},), got {tuple(n_keys.shape)}")


def key_visible(n_keys, batch, n_cache):
    """(B, 1, 1, S) bool: True where sequence b's query may see cached key j (j < n_keys[b])."""
    return torch.arange(n_cache, device=n_keys.device) < n_keys.reshape(-1, 1, 1, 1).expand(batch, 1, 1, 1)


def eager_decode_attention(q, k_cache, v_cache, n_keys):
    """The reference: eager.py's attention over the whole cache, keys past n_keys masked."""
    return masked_attention_with_lse(q, k_cache, v_cache, key_visible(n_keys, q.shape[0], k_cache.shape[2]))[0]


def tiled_decode_attention(q, k_cache, v_cache, n_keys, tile_size=64):
    """tiled.py's online softmax for one query row: walk the cache in key tiles, each folded
    into the running (m_i, l_i, acc) by tiled.online_softmax_update. S is static, so every
    tile is visited and masked past n_keys (tile 0 always holds a visible key, as n_keys >= 1)."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_row = q.to(compute) / math.sqrt(q.shape[-1])
    visible = key_visible(n_keys, q.shape[0], k_cache.shape[2])
    m_i = torch.full(q.shape[:-1], float("-inf"), dtype=compute, device=q.device)
    l_i = torch.zeros_like(m_i)
    acc = torch.zeros_like(q_row)
    for k_start in range(0, k_cache.shape[2], tile_size):
        k_end = min(k_start + tile_size, k_cache.shape[2])
        scores = q_row @ k_cache[:, :, k_start:k_end].to(compute).transpose(-2, -1)
        scores = scores.masked_fill(~visible[..., k_start:k_end], float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, scores, v_cache[:, :, k_start:k_end])
    return (acc / l_i[..., None]).to(q.dtype)


def sdpa_decode_attention(q, k_cache, v_cache, n_keys):
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=key_visible(n_keys, q.shape[0],
                                                                                      k_cache.shape[2]))


def triton_kernel_decode_attention(q, k_cache, v_cache, n_keys):
    check_triton_inputs(q, k_cache, v_cache)
    return triton_decode_attention(q, k_cache, v_cache, n_keys.reshape(-1).expand(q.shape[0]))


# triton and triton_fwd differ only in their backward; a decode step has none.
_DECODE_FUNCTIONS = {
    "eager": eager_decode_attention,
    "tiled": tiled_decode_attention,
    "triton": triton_kernel_decode_attention,
    "triton_fwd": triton_kernel_decode_attention,
    "sdpa": sdpa_decode_attention,
}


def decode_attention(q, k_cache, v_cache, n_keys, backend="triton"):
    if backend not in _DECODE_FUNCTIONS:
        raise ValueError(f"backend={backend!r} is not one of {tuple(_DECODE_FUNCTIONS)}")
    check_decode_inputs(q, k_cache, v_cache, n_keys)
    return _DECODE_FUNCTIONS[backend](q, k_cache, v_cache, n_keys)
