"""Step 3: the forward kernel's key loop, in Triton (docs/learn.md, chapter 4).

Yours stand in for attention.triton_forward's online_softmax_update and _key_tiles: the kernel
_attn_fwd loads a query tile, calls _key_tiles for the key tiles it sees, and writes O and lse.
On a CPU the kernel runs in Triton's interpreter. Check them:

    pytest --impl=mine tests/test_mine.py -k key_loop
"""
import triton
import triton.language as tl

from attention.masks import visible_in_tile_tl
from attention.triton_tiles import load_tile


@triton.jit
def online_softmax_update(acc, l_i, m_i, s, v_tile, qk_scale, MASKED: tl.constexpr):
    """Step 1's update in base 2, with the product on the tensor cores: fold one tile of raw
    scores s (BLOCK_M, BLOCK_N), hidden ones -inf, and its values v_tile (BLOCK_N, BLOCK_D) into
    acc (float32, BLOCK_M x BLOCK_D), l_i and m_i (BLOCK_M,); return (acc, l_i, m_i).

    qk_scale is log2(e) / sqrt(D): m_i is the running max of s * qk_scale (base-2 logits), and
    exp(score - max) is exp2(s * qk_scale - m), one fused multiply-add a score. Only a masked
    tile (MASKED) can hold a row that has seen no key yet: guard it there as in step 1. Cast p
    to v_tile's dtype for tl.dot, which adds into the rescaled acc, its third argument.
    """
    raise NotImplementedError("step 3, online_softmax_update: yours to write (docs/learn.md, Write it yourself)")


@triton.jit
def _key_tiles(acc, l_i, m_i, q_tile, rows, k_head, v_head, bounds, mask, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr):
    """Fold into acc, l_i, m_i the key tiles of bounds, (start, full_start, full_end, end): a
    masked run [start, full_start), a full run [full_start, full_end) and a masked run
    [full_end, end), BLOCK_N keys a tile; return (acc, l_i, m_i). q_tile holds query rows
    `rows`; mask is (N_Q, N_K, left, right).

    A tile of K or V: load_tile(k_head, tile_start, BLOCK_N, HEAD_DIM, BLOCK_D, USE_TMA), with
    BLOCK_D = q_tile.shape[1]. Raw scores: tl.dot(q_tile, tl.trans(k_tile)). In a masked tile,
    set to -inf the scores that visible_in_tile_tl(rows[:, None], cols[None, :], mask) hides.
    Walk the runs in tl.static_range(3), so that the run is a compile-time constant and the full
    run compiles with no mask at all.
    """
    raise NotImplementedError("step 3, _key_tiles: yours to write (docs/learn.md, Write it yourself)")
