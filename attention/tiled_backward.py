"""FlashAttention-2 backward in plain PyTorch: the Triton backward's twin, tile for tile.

The forward saved Q, K, V, O and lse (each query row's logsumexp), not the N_q x N_k
probabilities. The backward recomputes them a tile at a time, p = exp(s - lse), and needs one
more number per query row, computed first:

    delta = rowsum(dO * O)          (equal to rowsum(dP * P), at the cost of one pass over O)

For each tile pair, with s = q_tile k_tile^T * scale and the forward's mask:

    p  = exp(s - lse)        dp = do_tile v_tile^T        ds = p * (dp - delta)
    dV += p^T do_tile        dK += ds^T q_tile * scale    dQ += ds k_tile * scale

Two passes, so that each one owns the tiles it writes; given delta they are independent:
1. dK, dV: for each key tile, walk the query tiles that see it (query_tile_bounds).
2. dQ: for each query tile, walk the key tiles it sees (key_tile_bounds, as in the forward).
With grouped-query heads a key tile's dK and dV add up the parts of the G query heads that
read it: here a sum over the group dim, in the kernel a loop over the group's heads.

atomic_dq=True is FlashAttention-2's own schedule, five matrix multiplies a tile pair, not
seven: pass 1 also adds each tile pair's share of dQ, ds k_tile, to a float32 accumulator
dQ_acc, and pass 2 does not run; dQ = dQ_acc * scale. The kernel's programs add their shares
with atomics, in whatever order they land; here, in loop order.

triton_backward.py runs the same steps with the same names and bounds: a kernel for delta,
then one launch in which each program does one tile of one of the two passes (or, ATOMIC_DQ,
pass 1 with dQ's shares). As in tiled.py, this is clear, not fast: Python loops over tiles.
"""
import math

import torch
from einops import einsum

from .eager import group_queries
from .masks import check_tile_sizes, key_tile_bounds, query_tile_bounds, tile_mask, window_bounds


def tiled_backward(Q, K, V, O, lse, dO, is_causal=False, window_size=(-1, -1), tile_m=64, tile_n=64,
                   atomic_dq=False):
    """dQ, dK, dV of O = attention(Q, K, V) given dO, one tile pair at a time. Math in float32
    (float64 for float64 inputs); results in the inputs' dtype. atomic_dq: the five-matmul
    schedule (see above)."""
    check_tile_sizes(tile_m, tile_n)
    n_q, n_k = Q.shape[-2], K.shape[-2]
    mask = (n_q, n_k, *window_bounds(is_causal, window_size))
    scale = 1.0 / math.sqrt(Q.shape[-1])
    shapes, dtype = (Q.shape, K.shape, V.shape), Q.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    Q, K, V, O, lse, dO = (t.to(compute) for t in (Q, K, V, O, lse, dO))
    delta = (dO * O).sum(dim=-1)
    # Grouped: Q, dO (..., H_kv, G, N_q, D) against K, V (..., H_kv, 1, N_k, D).
    (Q, K), (_, V) = group_queries(Q, K), group_queries(Q, V)
    dO, lse, delta = dO.reshape(Q.shape), lse.reshape(Q.shape[:-1]), delta.reshape(Q.shape[:-1])
    dQ, dK, dV = torch.empty_like(Q), torch.empty_like(K), torch.empty_like(V)
    dQ_acc = torch.zeros_like(Q) if atomic_dq else None

    # 1. dK, dV. Everything is transposed (keys along rows), so dk and dv keep k_tile's shape.
    for k_start in range(0, n_k, tile_n):
        k_end = min(k_start + tile_n, n_k)
        k_tile, v_tile = K[..., k_start:k_end, :], V[..., k_start:k_end, :]
        dk, dv = torch.zeros_like(k_tile), torch.zeros_like(v_tile)
        start, full_start, full_end, end = query_tile_bounds(k_start, mask, tile_m, tile_n)
        for q_start in range(start, end, tile_m):
            q_end = min(q_start + tile_m, n_q)
            q_tile, do_tile = Q[..., q_start:q_end, :], dO[..., q_start:q_end, :]
            s_t = einsum(k_tile, q_tile, "... j d, ... i d -> ... j i") * scale
            p_t = torch.exp(s_t - lse[..., None, q_start:q_end])
            if not full_start <= q_start < full_end:  # a masked tile
                p_t = p_t.masked_fill(~tile_mask(q_start, q_end, k_start, k_end, mask, Q.device).mT, 0.0)
            dp_t = einsum(v_tile, do_tile, "... j d, ... i d -> ... j i")
            ds_t = p_t * (dp_t - delta[..., None, q_start:q_end])
            # The sum over the group's query heads (dim -3) is GQA's: one kv head, G readers.
            dv += einsum(p_t, do_tile, "... j i, ... i d -> ... j d").sum(-3, keepdim=True)
            dk += einsum(ds_t, q_tile, "... j i, ... i d -> ... j d").sum(-3, keepdim=True)
            if atomic_dq:  # this key tile's share of the query tile's dQ
                dQ_acc[..., q_start:q_end, :] += einsum(ds_t, k_tile, "... j i, ... j d -> ... i d")
        dK[..., k_start:k_end, :] = dk * scale
        dV[..., k_start:k_end, :] = dv

    # 2. dQ, with the forward's schedule; the atomic schedule has it already, as the sum of its shares.
    if atomic_dq:
        dQ = dQ_acc * scale
    else:
        for q_start in range(0, n_q, tile_m):
            q_end = min(q_start + tile_m, n_q)
            q_tile, do_tile = Q[..., q_start:q_end, :], dO[..., q_start:q_end, :]
            dq = torch.zeros_like(q_tile)
            start, full_start, full_end, end = key_tile_bounds(q_start, mask, tile_m, tile_n)
            for k_start in range(start, end, tile_n):
                k_end = min(k_start + tile_n, n_k)
                k_tile, v_tile = K[..., k_start:k_end, :], V[..., k_start:k_end, :]
                s = einsum(q_tile, k_tile, "... i d, ... j d -> ... i j") * scale
                p = torch.exp(s - lse[..., q_start:q_end, None])
                if not full_start <= k_start < full_end:  # a masked tile
                    p = p.masked_fill(~tile_mask(q_start, q_end, k_start, k_end, mask, Q.device), 0.0)
                dp = einsum(do_tile, v_tile, "... i d, ... j d -> ... i j")
                ds = p * (dp - delta[..., q_start:q_end, None])
                dq += einsum(ds, k_tile, "... i j, ... j d -> ... i d")
            dQ[..., q_start:q_end, :] = dq * scale
    return tuple(g.reshape(shape).to(dtype) for g, shape in zip((dQ, dK, dV), shapes))
