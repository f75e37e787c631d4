"""Attention for one decoding step against a static KV cache, on every backend.

    y = decode_attention(q, k, v, k_cache, v_cache, pos, window_size=(-1, -1), backend="triton")

q is the new token's query, (B, H, 1, D); k and v its key and value, (B, H_kv, 1, D) (views of
the model's fused projection). k_cache and v_cache are (B, H_kv, S, D): the whole preallocated
cache, S = block_size. pos is an int64 tensor of shape (1,) on q's device: the new token's
position in every sequence, 0 <= pos < S. A step stores the token's key and value at row pos of
the caches (in place), then its query attends over the cached keys [pos - left, pos], all in its
past (so no causal mask, and a window's right side does not matter). It returns (B, H, 1, D).
Rows of the cache outside those keys never reach the result, whatever they hold (stale keys and
values, NaN).

Why the whole cache and a position on the device, rather than k_cache[:, :, :n]: the step has
the same shapes whatever the cache holds, so torch.compile compiles it once, a CUDA graph can
replay it, and no backend meets a new shape at each token. The triton backend stores the token
inside its kernel (triton_decode.py); the others store with index_copy_, then mask.
"""
import math

import torch
import torch.nn.functional as F

from .eager import masked_attention_with_lse
from .inputs import BACKENDS, check_inputs, check_tensor, check_triton_inputs
from .masks import window_bounds
from .tiled import online_softmax_update
from .triton_decode import triton_decode_attention


def check_decode_inputs(q, k, v, k_cache, v_cache, pos, window_size):
    check_inputs(q, k, v, False, window_size)
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q must have shape (B, H, 1, D), one new token per sequence, got shape {tuple(q.shape)}")
    B, H_kv, _, D = k.shape
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, cache)
        if cache.dim() != 4 or (cache.shape[0], cache.shape[1], cache.shape[3]) != (B, H_kv, D):
            raise ValueError(f"{name} must have shape (B, H_kv, S, D) = ({B}, {H_kv}, S, {D}) to match k "
                             f"{tuple(k.shape)}, got shape {tuple(cache.shape)}")
        if cache.shape[2] == 0:
            raise ValueError(f"{name} has S=0 rows: a cache needs a row for the new token at pos")
        if cache.dtype != q.dtype or cache.device != q.device:
            raise ValueError(f"{name} is {cache.dtype} on {cache.device} but q is {q.dtype} on {q.device}; the "
                             "cache stores the projection's keys and values as they are")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache has {tuple(k_cache.shape)}")
    check_position(pos, q.device, k_cache.shape[2])


def check_position(pos, device, n_cache):
    """pos: an int64 tensor of shape (1,) on device, in [0, n_cache): its value checked wherever
    the host can read it without breaking a compiled graph or a CUDA graph capture; inside those
    the triton kernel clamps it into the cache rather than write outside it."""
    if not isinstance(pos, torch.Tensor) or pos.dtype != torch.int64:
        raise ValueError(f"pos must be an int64 torch.Tensor (the new token's position), got {pos!r}")
    if pos.device != device:
        raise ValueError(f"pos is on {pos.device} but q is on {device}: keep it on q's device, so that the step "
                         "never copies from the host")
    if pos.shape != (1,):
        raise ValueError(f"pos must have shape (1,), one position for every sequence, got {tuple(pos.shape)}")
    if torch.compiler.is_compiling() or (pos.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    if not 0 <= int(pos) < n_cache:
        raise ValueError(f"pos={int(pos)} is outside the cache's S={n_cache} rows")


def store_in_cache(k, v, k_cache, v_cache, pos):
    """Write k and v (B, H_kv, T, D) into the caches at positions pos (T,): a decode step's one
    token here, a prefill's prompt in the model."""
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v)


def cached_keys(pos, left, n_cache):
    """(1, 1, 1, S) bool: the cached keys a query at pos sees, [pos - left, pos]."""
    rows = torch.arange(n_cache, device=pos.device)
    return ((rows <= pos) & (rows >= pos - left)).view(1, 1, 1, n_cache)


def eager_decode_attention(q, k_cache, v_cache, visible):
    """The reference: eager.py's attention over the whole cache, keys outside visible masked and
    their values zeroed, so that 0 * a stale NaN cannot reach the output."""
    return masked_attention_with_lse(q, k_cache, v_cache.masked_fill(~visible.mT, 0.0), visible)[0]


def tiled_decode_attention(q, k_cache, v_cache, visible, tile_size=64):
    """tiled.py's online softmax for one query row over the cache's key tiles. S is static, so
    every tile is visited, masked outside visible."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_row = (q.to(compute) / math.sqrt(q.shape[-1])).unflatten(1, (k_cache.shape[1], -1))  # (B, H_kv, G, 1, D)
    m_i = torch.full(q_row.shape[:-1], float("-inf"), dtype=compute, device=q.device)
    l_i = torch.zeros_like(m_i)
    acc = torch.zeros_like(q_row)
    for k_start in range(0, k_cache.shape[2], tile_size):
        seen = visible[..., k_start:k_start + tile_size]  # (1, 1, 1, keys)
        k_tile = k_cache[:, :, None, k_start:k_start + tile_size].to(compute)
        v_tile = v_cache[:, :, None, k_start:k_start + tile_size].masked_fill(~seen.mT.unsqueeze(1), 0.0)
        scores = (q_row @ k_tile.transpose(-2, -1)).masked_fill(~seen.unsqueeze(1), float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, scores, v_tile)
    return (acc / l_i[..., None]).flatten(1, 2).to(q.dtype)


def sdpa_decode_attention(q, k_cache, v_cache, visible):
    """sdpa adds its mask to the scores, so a NaN key it hides would still give NaN: the hidden
    keys are zeroed as well as the hidden values."""
    hidden = ~visible.mT
    return F.scaled_dot_product_attention(q, k_cache.masked_fill(hidden, 0.0), v_cache.masked_fill(hidden, 0.0),
                                          attn_mask=visible, enable_gqa=q.shape[1] != k_cache.shape[1])


def triton_kernel_decode_attention(q, k, v, k_cache, v_cache, pos, left):
    check_triton_inputs(q, k, v, k_cache, v_cache)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, k_cache, v_cache)):
        raise ValueError("decode_attention with the triton backends computes no gradient: call it under "
                         "torch.no_grad() (generation), or use eager, tiled or sdpa for gradients")
    return triton_decode_attention(q, k, v, k_cache, v_cache, pos, left)


def decode_attention(q, k, v, k_cache, v_cache, pos, window_size=(-1, -1), backend="triton"):
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    check_decode_inputs(q, k, v, k_cache, v_cache, pos, window_size)
    left, _ = window_bounds(False, window_size)
    if backend in ("triton", "triton_fwd"):  # they differ only in their backward; a decode step has none
        return triton_kernel_decode_attention(q, k, v, k_cache, v_cache, pos, left)
    # eager, tiled and sdpa: store the new key and value with index_copy_, then attend.
    store_in_cache(k, v, k_cache, v_cache, pos)
    attend = {"eager": eager_decode_attention, "tiled": tiled_decode_attention, "sdpa": sdpa_decode_attention}
    return attend[backend](q, k_cache, v_cache, cached_keys(pos, left, k_cache.shape[2]))
