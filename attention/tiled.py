"""FlashAttention-2 forward in plain PyTorch: the algorithm with nothing else in the way.

Queries are cut into tiles of `tile_m` rows and keys/values into tiles of `tile_n` rows.
For one query tile we walk the key tiles it sees and keep, per query row,

    m_i  the largest score seen so far
    l_i  the sum of exp(score - m_i) so far
    acc  the sum of exp(score - m_i) * v so far (O before normalising)

When a new key tile raises the maximum from m_old to m_new, everything accumulated so far
was measured against m_old: multiply l_i and acc by exp(m_old - m_new) and carry on. After
the last tile, O = acc / l_i and lse = m_i + log(l_i), the logsumexp of the row's scores,
which the backward needs. The full N_q x N_k score matrix never exists; the largest
temporary is one tile_m x tile_n block of scores.

Which key tiles a query tile visits, and which of them need a mask, is masks.py's
key_tile_bounds: causal attention and windows skip whole tiles. Grouped-query heads are an
index map (eager.group_queries): the G query heads of a kv head broadcast against its K and V.

This is the teaching version: clear, not fast (Python loops over tiles). triton_forward.py
runs the same loop as a GPU kernel, with the same names and the same tile bounds. The
backward is tiled_backward.py.
"""
import math

import torch
from einops import einsum

from .eager import group_queries
from .inputs import check_inputs, first_order_only
from .masks import check_tile_sizes, key_tile_bounds, tile_mask, window_bounds
from .tiled_backward import tiled_backward


def online_softmax_update(m_i, l_i, acc, s, v_tile):
    """Fold one tile of scores s (..., rows, keys), hidden ones -inf, and its values v_tile
    (..., keys, D) into each row's running max m_i, sum l_i and unnormalised output acc, and
    return the three. P is rounded to V's dtype for the product, as the kernels' tensor cores
    take it, and the product is summed in acc's precision, as they sum it."""
    m_new = torch.maximum(m_i, s.amax(dim=-1))
    # A row that has seen no key yet has m_new = -inf, and exp(-inf - -inf) is NaN: measure it
    # against 0 instead, so its p and alpha are exp(-inf) = 0.
    m_shift = m_new.masked_fill(m_new == float("-inf"), 0.0)
    p = torch.exp(s - m_shift[..., None])
    alpha = torch.exp(m_i - m_shift)  # rescales what was accumulated against m_old
    l_i = alpha * l_i + p.sum(dim=-1)
    pv = einsum(p.to(v_tile.dtype).to(acc.dtype), v_tile.to(acc.dtype), "... i j, ... j d -> ... i d")
    return m_new, l_i, alpha[..., None] * acc + pv


def tiled_forward(Q, K, V, is_causal=False, window_size=(-1, -1), tile_m=64, tile_n=64):
    """O (Q's shape and dtype) and lse (Q.shape[:-1], float32; float64 for float64 inputs), one
    tile pair at a time."""
    check_tile_sizes(tile_m, tile_n)
    n_q, n_k = Q.shape[-2], K.shape[-2]
    mask = (n_q, n_k, *window_bounds(is_causal, window_size))
    scale = 1.0 / math.sqrt(Q.shape[-1])
    compute = torch.float64 if Q.dtype == torch.float64 else torch.float32
    Q_groups, K_groups = group_queries(Q, K)  # (..., H_kv, G, N_q, D) and (..., H_kv, 1, N_k, D)
    _, V_groups = group_queries(Q, V)
    O = torch.empty(Q_groups.shape, dtype=Q.dtype, device=Q.device)
    lse = torch.empty(Q_groups.shape[:-1], dtype=compute, device=Q.device)

    for q_start in range(0, n_q, tile_m):
        q_end = min(q_start + tile_m, n_q)
        q_tile = Q_groups[..., q_start:q_end, :].to(compute)
        m_i = torch.full(q_tile.shape[:-1], float("-inf"), dtype=compute, device=Q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros_like(q_tile)
        start, full_start, full_end, end = key_tile_bounds(q_start, mask, tile_m, tile_n)
        for k_start in range(start, end, tile_n):
            k_end = min(k_start + tile_n, n_k)  # a slice stops at n_k: the kernels mask keys past it instead
            k_tile = K_groups[..., k_start:k_end, :].to(compute)
            v_tile = V_groups[..., k_start:k_end, :]
            s = einsum(q_tile, k_tile, "... i d, ... j d -> ... i j") * scale
            if not full_start <= k_start < full_end:  # a masked tile
                s = s.masked_fill(~tile_mask(q_start, q_end, k_start, k_end, mask, Q.device),
                                  float("-inf"))
            m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, s, v_tile)
        # A row that saw no key keeps l_i = 0: O = 0 and lse = -inf.
        O[..., q_start:q_end, :] = (acc / l_i.masked_fill(l_i == 0, 1.0)[..., None]).to(Q.dtype)
        lse[..., q_start:q_end] = m_i + torch.log(l_i)
    return O.reshape(Q.shape), lse.reshape(Q.shape[:-1])


class FlashAttentionPytorch(torch.autograd.Function):
    """FlashAttentionPytorch.apply(Q, K, V, is_causal=False, window_size=(-1, -1), tile_m=64,
    tile_n=64) -> O, for Q (..., H, N_q, D) and K, V (..., H_kv, N_k, D), or (B, N, D) each.
    Saves exactly (Q, K, V, O, lse) for tiled_backward."""

    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False, window_size=(-1, -1), tile_m=64, tile_n=64):
        check_inputs(Q, K, V, is_causal, window_size)
        O, lse = tiled_forward(Q, K, V, is_causal, window_size, tile_m, tile_n)
        ctx.save_for_backward(Q, K, V, O, lse)
        ctx.settings = (is_causal, window_size, tile_m, tile_n)
        return O

    @staticmethod
    def backward(ctx, dO):
        with torch.no_grad():
            grads = tiled_backward(*ctx.saved_tensors, dO, *ctx.settings)
        return *first_order_only("tiled", grads, (dO, *ctx.saved_tensors)), None, None, None, None
