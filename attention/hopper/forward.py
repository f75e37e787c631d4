"""The FlashAttention forward for Hopper (sm_90), warp-specialised and persistent, in Gluon
(docs/hopper.md walks through it).

triton_forward.py's kernel leaves the schedule to Triton's compiler: every warp loads,
multiplies and computes the softmax in turn. Here the program spells it out, as
FlashAttention-3 does, in Gluon, Triton's lower-level language, where a kernel chooses its own
layouts, shared-memory buffers, barriers and warp roles:

- One program per SM takes units of work in turn (persistent). A unit is a pair of query
  tiles of one (batch, head), each 2 * BLOCK_M rows: tile t and its mirror T - 1 - t, which
  causal have T + 1 key tiles between them whatever t is: every unit is the same work (under a
  window every query tile has about the same work anyway).
- Grouped-query heads are an index map, as in triton_forward.py: query head h reads kv head
  h // GROUP. The heads of a group are neighbouring units, so their K and V tiles come from L2.
- The load partition (one warp) loads each query tile's Q, then streams the K and V tiles it
  sees (masks.key_tile_bounds_gl: a masked run at a window's left edge, full tiles, a masked run
  at the diagonal or the window's right edge)
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
from ..masks import key_tile_bounds_gl, tile_numbers_gl, visible_in_tile_gl
from ..triton_tiles import LN_2, LOG2_E
from .common import hopper_entry, has_window, load_into_ring, ring_slot, sm_count, tensor_matrices, tma_load, tma_store

# The (head dim, window) calls this kernel measured faster on, window meaning a window or causal
# (common.has_window; the kernel's WINDOW), and its constants for each:
# BLOCK_M query rows per softmax partition, BLOCK_N keys per tile, STAGES ring slots, and
# SCORES_AHEAD, whether a step issues the next key tile's scores with P V (_key_tiles).
TILES = {(128, False): dict(BLOCK_M=64, BLOCK_N=128, STAGES=2, SCORES_AHEAD=True),
         (128, True): dict(BLOCK_M=64, BLOCK_N=128, STAGES=2, SCORES_AHEAD=True),
         (64, False): dict(BLOCK_M=64, BLOCK_N=256, STAGES=2, SCORES_AHEAD=False),
         (64, True): dict(BLOCK_M=64, BLOCK_N=128, STAGES=2, SCORES_AHEAD=True)}
# The fewest keys it serves each from: the shortest length measured, or at head dim 64 causal
# the shortest where it was compared with triton_forward.py's kernel (faster at 1,024). A window
# takes its mask's entry.
MIN_KEYS = {(128, False): 256, (128, True): 256, (64, False): 256, (64, True): 1024}
# Registers per thread: the softmax warpgroups need many, the loader few.
REGISTERS = dict(SOFTMAX_REGISTERS=232, LOAD_REGISTERS=24)

def serves(q, k, left, right):
    """Whether flash_forward runs this kernel (common.hopper_entry with this file's TILES and MIN_KEYS)."""
    return hopper_entry(q, k, left, right, TILES, MIN_KEYS)


def tiles_for(head_dim, left, right):
    """This kernel's constants for a call (its TILES entry)."""
    return TILES[head_dim, has_window(left, right)]


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
# go as out = (O's descriptor, LSE), and the mask as masks.py's tuple (N_Q, N_K, left, right).
# Each partition reads its tile sizes off the shapes of its buffers. Its other constants (HALF,
# SCORES_AHEAD, WINDOW) come in its arguments, which stay compile-time only as written in the
# warp_specialize call (_attn_fwd_warp_specialized).

@gluon.jit
def _key_tile_numbers(start_m, mask, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """(first, full_first, full_last, last): the key tiles the query tile of ROWS rows from start_m
    visits, in tile numbers (masks.key_tile_bounds_gl's run)."""
    return tile_numbers_gl(key_tile_bounds_gl(start_m, mask, ROWS, BLOCK_N), BLOCK_N)


@gluon.jit
def key_tile_visited(t, tiles):
    """The key tile a query tile visits t-th (from 0), tiles = (first, full_first, full_last, last)
    (_key_tile_numbers): its full tiles first, then its masked ones, a window's left edge
    [first, full_first) and then [full_last, last). One loop over the full tiles and one over the
    masked ones (_softmax_query_tile) keep the kernel's code (and registers) to two loop bodies.
    The loader and the softmax partitions both ask here, so they agree on the order."""
    first, full_first, full_last, _ = tiles
    j = full_first + t
    if t >= full_last - full_first:
        j = first + t - (full_last - full_first)
        if j >= full_first:
            j += full_last - full_first
    return j


@gluon.jit
def _load_query_tile(Q, K, V, q_slots, kv_ring, b, h, kv_head, start_m, mask, ring, tiles_done):
    """The loader's part of one query tile: its two halves of Q into the buffers of query tile
    tiles_done % 2, once the softmax partitions have let go of the tile before; then the K and V
    of each key tile it sees, from kv head kv_head, into the ring's next slot."""
    q_smem, q_ready, q_empty = q_slots
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    BLOCK_N: gl.constexpr = kv_ring[0].shape[3]
    tiles = _key_tile_numbers(start_m, mask, 2 * BLOCK_M, BLOCK_N)
    for half in gl.static_range(2):
        q_buf, q_phase = _q_buffer(tiles_done, half)
        # The first wait on an "empty" barrier passes at once, as in common.load_into_ring.
        mbarrier.wait(q_empty.index(q_buf), q_phase ^ 1)
        mbarrier.expect(q_ready.index(q_buf), Q.block_type.nbytes)
        tma_load(Q, [b, h, start_m + half * BLOCK_M, 0], q_ready.index(q_buf), q_smem.index(q_buf))
    for t in range(tiles[3] - tiles[0]):
        load_into_ring(K, V, kv_ring, ring, b, kv_head, key_tile_visited(t, tiles) * BLOCK_N)
        ring += 1
    return ring, tiles_done + 1


@gluon.jit
def _load_partition(Q, K, V, q_slots, kv_ring, n_units, n_pairs, n_query_tiles, H, GROUP, mask):
    """One warp: the program's units in turn, each query tile's loads (_load_query_tile)."""
    BLOCK_M: gl.constexpr = q_slots[0].shape[3]
    ring = 0
    tiles_done = 0
    for unit in range(gl.program_id(0), n_units, gl.num_programs(0)):
        b, h, mirror_start, start = _unit(unit, n_pairs, n_query_tiles, H, 2 * BLOCK_M)
        ring, tiles_done = _load_query_tile(Q, K, V, q_slots, kv_ring, b, h, h // GROUP, mirror_start, mask, ring,
                                            tiles_done)
        if start != mirror_start:
            ring, tiles_done = _load_query_tile(Q, K, V, q_slots, kv_ring, b, h, h // GROUP, start, mask, ring,
                                                tiles_done)


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
def online_softmax_update(acc, l_i, m_i, s, qk_scale, UNSEEN_ROWS: gl.constexpr):
    """triton_forward.online_softmax_update up to its product P V, which the caller issues on
    the tensor cores (asynchronously): fold one tile of raw scores s (hidden ones -inf) into the
    running max m_i (base-2 logits) and sum l_i, rescale acc to the new max, and return P with
    the three. UNSEEN_ROWS: whether a row may have seen no key yet, which only a window's masked
    tiles allow (without one every row sees key 0 in its first tile, and the guard is not
    compiled)."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_shift = m_new
    if UNSEEN_ROWS:  # a row that has seen no key yet: measure against 0, not -inf (exp2(-inf - -inf) is NaN)
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - m_shift[:, None])
    alpha = gl.exp2(m_i - m_shift)  # <= 1: rescales the sums taken against the old, smaller maximum
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    return p, acc, l_i, m_new


@gluon.jit
def _key_tiles(acc, l_i, m_i, s, q_tile, kv_ring, tiles, visits, ring, rows, mask, qk_scale,
               MASKED: gl.constexpr, SCORES_AHEAD: gl.constexpr, WINDOW: gl.constexpr):
    """triton_forward._key_tiles with the ring: the online-softmax update over the query tile's
    visits [begin, end) (visits = (begin, end); the t-th visit is key tile key_tile_visited(t,
    tiles), read from ring position ring + t and released once P V is done with it). A step
    waits for the tensor cores twice, for S and for P V. With SCORES_AHEAD it issues the next
    visit's scores right after P V and waits once for both, so the tensor cores run the two back
    to back; s comes in holding visit begin's."""
    begin, end = visits
    n_visits = tiles[3] - tiles[0]
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
    for t in range(begin, end):
        slot, phase = ring_slot(ring + t, STAGES)
        v_tile = v_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])
        if not SCORES_AHEAD:
            s = _issue_scores(q_tile, kv_ring, ring + t, no_scores)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        if MASKED:  # keys past N_K, and outside the row's window (after the row's own when causal)
            cols = key_tile_visited(t, tiles) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where(visible_in_tile_gl(rows[:, None], cols[None, :], mask, WINDOW), s, float("-inf"))
        p, acc, l_i, m_i = online_softmax_update(acc, l_i, m_i, s, qk_scale, MASKED and WINDOW)
        mbarrier.wait(v_ready.index(slot), phase)
        pv = warpgroup_mma(gl.convert_layout(p.to(q_tile.dtype), p_layout), v_tile, acc, is_async=True)
        if SCORES_AHEAD and t + 1 < n_visits:
            s_next = _issue_scores(q_tile, kv_ring, ring + t + 1, no_scores)
            acc, s = warpgroup_mma_wait(num_outstanding=0, deps=(pv, s_next))
        else:  # s keeps its stale value: a new one here measured slower (docs/optimisation.md)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
        mbarrier.arrive(kv_empty.index(slot), count=1)
    return acc, l_i, m_i, s


@gluon.jit
def _softmax_query_tile(out, q_slots, o_smem, kv_ring, b, h, H, start_m, mask, qk_scale, ring, tiles_done,
                        HALF: gl.constexpr, SCORES_AHEAD: gl.constexpr, WINDOW: gl.constexpr):
    """One softmax partition's part of one query tile: rows [start_m + HALF * BLOCK_M, + BLOCK_M)
    against the tile's key tiles, then their O (through TMA, out[0]) and lse (out[1])."""
    O, LSE = out
    N_Q = mask[0]
    q_smem, q_ready, q_empty = q_slots
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    HEAD_DIM: gl.constexpr = q_smem.shape[4]
    BLOCK_N: gl.constexpr = kv_ring[0].shape[3]
    # Where wgmma leaves its results: 4 warps down the rows, instructions 16 rows by a tile's width.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    tiles = _key_tile_numbers(start_m, mask, 2 * BLOCK_M, BLOCK_N)
    first, full_first, full_last, last = tiles
    row_start = start_m + HALF * BLOCK_M
    rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    q_buf, q_phase = _q_buffer(tiles_done, HALF)
    q_tile = q_smem.index(q_buf).reshape([BLOCK_M, HEAD_DIM])
    mbarrier.wait(q_ready.index(q_buf), q_phase)
    if SCORES_AHEAD and first < last:  # the first key tile's scores; each step of _key_tiles issues the next one's
        s_first = _issue_scores(q_tile, kv_ring, ring, s)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_first,))
    # The full tiles, then the masked ones (a window's left edge, the diagonal or the window's
    # right edge, the end of the keys): key_tile_visited's order.
    acc, l_i, m_i, s = _key_tiles(acc, l_i, m_i, s, q_tile, kv_ring, tiles, (0, full_last - full_first), ring, rows,
                                  mask, qk_scale, False, SCORES_AHEAD, WINDOW)
    acc, l_i, m_i, s = _key_tiles(acc, l_i, m_i, s, q_tile, kv_ring, tiles, (full_last - full_first, last - first),
                                  ring, rows, mask, qk_scale, True, SCORES_AHEAD, WINDOW)
    mbarrier.arrive(q_empty.index(q_buf), count=1)  # the loader may bring the tile after next's Q
    # Normalise once. O leaves through its own buffer, once the previous tile's O has left it. A
    # row that saw no key (only a window allows one) keeps l_i = 0: O = 0, lse = -inf.
    l_safe = l_i
    if WINDOW:
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    o = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    tma.store_wait(pendings=0)
    o_tile = o_smem.index(HALF)
    o_tile.reshape([BLOCK_M, HEAD_DIM]).store(o.to(o_smem.dtype))
    fence_async_shared()
    tma_store(O, [b, h, row_start, 0], o_tile)
    lse = (m_i + gl.log2(l_safe)) * LN_2  # back to natural log
    if WINDOW:
        lse = gl.where(l_i == 0.0, float("-inf"), lse)
    gl.store(LSE + (b * H + h) * N_Q + rows, lse, mask=rows < N_Q)
    return ring + last - first, tiles_done + 1


@gluon.jit
def _softmax_partition(out, q_slots, o_smem, kv_ring, n_units, n_pairs, n_query_tiles, H, mask, qk_scale,
                       HALF: gl.constexpr, SCORES_AHEAD: gl.constexpr, WINDOW: gl.constexpr):
    """One warpgroup: the program's units in turn, as the loader takes them (_load_partition)."""
    BLOCK_M: gl.constexpr = q_slots[0].shape[3]
    ring = 0
    tiles_done = 0
    for unit in range(gl.program_id(0), n_units, gl.num_programs(0)):
        b, h, mirror_start, start = _unit(unit, n_pairs, n_query_tiles, H, 2 * BLOCK_M)
        ring, tiles_done = _softmax_query_tile(out, q_slots, o_smem, kv_ring, b, h, H, mirror_start, mask, qk_scale,
                                               ring, tiles_done, HALF, SCORES_AHEAD, WINDOW)
        if start != mirror_start:
            ring, tiles_done = _softmax_query_tile(out, q_slots, o_smem, kv_ring, b, h, H, start, mask, qk_scale, ring,
                                                   tiles_done, HALF, SCORES_AHEAD, WINDOW)
    tma.store_wait(pendings=0)


@gluon.jit
def _attn_fwd_warp_specialized(Q, K, V, O, LSE,
                               stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                               stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
                               B, H, GROUP, N_Q, N_K, left, right, qk_scale,
                               WINDOW: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SCORES_AHEAD: gl.constexpr,
                               SOFTMAX_REGISTERS: gl.constexpr, LOAD_REGISTERS: gl.constexpr):
    q_matrices = tensor_matrices(Q, B, H, N_Q, stride_qb, stride_qh, stride_qn, BLOCK_M, HEAD_DIM)
    k_matrices = tensor_matrices(K, B, H // GROUP, N_K, stride_kb, stride_kh, stride_kn, BLOCK_N, HEAD_DIM)
    v_matrices = tensor_matrices(V, B, H // GROUP, N_K, stride_vb, stride_vh, stride_vn, BLOCK_N, HEAD_DIM)
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
    mask = (N_Q, N_K, left, right)
    q_slots = (q_smem, q_ready, q_empty)
    kv_ring = (k_bufs, v_bufs, k_ready, v_ready, kv_empty)

    # The argument tuples are written in the call: a tuple assigned to a name first turns its
    # constants into runtime values (the bundles above hold none; the mask, none that a branch
    # needs), and the partitions would then
    # compile both sides of every branch on them. The first partition runs in the kernel's own
    # num_warps = 4 warps; the others in theirs.
    gl.warp_specialize([
        (_softmax_partition, (out, q_slots, o_smem, kv_ring, n_units, n_pairs, n_query_tiles, H, mask, qk_scale,
                              0, SCORES_AHEAD, WINDOW)),
        (_softmax_partition, (out, q_slots, o_smem, kv_ring, n_units, n_pairs, n_query_tiles, H, mask, qk_scale,
                              1, SCORES_AHEAD, WINDOW)),
        (_load_partition, (q_matrices, k_matrices, v_matrices, q_slots, kv_ring, n_units, n_pairs, n_query_tiles, H,
                           GROUP, mask)),
    ], [4, 1], [SOFTMAX_REGISTERS, LOAD_REGISTERS])


def launch(q, k, v, o, lse, left, right):
    """flash_forward's contract: q (B, H, N, D) and k, v (B, H_kv, N, D) descriptor-ready views, the
    window's sides (masks.window_bounds); writes O into o (descriptor-ready) and lse into lse
    (B, H, N_q) float32 contiguous."""
    B, H, N_Q, D = q.shape
    tiles = tiles_for(D, left, right)
    set_tma_scratch_allocator()
    units = B * H * cdiv(cdiv(N_Q, 2 * tiles["BLOCK_M"]), 2)
    grid = (min(units, sm_count(q.device)),)
    _attn_fwd_warp_specialized[grid](q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                                     *o.stride()[:3], B, H, H // k.shape[1], N_Q, k.shape[2], left, right,
                                     D ** -0.5 * LOG2_E.value, WINDOW=has_window(left, right), HEAD_DIM=D, **tiles,
                                     **REGISTERS, num_warps=4)
