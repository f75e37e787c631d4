"""Decoding attention in Triton: one new token per sequence against a static KV cache, split-KV
(Flash-Decoding) with a kv head's whole query group served from one read of the cache.

A decode step reads the whole cache once and does little arithmetic on it: its speed is the
memory's. Two things keep the memory busy:
- Grouped-query heads: the G query heads of a kv head are the rows of one q_tile (G padded to
  BLOCK_G >= 16, the smallest tl.dot takes), so each K and V tile is loaded once for all of them
  and the scores are a tensor-core product, not a multiply-and-sum per query head.
- Splits: the cache's rows are cut into n_splits ranges of SPLIT_ROWS rows (whole tiles), one
  program each, so that a batch of few sequences and kv heads still gives every SM work.

_decode_split: one program per (batch, kv head, split). It stores the new token's k and v at
row pos of the caches (the split whose range holds row pos does), then runs triton_forward.py's
online softmax over the cached rows of its range that the window sees, [pos - left, pos), in
tiles of BLOCK_N rows; the split holding row pos starts from the token's own key, already in
registers. Every row it reads is below pos, the one it writes: the store needs no barrier. It
writes a partial output o_split (normalised, float32) and its log-sum-exp lse_split; a split
that sees no key (all its rows past pos, or before the window) writes o_split = 0 and
lse_split = -inf.
_merge_splits: one program per (batch, query head) combines them with the online softmax's own
rescaling: O = sum_j exp(lse_j - lse_max) o_j / sum_j exp(lse_j - lse_max).
With one split the partial output is the output: the host points the first kernel at O and
launches no merge.

pos is read from memory: the host never learns it, and the split count comes from static
shapes alone (the cache's length S, not pos), so the launches are the same at every step and a
CUDA graph replays them while the cache fills. decode.py's tiled_decode_splits and merge_splits
are the twin in PyTorch, with the same names and split and tile bounds.
"""
import math

import torch
import triton
import triton.language as tl

from .launch import INTERPRETING, check_kernel_device, head_dim_block, kernels_may_load, power_of_2_at_least
from .triton_forward import online_softmax_update
from .triton_tiles import LN_2, LOG2_E


@triton.jit
def _decode_split(Q, K, V, K_CACHE, V_CACHE, O_SPLIT, LSE_SPLIT, POS,
                  stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                  stride_kcb, stride_kch, stride_kcn, stride_vcb, stride_vch, stride_vcn,
                  stride_osb, stride_osh, stride_oss, stride_lsb, stride_lsh, stride_lss,
                  H_KV, GROUP, N_CACHE, SPLIT_ROWS, left, qk_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    b = (tl.program_id(0) // H_KV).to(tl.int64)
    kv_head = (tl.program_id(0) % H_KV).to(tl.int64)
    split = tl.program_id(1)
    # The new token's position, clamped into the cache: a bad value never writes or reads outside
    # it (decode.check_position refuses one wherever the host can read it).
    pos = tl.minimum(tl.maximum(tl.load(POS).to(tl.int32), 0), N_CACHE - 1)
    dims = tl.arange(0, BLOCK_D)
    in_head = dims < HEAD_DIM  # the head dim padded to BLOCK_D
    group = tl.arange(0, BLOCK_G)
    in_group = group < GROUP  # the group padded to BLOCK_G rows: zero queries, never stored
    heads = kv_head * GROUP + group  # the query heads of this kv head
    q_tile = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                     mask=in_group[:, None] & in_head[None, :], other=0.0)
    k_row = tl.load(K + b * stride_kb + kv_head * stride_kh + dims, mask=in_head, other=0.0)
    v_row = tl.load(V + b * stride_vb + kv_head * stride_vh + dims, mask=in_head, other=0.0)
    K_CACHE += b * stride_kcb + kv_head * stride_kch
    V_CACHE += b * stride_vcb + kv_head * stride_vch

    split_start = split * SPLIT_ROWS
    split_end = split_start + SPLIT_ROWS
    holds_token = (split_start <= pos) & (pos < split_end)
    if holds_token:  # one program per kv head stores its key and value
        tl.store(K_CACHE + pos * stride_kcn + dims, k_row, mask=in_head)
        tl.store(V_CACHE + pos * stride_vcn + dims, v_row, mask=in_head)

    # The split holding row pos starts from the token's own key: its logit is the first running
    # max, its weight exp2(0) = 1. The others start having seen no key (m_i = -inf, l_i = 0).
    s_token = tl.sum(q_tile.to(tl.float32) * k_row.to(tl.float32)[None, :], 1)  # (BLOCK_G,) raw scores
    m_i = tl.where(holds_token, s_token * qk_scale, float("-inf"))  # running max of base-2 logits
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32) + tl.where(holds_token, 1.0, 0.0)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32) + tl.where(holds_token, v_row.to(tl.float32), 0.0)[None, :]

    # Then the cached keys of the split the window sees, [first, end), all below pos. Tiles are
    # whole tiles of the split (the twin's); those with no key in [first, end) are skipped.
    first = tl.maximum(tl.maximum(pos - left, 0), split_start)
    end = tl.minimum(pos, split_end)
    for tile_start in range(first // BLOCK_N * BLOCK_N, end, BLOCK_N):
        rows = tile_start + tl.arange(0, BLOCK_N)
        seen = (rows >= first) & (rows < end)
        mask = seen[:, None] & in_head[None, :]  # rows outside it are never loaded: a stale NaN stays out
        k_tile = tl.load(K_CACHE + rows[:, None] * stride_kcn + dims[None, :], mask=mask, other=0.0)
        s = tl.dot(q_tile, tl.trans(k_tile))  # raw scores, (BLOCK_G, BLOCK_N)
        s = tl.where(seen[None, :], s, float("-inf"))
        v_tile = tl.load(V_CACHE + rows[:, None] * stride_vcn + dims[None, :], mask=mask, other=0.0)
        # MASKED: a split without the token has seen no key before its first tile.
        acc, l_i, m_i = online_softmax_update(acc, l_i, m_i, s, v_tile, qk_scale, True)

    # A split that saw no key keeps l_i = 0: o_split = 0, lse_split = -inf (weight 0 in the merge).
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse_split = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * LN_2)  # natural log, as the forward's
    o_split = acc / l_safe[:, None]
    tl.store(O_SPLIT + b * stride_osb + heads[:, None] * stride_osh + split * stride_oss + dims[None, :],
             o_split.to(O_SPLIT.dtype.element_ty), mask=in_group[:, None] & in_head[None, :])
    tl.store(LSE_SPLIT + b * stride_lsb + heads * stride_lsh + split * stride_lss, lse_split, mask=in_group)


@triton.jit
def _merge_splits(O_SPLIT, LSE_SPLIT, O,
                  stride_osb, stride_osh, stride_oss, stride_lsb, stride_lsh, stride_lss, stride_ob, stride_oh,
                  H, N_SPLITS, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = (tl.program_id(0) // H).to(tl.int64)
    h = (tl.program_id(0) % H).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    in_splits = splits < N_SPLITS
    lse_split = tl.load(LSE_SPLIT + b * stride_lsb + h * stride_lsh + splits * stride_lss, mask=in_splits,
                        other=float("-inf"))
    lse_max = tl.max(lse_split, 0)  # finite: the split holding row pos saw the token's key
    # Each split's softmax sum, relative to the largest: the online softmax's alpha, one split at a time.
    weights = tl.exp2((lse_split - lse_max) * LOG2_E)
    o_split = tl.load(O_SPLIT + b * stride_osb + h * stride_osh + splits[:, None] * stride_oss + dims[None, :],
                      mask=in_splits[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    o = tl.sum(weights[:, None] * o_split, 0) / tl.sum(weights, 0)
    tl.store(O + b * stride_ob + h * stride_oh + dims, o.to(O.dtype.element_ty), mask=dims < HEAD_DIM)


# One fixed config rather than a tuned one: tuning would time candidates at the first call of
# each shape, which must never happen inside a CUDA graph capture. A K or V tile is 16 KB (64
# keys at D=128 in 16 bits): with 3 stages two tiles of K and of V are in flight, 64 KB of
# shared memory, under Ada's 99 KB at every head dim and element size.
DECODE_TILE_BYTES = 16384
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3
MAX_SPLITS = 64  # the merge holds every split's row of O in registers
ADA_SM_COUNT = 56  # the RTX 4070 Super's SMs: what the interpreter assumes


def decode_block_n(head_dim, element_size):
    """Rows of a K or V tile: DECODE_TILE_BYTES of them, 16 to 256 rows."""
    return min(256, max(16, DECODE_TILE_BYTES // (head_dim_block(head_dim) * element_size)))


def decode_splits(programs, n_tiles, n_sms):
    """How many splits to cut a cache of n_tiles tiles into, for `programs` (batch, kv head)
    pairs on a card of n_sms SMs: FlashAttention-2's num_splits_heuristic (flash_api.cpp), which
    counts two programs an SM. None when the pairs already fill 80% of that, or the cache is 4
    tiles or fewer (FlashAttention-3's rule: a merge launch costs more than it saves). Else the
    fewest splits whose last wave is at least 85% as full as the best count's, among counts that
    change the tiles per split."""
    slots = 2 * n_sms
    if programs >= 0.8 * slots or n_tiles <= 4:
        return 1
    tiles_per_split = lambda n: math.ceil(n_tiles / n)
    candidates = [n for n in range(1, min(MAX_SPLITS, slots, n_tiles) + 1)
                  if n == 1 or tiles_per_split(n) != tiles_per_split(n - 1)]
    waves = lambda n: programs * n / slots
    efficiency = {n: waves(n) / math.ceil(waves(n)) for n in candidates}
    best = max(efficiency.values())
    n_splits = next(n for n in candidates if efficiency[n] >= 0.85 * best)
    return math.ceil(n_tiles / tiles_per_split(n_splits))  # so that no split lies past the cache's end


def split_rows(n_cache, n_splits, block_n):
    """Rows of each split: whole tiles, the cache's tiles shared as evenly as they go."""
    return math.ceil(math.ceil(n_cache / block_n) / n_splits) * block_n


# torch.compile runs it as it traces and keeps the number: the tiled backend plans its splits
# inside a compiled decoding step, and the card's properties are nothing to trace.
@torch.compiler.assume_constant_result
def sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else ADA_SM_COUNT


def split_plan(k_cache):
    """(n_splits, block_n) for a cache (B, H_kv, S, D): from its static shape, dtype and card."""
    B, H_kv, S, D = k_cache.shape
    block_n = decode_block_n(D, k_cache.element_size())
    return decode_splits(B * H_kv, math.ceil(S / block_n), sm_count(k_cache.device)), block_n


def split_kv_decode(q, k, v, k_cache, v_cache, pos, left, n_splits, block_n):
    """Both launches: O (B, H, 1, D); k and v stored at row pos of the caches. Any split count
    and tile rows (tests choose them; the operator takes split_plan's)."""
    B, H, _, D = q.shape
    H_kv, S = k_cache.shape[1], k_cache.shape[2]
    o = q.new_empty(B, H, 1, D)
    if INTERPRETING and q.dtype == torch.bfloat16:
        # The interpreter's tl.dot is wrong on bfloat16 (numpy has no bf16): on the CPU, bf16 runs
        # in float32 on copies of the caches, then the token is stored into the caches themselves.
        o32 = split_kv_decode(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), pos, left, n_splits,
                              block_n)
        k_cache.index_copy_(2, pos, k)
        v_cache.index_copy_(2, pos, v)
        return o.copy_(o32)
    o_split = o if n_splits == 1 else torch.empty(B, H, n_splits, D, dtype=torch.float32, device=q.device)
    lse_split = torch.empty(B, H, n_splits, dtype=torch.float32, device=q.device)
    block_d = head_dim_block(D)
    _decode_split[(B * H_kv, n_splits)](
        q, k, v, k_cache, v_cache, o_split, lse_split, pos, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], *o_split.stride()[:3],
        *lse_split.stride(), H_kv, H // H_kv, S, split_rows(S, n_splits, block_n), left, D ** -0.5 * LOG2_E.value,
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_G=max(16, power_of_2_at_least(H // H_kv)), BLOCK_N=block_n,
        num_warps=DECODE_NUM_WARPS, num_stages=DECODE_NUM_STAGES)
    if n_splits > 1:
        _merge_splits[(B * H,)](o_split, lse_split, o, *o_split.stride()[:3], *lse_split.stride(), o.stride(0),
                                o.stride(1), H, n_splits, HEAD_DIM=D, BLOCK_D=block_d,
                                BLOCK_S=power_of_2_at_least(n_splits), num_warps=DECODE_NUM_WARPS)
    return o


# decode.py's arguments -> O (B, H, 1, D), k_cache and v_cache written at row pos. Declared, the
# writes are ordered by the compiler and made in place, not into a copy of each cache.
@torch.library.custom_op("nanofa2::decode_attention", mutates_args=("k_cache", "v_cache"))
def triton_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, pos: torch.Tensor, left: int) -> torch.Tensor:
    check_kernel_device(q)
    with kernels_may_load(q.device):  # sample.py captures the step; a first call may come inside it
        return split_kv_decode(q, k, v, k_cache, v_cache, pos, left, *split_plan(k_cache))


@triton_decode_attention.register_fake
def _(q, k, v, k_cache, v_cache, pos, left):
    return q.new_empty(q.shape)
