"""The FlashAttention forward for Hopper (sm_90), warp-specialised and persistent, in Gluon
(docs/hopper.md walks through it).

triton_forward.py's kernel leaves the schedule to Triton's compiler: every warp loads,
multiplies and computes the softmax in turn. Here the program spells it out, as
FlashAttention-3 does, in Gluon, Triton's lower-level language, where a kernel chooses its own
layouts, shared-memory buffers, barriers and warp roles:

- One program per SM takes units of work in turn (persistent). A unit is a pair of query
  tiles of one (batch, head), each 2 * BLOCK_M rows: tile t and its mirror T - 1 - t, which
  causal have T + 1 key tiles between them whatever t is: every unit is the same work.
- The load partition (one warp) loads each query tile's Q, then streams its K and V tiles
  through TMA into a ring of STAGES slots (mbarriers k_ready, v_ready, kv_empty per slot). Q
  has two buffers per half, so the next query tile's Q and first K/V tiles load while this
  one's keys are still read: a program pays the loads' latency once, not once a query tile.
- Two softmax partitions (a warpgroup each) own BLOCK_M query rows each and run
  triton_forward.py's online softmax on the tensor cores' asynchronous wgmma; while one waits
  for its matrix multiply, the warp scheduler runs the other's exponentials (FlashAttention-3's
  ping-pong, left to the hardware). With SCORES_AHEAD each also issues the next key tile's
  S = Q K^T with the current P V, waiting for the tensor cores once per key tile, not twice.

flash_forward sends a call here when serves() says so: where this kernel measured faster than
triton_forward.py's on the H200 (docs/optimisation.md). It computes what _attn_fwd computes:
O, and the logsumexp lse that the backward reads.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)

from ..launch import cdiv, set_tma_scratch_allocator
from ..masks import key_tile_counts_gl, visible_in_tile_gl
from ..triton_tiles import LN_2, LOG2_E
from .common import hopper_entry, load_into_ring, ring_slot, sm_count, tensor_matrices, tma_load, tma_store

# The (head dim, causal) calls this kernel measured faster on, and its constants for each:
# BLOCK_M query rows per softmax partition, BLOCK_N keys per tile, STAGES ring slots, and
# SCORES_AHEAD, whether a step issues the next key tile's scores with P V (_key_tiles).
TILES = {(128, False): dict(BLOCK_M=64, BLOCK_N=128, STAGES=2, SCORES_AHEAD=True),
         (128, True): dict(BLOCK_M=64, BLOCK_N=128, STAGES=2, SCORES_AHEAD=True),
         (64, False): dict(BLOCK_M=64, BLOCK_N=256, STAGES=2, SCORES_AHEAD=False),
         (64, True): dict(BLOCK_M=64, BLOCK_N=128, STAGES=2, SCORES_AHEAD=True)}
# The fewest keys it serves each from: the shortest length measured, or at head dim 64 causal
# the shortest where it was compared with triton_forward.py's kernel (faster at 1,024).
MIN_KEYS = {(128, False): 256, (128, True): 256, (64, False): 256, (64, True): 1024}
# Registers per thread: the softmax warpgroups need many, the loader few.
REGISTERS = dict(SOFTMAX_REGISTERS=232, LOAD_REGISTERS=24)

def serves(q, k, left, right):
    """Whether flash_forward runs this kernel (common.hopper_entry with this file's TILES and MIN_KEYS)."""
    return hopper_entry(q, k, left, right, TILES, MIN_KEYS)


@gluon.jit
def _unit(unit, n_pairs, n_query_tiles, H, TILE_ROWS: gl.constexpr):
    """Unit of work `unit` (n_pairs per batch-head): its batch, head, and the first rows of its
    two query tiles, the mirror (T - 1 - t) first, then tile t. With an odd number of tiles the
    middle one is its own mirror, and both rows are the same. The loader and the softmax
    partitions walk the units through this one function, so they agree on the order."""
    bh = unit // n_pairs
    pair = unit % n_pairs
    return bh // H, bh % H, (n_query_tiles - 1 - pair) * TILE_ROWS, pair * TILE_ROWS


@gluon.jit
def _q_buffer(tiles_done, half):
    """Where the program's query tile number tiles_done keeps its half `half` of Q: buffer
    (tiles_done % 2) * 2 + half, and the phase of that buffer's mbarriers for this tile (each
    buffer serves every other tile)."""
    return (tiles_done % 2) * 2 + half, (tiles_done // 2) & 1


# The partitions share their shared memory as two bundles, each a tuple (as Triton's Gluon
# tutorials pass theirs): q_slots = (q_smem, q_ready, q_empty), the four halves of Q a program
# keeps (_q_buffer) and their mbarriers, and kv_ring = (k_bufs, v_bufs, k_ready, v_ready,
# kv_empty), the ring of K and V tiles (common.load_into_ring); the softmax partitions' outputs
# go as out = (O's descriptor, LSE). Each partition reads its tile sizes off the shapes of its
# buffers. Its other constants (IS_CAUSAL, HALF, SCORES_AHEAD) come in
# its arguments, which stay compile-time only as written in the warp_specialize call
# (_attn_fwd_warp_specialized).

@gluon.jit
def _load_query_tile(Q, K, V, q_slots, kv_ring, b, h, start_m, N_K, ring, tiles_done, IS_CAUSAL: gl.constexpr):
    """The loader's part of one query tile: its two halves of Q into the buffers of query tile
    tiles_done % 2, once the softmax partitions have let go of the tile before; then key tile
    j's K and V into ring slot ring % STAGES."""
    q_smem, q_ready, q_empty = q_slots
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    BLOCK_N: gl.constexpr = kv_ring[0].shape[3]
    _, n_tiles = key_tile_counts_gl(start_m, N_K, IS_CAUSAL, 2 * BLOCK_M, BLOCK_N)
    for half in gl.static_range(2):
        q_buf, q_phase = _q_buffer(tiles_done, half)
        # The first wait on an "empty" barrier passes at once, as in common.load_into_ring.
        mbarrier.wait(q_empty.index(q_buf), q_phase ^ 1)
        mbarrier.expect(q_ready.index(q_buf), Q.block_type.nbytes)
        tma_load(Q, [b, h, start_m + half * BLOCK_M, 0], q_ready.index(q_buf), q_smem.index(q_buf))
    for j in range(n_tiles):
        load_into_ring(K, V, kv_ring, ring, b, h, j * BLOCK_N)
        ring += 1
    return ring, tiles_done + 1


@gluon.jit
def _load_partition(Q, K, V, q_slots, kv_ring, n_units, n_pairs, n_query_tiles, H, N_K, IS_CAUSAL: gl.constexpr):
    """One warp: the program's units in turn, each query tile's loads (_load_query_tile)."""
    BLOCK_M: gl.constexpr = q_slots[0].shape[3]
    ring = 0
    tiles_done = 0
    for unit in range(gl.program_id(0), n_units, gl.num_programs(0)):
        b, h, mirror_start, start = _unit(unit, n_pairs, n_query_tiles, H, 2 * BLOCK_M)
        ring, tiles_done = _load_query_tile(Q, K, V, q_slots, kv_ring, b, h, mirror_start, N_K, ring, tiles_done,
                                            IS_CAUSAL)
        if start != mirror_start:
            ring, tiles_done = _load_query_tile(Q, K, V, q_slots, kv_ring, b, h, start, N_K, ring, tiles_done,
                                                IS_CAUSAL)


@gluon.jit
def _issue_scores(q_tile, kv_ring, index, no_scores):
    """Start S = Q K^T on the tensor cores for the key tile at ring position `index`, once its K
    has landed. The caller waits for it (warpgroup_mma_wait)."""
    k_bufs, _, k_ready, _, _ = kv_ring
    STAGES: gl.constexpr = k_bufs.shape[0]
    slot, phase = ring_slot(index, STAGES)
    k_tile = k_bufs.index(slot).reshape([k_bufs.shape[3], k_bufs.shape[4]])
    mbarrier.wait(k_ready.index(slot), phase)
    return warpgroup_mma(q_tile, k_tile.permute((1, 0)), no_scores, use_acc=False, is_async=True)


@gluon.jit
def online_softmax_update(acc, l_i, m_i, s, qk_scale):
    """triton_forward.online_softmax_update up to its product P V, which the caller issues on
    the tensor cores (asynchronously): fold one tile of raw scores s into the running max m_i
    (base-2 logits) and sum l_i, rescale acc to the new max, and return P with the three. The
    Triton update's guard for a row that has seen no key is not needed: under the two masks
    these kernels take, every row sees key 0, in the first tile it visits."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)  # <= 1: rescales the sums taken against the old, smaller maximum
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    return p, acc, l_i, m_new


@gluon.jit
def _key_tiles(acc, l_i, m_i, s, q_tile, kv_ring, first, last, n_tiles, ring, rows, N_K, qk_scale,
               IS_CAUSAL: gl.constexpr, MASKED: gl.constexpr, SCORES_AHEAD: gl.constexpr):
    """triton_forward._key_tiles with the ring: the online-softmax update over key tiles
    [first, last) of the query tile's n_tiles, tile j read from slot (ring + j) % STAGES and
    released once P V is done with it. A step waits for the tensor cores twice, for S_j and for
    P_j V_j. With SCORES_AHEAD it issues tile j + 1's scores right after P_j V_j and waits once
    for both, so the tensor cores run the two back to back; s comes in holding tile first's."""
    k_bufs, v_bufs, _, v_ready, kv_empty = kv_ring
    s_layout: gl.constexpr = s.type.layout
    o_layout: gl.constexpr = acc.type.layout
    BLOCK_M: gl.constexpr = q_tile.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    HEAD_DIM: gl.constexpr = k_bufs.shape[4]
    STAGES: gl.constexpr = k_bufs.shape[0]
    # P goes into the second matrix multiply from registers, in the layout wgmma reads its A operand in.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    no_scores = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    for j in range(first, last):
        slot, phase = ring_slot(ring + j, STAGES)
        v_tile = v_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])
        if not SCORES_AHEAD:
            s = _issue_scores(q_tile, kv_ring, ring + j, no_scores)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        if MASKED:  # keys past N_K, and after the row's own when causal
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where(visible_in_tile_gl(rows[:, None], cols[None, :], N_K, IS_CAUSAL), s, float("-inf"))
        p, acc, l_i, m_i = online_softmax_update(acc, l_i, m_i, s, qk_scale)
        mbarrier.wait(v_ready.index(slot), phase)
        pv = warpgroup_mma(gl.convert_layout(p.to(q_tile.dtype), p_layout), v_tile, acc, is_async=True)
        if SCORES_AHEAD and j + 1 < n_tiles:
            s_next = _issue_scores(q_tile, kv_ring, ring + j + 1, no_scores)
            acc, s = warpgroup_mma_wait(num_outstanding=0, deps=(pv, s_next))
        else:  # s keeps its stale value: a new one here measured slower (docs/optimisation.md)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
        mbarrier.arrive(kv_empty.index(slot), count=1)
    return acc, l_i, m_i, s


@gluon.jit
def _softmax_query_tile(out, q_slots, o_smem, kv_ring, b, h, H, start_m, N_Q, N_K, qk_scale, ring, tiles_done,
                        IS_CAUSAL: gl.constexpr, HALF: gl.constexpr, SCORES_AHEAD: gl.constexpr):
    """One softmax partition's part of one query tile: rows [start_m + HALF * BLOCK_M, + BLOCK_M)
    against the tile's key tiles, then their O (through TMA, out[0]) and lse (out[1])."""
    O, LSE = out
    q_smem, q_ready, q_empty = q_slots
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    HEAD_DIM: gl.constexpr = q_smem.shape[4]
    BLOCK_N: gl.constexpr = kv_ring[0].shape[3]
    # Where wgmma leaves its results: 4 warps down the rows, instructions 16 rows by a tile's width.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    n_unmasked, n_tiles = key_tile_counts_gl(start_m, N_K, IS_CAUSAL, 2 * BLOCK_M, BLOCK_N)
    row_start = start_m + HALF * BLOCK_M
    rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    q_buf, q_phase = _q_buffer(tiles_done, HALF)
    q_tile = q_smem.index(q_buf).reshape([BLOCK_M, HEAD_DIM])
    mbarrier.wait(q_ready.index(q_buf), q_phase)
    if SCORES_AHEAD:  # the first key tile's scores; each step of _key_tiles issues the next one's
        s = _issue_scores(q_tile, kv_ring, ring, s)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    acc, l_i, m_i, s = _key_tiles(acc, l_i, m_i, s, q_tile, kv_ring, 0, n_unmasked, n_tiles, ring, rows, N_K, qk_scale,
                                  IS_CAUSAL, False, SCORES_AHEAD)
    acc, l_i, m_i, s = _key_tiles(acc, l_i, m_i, s, q_tile, kv_ring, n_unmasked, n_tiles, n_tiles, ring, rows, N_K,
                                  qk_scale, IS_CAUSAL, True, SCORES_AHEAD)
    mbarrier.arrive(q_empty.index(q_buf), count=1)  # the loader may bring the tile after next's Q
    # Normalise once. O leaves through its own buffer, once the previous tile's O has left it.
    o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    tma.store_wait(pendings=0)
    o_tile = o_smem.index(HALF)
    o_tile.reshape([BLOCK_M, HEAD_DIM]).store(o.to(o_smem.dtype))
    fence_async_shared()
    tma_store(O, [b, h, row_start, 0], o_tile)
    lse = (m_i + gl.log2(l_i)) * LN_2  # back to natural log
    gl.store(LSE + (b * H + h) * N_Q + rows, lse, mask=rows < N_Q)
    return ring + n_tiles, tiles_done + 1


@gluon.jit
def _softmax_partition(out, q_slots, o_smem, kv_ring, n_units, n_pairs, n_query_tiles, H, N_Q, N_K, qk_scale,
                       IS_CAUSAL: gl.constexpr, HALF: gl.constexpr, SCORES_AHEAD: gl.constexpr):
    """One warpgroup: the program's units in turn, as the loader takes them (_load_partition)."""
    BLOCK_M: gl.constexpr = q_slots[0].shape[3]
    ring = 0
    tiles_done = 0
    for unit in range(gl.program_id(0), n_units, gl.num_programs(0)):
        b, h, mirror_start, start = _unit(unit, n_pairs, n_query_tiles, H, 2 * BLOCK_M)
        ring, tiles_done = _softmax_query_tile(out, q_slots, o_smem, kv_ring, b, h, H, mirror_start, N_Q, N_K,
                                               qk_scale, ring, tiles_done, IS_CAUSAL, HALF, SCORES_AHEAD)
        if start != mirror_start:
            ring, tiles_done = _softmax_query_tile(out, q_slots, o_smem, kv_ring, b, h, H, start, N_Q, N_K, qk_scale,
                                                   ring, tiles_done, IS_CAUSAL, HALF, SCORES_AHEAD)
    tma.store_wait(pendings=0)


@gluon.jit
def _attn_fwd_warp_specialized(Q, K, V, O, LSE,
                               stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                               stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
                               B, H, N_Q, N_K, qk_scale,
                               IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SCORES_AHEAD: gl.constexpr,
                               SOFTMAX_REGISTERS: gl.constexpr, LOAD_REGISTERS: gl.constexpr):
    q_matrices = tensor_matrices(Q, B, H, N_Q, stride_qb, stride_qh, stride_qn, BLOCK_M, HEAD_DIM)
    k_matrices = tensor_matrices(K, B, H, N_K, stride_kb, stride_kh, stride_kn, BLOCK_N, HEAD_DIM)
    v_matrices = tensor_matrices(V, B, H, N_K, stride_vb, stride_vh, stride_vn, BLOCK_N, HEAD_DIM)
    o_matrices = tensor_matrices(O, B, H, N_Q, stride_ob, stride_oh, stride_on, BLOCK_M, HEAD_DIM)
    n_query_tiles = gl.cdiv(N_Q, 2 * BLOCK_M)
    n_pairs = gl.cdiv(n_query_tiles, 2)
    n_units = B * H * n_pairs

    # Q: two query tiles' halves (_q_buffer), so that the loader brings the next tile's while this
    # one's keys are still being read.
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [4, 1, 1, BLOCK_M, HEAD_DIM], q_matrices.layout)
    o_smem = gl.allocate_shared_memory(O.dtype.element_ty, [2, 1, 1, BLOCK_M, HEAD_DIM], o_matrices.layout)
    k_bufs = gl.allocate_shared_memory(K.dtype.element_ty, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_matrices.layout)
    v_bufs = gl.allocate_shared_memory(V.dtype.element_ty, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_matrices.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for q_buf in gl.static_range(4):
        mbarrier.init(q_ready.index(q_buf), count=1)
        mbarrier.init(q_empty.index(q_buf), count=1)
    for slot in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(slot), count=1)
        mbarrier.init(v_ready.index(slot), count=1)
        mbarrier.init(kv_empty.index(slot), count=2)  # one arrival from each softmax partition

    out = (o_matrices, LSE)
    q_slots = (q_smem, q_ready, q_empty)
    kv_ring = (k_bufs, v_bufs, k_ready, v_ready, kv_empty)

    # The argument tuples are written in the call: a tuple assigned to a name first turns its
    # constants into runtime values (the bundles above hold none), and the partitions would then
    # compile both sides of every branch on them. The first partition runs in the kernel's own
    # num_warps = 4 warps; the others in theirs.
    gl.warp_specialize([
        (_softmax_partition, (out, q_slots, o_smem, kv_ring, n_units, n_pairs, n_query_tiles, H, N_Q, N_K, qk_scale,
                              IS_CAUSAL, 0, SCORES_AHEAD)),
        (_softmax_partition, (out, q_slots, o_smem, kv_ring, n_units, n_pairs, n_query_tiles, H, N_Q, N_K, qk_scale,
                              IS_CAUSAL, 1, SCORES_AHEAD)),
        (_load_partition, (q_matrices, k_matrices, v_matrices, q_slots, kv_ring, n_units, n_pairs, n_query_tiles, H,
                           N_K, IS_CAUSAL)),
    ], [4, 1], [SOFTMAX_REGISTERS, LOAD_REGISTERS])


def launch(q, k, v, o, lse, is_causal):
    """flash_forward's contract: q, k, v (B, H, N, D) descriptor-ready views; writes O into o
    (descriptor-ready) and lse into lse (B, H, N_q) float32 contiguous."""
    B, H, N_Q, D = q.shape
    tiles = TILES[D, is_causal]
    set_tma_scratch_allocator()
    units = B * H * cdiv(cdiv(N_Q, 2 * tiles["BLOCK_M"]), 2)
    grid = (min(units, sm_count(q.device)),)
    _attn_fwd_warp_specialized[grid](q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                                     *o.stride()[:3], B, H, N_Q, k.shape[2], D ** -0.5 * LOG2_E.value,
                                     IS_CAUSAL=is_causal, HEAD_DIM=D, **tiles, **REGISTERS, num_warps=4)
