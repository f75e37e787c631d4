"""FlashAttention-2 backward in Triton: a delta kernel, then one launch that computes dQ and
dK, dV together, with no atomics.

1. _attn_bwd_delta: delta = rowsum(dO * O) for every query row, which both jobs below need.
2. _attn_bwd: each program does one of two jobs, chosen by its index.
   - dK, dV: the first programs each hold one K/V tile of one (batch, head) and stream the
     query tiles that see it past it, accumulating dK and dV in float32 registers.
   - dQ: the others each hold one query tile and stream the K/V tiles it sees (the forward's
     schedule), accumulating dQ.
   Why one launch for both: given delta the two jobs are independent, and at the model's
   shapes (a few hundred programs, each a short loop) the GPU is far from full. Launched one
   after the other, the second kernel waits for the first one's slowest program; launched
   together, the two jobs' programs run side by side.

Neither job stores P: both recompute it from the saved logsumexp, P = exp2(S*log2e - lse*log2e).
Splitting dQ from dK/dV costs two more matrix multiplies per tile pair (S = Q K^T and dP again:
seven, not five) but lets every program own its output tile, so there are no atomic adds, and
running the launch twice gives the same result (which is what lets TunedKernel time configs on
the real arguments). FlashAttention-2 and -3 add dQ up with atomics instead, from the dK/dV
programs; on the H200 that was slower at head dim 128 and within a few percent of this kernel
at 64 (docs/optimisation.md, "dQ by atomic adds"), so the split stays: deterministic, and one
code path. The exception is Hopper at long sequences: there gluon_backward.py's warp-specialised
kernel, five multiplies and dQ summed by TMA's reduce, measured faster, and flash_backward sends
it the calls its serves() names.

tiled_backward.py is this file's twin in PyTorch: delta, then the same two jobs, with the same
names and tile bounds. The tile helpers both kernels share are in triton_tiles.py.
"""
import torch
import triton
import triton.language as tl

from . import gluon_backward
from .triton_launch import (INTERPRETING, TunedKernel, dense_strides, descriptor_ready, heads_first, program_grid,
                            set_tma_scratch_allocator, traced, tuning_key)
from .triton_tiles import (LOG2_E, head_matrix, key_tile_bounds, load_tile, program_tile_and_head, query_tile_bounds,
                           query_tile_start, store_tile, visible_in_tile)

KERNEL_LOG2_E = tl.constexpr(LOG2_E)  # the same number, usable inside kernels


@triton.jit(do_not_specialize=["N_Q"])
def _attn_bwd_delta(O, dO, DELTA, stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don, H, N_Q,
                    HEAD_DIM: tl.constexpr, HEADS_FIRST: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta_i = dO_i . O_i for the BLOCK_M query rows of one program, stored to DELTA (B, H, N_Q)."""
    tile, bh, _ = program_tile_and_head(HEADS_FIRST)
    start_m = tile * BLOCK_M
    O = head_matrix(O, bh, H, stride_ob, stride_oh, stride_on, N_Q, HEAD_DIM, BLOCK_M, False)
    dO = head_matrix(dO, bh, H, stride_dob, stride_doh, stride_don, N_Q, HEAD_DIM, BLOCK_M, False)
    rows = start_m + tl.arange(0, BLOCK_M)
    o_tile = load_tile(O, start_m, N_Q, stride_on, BLOCK_M, HEAD_DIM, False)
    do_tile = load_tile(dO, start_m, N_Q, stride_don, BLOCK_M, HEAD_DIM, False)
    delta = tl.sum(o_tile.to(tl.float32) * do_tile.to(tl.float32), 1)
    tl.store(DELTA + bh * N_Q + rows, delta, mask=rows < N_Q)


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


# Compiled for the lengths (Triton specialises an integer on being 1 or divisible by 16, so a
# few binaries at most): faster at every paper shape than with N_Q and N_K unspecialised, as the
# forward keeps them, which specialising did not speed up (docs/optimisation.md, "Session 19: the
# split compiled for the lengths").
@triton.jit
def _attn_bwd(Q, K, V, dO, GRADS, LSE, DELTA, dq_offset, dk_offset, dv_offset,
              stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
              stride_dqb, stride_dqh, stride_dqn, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
              H, N_Q, N_K, qk_scale, sm_scale,
              IS_CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_FIRST: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DKDV_BLOCK_M: tl.constexpr, USE_TMA: tl.constexpr):
    """dQ, dK and dV are written into one tensor, GRADS, from element offsets dq_offset,
    dk_offset and dv_offset (flash_backward says why). Key tiles have BLOCK_N rows in both jobs.
    Query tiles: BLOCK_M rows where a dQ program holds one, DKDV_BLOCK_M rows where a dK/dV
    program streams them (each job has its best)."""
    tile, bh, tiles = program_tile_and_head(HEADS_FIRST)
    qk_scale, sm_scale = tl.cast(qk_scale, tl.float32), tl.cast(sm_scale, tl.float32)  # Inductor: float64
    dQ, dK, dV = GRADS + dq_offset, GRADS + dk_offset, GRADS + dv_offset
    K = head_matrix(K, bh, H, stride_kb, stride_kh, stride_kn, N_K, HEAD_DIM, BLOCK_N, USE_TMA)
    V = head_matrix(V, bh, H, stride_vb, stride_vh, stride_vn, N_K, HEAD_DIM, BLOCK_N, USE_TMA)
    LSE += bh * N_Q
    DELTA += bh * N_Q
    key_tiles = tl.cdiv(N_K, BLOCK_N)

    if tile < key_tiles:
        # dK, dV of key tile `tile`. Causal: tile 0 is seen by every query tile, so the
        # programs with the most work start first.
        # (Triton needs a name to keep one type in both branches: hence streamed_q, not q_matrix.)
        start_n = tile * BLOCK_N
        streamed_q = head_matrix(Q, bh, H, stride_qb, stride_qh, stride_qn, N_Q, HEAD_DIM, DKDV_BLOCK_M, USE_TMA)
        streamed_do = head_matrix(dO, bh, H, stride_dob, stride_doh, stride_don, N_Q, HEAD_DIM, DKDV_BLOCK_M, USE_TMA)
        dk_matrix = head_matrix(dK, bh, H, stride_dkb, stride_dkh, stride_dkn, N_K, HEAD_DIM, BLOCK_N, USE_TMA)
        dv_matrix = head_matrix(dV, bh, H, stride_dvb, stride_dvh, stride_dvn, N_K, HEAD_DIM, BLOCK_N, USE_TMA)
        cols = start_n + tl.arange(0, BLOCK_N)
        k_tile = load_tile(K, start_n, N_K, stride_kn, BLOCK_N, HEAD_DIM, USE_TMA)  # keys past N_K: zeros, never stored
        v_tile = load_tile(V, start_n, N_K, stride_vn, BLOCK_N, HEAD_DIM, USE_TMA)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        start_m, unmasked_start = query_tile_bounds(start_n, N_Q, IS_CAUSAL, DKDV_BLOCK_M, BLOCK_N)
        dk, dv = _dkdv_query_tiles(dk, dv, k_tile, v_tile, streamed_q, streamed_do, stride_qn, stride_don, LSE, DELTA,
                                   start_m, unmasked_start, cols, N_Q, N_K, qk_scale, True, IS_CAUSAL, HEAD_DIM,
                                   DKDV_BLOCK_M, USE_TMA)
        dk, dv = _dkdv_query_tiles(dk, dv, k_tile, v_tile, streamed_q, streamed_do, stride_qn, stride_don, LSE, DELTA,
                                   unmasked_start, N_Q, cols, N_Q, N_K, qk_scale, False, IS_CAUSAL, HEAD_DIM,
                                   DKDV_BLOCK_M, USE_TMA)
        store_tile(dk_matrix, start_n, N_K, stride_dkn, dk * sm_scale, BLOCK_N, HEAD_DIM, USE_TMA)
        store_tile(dv_matrix, start_n, N_K, stride_dvn, dv, BLOCK_N, HEAD_DIM, USE_TMA)
    else:
        # dQ of a query tile, in the forward's order among the query-tile programs.
        start_m = query_tile_start(tile - key_tiles, tiles - key_tiles, IS_CAUSAL, BLOCK_M)
        q_matrix = head_matrix(Q, bh, H, stride_qb, stride_qh, stride_qn, N_Q, HEAD_DIM, BLOCK_M, USE_TMA)
        do_matrix = head_matrix(dO, bh, H, stride_dob, stride_doh, stride_don, N_Q, HEAD_DIM, BLOCK_M, USE_TMA)
        dq_matrix = head_matrix(dQ, bh, H, stride_dqb, stride_dqh, stride_dqn, N_Q, HEAD_DIM, BLOCK_M, USE_TMA)
        rows = start_m + tl.arange(0, BLOCK_M)
        q_tile = load_tile(q_matrix, start_m, N_Q, stride_qn, BLOCK_M, HEAD_DIM, USE_TMA)
        do_tile = load_tile(do_matrix, start_m, N_Q, stride_don, BLOCK_M, HEAD_DIM, USE_TMA)
        lse = tl.load(LSE + rows, mask=rows < N_Q, other=float("inf")) * KERNEL_LOG2_E  # base 2
        delta = tl.load(DELTA + rows, mask=rows < N_Q, other=0.0)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        unmasked_end, end = key_tile_bounds(start_m, N_K, IS_CAUSAL, BLOCK_M, BLOCK_N)
        dq = _dq_key_tiles(dq, q_tile, do_tile, lse, delta, K, V, stride_kn, stride_vn, 0, unmasked_end, rows, N_K,
                           qk_scale, False, IS_CAUSAL, HEAD_DIM, BLOCK_N, USE_TMA)
        dq = _dq_key_tiles(dq, q_tile, do_tile, lse, delta, K, V, stride_kn, stride_vn, unmasked_end, end, rows, N_K,
                           qk_scale, True, IS_CAUSAL, HEAD_DIM, BLOCK_N, USE_TMA)
        store_tile(dq_matrix, start_m, N_Q, stride_dqn, dq * sm_scale, BLOCK_M, HEAD_DIM, USE_TMA)


def backward_smem_rows(config):
    """Per job, the tile pair a program keeps resident and the pair each pipeline stage streams."""
    tile_m, tile_n, dkdv_tile_m = (config.kwargs[name] for name in ("BLOCK_M", "BLOCK_N", "DKDV_BLOCK_M"))
    return [(2 * tile_m, 2 * tile_n),  # dQ: Q and dO resident, K and V streamed
            (2 * tile_n, 2 * dkdv_tile_m)]  # dK, dV: K and V resident, Q and dO streamed


# (dQ's query tile, key tile, dK/dV's query tile, num_warps, num_stages, TMA) the tuner chooses
# among. It times the first three that fit, so the order matters, and the best configs depend on
# the head dim (docs/benchmarks.md, session 21). This is the order at head dims up to 64: on the
# H200 the first was the fastest on the model's short sequences and at N = 1024, the second and
# third on the paper's longer ones. The last is the one that fits sm_89 with float32 at D=128.
BACKWARD_CONFIGS = [
    triton.Config({"BLOCK_M": m, "BLOCK_N": n, "DKDV_BLOCK_M": dkdv_m, "USE_TMA": tma}, num_warps=w, num_stages=s)
    for m, n, dkdv_m, w, s, tma in [
        (64, 64, 32, 4, 2, False), (64, 64, 32, 4, 3, True), (64, 64, 64, 4, 3, True), (64, 64, 64, 4, 2, True),
        (64, 32, 64, 4, 2, False), (64, 64, 64, 4, 2, False), (64, 32, 32, 4, 2, False), (64, 64, 64, 4, 3, False),
        (128, 64, 64, 8, 2, True), (64, 16, 16, 4, 2, False),
    ]
]
# At wider heads these go first: 64/64/64 with TMA was the fastest at D=128 but on short
# sequences, where 64/64/32 (causal) and 64/64/64 on cp.async (full) won.
WIDE_HEAD_FIRST = [BACKWARD_CONFIGS[i] for i in (3, 0, 5)]


def backward_configs(head_dim):
    """BACKWARD_CONFIGS in the order the tuner tries them at head_dim."""
    if head_dim <= 64:
        return BACKWARD_CONFIGS
    return WIDE_HEAD_FIRST + [c for c in BACKWARD_CONFIGS if c not in WIDE_HEAD_FIRST]


# delta reads O and dO once: no config to choose (TunedKernel then just keeps the launch cheap).
DELTA_CONFIG = triton.Config({"BLOCK_M": 64}, num_warps=4)

_attn_bwd_tuned = TunedKernel(_attn_bwd, backward_configs, backward_smem_rows)
_attn_bwd_delta_launch = TunedKernel(_attn_bwd_delta, [DELTA_CONFIG], smem_rows=None)


def gradient_views(grads, q, k, v):
    """dq, dk, dv as views of the flat tensor grads, one after another, each shaped like the
    (B, H, N, D) q, k, v and laid out in its memory order (dense_strides)."""
    views, offset = [], 0
    for t in (q, k, v):
        views.append(grads.as_strided(t.shape, dense_strides(t), offset))
        offset += t.numel()
    return views


def new_gradients(q, k, v):
    """(grads, dq, dk, dv): a new flat tensor and gradient_views of it."""
    grads = torch.empty(q.numel() + k.numel() + v.numel(), dtype=q.dtype, device=q.device)
    return grads, *gradient_views(grads, q, k, v)


def flash_backward(q, k, v, o, do, lse, is_causal, out=None, config=None):
    """Gradients of O = attention(q, k, v) for (B, H, N, D) descriptor-ready q, k, v, o, do
    and the forward's contiguous float32 lse. Returns dq, dk, dv, which are views of one tensor,
    grads, that the kernel writes: out = (grads, dq, dk, dv) gives them (for the model's fused
    projection, its gradient and the q, k, v views of it), else they are new_gradients.
    Why one tensor: compiled, a kernel's writes to views cost copies of their base (five of
    them for a packed gradient, docs/optimisation.md "The compiled route"); to one fresh tensor, none.
    config: a triton.Config of _attn_bwd to bypass the tuning and gluon_backward.py's kernel (tests, bench.py)."""
    B, H, N_Q, D = q.shape
    N_K = k.shape[2]
    grads, dq, dk, dv = out if out is not None else new_gradients(q, k, v)
    if INTERPRETING and q.dtype == torch.bfloat16:  # as in flash_forward: the interpreter's bf16 dot is garbage
        grads32 = flash_backward(*(descriptor_ready(t.float()) for t in (q, k, v, o, do)), lse, is_causal,
                                 config=config)
        return tuple(g.copy_(g32) for g, g32 in zip((dq, dk, dv), grads32))
    if B * H * N_Q * N_K == 0:  # no query or no key: every gradient is zero
        return dq.zero_(), dk.zero_(), dv.zero_()
    set_tma_scratch_allocator()
    key = tuning_key(q, k, is_causal)

    heads_go_first = heads_first(k)
    delta = torch.empty((B, H, N_Q), dtype=torch.float32, device=q.device)
    grid = lambda meta: program_grid(triton.cdiv(N_Q, meta["BLOCK_M"]), B * H, heads_go_first)
    _attn_bwd_delta_launch(grid, key, o, do, delta, *o.stride()[:3], *do.stride()[:3], H, N_Q, HEAD_DIM=D,
                           HEADS_FIRST=heads_go_first)
    if config is None and not traced(q) and gluon_backward.serves(q, k, is_causal):
        # Hopper, at the head dims, masks and lengths of gluon_backward.TILES and MIN_KEYS: the
        # warp-specialised kernel measured faster there. A traced call stays with _attn_bwd, as
        # flash_forward's does.
        gluon_backward.gluon_backward(q, k, v, do, lse, delta, is_causal, dq, dk, dv)
        return dq, dk, dv

    sm_scale = D ** -0.5
    offsets = (t.storage_offset() - grads.storage_offset() for t in (dq, dk, dv))
    args = (q, k, v, do, grads, lse, delta, *offsets, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *do.stride()[:3], *dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], H, N_Q, N_K, sm_scale * LOG2_E,
            sm_scale)
    # The key-tile programs first, then the query-tile programs (see _attn_bwd).
    grid = lambda meta: program_grid(triton.cdiv(N_K, meta["BLOCK_N"]) + triton.cdiv(N_Q, meta["BLOCK_M"]), B * H,
                                     heads_go_first)
    if config is None:
        _attn_bwd_tuned(grid, key, *args, IS_CAUSAL=is_causal, HEAD_DIM=D, HEADS_FIRST=heads_go_first)
    else:
        _attn_bwd[grid](*args, IS_CAUSAL=is_causal, HEAD_DIM=D, HEADS_FIRST=heads_go_first, **config.all_kwargs())
    return dq, dk, dv
