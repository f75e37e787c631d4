"""FlashAttention-2 backward in Triton: a delta kernel, then one launch that computes dQ and
dK, dV, in one of two schedules (ATOMIC_DQ, a config key the tuner chooses by).

1. _attn_bwd_delta: delta = rowsum(dO * O) for every query row, which the jobs below need (and,
   where the atomic schedule may run, zeros for its dQ accumulator).
2. _attn_bwd: each program holds one K/V tile of one (batch, kv head) and streams past it the
   query tiles that see it, of every query head that reads this kv head (GROUP of them),
   accumulating dK and dV in float32 registers. Then dQ, one of two ways:
   - split (ATOMIC_DQ False, seven matrix multiplies a tile pair): more programs, each holding
     one query tile and streaming the K/V tiles it sees (the forward's schedule), accumulating
     its dQ. Given delta the two jobs are independent, and at the model's shapes (a few hundred
     programs, each a short loop) the GPU is far from full: launched together, their programs
     run side by side. Every program owns its output tile: no atomics, the same result on every
     run, and a kernel the tuner may run several times.
   - atomic (ATOMIC_DQ True, five, FlashAttention-2's own schedule): the dK/dV program also
     computes its key tile's share of each query tile's dQ, dS K, and adds it with relaxed
     float32 atomics into an accumulator that the delta kernel zeroed; then dQ = sm_scale times
     that, in dQ's dtype and layout. Two matrix multiplies fewer a tile pair and no dQ programs,
     for a dQ whose last bits differ from run to run (the adds land in any order).
   torch.use_deterministic_algorithms(True) keeps the tuner to the split schedule (DETERMINISTIC).

Neither schedule stores P: both recompute it from the saved logsumexp, P = exp2(S*log2e - lse*log2e).
Hopper at long sequences runs hopper/backward.py's kernel instead, which measured faster.

tiled_backward.py is this file's twin in PyTorch, with the same names and tile bounds.
"""
import torch
import triton
import triton.language as tl

from .hopper import backward as hopper_backward
from .launch import (INTERPRETING, as_4d, autotuned, candidates, cdiv, descriptor_ready, head_dim_block,
                     heads_first, kernels_may_load, length_bucket, new_like, program_grid, set_tma_scratch_allocator)
from .launch_plan import Launch, plan_key, same_memory
from .masks import key_tile_bounds_tl, query_tile_bounds_tl, visible_in_tile_tl, window_bounds
from .triton_tiles import (LOG2_E, add_tile, head_matrix, load_tile, program_tile_and_head, query_tile_start,
                           store_tile)


DELTA_BLOCK_M = 64  # the query rows of a delta program


@triton.jit(do_not_specialize=["N_Q"])
def _attn_bwd_delta(O, dO, DELTA, DQ_ACC, stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don,
                    stride_dqb, stride_dqh, stride_dqn, H, N_Q,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEADS_FIRST: tl.constexpr, BLOCK_M: tl.constexpr,
                    ZERO_DQ: tl.constexpr):
    """delta_i = dO_i . O_i for the BLOCK_M query rows of one program, stored to DELTA (B, H, N_Q);
    with ZERO_DQ, zeros to the same rows of the atomic schedule's dQ accumulator DQ_ACC (float32,
    dQ's strides), while the program is writing anyway: no launch of its own."""
    tile, bh, _ = program_tile_and_head(HEADS_FIRST)
    start_m = tile * BLOCK_M
    b, h = bh // H, bh % H
    o_head = head_matrix(O, b, h, stride_ob, stride_oh, stride_on, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D, False)
    do_head = head_matrix(dO, b, h, stride_dob, stride_doh, stride_don, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D, False)
    rows = start_m + tl.arange(0, BLOCK_M)
    o_tile = load_tile(o_head, start_m, BLOCK_M, HEAD_DIM, BLOCK_D, False)
    do_tile = load_tile(do_head, start_m, BLOCK_M, HEAD_DIM, BLOCK_D, False)
    delta = tl.sum(o_tile.to(tl.float32) * do_tile.to(tl.float32), 1)
    tl.store(DELTA + bh * N_Q + rows, delta, mask=rows < N_Q)
    if ZERO_DQ:
        dq_acc_head = head_matrix(DQ_ACC, b, h, stride_dqb, stride_dqh, stride_dqn, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D,
                                  False)
        store_tile(dq_acc_head, start_m, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), BLOCK_M, HEAD_DIM, BLOCK_D,
                   False)


@triton.jit
def _dkdv_query_tiles(dk, dv, k_tile, v_tile, cols, heads, LSE, DELTA, bounds, mask, qk_scale,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ATOMIC_DQ: tl.constexpr, USE_TMA: tl.constexpr):
    """Add to the dK, dV of key tile `cols` the query tiles of one query head in bounds, (start,
    full_start, full_end, end): a masked run, a full run, a masked run. heads = (q_head, do_head,
    dq_acc_head) of that query head; with ATOMIC_DQ, add the key tile's share of each query
    tile's dQ to dq_acc_head. Everything is transposed (keys along rows) so the accumulators keep
    the K/V tile's shape."""
    BLOCK_D: tl.constexpr = k_tile.shape[1]
    N_Q, _, _, _ = mask
    q_head, do_head, dq_acc_head = heads
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
            ds_t = (p_t * (dp_t - delta[None, :])).to(q_tile.dtype)
            dk += tl.dot(ds_t, q_tile)
            if ATOMIC_DQ:  # dS K: this key tile's share of the query tile's dQ (sm_scale comes after the sum)
                add_tile(dq_acc_head, tile_start, tl.dot(tl.trans(ds_t), k_tile), BLOCK_M, HEAD_DIM, BLOCK_D)
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
    """Per job, the rows of BLOCK_D a program keeps resident and those each pipeline stage streams."""
    tile_m, tile_n, dkdv_tile_m = (config.kwargs[name] for name in ("BLOCK_M", "BLOCK_N", "DKDV_BLOCK_M"))
    if config.kwargs["ATOMIC_DQ"]:
        # One job. As compiled for sm_89: K (dS K's operand), one more stage of Q and dO than the
        # split keeps, and at times the dS tile (counted as rows of 128); Q and dO streamed.
        return [(tile_n + 2 * dkdv_tile_m + tile_n * dkdv_tile_m // 128, 2 * dkdv_tile_m)]
    return [(2 * tile_m, 2 * tile_n),  # dQ: Q and dO resident, K and V streamed
            (2 * tile_n, 2 * dkdv_tile_m)]  # dK, dV: K and V resident, Q and dO streamed


def split(BLOCK_M, BLOCK_N, DKDV_BLOCK_M, warps, stages, tma=False):
    """A config of the split schedule: dQ programs of BLOCK_M query rows, dK/dV programs of
    BLOCK_N key rows streaming DKDV_BLOCK_M query rows at a time (each job has its best)."""
    return triton.Config(dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DKDV_BLOCK_M=DKDV_BLOCK_M, ATOMIC_DQ=False,
                              USE_TMA=tma), num_warps=warps, num_stages=stages)


def atomic(query_rows, key_rows, warps, stages):
    """A config of the atomic schedule: programs of key_rows key rows streaming query_rows query
    rows at a time (named as FlashAttention-2 names its tiles: query rows x key rows)."""
    return triton.Config(dict(BLOCK_M=query_rows, BLOCK_N=key_rows, DKDV_BLOCK_M=query_rows, ATOMIC_DQ=True,
                              USE_TMA=False), num_warps=warps, num_stages=stages)


# The tuner's candidates, best first, per card path and largest head dim (launch.candidates):
# it times the first three that fit (launch.pruned_configs), the atomic ones dropped under
# torch.use_deterministic_algorithms. Named as launch.config_name names them. Ratios are FA2's
# time over ours on an H100 on the consumer-card path (NANOFA2_ADA=1, a stand-in), torch 2.11,
# Triton 3.6, at the FA2 paper's shapes (16k tokens a batch, hidden 2048); docs/optimisation.md.
BACKWARD_CONFIGS = {
    ("consumer card", 64): [
        atomic(64, 128, warps=8, stages=2),  # FA2's own tile on an sm_89 card (72 KB there): untimed yet
        split(64, 64, 32, warps=4, stages=3),  # the split's best at D 64: 0.70-0.89x FA2
        atomic(64, 64, warps=4, stages=2),  # a smaller atomic tile, for the short sequences: untimed yet
        split(64, 64, 32, warps=4, stages=2),  # the model's shapes at D 32: 1.02x FA2 (timed where deterministic)
    ],
    ("consumer card", 256): [
        atomic(64, 64, warps=8, stages=2),  # FA2's own tile at D 128 on an sm_89 card (80 KB there): untimed yet
        split(64, 64, 64, warps=4, stages=2),  # the split's best at D 128: 0.71-0.87x FA2
        atomic(32, 64, warps=4, stages=2),  # fewer registers a thread at D 128: untimed yet
        split(64, 32, 32, warps=4, stages=2),  # wide heads in 99 KB
        split(64, 16, 16, warps=4, stages=2),
        split(16, 16, 16, warps=4, stages=2),  # D 256 in float32
    ],
}
# Hopper: on the H200 the first was the fastest on the model's short sequences, the second and
# third on the paper's longer ones (where hopper/backward.py now runs instead); the last ones fit
# wide heads. The same list at every head dim.
BACKWARD_CONFIGS["hopper", 256] = [
    split(64, 64, 32, warps=4, stages=2),
    split(64, 64, 32, warps=4, stages=3, tma=True),
    split(64, 64, 64, warps=4, stages=3, tma=True),
    split(64, 64, 64, warps=4, stages=2, tma=True),
    split(64, 32, 64, warps=4, stages=2),
    split(64, 64, 64, warps=4, stages=2),
    split(64, 32, 32, warps=4, stages=2),
    split(64, 64, 64, warps=4, stages=3),
    split(128, 64, 64, warps=8, stages=2, tma=True),
    split(64, 16, 16, warps=4, stages=2),
    split(16, 16, 16, warps=4, stages=2),
]


@autotuned(BACKWARD_CONFIGS, backward_smem_rows,
           key=["N_Q_BUCKET", "N_K_BUCKET", "H", "GROUP", "left", "right", "HEAD_DIM", "DETERMINISTIC"],
           reset_to_zero=["DQ_ACC"])
@triton.jit
def _attn_bwd(Q, K, V, dO, dQ, dK, dV, LSE, DELTA, DQ_ACC,
              stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
              stride_dqb, stride_dqh, stride_dqn, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
              H, GROUP, N_Q, N_K, left, right, qk_scale, sm_scale,
              N_Q_BUCKET, N_K_BUCKET,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEADS_FIRST: tl.constexpr, DETERMINISTIC: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DKDV_BLOCK_M: tl.constexpr, ATOMIC_DQ: tl.constexpr,
              USE_TMA: tl.constexpr):
    """The grid's head axis runs over (batch, kv head); its tile axis over that kv head's key
    tiles (dK/dV jobs), then, in the split schedule, the query tiles of its GROUP query heads (dQ
    jobs, the heads of one query tile side by side, so they read the same K and V tiles at about
    the same time). Key tiles have BLOCK_N rows in both jobs; query tiles BLOCK_M rows where a dQ
    program holds one, DKDV_BLOCK_M where a dK/dV program streams them. DQ_ACC: the atomic
    schedule's float32 dQ accumulator, laid out as dQ (its strides). N_Q_BUCKET and N_K_BUCKET
    are only the tuner's key (launch.length_bucket)."""
    tl.static_assert(not (ATOMIC_DQ and DETERMINISTIC), "the atomic schedule's dQ differs run to run")
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
            dq_acc_head = head_matrix(DQ_ACC, b, h, stride_dqb, stride_dqh, stride_dqn, N_Q, HEAD_DIM, DKDV_BLOCK_M,
                                      BLOCK_D, False)
            lse, delta = LSE + (b * H + h) * N_Q, DELTA + (b * H + h) * N_Q
            dk, dv = _dkdv_query_tiles(dk, dv, k_tile, v_tile, cols, (q_head, do_head, dq_acc_head), lse, delta, bounds,
                                       mask, qk_scale, HEAD_DIM, DKDV_BLOCK_M, ATOMIC_DQ, USE_TMA)
        dk_head = head_matrix(dK, b, kv_head, stride_dkb, stride_dkh, stride_dkn, N_K, HEAD_DIM, BLOCK_N, BLOCK_D,
                              USE_TMA)
        dv_head = head_matrix(dV, b, kv_head, stride_dvb, stride_dvh, stride_dvn, N_K, HEAD_DIM, BLOCK_N, BLOCK_D,
                              USE_TMA)
        store_tile(dk_head, start_n, dk * sm_scale, BLOCK_N, HEAD_DIM, BLOCK_D, USE_TMA)
        store_tile(dv_head, start_n, dv, BLOCK_N, HEAD_DIM, BLOCK_D, USE_TMA)
    elif not ATOMIC_DQ:
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


# flash_backward's launch plans (launch_plan.py): key -> (the gradients' shapes and strides,
# the delta launch, the dQ/dK/dV launch).
PLANS = {}


def flash_backward(q, k, v, o, do, lse, is_causal=False, window_size=(-1, -1), config=None):
    """dq, dk, dv of O = attention(q, k, v) given do, for q, o, do (B, H, N_q, D), k, v
    (B, H_kv, N_k, D) (fewer dims are read as leading ones) and the forward's lse. Each gradient
    is laid out in its input's memory order and shaped (B, H, N, D). config: a triton.Config of
    _attn_bwd's, to bypass the tuner, the Hopper kernel and the plans (tests, bench.py). Under
    torch.use_deterministic_algorithms(True) only the split schedule runs: the same bits every run.
    A layout seen before launches from its plan; the rest of this function is what makes one."""
    # Whether torch asks for determinism is in the key: it decides whether the Hopper kernel serves,
    # and whether the atomic schedule may.
    deterministic = torch.are_deterministic_algorithms_enabled()
    key = plan_key((q, k, v, o, do, lse), is_causal, tuple(window_size), deterministic) if config is None else None
    plan = PLANS.get(key)
    if plan is not None:
        layouts, acc_layout, delta_launch, launch, atomic_dq = plan
        dq, dk, dv = (torch.empty_strided(shape, strides, dtype=q.dtype, device=q.device) for shape, strides in layouts)
        dq_acc = torch.empty_strided(*acc_layout, dtype=torch.float32, device=q.device)
        delta = torch.empty(layouts[0][0][:3], dtype=torch.float32, device=q.device)
        set_tma_scratch_allocator()
        delta_launch(o, do, delta, dq_acc)
        launch(q, k, v, do, dq, dk, dv, lse, delta, dq_acc)
        if atomic_dq:  # the convert pass: dQ's scale, dtype and layout
            torch.mul(dq_acc, q.shape[-1] ** -0.5, out=dq)
        return dq, dk, dv
    dq, dk, dv = (new_like(as_4d(t)) for t in (q, k, v))
    q4, k4, v4, o4, do4 = (descriptor_ready(t) for t in (q, k, v, o, do))
    B, H, N_Q, D = q4.shape
    H_KV, N_K = k4.shape[1], k4.shape[2]
    lse4 = lse.reshape(B, H, N_Q).contiguous()
    if INTERPRETING and q.dtype == torch.bfloat16:  # as in flash_forward: the interpreter's bf16 dot is wrong
        grads = flash_backward(q4.float(), k4.float(), v4.float(), o4.float(), do4.float(), lse4, is_causal,
                               window_size, config)
        return tuple(g.copy_(g32) for g, g32 in zip((dq, dk, dv), grads))
    if q4.numel() * N_K == 0:  # no query or no key: every gradient is zero
        return dq.zero_(), dk.zero_(), dv.zero_()
    left, right = window_bounds(is_causal, window_size)
    go_heads_first = heads_first(k4, B * H)
    hopper = config is None and hopper_backward.serves(q4, k4, left, right)
    # The atomic schedule's dQ accumulator, zeroed by the delta kernel, where that schedule may run
    # (elsewhere one element, never read, which the tuner's zeroing may clear).
    may_add = not hopper and (config.kwargs["ATOMIC_DQ"] if config is not None else not deterministic and any(
        c.kwargs["ATOMIC_DQ"] for c in candidates(BACKWARD_CONFIGS, q.device, D)))
    dq_acc = (torch.empty_strided(dq.shape, dq.stride(), dtype=torch.float32, device=q.device) if may_add
              else torch.empty(1, dtype=torch.float32, device=q.device))
    delta = torch.empty((B, H, N_Q), dtype=torch.float32, device=q.device)
    set_tma_scratch_allocator()
    delta_grid = program_grid(cdiv(N_Q, DELTA_BLOCK_M), B * H, go_heads_first)
    delta_args = (o4, do4, delta, dq_acc, *o4.stride()[:3], *do4.stride()[:3], *dq.stride()[:3], H, N_Q)
    delta_constexprs = dict(HEAD_DIM=D, BLOCK_D=head_dim_block(D), HEADS_FIRST=go_heads_first, BLOCK_M=DELTA_BLOCK_M,
                            ZERO_DQ=may_add)
    with kernels_may_load(q.device):
        delta_compiled = _attn_bwd_delta[delta_grid](*delta_args, **delta_constexprs, num_warps=4)
    if hopper:
        with kernels_may_load(q.device):
            hopper_backward.launch(q4, k4, v4, do4, lse4, delta, left, right, dq, dk, dv)
        return dq, dk, dv
    group = H // H_KV
    # Per (batch, kv head): its key tiles, then, split, its GROUP heads' query tiles (see _attn_bwd).
    dq_jobs = lambda meta: 0 if meta["ATOMIC_DQ"] else group * cdiv(N_Q, meta["BLOCK_M"])
    grid = lambda meta: program_grid(cdiv(N_K, meta["BLOCK_N"]) + dq_jobs(meta), B * H_KV, go_heads_first)
    kernel, config_args = (_attn_bwd, {}) if config is None else (_attn_bwd.fn, config.all_kwargs())
    args = (q4, k4, v4, do4, dq, dk, dv, lse4, delta, dq_acc, *q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3],
            *do4.stride()[:3], *dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
            H, group, N_Q, N_K, left, right, D ** -0.5 * LOG2_E.value, D ** -0.5,
            length_bucket(N_Q), length_bucket(N_K))
    constexprs = dict(HEAD_DIM=D, BLOCK_D=head_dim_block(D), HEADS_FIRST=go_heads_first, DETERMINISTIC=deterministic)
    with kernels_may_load(q.device):
        compiled = kernel[grid](*args, **constexprs, **config_args)
    atomic_dq = (config or _attn_bwd.best_config).kwargs["ATOMIC_DQ"]
    if atomic_dq:  # the convert pass: dQ's scale, dtype and layout
        torch.mul(dq_acc, D ** -0.5, out=dq)
    if key is not None and compiled is not None and same_memory((q, k, v, o, do, lse), (q4, k4, v4, o4, do4, lse4)):
        layouts = tuple((g.shape, g.stride()) for g in (dq, dk, dv))
        PLANS[key] = (layouts, (dq_acc.shape, dq_acc.stride()),
                      Launch(_attn_bwd_delta, delta_compiled, delta_grid, delta_args, delta_constexprs, n_tensors=4),
                      Launch(kernel, compiled, grid, args, constexprs, n_tensors=10), atomic_dq)
    return dq, dk, dv
