"""FlashAttention-2 forward in Triton.

One program computes one query tile of one (batch, head): it keeps q_tile and the running
softmax state (m_i, l_i, acc) in registers and streams K/V tiles past them, so the
N_q x N_k score matrix never exists in memory. It writes O and the logsumexp lse once.

The softmax runs in base 2 (exp2 is one instruction; log2(e) is folded into the scale), so
m_i is a running max of base-2 logits. Causal programs visit key tiles in two stages: tiles
wholly below the diagonal with no mask, then the few that cross the diagonal or the end of
the keys with one. Tiles wholly above the diagonal are never loaded. Where a tile starts, which
tiles a program visits, the mask and the tile loads and stores are triton_tiles.py's helpers,
which the backward shares.
"""
import torch
import triton
import triton.language as tl

from . import gluon_forward
from .triton_launch import (INTERPRETING, TunedKernel, descriptor_ready, heads_first, program_grid,
                            set_tma_scratch_allocator, traced, tuning_key)
from .triton_tiles import (LN_2, LOG2_E, head_matrix, key_tile_bounds, load_tile, program_tile_and_head,
                           query_tile_start, store_tile, visible_in_tile)


@triton.jit
def _fwd_key_tiles(acc, l_i, m_i, q_tile, K, V, stride_kn, stride_vn, start_n, end_n, rows, N_K, qk_scale,
                   MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   USE_TMA: tl.constexpr):
    """The online-softmax update over key tiles [start_n, end_n): for each tile, rescale what
    was accumulated by exp2(m_old - m_new) and add this tile's share."""
    for tile_start in range(start_n, end_n, BLOCK_N):
        k_tile = load_tile(K, tile_start, N_K, stride_kn, BLOCK_N, HEAD_DIM, USE_TMA)
        s = tl.dot(q_tile, tl.trans(k_tile))  # raw scores, (BLOCK_M, BLOCK_N)
        if MASKED:  # this tile crosses the diagonal or runs past the last key
            cols = tile_start + tl.arange(0, BLOCK_N)
            s = tl.where(visible_in_tile(rows[:, None], cols[None, :], N_K, IS_CAUSAL), s, float("-inf"))
        # The scale is applied where it is needed, not to the whole tile first: to the row max
        # (BLOCK_M values) and inside exp2's argument, where scale * s - m is one fused multiply-add.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # running max of base-2 logits
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)  # how much the old maximum overstated the new one
        l_i = l_i * alpha + tl.sum(p, 1)
        v_tile = load_tile(V, tile_start, N_K, stride_vn, BLOCK_N, HEAD_DIM, USE_TMA)
        acc = tl.dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["N_Q", "N_K"])
def _attn_fwd(Q, K, V, O, LSE,
              stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
              H, N_Q, N_K, qk_scale,
              IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_FIRST: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr):
    tile, bh, tiles = program_tile_and_head(HEADS_FIRST)
    start_m = query_tile_start(tile, tiles, IS_CAUSAL, BLOCK_M)
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor passes a Python float as float64
    Q = head_matrix(Q, bh, H, stride_qb, stride_qh, stride_qn, N_Q, HEAD_DIM, BLOCK_M, USE_TMA)
    K = head_matrix(K, bh, H, stride_kb, stride_kh, stride_kn, N_K, HEAD_DIM, BLOCK_N, USE_TMA)
    V = head_matrix(V, bh, H, stride_vb, stride_vh, stride_vn, N_K, HEAD_DIM, BLOCK_N, USE_TMA)
    O = head_matrix(O, bh, H, stride_ob, stride_oh, stride_on, N_Q, HEAD_DIM, BLOCK_M, USE_TMA)

    rows = start_m + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    q_tile = load_tile(Q, start_m, N_Q, stride_qn, BLOCK_M, HEAD_DIM, USE_TMA)

    unmasked_end, end = key_tile_bounds(start_m, N_K, IS_CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_key_tiles(acc, l_i, m_i, q_tile, K, V, stride_kn, stride_vn, 0, unmasked_end, rows, N_K,
                                   qk_scale, False, IS_CAUSAL, HEAD_DIM, BLOCK_N, USE_TMA)
    acc, l_i, m_i = _fwd_key_tiles(acc, l_i, m_i, q_tile, K, V, stride_kn, stride_vn, unmasked_end, end, rows, N_K,
                                   qk_scale, True, IS_CAUSAL, HEAD_DIM, BLOCK_N, USE_TMA)

    # Normalise once, at the end. Every row saw key 0, so l_i >= 1.
    store_tile(O, start_m, N_Q, stride_on, acc / l_i[:, None], BLOCK_M, HEAD_DIM, USE_TMA)
    lse = (m_i + tl.log2(l_i)) * LN_2  # back to natural log
    tl.store(LSE + bh * N_Q + rows, lse, mask=rows < N_Q)


def forward_smem_rows(config):
    # One job: q_tile stays resident; each pipeline stage holds one K and one V tile.
    return [(config.kwargs["BLOCK_M"], 2 * config.kwargs["BLOCK_N"])]


# The tuner's choices, best first (TunedKernel times only the first TIMED_CANDIDATES that fit).
# Besides tile sizes, warps and pipeline depth, the load path is a knob. On the H200 the three
# timed there each win somewhere: 64x128 with TMA the long D=64 sequences, 128x64 with TMA
# D=128, 64x64 with cp.async the model's short ones. Cards without TMA keep the cp.async
# configs, of which the first three are timed. docs/optimisation.md and docs/benchmarks.md
# have the numbers.
FORWARD_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "USE_TMA": tma}, num_warps=w, num_stages=s)
    for bm, bn, w, s, tma in [
        (64, 128, 4, 2, True), (128, 64, 4, 2, True), (64, 64, 4, 3, False), (128, 64, 8, 3, False), (64, 64, 4, 2, True),
        (64, 64, 4, 3, True), (128, 128, 4, 3, True), (128, 32, 4, 3, False), (64, 32, 4, 2, False),
    ]
]

_attn_fwd_tuned = TunedKernel(_attn_fwd, FORWARD_CONFIGS, forward_smem_rows)


def flash_forward(q, k, v, is_causal, config=None, out=None):
    """q, k, v: (B, H, N, D) descriptor-ready views. Returns O (B, H, N_q, D) in q's dtype
    and lse (B, H, N_q) float32: written into out = (O, lse) when given (O descriptor-ready, lse
    contiguous). config: a triton.Config to bypass the tuning and gluon_forward.py's kernel (tests, bench)."""
    B, H, N_Q, D = q.shape
    N_K = k.shape[2]
    # O in q's memory order: for the model's q, a view of (B, N, 3, H, D), that is (B, N, H, D),
    # so the transpose back to (B, N, H * D) after attention costs no copy.
    o, lse = out if out is not None else (torch.empty_like(q), torch.empty((B, H, N_Q), dtype=torch.float32,
                                                                           device=q.device))
    if INTERPRETING and q.dtype == torch.bfloat16:
        # The interpreter's tl.dot returns garbage on bfloat16 (numpy has no bf16): on the CPU,
        # bf16 runs in float32 and O is rounded to bf16 at the end.
        o32, _ = flash_forward(*(descriptor_ready(t.float()) for t in (q, k, v)), is_causal, config,
                               out=(torch.empty(o.shape, dtype=torch.float32), lse))
        return o.copy_(o32), lse
    if N_K == 0:  # no key to attend to (TMA cannot describe an empty matrix): O = 0, lse = -inf
        return o.zero_(), lse.fill_(float("-inf"))
    if o.numel() == 0:
        return o, lse
    if config is None and not traced(q) and gluon_forward.serves(q, k, is_causal):
        # Hopper, at the head dims, masks and lengths of gluon_forward.TILES and MIN_KEYS: the
        # warp-specialised kernel measured faster there. A traced call stays with _attn_fwd:
        # torch.compile records launches through wrap_triton, which we have not tried with a
        # Gluon kernel.
        gluon_forward.gluon_forward(q, k, v, o, lse, is_causal)
        return o, lse
    args = (q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
            H, N_Q, N_K, D ** -0.5 * LOG2_E)
    heads_go_first = heads_first(k)
    grid = lambda meta: program_grid(triton.cdiv(N_Q, meta["BLOCK_M"]), B * H, heads_go_first)
    set_tma_scratch_allocator()
    if config is None:
        _attn_fwd_tuned(grid, tuning_key(q, k, is_causal), *args, IS_CAUSAL=is_causal, HEAD_DIM=D,
                        HEADS_FIRST=heads_go_first)
    else:
        _attn_fwd[grid](*args, IS_CAUSAL=is_causal, HEAD_DIM=D, HEADS_FIRST=heads_go_first, **config.all_kwargs())
    return o, lse
