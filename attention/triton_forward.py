"""FlashAttention-2 forward in Triton.

One program computes one query tile of one (batch, head): it keeps q_tile and the running
softmax state (m_i, l_i, acc) in registers and streams K/V tiles past them, so the
N_q x N_k score matrix never exists in memory. It writes O and the logsumexp lse once.

The softmax runs in base 2 (exp2 is one instruction; log2(e) is folded into the scale), so
m_i is a running max of base-2 logits. A program visits its key tiles in three runs
(masks.key_tile_bounds_tl): masked tiles at a window's left edge, full tiles with no mask,
masked tiles at the diagonal, a window's right edge or the end of the keys. Tiles no row of the
query tile sees are never loaded: a causal mask or a window is a bound on the loop.
Grouped-query heads are an index map: query head h reads kv head h // GROUP.

tiled.py is this file's twin in PyTorch, with the same names and tile bounds.
"""
import torch
import triton
import triton.language as tl

from .hopper import forward as hopper_forward
from .launch import (INTERPRETING, as_4d, autotuned, cdiv, check_kernel_device, descriptor_ready, head_dim_block,
                     heads_first, kernels_may_load, length_bucket, new_like, program_grid, set_tma_scratch_allocator)
from .launch_plan import Launch, plan_key, same_memory
from .masks import key_tile_bounds_tl, visible_in_tile_tl, window_bounds
from .triton_tiles import LN_2, LOG2_E, head_matrix, load_tile, program_tile_and_head, query_tile_start, store_tile


@triton.jit
def online_softmax_update(acc, l_i, m_i, s, v_tile, qk_scale, MASKED: tl.constexpr):
    """tiled.online_softmax_update: fold one tile of raw scores s (hidden ones -inf) and its
    values into the running max m_i (base-2 logits), sum l_i and unnormalised output acc. The
    scale goes where it is needed, not to the whole tile first: into the row max and inside
    exp2's argument, where scale * s - m is one fused multiply-add."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_shift = m_new
    if MASKED:  # a row that has seen no key yet: measure against 0, not -inf (exp2(-inf - -inf) is NaN)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * qk_scale - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)  # rescales the sums accumulated against the old maximum to the new one
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _key_tiles(acc, l_i, m_i, q_tile, rows, k_head, v_head, bounds, mask, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr):
    """The online-softmax update of query rows `rows` over the key tiles of bounds, (start,
    full_start, full_end, end): a masked run, a full run, a masked run. The run is a compile-time
    constant (static_range), so the full one compiles with no mask at all."""
    BLOCK_D: tl.constexpr = q_tile.shape[1]
    for run in tl.static_range(3):  # masked, full, masked
        for tile_start in range(bounds[run], bounds[run + 1], BLOCK_N):
            k_tile = load_tile(k_head, tile_start, BLOCK_N, HEAD_DIM, BLOCK_D, USE_TMA)
            s = tl.dot(q_tile, tl.trans(k_tile))  # raw scores, (BLOCK_M, BLOCK_N)
            if run != 1:
                cols = tile_start + tl.arange(0, BLOCK_N)
                s = tl.where(visible_in_tile_tl(rows[:, None], cols[None, :], mask), s, float("-inf"))
            v_tile = load_tile(v_head, tile_start, BLOCK_N, HEAD_DIM, BLOCK_D, USE_TMA)
            acc, l_i, m_i = online_softmax_update(acc, l_i, m_i, s, v_tile, qk_scale, run != 1)
    return acc, l_i, m_i


def forward_smem_rows(config):
    # One job: q_tile stays resident; each pipeline stage holds one K and one V tile.
    return [(config.kwargs["BLOCK_M"], 2 * config.kwargs["BLOCK_N"])]


def tiles(BLOCK_M, BLOCK_N, warps, stages, tma=False):
    """A config of _attn_fwd: query tiles of BLOCK_M rows against key tiles of BLOCK_N."""
    return triton.Config(dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, USE_TMA=tma), num_warps=warps, num_stages=stages)


# The tuner's candidates, best first, per card path and largest head dim (launch.candidates): it
# times the first three that fit (launch.pruned_configs). Named as launch.config_name names them.
# Ratios are FA2's time over ours on an H100 on the consumer-card path (NANOFA2_ADA=1, a
# stand-in), torch 2.11, Triton 3.6, at the FA2 paper's shapes (16k tokens a batch, hidden 2048);
# docs/optimisation.md. 128-row tiles with 4 warps (32 query rows a warp, as FA2) read each K/V
# tile from shared memory half as often as 64-row ones, but at D 128 want more than 255
# registers a thread (the scores, a 128 x 128 float32 acc, a whole K tile as an operand): they spill.
FORWARD_CONFIGS = {
    ("consumer card", 64): [
        tiles(128, 64, warps=4, stages=3),  # FA2's 32 rows a warp: 0.91-1.01x FA2 at D 64; 1.31x at 2 x 12 x 4,096 x 32
        tiles(64, 32, warps=4, stages=3),  # the model's shape, 8 x 12 x 512 x 32: 1.23x FA2
        tiles(128, 64, warps=4, stages=2),  # D 64 without a mask, within 2% of the first
        tiles(32, 16, warps=4, stages=2),  # short sequences
        tiles(16, 16, warps=4, stages=2),
    ],
    ("consumer card", 256): [
        tiles(128, 32, warps=4, stages=3),  # FA2's sm_89 tile without a mask: 0.82-0.93x FA2 at D 128
        tiles(128, 64, warps=4, stages=2),  # FA2's H100 tile: 0.78-0.90x, the best at 4k without a mask
        tiles(64, 64, warps=4, stages=2),  # FA2's sm_89 tile with a mask, 48 KB, two blocks an SM: 0.52-0.60x here
        tiles(64, 32, warps=4, stages=2),  # wide heads in 99 KB
        tiles(32, 16, warps=4, stages=2),
        tiles(16, 16, warps=4, stages=2),  # D 256 in float32
    ],
}
# Hopper: on the H200 each of the first three won somewhere; the last ones fit wide heads. The
# same list at every head dim.
FORWARD_CONFIGS["hopper", 256] = [
    tiles(64, 128, warps=4, stages=2, tma=True),  # long D=64 sequences
    tiles(128, 64, warps=4, stages=2, tma=True),  # D=128
    tiles(64, 64, warps=4, stages=3),  # the model's
    tiles(128, 64, warps=8, stages=3),
    tiles(64, 64, warps=4, stages=2, tma=True),
    tiles(64, 64, warps=4, stages=3, tma=True),
    tiles(128, 128, warps=4, stages=3, tma=True),
    tiles(128, 32, warps=4, stages=3),
    tiles(64, 32, warps=4, stages=2),
    tiles(32, 16, warps=4, stages=2),
    tiles(16, 16, warps=4, stages=2),
]


@autotuned(FORWARD_CONFIGS, forward_smem_rows, key=["N_Q_BUCKET", "N_K_BUCKET", "H", "left", "right", "HEAD_DIM"])
@triton.jit(do_not_specialize=["N_Q", "N_K"])
def _attn_fwd(Q, K, V, O, LSE,
              stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
              H, GROUP, N_Q, N_K, left, right, qk_scale, N_Q_BUCKET, N_K_BUCKET,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEADS_FIRST: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr):
    """One program: the query tile from start_m of (batch b, head h), against kv head h // GROUP.
    N_Q_BUCKET and N_K_BUCKET are only the tuner's key (launch.length_bucket)."""
    tile, bh, tiles = program_tile_and_head(HEADS_FIRST)
    start_m = query_tile_start(tile, tiles, BLOCK_M)
    b, h = bh // H, bh % H
    q_head = head_matrix(Q, b, h, stride_qb, stride_qh, stride_qn, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
    o_head = head_matrix(O, b, h, stride_ob, stride_oh, stride_on, N_Q, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
    k_head = head_matrix(K, b, h // GROUP, stride_kb, stride_kh, stride_kn, N_K, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    v_head = head_matrix(V, b, h // GROUP, stride_vb, stride_vh, stride_vn, N_K, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)

    rows = start_m + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    q_tile = load_tile(q_head, start_m, BLOCK_M, HEAD_DIM, BLOCK_D, USE_TMA)

    mask = (N_Q, N_K, left, right)
    bounds = key_tile_bounds_tl(start_m, mask, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _key_tiles(acc, l_i, m_i, q_tile, rows, k_head, v_head, bounds, mask, qk_scale, HEAD_DIM, BLOCK_N,
                               USE_TMA)

    # Normalise once, at the end. A row that saw no key keeps l_i = 0: O = 0, lse = -inf.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    store_tile(o_head, start_m, acc / l_safe[:, None], BLOCK_M, HEAD_DIM, BLOCK_D, USE_TMA)
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * LN_2)  # back to natural log
    tl.store(LSE + bh * N_Q + rows, lse, mask=rows < N_Q)


# flash_forward's launch plans (launch_plan.py): key -> (O's shape, O's strides, the launch).
PLANS = {}


def flash_forward(q, k, v, is_causal=False, window_size=(-1, -1), config=None):
    """O and lse of attention over q (B, H, N_q, D) and k, v (B, H_kv, N_k, D) (fewer dims are
    read as leading ones), any strides with unit stride along D. O comes back laid out in q's
    memory order (launch.new_like) and shaped (B, H, N_q, D); lse (B, H, N_q) float32. config: a
    triton.Config of _attn_fwd's, to bypass the tuner, the Hopper kernel and the plans (tests,
    bench.py). A layout seen before launches from its plan; the rest of this function is what
    makes one."""
    check_kernel_device(q)
    key = plan_key((q, k, v), is_causal, tuple(window_size)) if config is None else None
    plan = PLANS.get(key)
    if plan is not None:
        o_shape, o_strides, launch = plan
        o = torch.empty_strided(o_shape, o_strides, dtype=q.dtype, device=q.device)
        lse = torch.empty(o_shape[:3], dtype=torch.float32, device=q.device)
        set_tma_scratch_allocator()
        launch(q, k, v, o, lse)
        return o, lse
    o = new_like(as_4d(q))
    q4, k4, v4 = (descriptor_ready(t) for t in (q, k, v))
    B, H, N_Q, D = q4.shape
    N_K = k4.shape[2]
    lse = torch.empty((B, H, N_Q), dtype=torch.float32, device=q.device)
    if INTERPRETING and q.dtype == torch.bfloat16:
        # The interpreter's tl.dot is wrong on bfloat16 (numpy has no bf16): on the CPU, bf16 runs
        # in float32 and O is rounded to bf16 at the end.
        o32, lse = flash_forward(q4.float(), k4.float(), v4.float(), is_causal, window_size, config)
        return o.copy_(o32), lse
    if N_K == 0 or o.numel() == 0:  # no key to attend to: O = 0, lse = -inf
        return o.zero_(), lse.fill_(float("-inf"))
    left, right = window_bounds(is_causal, window_size)
    set_tma_scratch_allocator()
    if config is None and hopper_forward.serves(q4, k4, left, right):
        with kernels_may_load(q.device):
            hopper_forward.launch(q4, k4, v4, o, lse, left, right)
        return o, lse
    go_heads_first = heads_first(k4, B * H)
    grid = lambda meta: program_grid(cdiv(N_Q, meta["BLOCK_M"]), B * H, go_heads_first)
    kernel, config_args = (_attn_fwd, {}) if config is None else (_attn_fwd.fn, config.all_kwargs())
    args = (q4, k4, v4, o, lse, *q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3], *o.stride()[:3],
            H, H // k4.shape[1], N_Q, N_K, left, right, D ** -0.5 * LOG2_E.value,
            length_bucket(N_Q), length_bucket(N_K))
    constexprs = dict(HEAD_DIM=D, BLOCK_D=head_dim_block(D), HEADS_FIRST=go_heads_first)
    with kernels_may_load(q.device):
        compiled = kernel[grid](*args, **constexprs, **config_args)
    if key is not None and compiled is not None and same_memory((q, k, v), (q4, k4, v4)):
        PLANS[key] = (o.shape, o.stride(), Launch(kernel, compiled, grid, args, constexprs, n_tensors=5))
    return o, lse
