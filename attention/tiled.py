"""FlashAttention-2 forward in plain PyTorch: the algorithm with nothing else in the way.

Queries are cut into tiles of `tile_size` rows and keys/values into tiles of `tile_size`
rows. For one query tile we walk the key tiles and keep, per query row,

    m_i  the largest score seen so far
    l_i  the sum of exp(score - m_i) so far
    acc  the sum of exp(score - m_i) * v so far (O before normalising)

When a new key tile raises the maximum from m_old to m_new, everything accumulated so far
was measured against m_old: multiply l_i and acc by exp(m_old - m_new) and carry on. After
the last tile, O = acc / l_i and L = m_i + log(l_i). The full N_q x N_k score matrix never
exists; the largest temporary is one tile_size x tile_size block of scores.

This is the teaching version: clear, not fast (Python loops over tiles). triton_forward.py
runs the same loop as a GPU kernel. The backward is recompute_backward.py.
"""
import math

import torch
from einops import einsum

from .inputs import check_inputs
from .recompute_backward import recompute_backward


def tiled_forward(Q, K, V, is_causal=False, tile_size=64):
    """O (Q's shape and dtype) and L (Q.shape[:-1], float32), one tile pair at a time."""
    if not isinstance(tile_size, int) or tile_size < 1:
        raise ValueError(f"tile_size must be a positive int, got {tile_size!r}")
    n_q, n_k, head_dim = Q.shape[-2], K.shape[-2], Q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim)
    compute = torch.float64 if Q.dtype == torch.float64 else torch.float32
    O = torch.empty_like(Q)
    L = torch.empty(Q.shape[:-1], dtype=torch.float32, device=Q.device)

    for q_start in range(0, n_q, tile_size):
        q_end = min(q_start + tile_size, n_q)
        q_tile = Q[..., q_start:q_end, :].to(compute)
        m_i = torch.full(q_tile.shape[:-1], float("-inf"), dtype=compute, device=Q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros_like(q_tile)
        # Causal: key tiles that start past this tile's last row are wholly above the diagonal.
        k_stop = min(q_end, n_k) if is_causal else n_k
        for k_start in range(0, k_stop, tile_size):
            k_end = min(k_start + tile_size, n_k)
            k_tile = K[..., k_start:k_end, :].to(compute)
            v_tile = V[..., k_start:k_end, :]
            scores = einsum(q_tile, k_tile, "... i d, ... j d -> ... i j") * scale
            if is_causal and k_end - 1 > q_start:  # the tile crosses the diagonal: mask j > i
                rows = torch.arange(q_start, q_end, device=Q.device)[:, None]
                cols = torch.arange(k_start, k_end, device=Q.device)[None, :]
                scores = scores.masked_fill(cols > rows, float("-inf"))
            m_new = torch.maximum(m_i, scores.amax(dim=-1))
            p = torch.exp(scores - m_new[..., None])
            alpha = torch.exp(m_i - m_new)  # rescales what was accumulated against m_old
            l_i = alpha * l_i + p.sum(dim=-1)
            pv = einsum(p.to(V.dtype), v_tile, "... i j, ... j d -> ... i d")
            acc = alpha[..., None] * acc + pv.to(compute)
            m_i = m_new
        # A row that saw no key (only when N_k == 0) has l_i == 0: output zeros, L = -inf.
        O[..., q_start:q_end, :] = (acc / l_i.clamp_min(torch.finfo(compute).tiny)[..., None]).to(Q.dtype)
        L[..., q_start:q_end] = (m_i + torch.log(l_i)).float()
    return O, L


class FlashAttentionPytorch(torch.autograd.Function):
    """FlashAttentionPytorch.apply(Q, K, V, is_causal=False, tile_size=64) -> O.
    Saves exactly (Q, K, V, O, L) for the recompute backward."""

    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False, tile_size=64):
        check_inputs(Q, K, V, is_causal)
        O, L = tiled_forward(Q, K, V, is_causal, tile_size)
        ctx.save_for_backward(Q, K, V, O, L)
        ctx.is_causal = is_causal
        return O

    @staticmethod
    def backward(ctx, dO):
        # The recompute backward is first order only: a graph built through it would miss how
        # O and L depend on Q, K, V, so a second-order gradient would be silently wrong. Grad
        # mode is on inside a backward only under create_graph=True, the request for such a
        # graph. (torch's once_differentiable is not enough: torch.autograd.grad(..., inputs)
        # prunes its error node and reports an input "not used in the graph" instead.)
        if torch.is_grad_enabled():
            raise RuntimeError("double backward is not supported by the tiled backend (its backward is first "
                               "order only): for gradients with create_graph=True use the eager backend")
        dQ, dK, dV = recompute_backward(*ctx.saved_tensors, dO, ctx.is_causal)
        return dQ, dK, dV, None, None
