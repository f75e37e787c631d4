"""Attention for one decoding step against a static KV cache, on every backend.

    from attention import decode_attention
    y = decode_attention(qkv, k_cache, v_cache, pos, backend="triton")

qkv is the new token's fused projection, (B, 1, 3, H, D), as packed_attention takes it (q, k,
v = qkv.unbind(2)). k_cache and v_cache are (B, H, S, D): the whole preallocated cache, S =
block_size. pos is an integer tensor of shape (1,) on qkv's device: the new token's position,
the same in every sequence, 0 <= pos < S. A step stores the token's key and value at row pos of
the caches (in place), then its query attends over keys [0, pos], its own the last; every one
is in its past, so there is no causal mask. It returns (B, 1, H, D), as packed_attention does.

Why the whole cache and a position on the device, rather than k_cache[:, :, :n]: the step then
has the same shapes whatever the cache holds, so torch.compile compiles it once, a CUDA graph
can replay it, and no backend meets a new shape (a new kernel plan, a new tuning) at each token.
Why the store is in here: the triton backend makes it inside its kernel (triton_decode.py). The
others store with index_copy_, then eager and sdpa mask keys past pos, and tiled stops at them.
"""
import functools
import math

import torch
import torch.nn.functional as F

from .eager import masked_attention_with_lse
from .inputs import check_packed_inputs, check_tensor, check_triton_inputs, unpack_heads
from .tiled import online_softmax_update
from .triton_decode import triton_decode_attention


def check_decode_inputs(qkv, k_cache, v_cache, pos):
    check_packed_inputs(qkv, False)
    if qkv.shape[1] != 1:
        raise ValueError(f"qkv must have shape (B, 1, 3, H, D), one new token per sequence, got shape "
                         f"{tuple(qkv.shape)}")
    B, _, _, H, D = qkv.shape
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, cache)
        if cache.dim() != 4 or (cache.shape[0], cache.shape[1], cache.shape[3]) != (B, H, D):
            raise ValueError(f"{name} must have shape (B, H, S, D) = ({B}, {H}, S, {D}) to match qkv "
                             f"{tuple(qkv.shape)}, got shape {tuple(cache.shape)}")
        if cache.dtype != qkv.dtype or cache.device != qkv.device:
            raise ValueError(f"{name} is {cache.dtype} on {cache.device} but qkv is {qkv.dtype} on {qkv.device}; "
                             "the cache stores the projection's keys and values as they are")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache has {tuple(k_cache.shape)}; they "
                         "must match")
    if not isinstance(pos, torch.Tensor) or pos.is_floating_point() or pos.is_complex():
        raise ValueError(f"pos must be an integer torch.Tensor (the new token's position), got {pos!r}")
    if pos.device != qkv.device:
        raise ValueError(f"pos is on {pos.device} but qkv is on {qkv.device}: keep it on qkv's device, so that the "
                         "step never copies from the host")
    if pos.shape != (1,):
        raise ValueError(f"pos must have shape (1,), one position for every sequence, got {tuple(pos.shape)}")


def key_visible(n_keys, batch, n_cache):
    """(B, 1, 1, S) bool: True where sequence b's query may see cached key j (j < n_keys)."""
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


def store_in_cache(qkv, k_cache, v_cache, pos):
    """Write the keys and values of qkv (B, T, 3, H, D) into the caches at positions pos (T,):
    a decode step's one token here, a prefill's prompt in the model."""
    _, k, v = unpack_heads(qkv)
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v)


def store_then_attend(qkv, k_cache, v_cache, pos, attend):
    """eager, tiled and sdpa: store the new key and value with index_copy_, then attend over the
    first n_keys = pos + 1 keys of the cache."""
    store_in_cache(qkv, k_cache, v_cache, pos)
    return attend(unpack_heads(qkv)[0], k_cache, v_cache, pos + 1).transpose(1, 2)


def triton_kernel_decode_attention(qkv, k_cache, v_cache, pos):
    check_triton_inputs(qkv, k_cache, v_cache, names=("qkv", "k_cache", "v_cache"))
    return triton_decode_attention(qkv, k_cache, v_cache, pos)


# triton and triton_fwd differ only in their backward; a decode step has none.
_DECODE_FUNCTIONS = {
    "eager": functools.partial(store_then_attend, attend=eager_decode_attention),
    "tiled": functools.partial(store_then_attend, attend=tiled_decode_attention),
    "triton": triton_kernel_decode_attention,
    "triton_fwd": triton_kernel_decode_attention,
    "sdpa": functools.partial(store_then_attend, attend=sdpa_decode_attention),
}


def decode_attention(qkv, k_cache, v_cache, pos, backend="triton"):
    if backend not in _DECODE_FUNCTIONS:
        raise ValueError(f"backend={backend!r} is not one of {tuple(_DECODE_FUNCTIONS)}")
    check_decode_inputs(qkv, k_cache, v_cache, pos)
    return _DECODE_FUNCTIONS[backend](qkv, k_cache, v_cache, pos)
