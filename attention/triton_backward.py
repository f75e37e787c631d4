"""FlashAttention-2 backward in Triton: two kernels, no atomics.

1. _bwd_dq: one program holds one query tile and streams the K/V tiles past it (the same
   schedule as the forward), accumulating dQ. It first computes its rows' delta =
   rowsum(dO * O), which it needs itself, and stores it for the second kernel.
2. _bwd_dkdv: one program holds one K/V tile of one (batch, head) and streams the query
   tiles past it, accumulating dK and dV in float32 registers.

Neither pass stores P: both recompute it from the saved logsumexp, P = exp2(S*log2e - lse*log2e).
Splitting dQ from dK/dV costs one more S = Q K^T per tile pair but lets every program own
its output tile, so there are no atomic adds and each pass gets its own tile sizes.

tiled_backward.py is this file's twin in PyTorch: the same passes, in the same order, with the
same names and tile bounds. The tile helpers both kernels share are in triton_tiles.py.
"""
import torch
import triton
import triton.language as tl

from .triton_launch import INTERPRETING, TunedKernel, descriptor_ready, set_tma_scratch_allocator, tuning_key
from .triton_tiles import (LOG2_E, head_matrix, key_tile_bounds, load_tile, query_tile_bounds, query_tile_start,
                           store_tile, visible_in_tile)

KERNEL_LOG2_E = tl.constexpr(LOG2_E)  # the same number, usable inside kernels


@triton.jit
def _dq_key_tiles(dq, q_tile, do_tile, lse, delta, K, V, stride_kn, stride_vn, start_n, end_n, rows, N_K, qk_scale,
                  MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  USE_TMA: tl.constexpr):
    """Add the contributions of key tiles [start_n, end_n) to this query tile's dQ."""
    for tile_start in range(start_n, end_n, BLOCK_N):
        k_tile = load_tile(K, tile_start, N_K, stride_kn, BLOCK_N, HEAD_DIM, USE_TMA)
        v_tile = load_tile(V, tile_start, N_K, stride_vn, BLOCK_N, HEAD_DIM, USE_TMA)
        p = tl.exp2(tl.dot(q_tile, tl.trans(k_tile)) * qk_scale - lse[:, None])
        if MASKED:  # the tile crosses the diagonal or the end of the keys
            cols = tile_start + tl.arange(0, BLOCK_N)
            p = tl.where(visible_in_tile(rows[:, None], cols[None, :], N_K, IS_CAUSAL), p, 0.0)
        dp = tl.dot(do_tile, tl.trans(v_tile))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k_tile.dtype), k_tile)
    return dq


@triton.jit(do_not_specialize=["N_Q", "N_K"])
def _bwd_dq(Q, K, V, O, dO, dQ, LSE, DELTA,
            stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
            stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don,
            stride_dqb, stride_dqh, stride_dqn,
            H, N_Q, N_K, qk_scale, sm_scale,
            IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr):
    start_m = query_tile_start(IS_CAUSAL, BLOCK_M)
    bh = tl.program_id(1)
    Q = head_matrix(Q, bh, H, stride_qb, stride_qh, stride_qn, N_Q, HEAD_DIM, BLOCK_M, USE_TMA)
    dO = head_matrix(dO, bh, H, stride_dob, stride_doh, stride_don, N_Q, HEAD_DIM, BLOCK_M, USE_TMA)
    K = head_matrix(K, bh, H, stride_kb, stride_kh, stride_kn, N_K, HEAD_DIM, BLOCK_N, USE_TMA)
    V = head_matrix(V, bh, H, stride_vb, stride_vh, stride_vn, N_K, HEAD_DIM, BLOCK_N, USE_TMA)
    O = head_matrix(O, bh, H, stride_ob, stride_oh, stride_on, N_Q, HEAD_DIM, BLOCK_M, False)
    dQ = head_matrix(dQ, bh, H, stride_dqb, stride_dqh, stride_dqn, N_Q, HEAD_DIM, BLOCK_M, USE_TMA)

    rows = start_m + tl.arange(0, BLOCK_M)
    q_tile = load_tile(Q, start_m, N_Q, stride_qn, BLOCK_M, HEAD_DIM, USE_TMA)
    do_tile = load_tile(dO, start_m, N_Q, stride_don, BLOCK_M, HEAD_DIM, USE_TMA)
    lse = tl.load(LSE + bh * N_Q + rows, mask=rows < N_Q, other=float("inf")) * KERNEL_LOG2_E  # base 2
    # delta_i = dO_i . O_i: read once per row, as a plain load (O is needed for nothing else).
    o_tile = load_tile(O, start_m, N_Q, stride_on, BLOCK_M, HEAD_DIM, False)
    delta = tl.sum(o_tile.to(tl.float32) * do_tile.to(tl.float32), 1)
    tl.store(DELTA + bh * N_Q + rows, delta, mask=rows < N_Q)  # for _bwd_dkdv, launched next
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    unmasked_end, end = key_tile_bounds(start_m, N_K, IS_CAUSAL, BLOCK_M, BLOCK_N)
    dq = _dq_key_tiles(dq, q_tile, do_tile, lse, delta, K, V, stride_kn, stride_vn, 0, unmasked_end, rows, N_K,
                       qk_scale, False, IS_CAUSAL, HEAD_DIM, BLOCK_N, USE_TMA)
    dq = _dq_key_tiles(dq, q_tile, do_tile, lse, delta, K, V, stride_kn, stride_vn, unmasked_end, end, rows, N_K,
                       qk_scale, True, IS_CAUSAL, HEAD_DIM, BLOCK_N, USE_TMA)
    store_tile(dQ, start_m, N_Q, stride_dqn, dq * sm_scale, BLOCK_M, HEAD_DIM, USE_TMA)


@triton.jit
def _dkdv_query_tiles(dk, dv, k_tile, v_tile, Q, dO, stride_qn, stride_don, LSE, DELTA, start_m, end_m, cols, N_Q,
                      N_K, qk_scale, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_M: tl.constexpr, USE_TMA: tl.constexpr):
    """Add the contributions of query tiles [start_m, end_m) to this K/V tile's dK, dV.
    Everything is transposed (keys along rows) so the accumulators keep the K/V tile's shape."""
    for tile_start in range(start_m, end_m, BLOCK_M):
        rows = tile_start + tl.arange(0, BLOCK_M)
        q_tile = load_tile(Q, tile_start, N_Q, stride_qn, BLOCK_M, HEAD_DIM, USE_TMA)
        do_tile = load_tile(dO, tile_start, N_Q, stride_don, BLOCK_M, HEAD_DIM, USE_TMA)
        # Rows past N_Q read lse = +inf, so their probabilities are exactly 0 and need no mask.
        # lse in base 2, like the scores (as m_i is in the forward).
        lse = tl.load(LSE + rows, mask=rows < N_Q, other=float("inf")) * KERNEL_LOG2_E
        delta = tl.load(DELTA + rows, mask=rows < N_Q, other=0.0)
        p_t = tl.exp2(tl.dot(k_tile, tl.trans(q_tile)) * qk_scale - lse[None, :])  # P^T, (BLOCK_N, BLOCK_M)
        if MASKED:  # this query tile crosses the diagonal
            p_t = tl.where(visible_in_tile(rows[None, :], cols[:, None], N_K, IS_CAUSAL), p_t, 0.0)
        dv += tl.dot(p_t.to(do_tile.dtype), do_tile)
        dp_t = tl.dot(v_tile, tl.trans(do_tile))
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q_tile.dtype), q_tile)
    return dk, dv


@triton.jit(do_not_specialize=["N_Q", "N_K"])
def _bwd_dkdv(Q, K, V, dO, dK, dV, LSE, DELTA,
              stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
              stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
              H, N_Q, N_K, qk_scale, sm_scale,
              IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    Q = head_matrix(Q, bh, H, stride_qb, stride_qh, stride_qn, N_Q, HEAD_DIM, BLOCK_M, USE_TMA)
    dO = head_matrix(dO, bh, H, stride_dob, stride_doh, stride_don, N_Q, HEAD_DIM, BLOCK_M, USE_TMA)
    K = head_matrix(K, bh, H, stride_kb, stride_kh, stride_kn, N_K, HEAD_DIM, BLOCK_N, USE_TMA)
    V = head_matrix(V, bh, H, stride_vb, stride_vh, stride_vn, N_K, HEAD_DIM, BLOCK_N, USE_TMA)
    dK = head_matrix(dK, bh, H, stride_dkb, stride_dkh, stride_dkn, N_K, HEAD_DIM, BLOCK_N, USE_TMA)
    dV = head_matrix(dV, bh, H, stride_dvb, stride_dvh, stride_dvn, N_K, HEAD_DIM, BLOCK_N, USE_TMA)
    LSE += bh * N_Q
    DELTA += bh * N_Q

    cols = start_n + tl.arange(0, BLOCK_N)
    k_tile = load_tile(K, start_n, N_K, stride_kn, BLOCK_N, HEAD_DIM, USE_TMA)  # keys past N_K: zeros, never stored
    v_tile = load_tile(V, start_n, N_K, stride_vn, BLOCK_N, HEAD_DIM, USE_TMA)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    start_m, unmasked_start = query_tile_bounds(start_n, N_Q, IS_CAUSAL, BLOCK_M, BLOCK_N)
    dk, dv = _dkdv_query_tiles(dk, dv, k_tile, v_tile, Q, dO, stride_qn, stride_don, LSE, DELTA, start_m,
                               unmasked_start, cols, N_Q, N_K, qk_scale, True, IS_CAUSAL, HEAD_DIM, BLOCK_M, USE_TMA)
    dk, dv = _dkdv_query_tiles(dk, dv, k_tile, v_tile, Q, dO, stride_qn, stride_don, LSE, DELTA, unmasked_start,
                               N_Q, cols, N_Q, N_K, qk_scale, False, IS_CAUSAL, HEAD_DIM, BLOCK_M, USE_TMA)
    store_tile(dK, start_n, N_K, stride_dkn, dk * sm_scale, BLOCK_N, HEAD_DIM, USE_TMA)
    store_tile(dV, start_n, N_K, stride_dvn, dv, BLOCK_N, HEAD_DIM, USE_TMA)


def dq_smem_rows(config):
    # The Q/dO tile pair stays resident; each stage streams one K and one V tile.
    return 2 * config.kwargs["BLOCK_M"], 2 * config.kwargs["BLOCK_N"]


def dkdv_smem_rows(config):
    # The K/V tile pair stays resident; each stage streams one Q and one dO tile.
    return 2 * config.kwargs["BLOCK_N"], 2 * config.kwargs["BLOCK_M"]


# (resident tile, streamed tile, num_warps, num_stages, TMA) the autotuner chooses among,
# from bench.py --configs on the H200; the last is the one that fits sm_89 with float32 at D=128.
_BACKWARD_CONFIGS = {
    "dq": [(64, 64, 4, 3, True), (128, 64, 8, 3, True), (64, 32, 4, 3, True),
           (64, 64, 4, 3, False), (128, 64, 8, 3, False), (64, 32, 4, 3, False), (64, 16, 4, 2, False)],
    "dkdv": [(64, 32, 4, 2, True), (64, 64, 4, 2, True), (128, 64, 8, 2, True),
             (64, 32, 4, 2, False), (64, 64, 4, 2, False), (128, 32, 4, 3, False), (64, 16, 4, 2, False)],
}
DQ_CONFIGS = [triton.Config({"BLOCK_M": r, "BLOCK_N": n, "USE_TMA": tma}, num_warps=w, num_stages=s)
              for r, n, w, s, tma in _BACKWARD_CONFIGS["dq"]]
DKDV_CONFIGS = [triton.Config({"BLOCK_N": r, "BLOCK_M": m, "USE_TMA": tma}, num_warps=w, num_stages=s)
                for r, m, w, s, tma in _BACKWARD_CONFIGS["dkdv"]]

_bwd_dq_tuned = TunedKernel(_bwd_dq, DQ_CONFIGS, dq_smem_rows)
_bwd_dkdv_tuned = TunedKernel(_bwd_dkdv, DKDV_CONFIGS, dkdv_smem_rows)


def flash_backward(q, k, v, o, do, lse, is_causal, out=None, dkdv_config=None, dq_config=None):
    """Gradients of O = attention(q, k, v) for (B, H, N, D) descriptor-ready q, k, v, o, do
    and the forward's contiguous float32 lse. Returns dq, dk, dv: written into out, descriptor-
    ready views, when given; otherwise new tensors in the dtypes and memory order of q, k, v
    (for the model's views of one fused projection, the order its gradient is assembled in).
    dkdv_config / dq_config: triton.Configs to bypass the tuning (tests, bench.py)."""
    B, H, N_Q, D = q.shape
    N_K = k.shape[2]
    dq, dk, dv = out if out is not None else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    if INTERPRETING and q.dtype == torch.bfloat16:  # as in flash_forward: the interpreter's bf16 dot is garbage
        grads32 = flash_backward(*(descriptor_ready(t.float()) for t in (q, k, v, o, do)), lse, is_causal,
                                 dkdv_config=dkdv_config, dq_config=dq_config)
        return tuple(g.copy_(g32) for g, g32 in zip((dq, dk, dv), grads32))
    if B * H * N_Q * N_K == 0:  # no query or no key: every gradient is zero
        return dq.zero_(), dk.zero_(), dv.zero_()
    set_tma_scratch_allocator()
    delta = torch.empty((B, H, N_Q), dtype=torch.float32, device=q.device)
    sm_scale = D ** -0.5
    shape_args = (H, N_Q, N_K, sm_scale * LOG2_E, sm_scale)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
    key = tuning_key(q, k, is_causal)

    # dQ first: it also writes delta, which the dK/dV kernel reads.
    args = (q, k, v, o, do, dq, lse, delta, *strides, *o.stride()[:3], *do.stride()[:3], *dq.stride()[:3], *shape_args)
    grid = lambda meta: (triton.cdiv(N_Q, meta["BLOCK_M"]), B * H)
    if dq_config is None:
        _bwd_dq_tuned(grid, key, *args, IS_CAUSAL=is_causal, HEAD_DIM=D)
    else:
        _bwd_dq[grid](*args, IS_CAUSAL=is_causal, HEAD_DIM=D, **dq_config.all_kwargs())

    args = (q, k, v, do, dk, dv, lse, delta, *strides, *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
            *shape_args)
    grid = lambda meta: (triton.cdiv(N_K, meta["BLOCK_N"]), B * H)
    if dkdv_config is None:
        _bwd_dkdv_tuned(grid, key, *args, IS_CAUSAL=is_causal, HEAD_DIM=D)
    else:
        _bwd_dkdv[grid](*args, IS_CAUSAL=is_causal, HEAD_DIM=D, **dkdv_config.all_kwargs())
    return dq, dk, dv
