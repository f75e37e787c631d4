"""Step 4: the backward kernel's dK/dV loop, in Triton (docs/learn.md, chapter 6).

Yours stands in for attention.triton_backward._dkdv_query_tiles: a dK/dV program of the kernel
_attn_bwd holds one key tile and calls it once per query head that reads the tile's kv head.
Under the split schedule the dQ job is the repo's; under the atomic one (ATOMIC_DQ) your loop
also adds this key tile's share of each query tile's dQ. Check it:

    pytest --impl=mine tests/test_mine.py -k dkdv_loop
"""
import triton
import triton.language as tl

from attention.masks import visible_in_tile_tl
from attention.triton_tiles import LOG2_E, add_tile, load_tile


@triton.jit
def _dkdv_query_tiles(dk, dv, k_tile, v_tile, cols, heads, LSE, DELTA, bounds, mask, qk_scale,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ATOMIC_DQ: tl.constexpr, USE_TMA: tl.constexpr):
    """Add to dk and dv (float32, BLOCK_N x BLOCK_D) of the key tile holding keys `cols` (its
    k_tile and v_tile) the query tiles of one query head in bounds, (start, full_start,
    full_end, end): masked, full, masked runs of BLOCK_M rows; return (dk, dv).

    heads = (q_head, do_head, dq_acc_head): that head's Q and dO (load_tile, as in step 3) and
    its float32 dQ accumulator. LSE and DELTA point at its N_Q values of lse (natural log) and
    delta = rowsum(dO * O); mask is (N_Q, N_K, left, right). Keep the keys along the rows, so
    that dk and dv keep the K tile's shape: P^T = exp2(k_tile q_tile^T * qk_scale - lse *
    LOG2_E), zero where visible_in_tile_tl hides a score in a masked tile; dV += P^T dO;
    dP^T = v_tile dO^T; dS^T = P^T * (dP^T - delta); dK += dS^T Q (the kernel scales dK by
    1 / sqrt(D) once, at the end). Rows past N_Q read lse = +inf (so P = 0) and delta = 0.
    Cast P^T and dS^T to the inputs' dtype for tl.dot. With ATOMIC_DQ, add dS K (that is,
    (dS^T)^T k_tile) to the query tile's rows of dq_acc_head with add_tile: other key tiles'
    programs add to the same rows at the same time, and the 1 / sqrt(D) comes after the sum.
    """
    raise NotImplementedError("step 4, _dkdv_query_tiles: yours to write (docs/learn.md, Write it yourself)")
