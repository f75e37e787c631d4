"""The FlashAttention forward for Hopper (sm_90) at head dim 128, warp-specialised, in Gluon.

triton_forward.py's kernel leaves the schedule to Triton's compiler: every warp loads, multiplies
and computes the softmax in turn. Here the program spells it out, as FlashAttention-3 does, in
Gluon (triton.experimental.gluon), Triton's lower-level language, where a kernel chooses its
own layouts, shared-memory buffers, barriers and warp roles:

- One program owns 2 * BLOCK_M query rows of one (batch, head), in three partitions.
- The load partition (one warp) streams K and V tiles through TMA into a ring of STAGES
  shared-memory slots. Each slot has three mbarriers: k_ready and v_ready (the copy landed) and
  kv_empty (both softmax partitions are done with it).
- Two softmax partitions (a warpgroup each) own BLOCK_M query rows each. Each runs
  triton_forward.py's online softmax over the same K/V tiles on its own, with the tensor cores'
  asynchronous warpgroup MMA (wgmma). While one waits for its matrix multiply, the warp
  scheduler runs the other's exponentials: FlashAttention-3's ping-pong, here left to the
  hardware, without named barriers forcing the two to alternate.

flash_forward (triton_forward.py) sends a call here when serves() says so. That is only where
this kernel measured faster than triton_forward.py's on the H200: head dim 128 and at least
MIN_KEYS keys (docs/optimisation.md, "Warp specialisation in Gluon"). It computes what
_attn_fwd computes: O, and the logsumexp lse that the backward reads.
"""
import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)

from .triton_launch import GRID_Y_LIMIT, INTERPRETING, set_tma_scratch_allocator
from .triton_tiles import LN_2, LOG2_E

SERVED_HEAD_DIM = 128
MIN_KEYS = 2048
# BLOCK_M query rows per softmax partition, BLOCK_N keys per tile, STAGES ring slots; registers
# per thread: the softmax warpgroups need many, the loader few. The best of those the probe timed.
CONFIG = dict(BLOCK_M=64, BLOCK_N=128, STAGES=2, SOFTMAX_REGISTERS=232, LOAD_REGISTERS=24)

# The TMA copies are named async_copy_global_to_shared / async_copy_shared_to_global in Triton 3.6
# and async_load / async_store in later releases.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


def serves(q, k):
    """Whether flash_forward runs this kernel for q, k: 16-bit, head dim 128, MIN_KEYS keys or
    more, a grid within CUDA's y limit, compiled (not interpreted) for a Hopper card."""
    return (q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] == SERVED_HEAD_DIM and k.shape[2] >= MIN_KEYS
            and q.shape[0] * q.shape[1] <= GRID_Y_LIMIT and not INTERPRETING and is_hopper(q.device))


@functools.cache
def is_hopper(device):
    """sm_90 exactly: wgmma, which the kernel is built on, is Hopper's alone."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


@gluon.jit
def _head_matrix(T, bh, H, stride_b, stride_h, stride_n, N, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr):
    """triton_tiles.head_matrix's TMA case: the (N, HEAD_DIM) matrix of batch-head bh, in tiles of BLOCK rows."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, HEAD_DIM], T.dtype.element_ty)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)
    return tma.make_tensor_descriptor(T + b * stride_b + h * stride_h, shape=[N, HEAD_DIM], strides=[stride_n, 1],
                                      block_shape=[BLOCK, HEAD_DIM], layout=layout)


# A partition's arguments reach it as tensors, constants included, so each partition reads its
# tile sizes off the shapes of its shared-memory buffers.

@gluon.jit
def _load_partition(Q, K, V, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, start_m, n_tiles):
    """One warp: the two query tiles once, then key tile j's K and V into ring slot j % STAGES."""
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    BLOCK_N: gl.constexpr = k_bufs.shape[1]
    STAGES: gl.constexpr = k_bufs.shape[0]
    for half in gl.static_range(2):
        mbarrier.expect(q_ready.index(half), Q.block_type.nbytes)
        tma_load(Q, [start_m + half * BLOCK_M, 0], q_ready.index(half), q_smem.index(half))
    for j in range(n_tiles):
        slot = j % STAGES
        # Wait for both softmax partitions to release the slot's previous tile. An mbarrier's
        # phase flips each time it completes; waiting on the phase before the first passes at
        # once, so the first lap through the ring does not wait.
        mbarrier.wait(kv_empty.index(slot), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(slot), K.block_type.nbytes)
        tma_load(K, [j * BLOCK_N, 0], k_ready.index(slot), k_bufs.index(slot))
        mbarrier.expect(v_ready.index(slot), V.block_type.nbytes)
        tma_load(V, [j * BLOCK_N, 0], v_ready.index(slot), v_bufs.index(slot))


@gluon.jit
def _key_tiles(acc, l_i, m_i, q_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty, first, last, rows, N_K, diagonal,
               qk_scale, MASKED: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """triton_forward._fwd_key_tiles with the ring: the online-softmax update over key tiles
    [first, last), tile j read from slot j % STAGES and released once P V is done with it."""
    BLOCK_M: gl.constexpr = q_tile.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[1]
    STAGES: gl.constexpr = k_bufs.shape[0]
    # P goes into the second matrix multiply from registers, in the layout wgmma reads its A operand in.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    no_scores = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    for j in range(first, last):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        s = warpgroup_mma(q_tile, k_bufs.index(slot).permute((1, 0)), no_scores, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        if MASKED:  # keys past N_K, and after the row's own when causal (diagonal = 0; N_K otherwise)
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where((cols[None, :] < N_K) & (cols[None, :] <= rows[:, None] + diagonal), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)  # running max of base-2 logits
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        mbarrier.wait(v_ready.index(slot), phase)
        acc = warpgroup_mma(gl.convert_layout(p.to(q_tile.dtype), p_layout), v_bufs.index(slot), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(kv_empty.index(slot), count=1)
        m_i = m_new
    return acc, l_i, m_i


@gluon.jit
def _softmax_partition(O, LSE, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, bh, start_m, n_unmasked,
                       n_tiles, N_Q, N_K, diagonal, qk_scale, HALF: gl.constexpr):
    """One warpgroup: query rows [start_m + HALF * BLOCK_M, + BLOCK_M) against the program's
    key tiles, then their O (through TMA) and lse."""
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    BLOCK_N: gl.constexpr = k_bufs.shape[1]
    # Where wgmma leaves its results: 4 warps down the rows, instructions 16 rows by a tile's width.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    row_start = start_m + HALF * BLOCK_M
    rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    q_tile = q_smem.index(HALF)
    mbarrier.wait(q_ready.index(HALF), 0)
    acc, l_i, m_i = _key_tiles(acc, l_i, m_i, q_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty, 0, n_unmasked, rows,
                               N_K, diagonal, qk_scale, False, s_layout, o_layout)
    acc, l_i, m_i = _key_tiles(acc, l_i, m_i, q_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty, n_unmasked, n_tiles,
                               rows, N_K, diagonal, qk_scale, True, s_layout, o_layout)
    # Normalise once. The query tile's buffer is free now: O leaves through it (TMA drops rows past N_Q).
    o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    q_tile.store(o.to(q_tile.dtype))
    fence_async_shared()
    tma_store(O, [row_start, 0], q_tile)
    lse = (m_i + gl.log2(l_i)) * LN_2  # back to natural log
    gl.store(LSE + bh * N_Q + rows, lse, mask=rows < N_Q)
    tma.store_wait(pendings=0)


@gluon.jit
def _first_half(O, LSE, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, bh, start_m, n_unmasked, n_tiles,
                N_Q, N_K, diagonal, qk_scale):
    _softmax_partition(O, LSE, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, bh, start_m, n_unmasked,
                       n_tiles, N_Q, N_K, diagonal, qk_scale, 0)


@gluon.jit
def _second_half(O, LSE, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, bh, start_m, n_unmasked, n_tiles,
                 N_Q, N_K, diagonal, qk_scale):
    _softmax_partition(O, LSE, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, bh, start_m, n_unmasked,
                       n_tiles, N_Q, N_K, diagonal, qk_scale, 1)


@gluon.jit
def _attn_fwd_warp_specialized(Q, K, V, O, LSE,
                               stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                               stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
                               H, N_Q, N_K, qk_scale,
                               IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SOFTMAX_REGISTERS: gl.constexpr,
                               LOAD_REGISTERS: gl.constexpr):
    tile, bh, tiles = gl.program_id(0), gl.program_id(1), gl.num_programs(0)
    if IS_CAUSAL:  # the query tiles with the most keys first (triton_tiles.query_tile_start)
        tile = tiles - 1 - tile
    start_m = tile * 2 * BLOCK_M
    q_matrix = _head_matrix(Q, bh, H, stride_qb, stride_qh, stride_qn, N_Q, BLOCK_M, HEAD_DIM)
    k_matrix = _head_matrix(K, bh, H, stride_kb, stride_kh, stride_kn, N_K, BLOCK_N, HEAD_DIM)
    v_matrix = _head_matrix(V, bh, H, stride_vb, stride_vh, stride_vn, N_K, BLOCK_N, HEAD_DIM)
    o_matrix = _head_matrix(O, bh, H, stride_ob, stride_oh, stride_on, N_Q, BLOCK_M, HEAD_DIM)

    # Key tiles [0, n_unmasked) need no mask for any of the program's rows; [n_unmasked, n_tiles) do.
    n_tiles = gl.cdiv(N_K, BLOCK_N)
    n_unmasked = N_K // BLOCK_N
    diagonal = N_K
    if IS_CAUSAL:
        n_tiles = gl.minimum(n_tiles, gl.cdiv(start_m + 2 * BLOCK_M, BLOCK_N))
        n_unmasked = gl.minimum(n_unmasked, (start_m + 1) // BLOCK_N)
        diagonal = 0

    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2, BLOCK_M, HEAD_DIM], q_matrix.layout)
    k_bufs = gl.allocate_shared_memory(K.dtype.element_ty, [STAGES, BLOCK_N, HEAD_DIM], k_matrix.layout)
    v_bufs = gl.allocate_shared_memory(V.dtype.element_ty, [STAGES, BLOCK_N, HEAD_DIM], v_matrix.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for half in gl.static_range(2):
        mbarrier.init(q_ready.index(half), count=1)
    for slot in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(slot), count=1)
        mbarrier.init(v_ready.index(slot), count=1)
        mbarrier.init(kv_empty.index(slot), count=2)  # one arrival from each softmax partition

    softmax_args = (o_matrix, LSE, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, bh, start_m,
                    n_unmasked, n_tiles, N_Q, N_K, diagonal, qk_scale)
    load_args = (q_matrix, k_matrix, v_matrix, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, start_m,
                 n_tiles)
    # The first partition runs in the kernel's own num_warps = 4 warps; the others in theirs.
    gl.warp_specialize([(_first_half, softmax_args), (_second_half, softmax_args), (_load_partition, load_args)],
                       [4, 1], [SOFTMAX_REGISTERS, LOAD_REGISTERS])


def gluon_forward(q, k, v, o, lse, is_causal):
    """flash_forward's contract: q, k, v (B, H, N, D) descriptor-ready views; writes O into o
    (descriptor-ready) and lse into lse (B, H, N_q) float32 contiguous."""
    B, H, N_Q, D = q.shape
    set_tma_scratch_allocator()
    grid = (triton.cdiv(N_Q, 2 * CONFIG["BLOCK_M"]), B * H)
    _attn_fwd_warp_specialized[grid](q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                                     *o.stride()[:3], H, N_Q, k.shape[2], D ** -0.5 * LOG2_E, IS_CAUSAL=is_causal,
                                     HEAD_DIM=D, **CONFIG, num_warps=4)
