"""The backward of `triton_fwd`: the step of the story before the FlashAttention-2 backward
landed. It keeps the forward's promise (no N_q x N_k matrix for all rows at once) but not its
schedule: where tiled_backward.py and the Triton kernels run a dK/dV pass and a dQ pass over
tiles, this walks chunks of query rows against all the keys they see, so its extra memory is
O(chunk_size x N_k) rather than O(N_q x N_k). `triton_fwd` keeps it so the two backwards can
be compared.

    delta = rowsum(dO * O)        (= rowsum(dP * P), the softmax's Jacobian term)
    P  = exp(S - lse)             with S = Q K^T * scale, masked as in the forward
    dV = P^T dO                   dP = dO V^T
    dS = P * (dP - delta)
    dQ = dS K * scale             dK = dS^T Q * scale
"""
import math

import torch

from .tile_bounds import visible_in_tile


def recompute_backward(Q, K, V, O, lse, dO, is_causal, chunk_size=128):
    """Gradients (dQ, dK, dV) of O = attention(Q, K, V) given dO. Math in float32 (float64
    for float64 inputs); results in the inputs' dtype."""
    scale = 1.0 / math.sqrt(Q.shape[-1])
    dtype = Q.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    Q, K, V, O, lse, dO = (t.to(compute) for t in (Q, K, V, O, lse, dO))
    n_q, n_k = Q.shape[-2], K.shape[-2]
    delta = (dO * O).sum(-1)
    dQ = torch.empty_like(Q)
    dK = torch.zeros_like(K)
    dV = torch.zeros_like(V)
    for start in range(0, n_q, chunk_size):
        end = min(start + chunk_size, n_q)
        # Causal: rows [start, end) see no key at or past `end`, so those keys are skipped.
        n_visible = min(end, n_k) if is_causal else n_k
        q, do = Q[..., start:end, :], dO[..., start:end, :]
        k, v = K[..., :n_visible, :], V[..., :n_visible, :]
        S = (q @ k.transpose(-2, -1)) * scale
        if is_causal:
            S = S.masked_fill(~visible_in_tile(start, end, 0, n_visible, Q.device), float("-inf"))
        P = torch.exp(S - lse[..., start:end, None])
        dV[..., :n_visible, :] += P.transpose(-2, -1) @ do
        dS = P * (do @ v.transpose(-2, -1) - delta[..., start:end, None])
        dQ[..., start:end, :] = (dS @ k) * scale
        dK[..., :n_visible, :] += (dS.transpose(-2, -1) @ q) * scale
    return dQ.to(dtype), dK.to(dtype), dV.to(dtype)
