"""Step 4: the backward kernel's dK/dV loop, in Triton (docs/learn.md, chapter 6).

Yours stands in for attention.triton_backward._dkdv_query_tiles: a dK/dV program of the kernel
_attn_bwd holds one key tile and calls it once per query head that reads the tile's kv head;
the dQ job is the repo's. Check it:

    pytest --impl=mine tests/test_mine.py -k dkdv_loop
"""
import triton
import triton.language as tl

from attention.masks import visible_in_tile_tl
from attention.triton_tiles import LOG2_E, load_tile


@triton.jit
def _dkdv_query_tiles(dk, dv, k_tile, v_tile, cols, q_head, do_head, LSE, DELTA, bounds, mask, qk_scale,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, USE_TMA: tl.constexpr):
    """Add to dk and dv (float32, BLOCK_N x BLOCK_D) of the key tile holding keys `cols` (its
    k_tile and v_tile) the query tiles of one query head in bounds, (start, full_start,
    full_end, end): masked, full, masked runs of BLOCK_M rows; return (dk, dv).

    q_head and do_head are that head's Q and dO (load_tile, as in step 3); LSE and DELTA point
    at its N_Q values of lse (natural log) and delta = rowsum(dO * O); mask is (N_Q, N_K, left,
    right). Keep the keys along the rows, so that dk and dv keep the K tile's shape:
    P^T = exp2(k_tile q_tile^T * qk_scale - lse * LOG2_E), zero where visible_in_tile_tl hides a
    score in a masked tile; dV += P^T dO; dP^T = v_tile dO^T; dS^T = P^T * (dP^T - delta);
    dK += dS^T Q (the kernel scales dK by 1 / sqrt(D) once, at the end). Rows past N_Q read
    lse = +inf (so P = 0) and delta = 0. Cast P^T and dS^T to the inputs' dtype for tl.dot.
    """
    raise NotImplementedError("step 4, _dkdv_query_tiles: yours to write (docs/learn.md, Write it yourself)")
