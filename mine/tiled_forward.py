"""Step 2: the tiled forward, in PyTorch (docs/learn.md, chapters 2 and 3).

Yours stands in for attention.tiled.tiled_forward, which FlashAttentionPytorch (the `tiled`
backend) calls; it folds each tile with your step 1. Check it:

    pytest --impl=mine tests/test_mine.py -k tiled_forward
"""
import math

import torch
from einops import einsum

from attention.eager import group_queries
from attention.masks import check_tile_sizes, key_tile_bounds, tile_mask, window_bounds
from mine.online_softmax import online_softmax_update  # yours, step 1


def tiled_forward(Q, K, V, is_causal=False, window_size=(-1, -1), tile_m=64, tile_n=64):
    """O (Q's shape and dtype) and lse (Q.shape[:-1], float32; float64 for float64 inputs) of
    attention over Q (..., H, N_q, D) and K, V (..., H_kv, N_k, D), one tile pair at a time.

    The mask is (N_q, N_k, left, right), the last two from window_bounds(is_causal, window_size);
    the scale is 1 / sqrt(D); compute in float32 (float64 for float64 inputs).
    group_queries(Q, K) views Q as (..., H_kv, G, N_q, D) against K as (..., H_kv, 1, N_k, D),
    and likewise for V. For each query tile of tile_m rows from q_start: m_i = -inf, l_i = 0 and
    acc = 0 per row; key_tile_bounds(q_start, mask, tile_m, tile_n) gives (start, full_start,
    full_end, end): walk the key tiles from start to end, tile_n rows at a time, where those
    outside [full_start, full_end) need the mask (tile_mask: -inf where hidden), and fold each
    tile's scores with online_softmax_update. Then O = acc / l_i and lse = m_i + log(l_i); a row
    that saw no key keeps l_i = 0 and gets O = 0 and lse = -inf.
    """
    raise NotImplementedError("step 2, tiled_forward: yours to write (docs/learn.md, Write it yourself)")
