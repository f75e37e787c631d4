"""FlashAttention-2 forward in plain PyTorch: the algorithm with nothing else in the way.

Queries are cut into tiles of `tile_m` rows and keys/values into tiles of `tile_n` rows.
For one query tile we walk the key tiles and keep, per query row,

    m_i  the largest score seen so far
    l_i  the sum of exp(score - m_i) so far
    acc  the sum of exp(score - m_i) * v so far (O before normalising)

When a new key tile raises the maximum from m_old to m_new, everything accumulated so far
was measured against m_old: multiply l_i and acc by exp(m_old - m_new) and carry on. After
the last tile, O = acc / l_i and lse = m_i + log(l_i), the logsumexp of the row's scores,
which the backward needs. The full N_q x N_k score matrix never exists; the largest
temporary is one tile_m x tile_n block of scores.

This is the teaching version: clear, not fast (Python loops over tiles). triton_forward.py
runs the same loop as a GPU kernel, with the same names and the same tile bounds
(key_tile_bounds: tile_bounds.py's here, triton_tiles.py's there). The backward is
tiled_backward.py.
"""
import math

import torch
from einops import einsum

from .inputs import check_inputs
from .tile_bounds import check_tile_sizes, key_tile_bounds, visible_in_tile
from .tiled_backward import tiled_backward


def online_softmax_update(m_i, l_i, acc, s, v_tile):
    """Fold one tile of scores s (..., rows, keys), hidden ones -inf, and its values v_tile
    (..., keys, D) into each row's running max m_i, sum l_i and unnormalised output acc, and
    return the three. A wholly hidden tile changes nothing, as long as the row has seen a key."""
    m_new = torch.maximum(m_i, s.amax(dim=-1))
    p = torch.exp(s - m_new[..., None])
    alpha = torch.exp(m_i - m_new)  # rescales what was accumulated against m_old
    l_i = alpha * l_i + p.sum(dim=-1)
    pv = einsum(p.to(v_tile.dtype), v_tile, "... i j, ... j d -> ... i d")
    return m_new, l_i, alpha[..., None] * acc + pv.to(acc.dtype)


def tiled_forward(Q, K, V, is_causal=False, tile_m=64, tile_n=64):
    """O (Q's shape and dtype) and lse (Q.shape[:-1], float32), one tile pair at a time."""
    check_tile_sizes(tile_m, tile_n)
    n_q, n_k, head_dim = Q.shape[-2], K.shape[-2], Q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim)
    compute = torch.float64 if Q.dtype == torch.float64 else torch.float32
    O = torch.empty_like(Q)
    lse = torch.empty(Q.shape[:-1], dtype=torch.float32, device=Q.device)

    for q_start in range(0, n_q, tile_m):
        q_end = min(q_start + tile_m, n_q)
        q_tile = Q[..., q_start:q_end, :].to(compute)
        m_i = torch.full(q_tile.shape[:-1], float("-inf"), dtype=compute, device=Q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros_like(q_tile)
        unmasked_end, end = key_tile_bounds(q_start, n_k, is_causal, tile_m, tile_n)
        for k_start in range(0, end, tile_n):
            k_end = min(k_start + tile_n, n_k)  # a slice stops at n_k: the kernels mask keys past it instead
            k_tile = K[..., k_start:k_end, :].to(compute)
            v_tile = V[..., k_start:k_end, :]
            s = einsum(q_tile, k_tile, "... i d, ... j d -> ... i j") * scale
            if is_causal and k_start >= unmasked_end:  # the tile crosses the diagonal
                s = s.masked_fill(~visible_in_tile(q_start, q_end, k_start, k_end, Q.device), float("-inf"))
            m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, s, v_tile)
        # A row that saw no key (only when N_k == 0) has l_i == 0: output zeros, lse = -inf.
        O[..., q_start:q_end, :] = (acc / l_i.clamp_min(torch.finfo(compute).tiny)[..., None]).to(Q.dtype)
        lse[..., q_start:q_end] = (m_i + torch.log(l_i)).float()
    return O, lse


class FlashAttentionPytorch(torch.autograd.Function):
    """FlashAttentionPytorch.apply(Q, K, V, is_causal=False, tile_m=64, tile_n=64) -> O.
    Saves exactly (Q, K, V, O, lse) for tiled_backward."""

    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False, tile_m=64, tile_n=64):
        check_inputs(Q, K, V, is_causal)
        O, lse = tiled_forward(Q, K, V, is_causal, tile_m, tile_n)
        ctx.save_for_backward(Q, K, V, O, lse)
        ctx.is_causal, ctx.tile_m, ctx.tile_n = is_causal, tile_m, tile_n
        return O

    @staticmethod
    def backward(ctx, dO):
        # The tiled backward is first order only: a graph built through it would miss how
        # O and lse depend on Q, K, V, so a second-order gradient would be silently wrong. Grad
        # mode is on inside a backward only under create_graph=True, the request for such a
        # graph. (torch's once_differentiable is not enough: torch.autograd.grad(..., inputs)
        # prunes its error node and reports an input "not used in the graph" instead.)
        if torch.is_grad_enabled():
            raise RuntimeError("double backward is not supported by the tiled backend (its backward is first "
                               "order only): for gradients with create_graph=True use the eager backend")
        dQ, dK, dV = tiled_backward(*ctx.saved_tensors, dO, ctx.is_causal, ctx.tile_m, ctx.tile_n)
        return dQ, dK, dV, None, None, None
