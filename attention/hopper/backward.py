"""The FlashAttention backward for Hopper (sm_90), warp-specialised, in Gluon: dK, dV and dQ in
one kernel, dQ summed by TMA's bulk reduce (docs/hopper.md walks through it).

triton_backward.py splits the backward so that every program owns its output, at seven matrix
multiplies a tile pair. Here, as FlashAttention-2 and -3 do it, one program per key tile
computes dK, dV and its key tile's share of dQ, five multiplies, and adds that share into a
float32 dQ in global memory:

- The grid is one program per (key tile of 2 * BLOCK_N keys, batch and kv head).
- The load partition (one warp) brings the key tile's K and V once, a half for each MMA
  warpgroup, then streams the Q and dO of every query tile that sees it (masks.
  query_tile_bounds_gl), the last first, of each of the GROUP query heads that read this kv head
  in turn, through a ring of STAGES slots (mbarriers q_ready, do_ready, qdo_empty per slot). A kv
  head's dK and dV add up the parts of its query heads, as triton_backward._attn_bwd's do.
- Two MMA partitions (a warpgroup each) own one half of the key tile: its dK and dV in float32
  registers. Per query tile, transposed as in triton_backward._dkdv_query_tiles:
      S^T = K Q^T, dP^T = V dO^T, P^T = exp2(S^T - lse), dS^T = P^T (dP^T - delta),
      dV += P^T dO, dK += dS^T Q.
  dQ = dS K needs both halves' dS^T: each warpgroup writes its own into one shared buffer
  (ds_ready, count 2), then computes half of dQ's columns over all 2 * BLOCK_N keys
  (FlashAttention-3's split); ds_free lets the next query tile's dS^T in.
- Each warpgroup's dQ half goes through shared memory to TMA's reduce-add, which adds it into
  dQ in float32 in the memory system, while the warpgroup goes on into its other staging
  buffer. launch() zeroes that dQ before and casts it after: a float32 copy of dQ is this
  kernel's extra memory. At the end dK (times sm_scale) and dV leave through TMA.

The last query tile first: at head dim 128 it measured faster than ascending, most of all
causal (every key tile sees the last query tile, so one head's programs start on the same rows
and walk down together), and compiles to fewer spilled registers; a few percent slower at 64.
The reduces land in any order, so two runs can differ in dQ's last bits:
torch.use_deterministic_algorithms keeps the split. flash_backward sends a call here where
serves() says so: where this kernel measured faster than the split (docs/optimisation.md).
"""
import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)

from ..launch import GRID_Y_LIMIT, cdiv, set_tma_scratch_allocator
from ..masks import query_tile_bounds_gl, tile_numbers_gl, visible_in_tile_gl
from ..triton_tiles import LOG2_E
from .common import hopper_entry, has_window, load_into_ring, ring_slot, tensor_matrices, tma_load, tma_store

# The (head dim, window) calls this kernel measured faster on (window: a window or causal,
# common.has_window; the kernel's WINDOW), and its constants for each:
# BLOCK_N keys per MMA warpgroup (the program's key tile is twice that), BLOCK_M query rows per
# streamed tile, STAGES ring slots.
TILES = {(64, False): dict(BLOCK_M=64, BLOCK_N=64, STAGES=2),
         (64, True): dict(BLOCK_M=64, BLOCK_N=64, STAGES=2),
         (128, False): dict(BLOCK_M=64, BLOCK_N=64, STAGES=2),
         (128, True): dict(BLOCK_M=64, BLOCK_N=64, STAGES=2)}
# The fewest keys it serves each from: the shortest of the lengths compared (1,024 to 16,384,
# doubling) where it was faster than the split by more than the rounds' spread.
MIN_KEYS = {(64, False): 4096, (64, True): 4096, (128, False): 2048, (128, True): 4096}
# Registers per thread: the MMA warpgroups hold dK and dV (128 at head dim 128), the loader few.
REGISTERS = dict(MMA_REGISTERS=240, LOAD_REGISTERS=24)


@builtin
def _tma_reduce_add_triton36(tensor_desc, coord, src, _semantic=None):
    """TMA's reduce-add of a shared-memory tile into global memory at coord: what later Gluon
    names tma.async_atomic_add, built here from the op Triton 3.6 has without a Gluon name."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_triton36
# Every thread of a warpgroup at one point: gl.thread_barrier in Triton 3.6, gl.barrier since.
warpgroup_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


def serves(q, k, left, right):
    """Whether flash_backward runs this kernel: common.hopper_entry with this file's TILES and
    MIN_KEYS, the batch's kv heads within the grid's y dimension, and determinism not asked for:
    its reduces land in any order, so under torch.use_deterministic_algorithms(True) the split
    runs instead."""
    return (hopper_entry(q, k, left, right, TILES, MIN_KEYS) and k.shape[0] * k.shape[1] <= GRID_Y_LIMIT
            and not torch.are_deterministic_algorithms_enabled())


def tiles_for(head_dim, left, right):
    """This kernel's constants for a call (its TILES entry)."""
    return TILES[head_dim, has_window(left, right)]


# The partitions share their shared memory as three bundles, each a tuple (as Triton's Gluon
# tutorials pass theirs): key_smem = (k_smem, v_smem, k_ready, v_ready), the program's key tile,
# both halves of K and of V in one buffer each, and each half's mbarrier; ring = (q_bufs, do_bufs,
# q_ready, do_ready, qdo_empty), the ring of Q and dO tiles (common.load_into_ring); dq_bufs =
# (ds_smem, dq_smem, ds_ready, ds_free), dQ's product: both warpgroups' dS^T, their dQ staging
# buffers, and the mbarriers of dS^T. The mask goes as masks.py's tuple (N_Q, N_K, left, right).
# Each partition reads its tile sizes off the shapes of its buffers; its other constants (HALF,
# WINDOW) stay compile-time as written in the warp_specialize call.

@gluon.jit
def _program_key_tile(H, GROUP, BLOCK_N: gl.constexpr):
    """The program's batch, kv head and first key (of 2 * BLOCK_N) from its place in the grid."""
    H_KV = H // GROUP
    return gl.program_id(1) // H_KV, gl.program_id(1) % H_KV, gl.program_id(0) * 2 * BLOCK_N


@gluon.jit
def _query_tile_numbers(start_n, mask, BLOCK_M: gl.constexpr, KEY_ROWS: gl.constexpr):
    """(first, full_first, full_last, last): the query tiles that see the key tile of KEY_ROWS keys
    from start_n, in tile numbers (masks.query_tile_bounds_gl's run)."""
    return tile_numbers_gl(query_tile_bounds_gl(start_n, mask, BLOCK_M, KEY_ROWS), BLOCK_M)


@gluon.jit
def query_tile_visited(u, tiles, GROUP):
    """(g, m): the query head (the g-th of the kv head's GROUP) and the query tile of a program's
    u-th visit (from 0), tiles = (first, full_first, full_last, last) (_query_tile_numbers):
    first every head's full tiles, head by head, the last first; then every head's masked ones,
    head by head, the last first: a window's left edge [full_last, last), then the diagonal
    [first, full_first). Two flat loops, over the full visits and the masked ones
    (_mma_partition), keep the kernel's code (and registers) to two loop bodies. The loader and
    the MMA partitions both ask here, so they agree on the order."""
    first, full_first, full_last, last = tiles
    n_full = full_last - full_first
    n_masked = last - first - n_full
    if u < GROUP * n_full:
        g = u // n_full
        m = full_last - 1 - u % n_full
    else:
        g = (u - GROUP * n_full) // n_masked
        m = last - 1 - (u - GROUP * n_full) % n_masked
        if m < full_last:
            m -= n_full
    return g, m


@gluon.jit
def _load_partition(Q, K, V, dO, key_smem, ring, H, GROUP, mask):
    """One warp: the key tile's two halves of K and V, then the query tiles that see them, of
    every query head of the kv head, in query_tile_visited's order: the u-th one's Q and dO into
    ring slot u % STAGES."""
    k_smem, v_smem, k_ready, v_ready = key_smem
    BLOCK_N: gl.constexpr = k_smem.shape[2] // 2
    BLOCK_M: gl.constexpr = ring[0].shape[3]
    b, kv_head, start_n = _program_key_tile(H, GROUP, BLOCK_N)
    for half in gl.static_range(2):
        mbarrier.expect(k_ready.index(half), K.block_type.nbytes)
        tma_load(K, [b, kv_head, start_n + half * BLOCK_N, 0], k_ready.index(half),
                 k_smem.slice(half * BLOCK_N, BLOCK_N, dim=2))
        mbarrier.expect(v_ready.index(half), V.block_type.nbytes)
        tma_load(V, [b, kv_head, start_n + half * BLOCK_N, 0], v_ready.index(half),
                 v_smem.slice(half * BLOCK_N, BLOCK_N, dim=2))
    tiles = _query_tile_numbers(start_n, mask, BLOCK_M, 2 * BLOCK_N)
    for u in range(0, GROUP * (tiles[3] - tiles[0])):
        g, m = query_tile_visited(u, tiles, GROUP)
        load_into_ring(Q, dO, ring, u, b, kv_head * GROUP + g, m * BLOCK_M)


@gluon.jit
def _query_tiles(dk, dv, key_tile, ring, dq_bufs, stats, DQ, heads, tiles, visits, mask, scales,
                 HALF: gl.constexpr, MASKED: gl.constexpr, WINDOW: gl.constexpr):
    """One MMA warpgroup over the program's visits [begin, end) = visits, the u-th one's query
    head and tile query_tile_visited(u, tiles, GROUP), streamed u-th (_load_partition's order):
    dK and dV of its half of the keys, key_tile = (k_tile, v_tile, k_cols, keys), and dQ's
    columns HALF of the program's whole key tile (k_cols), reduced into DQ. stats = (LSE,
    DELTA), heads = (b, kv_head, H, GROUP), scales = (qk_scale, sm_scale)."""
    k_tile, v_tile, k_cols, keys = key_tile
    q_bufs, do_bufs, q_ready, do_ready, qdo_empty = ring
    ds_smem, dq_smem, ds_ready, ds_free = dq_bufs
    LSE, DELTA = stats
    b, kv_head, H, GROUP = heads
    qk_scale, sm_scale = scales
    N_Q = mask[0]
    begin, end = visits
    s_layout: gl.constexpr = keys.type.layout.parent
    acc_layout: gl.constexpr = dk.type.layout
    BLOCK_M: gl.constexpr = q_bufs.shape[3]
    HEAD_DIM: gl.constexpr = q_bufs.shape[4]
    BLOCK_N: gl.constexpr = k_tile.shape[0]
    STAGES: gl.constexpr = q_bufs.shape[0]
    # P^T goes into its product from registers, in the layout wgmma reads its A operand in.
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM // 2, 16])
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # one query row a thread
    no_scores = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    ds_own = ds_smem.slice(HALF * BLOCK_N, BLOCK_N, dim=0)  # this warpgroup's keys' rows of dS^T
    for i in range(begin, end):
        g, m = query_tile_visited(i, tiles, GROUP)
        h = kv_head * GROUP + g
        slot, phase = ring_slot(i, STAGES)
        q_tile = q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
        do_tile = do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
        # lse and delta of the tile's rows, loaded early, one a thread: along S^T's columns they
        # would hold 16 registers a thread each for the whole step. Rows past N_Q read
        # lse = +inf: P = 0 there, no mask.
        rows = m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
        lse_rows = gl.load(LSE + (b * H + h) * N_Q + rows, mask=rows < N_Q, other=float("inf"))
        delta_rows = gl.load(DELTA + (b * H + h) * N_Q + rows, mask=rows < N_Q, other=0.0)
        # S^T and dP^T both issued at once: P^T's exponentials run while dP^T finishes.
        mbarrier.wait(q_ready.index(slot), phase)
        s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), no_scores, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(slot), phase)
        dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)), no_scores, use_acc=False, is_async=True)
        s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))  # they retire in order: S^T is done
        lse = gl.convert_layout(lse_rows, gl.SliceLayout(0, s_layout)) * LOG2_E
        p_t = gl.exp2(s_t * qk_scale - lse[None, :])
        # A tile at the diagonal or a window's edge: masks.visible_in_tile_gl, transposed (the
        # query rows along S^T's columns).
        if MASKED:
            cols = m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
            p_t = gl.where(visible_in_tile_gl(cols[None, :], keys[:, None], mask, WINDOW), p_t, 0.0)
        delta = gl.convert_layout(delta_rows, gl.SliceLayout(0, s_layout))
        dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dp_t,))
        ds_t = p_t * (dp_t - delta[None, :])
        p_op = gl.convert_layout(p_t.to(q_tile.dtype), op_layout)
        mbarrier.wait(ds_free.index(0), (i & 1) ^ 1)  # both dQ products of the last tile have read dS^T
        ds_own.store(ds_t.to(q_tile.dtype))
        fence_async_shared()
        warpgroup_barrier()  # every thread's dS^T is in before the one arrival below
        mbarrier.arrive(ds_ready.index(0), count=1)
        dv = warpgroup_mma(p_op, do_tile, dv, is_async=True)
        dk = warpgroup_mma(ds_own, q_tile, dk, is_async=True)
        mbarrier.wait(ds_ready.index(0), i & 1)  # the other half's dS^T is in too
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k_cols, gl.zeros([BLOCK_M, HEAD_DIM // 2], gl.float32, dq_layout),
                           use_acc=False, is_async=True)
        # The operands among the deps: the running wgmmas read their registers, which must stay live.
        dv, dk, dq, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq, p_op))
        mbarrier.arrive(ds_free.index(0), count=1)
        mbarrier.arrive(qdo_empty.index(slot), count=1)  # this warpgroup is done with Q and dO
        # Two buffers per warpgroup, taken in turn: the reduce of two tiles back has read this one.
        dq_buf = dq_smem.index(HALF * 2 + i % 2)
        tma.store_wait(pendings=1)
        dq_buf.reshape([BLOCK_M, HEAD_DIM // 2]).store(dq * sm_scale)
        fence_async_shared()
        tma_reduce_add(DQ, [b, h, m * BLOCK_M, HALF * (HEAD_DIM // 2)], dq_buf)
    return dk, dv


@gluon.jit
def _mma_partition(dK, dV, LSE, DQ, DELTA, key_smem, ring, dq_bufs, H, GROUP, mask, qk_scale, sm_scale,
                   HALF: gl.constexpr, WINDOW: gl.constexpr):
    """One warpgroup: dK and dV of keys [start_n + HALF * BLOCK_N, + BLOCK_N) of the kv head and
    its columns of dQ, over every query tile that sees the program's key tile, of each query head
    of the kv head; then dK and dV's store."""
    k_smem, v_smem, k_ready, v_ready = key_smem
    _, _, _, ds_free = dq_bufs
    BLOCK_N: gl.constexpr = k_smem.shape[2] // 2
    HEAD_DIM: gl.constexpr = k_smem.shape[3]
    BLOCK_M: gl.constexpr = ring[0].shape[3]
    # Where wgmma leaves its results: 4 warps down the rows, instructions 16 rows by a tile's width.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    b, kv_head, start_n = _program_key_tile(H, GROUP, BLOCK_N)
    key_start = start_n + HALF * BLOCK_N
    keys = key_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    k_all = k_smem.reshape([2 * BLOCK_N, HEAD_DIM])
    k_tile = k_all.slice(HALF * BLOCK_N, BLOCK_N, dim=0)
    v_tile = v_smem.reshape([2 * BLOCK_N, HEAD_DIM]).slice(HALF * BLOCK_N, BLOCK_N, dim=0)
    k_cols = k_all.slice(HALF * (HEAD_DIM // 2), HEAD_DIM // 2, dim=1)  # dQ's product: both halves' keys
    tiles = _query_tile_numbers(start_n, mask, BLOCK_M, 2 * BLOCK_N)
    full_visits = GROUP * (tiles[2] - tiles[1])
    visits = GROUP * (tiles[3] - tiles[0])
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(k_ready.index(0), 0)  # each is used once: phase 0
    mbarrier.wait(k_ready.index(1), 0)
    mbarrier.wait(v_ready.index(HALF), 0)
    key_tile = (k_tile, v_tile, k_cols, keys)
    scales = (qk_scale, sm_scale)
    heads = (b, kv_head, H, GROUP)
    # The full visits, then the masked ones (query_tile_visited's order). Without a window every
    # query tile is full (rows past N_Q need no mask), and the masked loop is not compiled: one
    # loop body fewer, fewer registers spilled.
    dk, dv = _query_tiles(dk, dv, key_tile, ring, dq_bufs, (LSE, DELTA), DQ, heads, tiles, (0, full_visits), mask,
                          scales, HALF, False, WINDOW)
    if WINDOW:
        dk, dv = _query_tiles(dk, dv, key_tile, ring, dq_bufs, (LSE, DELTA), DQ, heads, tiles, (full_visits, visits),
                              mask, scales, HALF, True, WINDOW)
    # The other warpgroup's last dQ product reads this half's K too: wait until both are done
    # (ds_free of the last query tile; passes at once when there was none).
    mbarrier.wait(ds_free.index(0), (visits - 1) & 1)
    # Nothing reads this half's K and V any more: their buffers take dK and dV out.
    k_tile.store((dk * sm_scale).to(k_smem.dtype))
    v_tile.store(dv.to(v_smem.dtype))
    fence_async_shared()
    tma_store(dK, [b, kv_head, key_start, 0], k_smem.slice(HALF * BLOCK_N, BLOCK_N, dim=2))
    tma_store(dV, [b, kv_head, key_start, 0], v_smem.slice(HALF * BLOCK_N, BLOCK_N, dim=2))
    tma.store_wait(pendings=0)


@gluon.jit
def _attn_bwd_warp_specialized(Q, K, V, dO, dK, dV, LSE, DELTA, DQ,
                               stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                               stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                               stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                               stride_dqb, stride_dqh, stride_dqn, B, H, GROUP, N_Q, N_K, left, right, qk_scale,
                               sm_scale, WINDOW: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MMA_REGISTERS: gl.constexpr,
                               LOAD_REGISTERS: gl.constexpr):
    q_matrices = tensor_matrices(Q, B, H, N_Q, stride_qb, stride_qh, stride_qn, BLOCK_M, HEAD_DIM)
    do_matrices = tensor_matrices(dO, B, H, N_Q, stride_dob, stride_doh, stride_don, BLOCK_M, HEAD_DIM)
    H_KV = H // GROUP
    k_matrices = tensor_matrices(K, B, H_KV, N_K, stride_kb, stride_kh, stride_kn, BLOCK_N, HEAD_DIM)
    v_matrices = tensor_matrices(V, B, H_KV, N_K, stride_vb, stride_vh, stride_vn, BLOCK_N, HEAD_DIM)
    dk_matrices = tensor_matrices(dK, B, H_KV, N_K, stride_dkb, stride_dkh, stride_dkn, BLOCK_N, HEAD_DIM)
    dv_matrices = tensor_matrices(dV, B, H_KV, N_K, stride_dvb, stride_dvh, stride_dvn, BLOCK_N, HEAD_DIM)
    # dQ (float32) is reduced into in tiles of a warpgroup's half of its columns.
    dq_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_M, HEAD_DIM // 2], gl.float32)
    dq_matrices = tma.make_tensor_descriptor(DQ, shape=[B, H, N_Q, HEAD_DIM],
                                             strides=[stride_dqb, stride_dqh, stride_dqn, 1],
                                             block_shape=[1, 1, BLOCK_M, HEAD_DIM // 2], layout=dq_smem_layout)

    # K and V: both halves of the key tile in one buffer each; dK, dV (same dtype, same tile)
    # leave through them.
    k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [1, 1, 2 * BLOCK_N, HEAD_DIM], k_matrices.layout)
    v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [1, 1, 2 * BLOCK_N, HEAD_DIM], v_matrices.layout)
    q_bufs = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], q_matrices.layout)
    do_bufs = gl.allocate_shared_memory(dO.dtype.element_ty, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], do_matrices.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_N, BLOCK_M], Q.dtype.element_ty)
    ds_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2 * BLOCK_N, BLOCK_M], ds_layout)
    # dQ's staging: two buffers per MMA warpgroup (_query_tiles takes them in turn).
    dq_smem = gl.allocate_shared_memory(gl.float32, [4, 1, 1, BLOCK_M, HEAD_DIM // 2], dq_smem_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for half in gl.static_range(2):
        mbarrier.init(k_ready.index(half), count=1)
        mbarrier.init(v_ready.index(half), count=1)
    for slot in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(slot), count=1)
        mbarrier.init(do_ready.index(slot), count=1)
        mbarrier.init(qdo_empty.index(slot), count=2)  # one arrival from each MMA partition
    mbarrier.init(ds_ready.index(0), count=2)
    mbarrier.init(ds_free.index(0), count=2)

    key_smem = (k_smem, v_smem, k_ready, v_ready)
    ring = (q_bufs, do_bufs, q_ready, do_ready, qdo_empty)
    dq_bufs = (ds_smem, dq_smem, ds_ready, ds_free)
    mask = (N_Q, N_K, left, right)

    # The argument tuples are written in the call, so their constants stay compile-time
    # (forward._attn_fwd_warp_specialized says why).
    gl.warp_specialize([
        (_mma_partition, (dk_matrices, dv_matrices, LSE, dq_matrices, DELTA, key_smem, ring, dq_bufs, H, GROUP, mask,
                          qk_scale, sm_scale, 0, WINDOW)),
        (_mma_partition, (dk_matrices, dv_matrices, LSE, dq_matrices, DELTA, key_smem, ring, dq_bufs, H, GROUP, mask,
                          qk_scale, sm_scale, 1, WINDOW)),
        (_load_partition, (q_matrices, k_matrices, v_matrices, do_matrices, key_smem, ring, H, GROUP, mask)),
    ], [4, 1], [MMA_REGISTERS, LOAD_REGISTERS])


def launch(q, k, v, do, lse, delta, left, right, dq, dk, dv):
    """flash_backward's contract, given delta = rowsum(dO * O): q, do (B, H, N_q, D) and k, v,
    dk, dv (B, H_kv, N_k, D) descriptor-ready views, lse and delta (B, H, N_q) float32
    contiguous, the window's sides (masks.window_bounds). Writes dk and dv, and dq (any strides)
    from a float32 dQ the kernel reduces into."""
    B, H, N_Q, D = q.shape
    H_KV, N_K = k.shape[1], k.shape[2]
    tiles = tiles_for(D, left, right)
    dq_sum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    set_tma_scratch_allocator()
    grid = (cdiv(N_K, 2 * tiles["BLOCK_N"]), B * H_KV)
    sm_scale = D ** -0.5
    _attn_bwd_warp_specialized[grid](q, k, v, do, dk, dv, lse, delta, dq_sum, *q.stride()[:3], *k.stride()[:3],
                                     *v.stride()[:3], *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
                                     *dq_sum.stride()[:3], B, H, H // H_KV, N_Q, N_K, left, right,
                                     sm_scale * LOG2_E.value, sm_scale, WINDOW=has_window(left, right), HEAD_DIM=D,
                                     **tiles, **REGISTERS, num_warps=4)
    dq.copy_(dq_sum)
