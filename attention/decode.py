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
inside its kernel (triton_decode.py: split-KV, Flash-Decoding, one launch); the others store with
index_copy_, then mask, tiled as that kernel's twin.
decode_attention (attention/__init__.py) checks its inputs here (check_decode_inputs) and calls
the backend's function below, as backends.py's table names it, with the window's left side.
"""
import math

import torch
import torch.nn.functional as F

from .eager import masked_attention_with_lse
from .inputs import check_inputs, check_tensor, check_triton_inputs
from .masks import visible_in_tile
from .tiled import online_softmax_update
from .triton_decode import split_plan, split_rows, triton_decode_attention


def check_decode_inputs(q, k, v, k_cache, v_cache, pos, window_size):
    check_inputs(q, k, v, False, window_size)
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q must have shape (B, H, 1, D), one new token per sequence, got shape {tuple(q.shape)}")
    B, H_kv, rows, D = k.shape
    if rows != 1:
        raise ValueError(f"k must have shape (B, H_kv, 1, D), the new token's key (v its value), got shape "
                         f"{tuple(k.shape)}")
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
        # torch's own test for memory a write would share (index_copy_'s): stride 0 along a dim
        # of more than one element. The triton kernel would store every sequence's token on the one row.
        shared = [dim for dim in range(4) if cache.stride(dim) == 0 and cache.shape[dim] > 1]
        if shared:
            raise ValueError(f"{name} has rows that share memory (stride 0 along dim {shared[0]}, as expand() makes): "
                             f"a step stores each sequence's token in rows of its own; allocate the cache whole, or "
                             f"pass {name}.contiguous()")
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
    """(1, 1, 1, S) bool: the cached keys a query at pos sees once its own key is stored, [pos -
    left, pos]: masks.py's rule for a query at row pos over the pos + 1 keys up to its own (the
    Triton kernel's is the same query over the pos keys before it, its own in registers)."""
    rows = torch.arange(n_cache, device=pos.device)
    return visible_in_tile(pos, rows, (pos + 1, pos + 1, left, 0)).view(1, 1, 1, n_cache)


def eager_decode_attention(q, k, v, k_cache, v_cache, pos, left):
    """The reference: eager.py's attention over the whole cache, keys outside visible masked and
    their values zeroed, so that 0 * a stale NaN cannot reach the output."""
    store_in_cache(k, v, k_cache, v_cache, pos)
    visible = cached_keys(pos, left, k_cache.shape[2])
    return masked_attention_with_lse(q, k_cache, v_cache.masked_fill(~visible.mT, 0.0), visible)[0]


def tiled_decode_attention(q, k, v, k_cache, v_cache, pos, left):
    """The tiled backend's decoding step: Flash-Decoding in PyTorch, split as the kernel splits
    the cache (triton_decode.split_plan)."""
    if q.shape[0] == 0:  # no sequence: nothing to store or split (the planner counts programs per SM)
        return q.new_empty(q.shape)
    return tiled_split_kv_decode(q, k, v, k_cache, v_cache, pos, left, *split_plan(k_cache))


def tiled_split_kv_decode(q, k, v, k_cache, v_cache, pos, left, n_splits, tile_size):
    """triton_decode.split_kv_decode's twin: the token stored at pos, the splits' partial outputs
    (tiled_decode_splits), then merge_splits."""
    store_in_cache(k, v, k_cache, v_cache, pos)
    visible = cached_keys(pos, left, k_cache.shape[2])
    o = merge_splits(*tiled_decode_splits(q, k_cache, v_cache, visible, n_splits, tile_size))  # (B, H_kv, G, D)
    return o.reshape(q.shape).to(q.dtype)


def tiled_decode_splits(q, k_cache, v_cache, visible, n_splits, tile_size):
    """o_split (B, H_kv, G, n_splits, D) and lse_split (B, H_kv, G, n_splits): the cache's rows
    cut into n_splits splits of split_rows(S, n_splits, tile_size) rows, each split running
    tiled.py's online softmax over its key tiles, with the G query heads of a kv head as the
    rows of q_tile, to a partial output and its log-sum-exp. S is static, so every tile of every
    split is visited, masked outside visible (the kernel skips the tiles without a visible key),
    and a split that sees no key ends with l_i = 0: o_split = 0, lse_split = -inf. The token's
    key is in the cache here (stored before), at row pos."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, H_kv, S, D = k_cache.shape
    q_tile = q.to(compute).reshape(B, H_kv, -1, D)  # (B, H_kv, G, D): a kv head's query heads are the rows
    rows = split_rows(S, n_splits, tile_size)
    o_split, lse_split = [], []
    for split_start in range(0, n_splits * rows, rows):
        m_i = torch.full(q_tile.shape[:-1], float("-inf"), dtype=compute, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros_like(q_tile)
        for tile_start in range(split_start, min(split_start + rows, S), tile_size):
            tile = slice(tile_start, min(tile_start + tile_size, S))
            seen = visible[0, 0, 0, tile]  # (keys,)
            k_tile = k_cache[:, :, tile].to(compute)
            v_tile = v_cache[:, :, tile].masked_fill(~seen[:, None], 0.0)  # 0 * a stale NaN is NaN
            s = (q_tile @ k_tile.mT / math.sqrt(D)).masked_fill(~seen, float("-inf"))
            m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, s, v_tile)
        l_safe = l_i.masked_fill(l_i == 0, 1.0)
        o_split.append(acc / l_safe[..., None])
        lse_split.append((m_i + torch.log(l_safe)).masked_fill(l_i == 0, float("-inf")))
    return torch.stack(o_split, dim=-2), torch.stack(lse_split, dim=-1)


def merge_splits(o_split, lse_split):
    """O from the splits' partial outputs (..., n_splits, D) and log-sum-exps (..., n_splits):
    each split weighted by its share of the softmax's sum, exp(lse_split - lse_max) up to a
    common factor, as the online softmax rescales a tile by alpha."""
    lse_max = lse_split.amax(dim=-1, keepdim=True)  # finite: the split holding row pos sees the token
    weights = torch.exp(lse_split - lse_max)
    return (weights[..., None] * o_split).sum(dim=-2) / weights.sum(dim=-1)[..., None]


def sdpa_decode_attention(q, k, v, k_cache, v_cache, pos, left):
    """sdpa adds its mask to the scores, so a NaN key it hides would still give NaN: the hidden
    keys are zeroed as well as the hidden values."""
    store_in_cache(k, v, k_cache, v_cache, pos)
    visible = cached_keys(pos, left, k_cache.shape[2])
    hidden = ~visible.mT
    return F.scaled_dot_product_attention(q, k_cache.masked_fill(hidden, 0.0), v_cache.masked_fill(hidden, 0.0),
                                          attn_mask=visible, enable_gqa=q.shape[1] != k_cache.shape[1])


def triton_kernel_decode_attention(q, k, v, k_cache, v_cache, pos, left):
    check_triton_inputs(q, k, v, k_cache, v_cache)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, k_cache, v_cache)):
        raise ValueError("decode_attention with the triton backends computes no gradient: call it under "
                         "torch.no_grad() (generation), or use eager, tiled or sdpa for gradients")
    if q.shape[0] == 0:  # no sequence: nothing to store or split (the planner counts programs per SM)
        return q.new_empty(q.shape)
    return triton_decode_attention(q, k, v, k_cache, v_cache, pos, left)
