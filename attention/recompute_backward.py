"""The backward of `triton_fwd`: the step of the story before the FlashAttention-2 backward. It
keeps the forward's promise (no N_q x N_k matrix for all rows at once) but not its schedule:
where tiled_backward.py and the Triton kernels run a dK/dV pass and a dQ pass over tiles, this
walks chunks of query rows against all the keys, so its extra memory is O(chunk_size x N_k)
rather than O(N_q x N_k). `triton_fwd` keeps it so the two backwards can be compared.

    delta = rowsum(dO * O)        (= rowsum(dP * P), the softmax's Jacobian term)
    P  = exp(S - lse)             with S = Q K^T * scale, masked as in the forward
    dV = P^T dO                   dP = dO V^T
    dS = P * (dP - delta)
    dQ = dS K * scale             dK = dS^T Q * scale
"""
import math

import torch

from .eager import group_queries
from .masks import tile_mask, window_bounds


def recompute_backward(Q, K, V, O, lse, dO, is_causal=False, window_size=(-1, -1), chunk_size=128):
    """Gradients (dQ, dK, dV) of O = attention(Q, K, V) given dO. Math in float32 (float64
    for float64 inputs); results in the inputs' dtype."""
    scale = 1.0 / math.sqrt(Q.shape[-1])
    shapes, dtype = (Q.shape, K.shape, V.shape), Q.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    Q, K, V, O, lse, dO = (t.to(compute) for t in (Q, K, V, O, lse, dO))
    delta = (dO * O).sum(-1)
    (Q, K), (_, V) = group_queries(Q, K), group_queries(Q, V)  # grouped-query heads broadcast
    dO, lse, delta = dO.reshape(Q.shape), lse.reshape(Q.shape[:-1]), delta.reshape(Q.shape[:-1])
    n_q, n_k = Q.shape[-2], K.shape[-2]
    mask = (n_q, n_k, *window_bounds(is_causal, window_size))
    dQ, dK, dV = torch.empty_like(Q), torch.zeros_like(K), torch.zeros_like(V)
    for start in range(0, n_q, chunk_size):
        end = min(start + chunk_size, n_q)
        q, do = Q[..., start:end, :], dO[..., start:end, :]
        S = (q @ K.transpose(-2, -1)) * scale
        # Masked after the exp, not with -inf before: a row that sees no key has lse = -inf.
        P = torch.exp(S - lse[..., start:end, None]).masked_fill(~tile_mask(start, end, 0, n_k, mask, Q.device), 0.0)
        dS = P * (do @ V.transpose(-2, -1) - delta[..., start:end, None])
        dQ[..., start:end, :] = (dS @ K) * scale
        dV += (P.transpose(-2, -1) @ do).sum(-3, keepdim=True)  # a kv head sums its G query heads
        dK += (dS.transpose(-2, -1) @ q).sum(-3, keepdim=True) * scale
    return tuple(g.reshape(shape).to(dtype) for g, shape in zip((dQ, dK, dV), shapes))
