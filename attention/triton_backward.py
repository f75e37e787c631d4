"""FlashAttention-2 backward in Triton: a delta kernel, then one launch that computes dQ and
dK, dV together, with no atomics.

1. _attn_bwd_delta: delta = rowsum(dO * O) for every query row, which both jobs below need.
2. _attn_bwd: each program does one of two jobs, chosen by its index.
   - dK, dV: a program holds one K/V tile of one (batch, kv head) and streams past it
     the query tiles that see it, of every query head that reads this kv head (GROUP of them),
     accumulating dK and dV in float32 registers.
   - dQ: a program holds one query tile and streams the K/V tiles it sees (the forward's
     schedule), accumulating dQ.
   Given delta the two jobs are independent, and at the model's shapes (a few hundred programs,
   each a short loop) the GPU is far from full: launched together, their programs run side by
   side, where one launch after the other would wait for the first one's slowest program.

Neither job stores P: both recompute it from the saved logsumexp, P = exp2(S*log2e - lse*log2e).
Splitting dQ from dK/dV costs two more matrix multiplies per tile pair (seven, not five) but
every program owns its output tile: no atomic adds, the same result on every run, and a kernel
the tuner may run several times. FlashAttention-2 adds dQ up with atomics from the dK/dV programs
instead; on the H200 that was slower at head dim 128 and level at 64 (docs/optimisation.md).
Hopper at long sequences runs hopper/backward.py's kernel instead, which measured faster.

tiled_backward.py is this file's twin in PyTorch, with the same names and tile bounds.
"""
import torch
import triton
import triton.language as tl

from .hopper import backward as hopper_backward
from .launch import (INTERPRETING, as_4d, autotuned, descriptor_ready, head_dim_block, heads_first, new_like,
                     program_grid, set_tma_scratch_allocator)
from .masks import key_tile_bounds_tl, query_tile_bounds_tl, visible_in_tile_tl, window_bounds
from .triton_tiles import LOG2_E, head_matrix, load_tile, program_tile_and_head, query_tile_start, store_tile


@triton.jit(do_not_specialize=["N_Q"])
def _attn_bwd_delta(O, dO, DELTA, stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don, H, N_Q,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEADS_FIRST: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta_i = dO_i . O_i for the BLOCK_M query rows of one program, stored to DELTA (B, H, N_Q)."""
    tile, bh, _ = program_tile_and_head(HEADS_FIRST)
    start_m = tile * BLOCK_M
    o_head = head_matrix(O, bh // H, bh % H, stride_ob, stride_oh, stride_on, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D, False)
    do_head = head_matrix(dO, bh // H, bh % H, stride_dob, stride_doh, stride_don, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D,
                          False)
    rows = start_m + tl.arange(0, BLOCK_M)
    o_tile = load_tile(o_head, start_m, BLOCK_M, HEAD_DIM, BLOCK_D, False)
    do_tile = load_tile(do_head, start_m, BLOCK_M, HEAD_DIM, BLOCK_D, False)
    delta = tl.sum(o_tile.to(tl.float32) * do_tile.to(tl.float32), 1)
    tl.store(DELTA + bh * N_Q + rows, delta, mask=rows < N_Q)


@triton.jit
def _dkdv_query_tiles(dk, dv, k_tile, v_tile, cols, q_head, do_head, LSE, DELTA, bounds, mask, qk_scale,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, USE_TMA: tl.constexpr):
    """Add to the dK, dV of key tile `cols` the query tiles of one query head in bounds, (start,
    full_start, full_end, end): a masked run, a full run, a masked run. Everything is transposed
    (keys along rows) so the accumulators keep the K/V tile's shape."""
    BLOCK_D: tl.constexpr = k_tile.shape[1]
    N_Q, _, _, _ = mask
    for run in tl.static_range(3):  # masked, full, masked
        for tile_start in range(bounds[run], bounds[run + 1], BLOCK_M):
            rows = tile_start + tl.arange(0, BLOCK_M)
            q_tile = load_tile(q_head, tile_start, BLOCK_M, HEAD_DIM, BLOCK_D, USE_TMA)
            do_tile = load_tile(do_head, tile_start, BLOCK_M, HEAD_DIM, BLOCK_D, USE_TMA)
            # Rows past N_Q read lse = +inf, so their probabilities are exactly 0 and need no mask.
            # lse in base 2, like the scores (as m_i is in the forward).
            lse = tl.load(LSE + rows, mask=rows < N_Q, other=float("inf")) * LOG2_E
            delta = tl.load(DELTA + rows, mask=rows < N_Q, other=0.0)
            p_t = tl.exp2(tl.dot(k_tile, tl.trans(q_tile)) * qk_scale - lse[None, :])  # P^T, (BLOCK_N, BLOCK_M)
            if run != 1:
                p_t = tl.where(visible_in_tile_tl(rows[None, :], cols[:, None], mask), p_t, 0.0)
            dv += tl.dot(p_t.to(do_tile.dtype), do_tile)
            dp_t = tl.dot(v_tile, tl.trans(do_tile))
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q_tile.dtype), q_tile)
    return dk, dv


@triton.jit
def _dq_key_tiles(dq, q_tile, do_tile, lse, delta, rows, k_head, v_head, bounds, mask, qk_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr):
    """Add to the dQ of query rows `rows` the key tiles in bounds, with the forward's runs."""
    BLOCK_D: tl.constexpr = q_tile.shape[1]
    for run in tl.static_range(3):  # masked, full, masked
        for tile_start in range(bounds[run], bounds[run + 1], BLOCK_N):
            k_tile = load_tile(k_head, tile_start, BLOCK_N, HEAD_DIM, BLOCK_D, USE_TMA)
            v_tile = load_tile(v_head, tile_start, BLOCK_N, HEAD_DIM, BLOCK_D, USE_TMA)
            p = tl.exp2(tl.dot(q_tile, tl.trans(k_tile)) * qk_scale - lse[:, None])
            if run != 1:
                cols = tile_start + tl.arange(0, BLOCK_N)
                p = tl.where(visible_in_tile_tl(rows[:, None], cols[None, :], mask), p, 0.0)
            dp = tl.dot(do_tile, tl.trans(v_tile))
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k_tile.dtype), k_tile)
    return dq


def backward_smem_rows(config):
    """Per job, the tile pair a program keeps resident and the pair each pipeline stage streams."""
    tile_m, tile_n, dkdv_tile_m = (config.kwargs[name] for name in ("BLOCK_M", "BLOCK_N", "DKDV_BLOCK_M"))
    return [(2 * tile_m, 2 * tile_n),  # dQ: Q and dO resident, K and V streamed
            (2 * tile_n, 2 * dkdv_tile_m)]  # dK, dV: K and V resident, Q and dO streamed


# Best first: the tuner times the first three that fit the card (launch.fitting_configs). BLOCK_M
# is the query tile a dQ program holds, DKDV_BLOCK_M the one a dK/dV program streams. On the H200
# the first was the fastest on the model's short sequences, the second and third on the paper's
# longer ones; the last ones fit wide heads in 99 KB.
BACKWARD_CONFIGS = [
    triton.Config(dict(BLOCK_M=64, BLOCK_N=64, DKDV_BLOCK_M=32, USE_TMA=False), num_warps=4, num_stages=2),
    triton.Config(dict(BLOCK_M=64, BLOCK_N=64, DKDV_BLOCK_M=32, USE_TMA=True), num_warps=4, num_stages=3),
    triton.Config(dict(BLOCK_M=64, BLOCK_N=64, DKDV_BLOCK_M=64, USE_TMA=True), num_warps=4, num_stages=3),
    triton.Config(dict(BLOCK_M=64, BLOCK_N=64, DKDV_BLOCK_M=64, USE_TMA=True), num_warps=4, num_stages=2),
    triton.Config(dict(BLOCK_M=64, BLOCK_N=32, DKDV_BLOCK_M=64, USE_TMA=False), num_warps=4, num_stages=2),
    triton.Config(dict(BLOCK_M=64, BLOCK_N=64, DKDV_BLOCK_M=64, USE_TMA=False), num_warps=4, num_stages=2),
    triton.Config(dict(BLOCK_M=64, BLOCK_N=32, DKDV_BLOCK_M=32, USE_TMA=False), num_warps=4, num_stages=2),
    triton.Config(dict(BLOCK_M=64, BLOCK_N=64, DKDV_BLOCK_M=64, USE_TMA=False), num_warps=4, num_stages=3),
    triton.Config(dict(BLOCK_M=128, BLOCK_N=64, DKDV_BLOCK_M=64, USE_TMA=True), num_warps=8, num_stages=2),
    triton.Config(dict(BLOCK_M=64, BLOCK_N=16, DKDV_BLOCK_M=16, USE_TMA=False), num_warps=4, num_stages=2),
    triton.Config(dict(BLOCK_M=16, BLOCK_N=16, DKDV_BLOCK_M=16, USE_TMA=False), num_warps=4, num_stages=2),
]


@autotuned(BACKWARD_CONFIGS, backward_smem_rows, key=["N_Q", "N_K", "H", "GROUP", "left", "right", "HEAD_DIM"])
@triton.jit
def _attn_bwd(Q, K, V, dO, dQ, dK, dV, LSE, DELTA,
              stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
              stride_dqb, stride_dqh, stride_dqn, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
              H, GROUP, N_Q, N_K, left, right, qk_scale, sm_scale,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEADS_FIRST: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DKDV_BLOCK_M: tl.constexpr, USE_TMA: tl.constexpr):
    """The grid's head axis runs over (batch, kv head); its tile axis over that kv head's key
    tiles (dK/dV jobs), then the query tiles of its GROUP query heads (dQ jobs, the heads of one
    query tile side by side, so they read the same K and V tiles at about the same time). Key
    tiles have BLOCK_N rows in both jobs; query tiles BLOCK_M rows where a dQ program holds one,
    DKDV_BLOCK_M where a dK/dV program streams them (each job has its best)."""
    tile, b_kv, tiles = program_tile_and_head(HEADS_FIRST)
    b, kv_head = b_kv // (H // GROUP), b_kv % (H // GROUP)
    mask = (N_Q, N_K, left, right)
    key_tiles = tl.cdiv(N_K, BLOCK_N)
    if tile < key_tiles:
        # The dK/dV job: the key tile from start_n of (b, kv_head).
        start_n = tile * BLOCK_N
        k_head = head_matrix(K, b, kv_head, stride_kb, stride_kh, stride_kn, N_K, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
        v_head = head_matrix(V, b, kv_head, stride_vb, stride_vh, stride_vn, N_K, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
        cols = start_n + tl.arange(0, BLOCK_N)
        k_tile = load_tile(k_head, start_n, BLOCK_N, HEAD_DIM, BLOCK_D, USE_TMA)  # keys past N_K: zeros, never stored
        v_tile = load_tile(v_head, start_n, BLOCK_N, HEAD_DIM, BLOCK_D, USE_TMA)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        bounds = query_tile_bounds_tl(start_n, mask, DKDV_BLOCK_M, BLOCK_N)
        for g in range(GROUP):  # a kv head's dK and dV add up the parts of every query head that reads it
            h = kv_head * GROUP + g
            q_head = head_matrix(Q, b, h, stride_qb, stride_qh, stride_qn, N_Q, HEAD_DIM, DKDV_BLOCK_M, BLOCK_D,
                                 USE_TMA)
            do_head = head_matrix(dO, b, h, stride_dob, stride_doh, stride_don, N_Q, HEAD_DIM, DKDV_BLOCK_M, BLOCK_D,
                                  USE_TMA)
            lse, delta = LSE + (b * H + h) * N_Q, DELTA + (b * H + h) * N_Q
            dk, dv = _dkdv_query_tiles(dk, dv, k_tile, v_tile, cols, q_head, do_head, lse, delta, bounds, mask,
                                       qk_scale, HEAD_DIM, DKDV_BLOCK_M, USE_TMA)
        dk_head = head_matrix(dK, b, kv_head, stride_dkb, stride_dkh, stride_dkn, N_K, HEAD_DIM, BLOCK_N, BLOCK_D,
                              USE_TMA)
        dv_head = head_matrix(dV, b, kv_head, stride_dvb, stride_dvh, stride_dvn, N_K, HEAD_DIM, BLOCK_N, BLOCK_D,
                              USE_TMA)
        store_tile(dk_head, start_n, dk * sm_scale, BLOCK_N, HEAD_DIM, BLOCK_D, USE_TMA)
        store_tile(dv_head, start_n, dv, BLOCK_N, HEAD_DIM, BLOCK_D, USE_TMA)
    else:
        # The dQ job: the query tile from start_m of (b, h), with the forward's schedule.
        job = tile - key_tiles
        start_m = query_tile_start(job // GROUP, (tiles - key_tiles) // GROUP, BLOCK_M)
        h = kv_head * GROUP + job % GROUP
        k_head = head_matrix(K, b, h // GROUP, stride_kb, stride_kh, stride_kn, N_K, HEAD_DIM, BLOCK_N, BLOCK_D,
                             USE_TMA)
        v_head = head_matrix(V, b, h // GROUP, stride_vb, stride_vh, stride_vn, N_K, HEAD_DIM, BLOCK_N, BLOCK_D,
                             USE_TMA)
        q_head = head_matrix(Q, b, h, stride_qb, stride_qh, stride_qn, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        do_head = head_matrix(dO, b, h, stride_dob, stride_doh, stride_don, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        rows = start_m + tl.arange(0, BLOCK_M)
        q_tile = load_tile(q_head, start_m, BLOCK_M, HEAD_DIM, BLOCK_D, USE_TMA)
        do_tile = load_tile(do_head, start_m, BLOCK_M, HEAD_DIM, BLOCK_D, USE_TMA)
        lse = tl.load(LSE + (b * H + h) * N_Q + rows, mask=rows < N_Q, other=float("inf")) * LOG2_E  # base 2
        delta = tl.load(DELTA + (b * H + h) * N_Q + rows, mask=rows < N_Q, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        bounds = key_tile_bounds_tl(start_m, mask, BLOCK_M, BLOCK_N)
        dq = _dq_key_tiles(dq, q_tile, do_tile, lse, delta, rows, k_head, v_head, bounds, mask, qk_scale, HEAD_DIM,
                           BLOCK_N, USE_TMA)
        dq_head = head_matrix(dQ, b, h, stride_dqb, stride_dqh, stride_dqn, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        store_tile(dq_head, start_m, dq * sm_scale, BLOCK_M, HEAD_DIM, BLOCK_D, USE_TMA)


def flash_backward(q, k, v, o, do, lse, is_causal=False, window_size=(-1, -1), config=None):
    """dq, dk, dv of O = attention(q, k, v) given do, for q, o, do (B, H, N_q, D), k, v
    (B, H_kv, N_k, D) (fewer dims are read as leading ones) and the forward's lse. Each gradient
    is laid out in its input's memory order and shaped (B, H, N, D). config: a triton.Config of
    _attn_bwd's, to bypass the tuner and the Hopper kernel (tests, bench.py)."""
    dq, dk, dv = (new_like(as_4d(t)) for t in (q, k, v))
    q, k, v, o, do = (descriptor_ready(t) for t in (q, k, v, o, do))
    B, H, N_Q, D = q.shape
    H_KV, N_K = k.shape[1], k.shape[2]
    lse = lse.reshape(B, H, N_Q).contiguous()
    if INTERPRETING and q.dtype == torch.bfloat16:  # as in flash_forward: the interpreter's bf16 dot is wrong
        grads = flash_backward(q.float(), k.float(), v.float(), o.float(), do.float(), lse, is_causal, window_size,
                               config)
        return tuple(g.copy_(g32) for g, g32 in zip((dq, dk, dv), grads))
    if q.numel() * N_K == 0:  # no query or no key: every gradient is zero
        return dq.zero_(), dk.zero_(), dv.zero_()
    left, right = window_bounds(is_causal, window_size)
    go_heads_first = heads_first(k, B * H)
    delta = torch.empty((B, H, N_Q), dtype=torch.float32, device=q.device)
    set_tma_scratch_allocator()
    _attn_bwd_delta[program_grid(triton.cdiv(N_Q, 64), B * H, go_heads_first)](
        o, do, delta, *o.stride()[:3], *do.stride()[:3], H, N_Q,
        HEAD_DIM=D, BLOCK_D=head_dim_block(D), HEADS_FIRST=go_heads_first, BLOCK_M=64, num_warps=4)
    if config is None and hopper_backward.serves(q, k, left, right):
        hopper_backward.launch(q, k, v, do, lse, delta, left, right, dq, dk, dv)
        return dq, dk, dv
    group = H // H_KV
    # Per (batch, kv head): its key tiles, then its GROUP heads' query tiles (see _attn_bwd).
    grid = lambda meta: program_grid(triton.cdiv(N_K, meta["BLOCK_N"]) + group * triton.cdiv(N_Q, meta["BLOCK_M"]),
                                     B * H_KV, go_heads_first)
    kernel, config_args = (_attn_bwd, {}) if config is None else (_attn_bwd.fn, config.all_kwargs())
    kernel[grid](q, k, v, do, dq, dk, dv, lse, delta, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                 *do.stride()[:3], *dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
                 H, group, N_Q, N_K, left, right, D ** -0.5 * LOG2_E.value, D ** -0.5,
                 HEAD_DIM=D, BLOCK_D=head_dim_block(D), HEADS_FIRST=go_heads_first, **config_args)
    return dq, dk, dv
