"""Decoding attention in Triton: one new token per sequence against a static KV cache, split-KV
(Flash-Decoding) with a kv head's whole query group served from one read of the cache, in one
launch.

A decode step reads the whole cache once and does little arithmetic on it: its speed is the
memory's. Three things keep the memory busy:
- Grouped-query heads: the G query heads of a kv head are the rows of one q_tile (G padded to
  BLOCK_G >= 16, the smallest tl.dot takes), so each K and V tile is loaded once for all of them
  and the scores are a tensor-core product, not a multiply-and-sum per query head.
- Splits sized by bytes: the cache's rows are cut into n_splits ranges of SPLIT_ROWS rows (whole
  tiles), one program each, so that a batch of few sequences and kv heads still gives every SM
  PROGRAMS_PER_SM programs to overlap their loads, while no split reads fewer than
  SPLIT_MIN_BYTES (decode_splits).
- One launch: the merge of the splits is folded into the kernel. Each split program writes its
  partial output and counts itself done on its (batch, kv head)'s counter; the last one to
  finish merges them all. A separate merge launch cost a few microseconds of a step of tens.

_decode_split: one program per (batch, kv head, split). It stores the new token's k and v at
row pos of the caches (the split whose range holds row pos does), then runs triton_forward.py's
online softmax over the cached rows of its range that the window sees, [pos - left, pos) (the
mask masks.py's rules give a query at row pos over the pos keys before it), in tiles of BLOCK_N
rows; the split holding row pos starts from the token's own key, already in registers. Every row
it reads is below pos, the one it writes: the store needs no barrier. With one split it writes O.
With more it writes a partial output o_split (normalised, float32) and its log-sum-exp lse_split
(a split that sees no key writes o_split = 0 and lse_split = -inf), and the last of the splits to
finish combines them with the online softmax's own rescaling (_merge_splits):
O = sum_j exp(lse_j - lse_max) o_j / sum_j exp(lse_j - lse_max).

pos is read from memory: the host never learns it, and the split count comes from static
shapes alone (the cache's shape and dtype, and the card's SM count; never pos), so the launch is
the same at every step and a CUDA graph replays it while the cache fills. The counters are left
at zero by the merging program, ready for the next step or replay. decode.py's
tiled_decode_splits and merge_splits are the twin in PyTorch, with the same names and split and
tile bounds.
"""
import math

import torch
import triton
import triton.language as tl

from .launch import INTERPRETING, check_kernel_device, head_dim_block, kernels_may_load, power_of_2_at_least
from .masks import key_tile_bounds_tl, visible_in_tile_tl
from .triton_forward import online_softmax_update
from .triton_tiles import LN_2, LOG2_E


@triton.jit
def _merge_splits(O, O_SPLIT, LSE_SPLIT, heads, in_group, dims, in_head, stride_oh, stride_osh, stride_oss,
                  stride_lsh, stride_lss, N_SPLITS, BLOCK_S: tl.constexpr):
    """O of the query heads `heads` (rows; in_group the real ones, in_head the real dims) from the
    partial outputs and log-sum-exps of all N_SPLITS splits, each weighted by its share of the
    softmax's sum: exp(lse_j - lse_max), up to a common factor. The partials were written by
    other programs: they are read from L2 (.cg), past any stale line of this SM's L1."""
    splits = tl.arange(0, BLOCK_S)
    out_mask = in_group[:, None] & in_head[None, :]
    lse_split = tl.load(LSE_SPLIT + heads[:, None] * stride_lsh + splits[None, :] * stride_lss,
                        mask=in_group[:, None] & (splits < N_SPLITS)[None, :], other=float("-inf"),
                        cache_modifier=".cg")
    lse_split = tl.where(in_group[:, None], lse_split, 0.0)  # padding rows: weights of 1 on zeros, never stored
    lse_max = tl.max(lse_split, 1)  # finite: the split holding row pos saw the token's key
    weights = tl.exp2((lse_split - lse_max[:, None]) * LOG2_E)  # (BLOCK_G, BLOCK_S); splits past N_SPLITS: 0
    o = tl.zeros(out_mask.shape, dtype=tl.float32)
    for split in range(N_SPLITS):
        weight = tl.sum(tl.where(splits[None, :] == split, weights, 0.0), 1)
        o_split = tl.load(O_SPLIT + heads[:, None] * stride_osh + split * stride_oss + dims[None, :], mask=out_mask,
                          other=0.0, cache_modifier=".cg")
        o += weight[:, None] * o_split
    o = o / tl.sum(weights, 1)[:, None]
    tl.store(O + heads[:, None] * stride_oh + dims[None, :], o.to(O.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_split(Q, K, V, K_CACHE, V_CACHE, O, O_SPLIT, LSE_SPLIT, COUNTS, POS,
                  stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                  stride_kcb, stride_kch, stride_kcn, stride_vcb, stride_vch, stride_vcn, stride_ob, stride_oh,
                  stride_osb, stride_osh, stride_oss, stride_lsb, stride_lsh, stride_lss,
                  H_KV, GROUP, N_CACHE, N_SPLITS, SPLIT_ROWS, left, qk_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    pair = tl.program_id(0)  # (batch, kv head)
    b = (pair // H_KV).to(tl.int64)
    kv_head = (pair % H_KV).to(tl.int64)
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

    # Then the cached keys the window sees: masks.py's rules for a query at row pos over the pos
    # keys before it (its own is in registers), (pos + 1, pos, left, 0), in the split's tiles
    # (whole tiles, the twin's); a tile with no key the window sees is skipped.
    mask = (pos + 1, pos, left, 0)
    start, _, _, end = key_tile_bounds_tl(pos, mask, 1, BLOCK_N)
    for tile_start in range(tl.maximum(start, split_start), tl.minimum(end, split_end), BLOCK_N):
        rows = tile_start + tl.arange(0, BLOCK_N)
        seen = visible_in_tile_tl(pos, rows, mask)
        seen_dims = seen[:, None] & in_head[None, :]  # rows outside it are never loaded: a stale NaN stays out
        k_tile = tl.load(K_CACHE + rows[:, None] * stride_kcn + dims[None, :], mask=seen_dims, other=0.0)
        s = tl.dot(q_tile, tl.trans(k_tile))  # raw scores, (BLOCK_G, BLOCK_N)
        s = tl.where(seen[None, :], s, float("-inf"))
        v_tile = tl.load(V_CACHE + rows[:, None] * stride_vcn + dims[None, :], mask=seen_dims, other=0.0)
        # MASKED: a split without the token has seen no key before its first tile.
        acc, l_i, m_i = online_softmax_update(acc, l_i, m_i, s, v_tile, qk_scale, True)

    # A split that saw no key keeps l_i = 0: o_split = 0, lse_split = -inf (weight 0 in the merge).
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o_split = acc / l_safe[:, None]
    out_mask = in_group[:, None] & in_head[None, :]
    O += b * stride_ob
    if N_SPLITS == 1:  # the split is the whole cache: its output is O
        tl.store(O + heads[:, None] * stride_oh + dims[None, :], o_split.to(O.dtype.element_ty), mask=out_mask)
    else:
        O_SPLIT += b * stride_osb
        LSE_SPLIT += b * stride_lsb
        lse_split = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * LN_2)  # natural log, as the forward's
        tl.store(O_SPLIT + heads[:, None] * stride_osh + split * stride_oss + dims[None, :], o_split, mask=out_mask)
        tl.store(LSE_SPLIT + heads * stride_lsh + split * stride_lss, lse_split, mask=in_group)
        # Every thread's partial is stored before the count says so; the count releases them to
        # the program that sees it reach N_SPLITS (acq_rel at the GPU's scope), which merges.
        tl.debug_barrier()
        done_before = tl.atomic_add(COUNTS + pair, 1, sem="acq_rel", scope="gpu")
        if done_before == N_SPLITS - 1:
            _merge_splits(O, O_SPLIT, LSE_SPLIT, heads, in_group, dims, in_head, stride_oh, stride_osh, stride_oss,
                          stride_lsh, stride_lss, N_SPLITS, BLOCK_S)
            tl.atomic_xchg(COUNTS + pair, 0, sem="relaxed", scope="gpu")  # zero again: the next step's


# One fixed config rather than a tuned one: tuning would time candidates at the first call of
# each shape, which must never happen inside a CUDA graph capture. A K or V tile is 16 KB (64
# keys at D=128 in 16 bits): with 3 stages two tiles of K and of V are in flight, 64 KB of
# shared memory, under Ada's 99 KB at every head dim and element size (three programs an SM on
# Hopper's 227 KB).
DECODE_TILE_BYTES = 16384
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3
# The split plan (decode_splits): programs an SM to aim for, so that while one waits on its
# loads another's are in flight, and the fewest K and V bytes a split reads, below which its
# fixed costs (the query's load, the pipeline's fill, its partial output and the merge's read
# of it) weigh on the bytes: 128 KB is 4 tiles of K and V.
PROGRAMS_PER_SM = 2
SPLIT_MIN_BYTES = 128 * 1024
MAX_SPLITS = 64  # the merge holds a (query heads, splits) tile of log-sum-exps in registers
MAX_SPLIT_PAIRS = 1024  # (batch, kv head) pairs a split plan may have: one counter each, in one buffer
ADA_SM_COUNT = 56  # the RTX 4070 Super's SMs: what the interpreter assumes


def decode_block_n(head_dim, element_size):
    """Rows of a K or V tile: DECODE_TILE_BYTES of them, 16 to 256 rows."""
    return min(256, max(16, DECODE_TILE_BYTES // (head_dim_block(head_dim) * element_size)))


def decode_splits(pairs, pair_bytes, n_tiles, n_sms):
    """How many splits to cut each (batch, kv head)'s cache of n_tiles tiles and pair_bytes K and V
    bytes into, for `pairs` such pairs on a card of n_sms SMs: enough for PROGRAMS_PER_SM
    programs an SM, as long as every split reads SPLIT_MIN_BYTES or more, at most MAX_SPLITS
    (and a tile a split). One when the pairs already give the card its programs. Then whole
    tiles a split, shared as evenly as they go, so that no split lies past the cache's end."""
    if pairs > MAX_SPLIT_PAIRS:
        return 1
    wanted = math.ceil(PROGRAMS_PER_SM * n_sms / pairs)
    n_splits = max(1, min(wanted, pair_bytes // SPLIT_MIN_BYTES, n_tiles, MAX_SPLITS))
    return math.ceil(n_tiles / math.ceil(n_tiles / n_splits))


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
    pair_bytes = 2 * S * D * k_cache.element_size()
    return decode_splits(B * H_kv, pair_bytes, math.ceil(S / block_n), sm_count(k_cache.device)), block_n


_split_counters = {}


def split_counters(device):
    """The counters of the (batch, kv head) pairs, MAX_SPLIT_PAIRS int32 zeros on device, that a
    step's split programs count themselves done on. The program that merges a pair's splits
    zeroes its counter again, so one buffer serves every step and every replay of a captured one
    (steps run one at a time on a device: a model's layers in turn). Made at the first call
    outside a CUDA graph capture; a capture before that zeroes counters of its own, a memset
    that each replay repeats."""
    if device not in _split_counters:
        counters = torch.zeros(MAX_SPLIT_PAIRS, dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return counters
        _split_counters[device] = counters
    return _split_counters[device]


def split_kv_decode(q, k, v, k_cache, v_cache, pos, left, n_splits, block_n):
    """The launch: O (B, H, 1, D); k and v stored at row pos of the caches. Any split count and
    tile rows (tests choose them; the operator takes split_plan's)."""
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
    if n_splits > 1 and B * H_kv > MAX_SPLIT_PAIRS:
        raise ValueError(f"split_kv_decode: {n_splits} splits of {B * H_kv} (batch, kv head) pairs, more than the "
                         f"{MAX_SPLIT_PAIRS} counters of a split plan")
    o_split = torch.empty(B, H, n_splits if n_splits > 1 else 0, D, dtype=torch.float32, device=q.device)
    lse_split = torch.empty(B, H, n_splits if n_splits > 1 else 0, dtype=torch.float32, device=q.device)
    _decode_split[(B * H_kv, n_splits)](
        q, k, v, k_cache, v_cache, o, o_split, lse_split, split_counters(q.device), pos, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        o.stride(0), o.stride(1), *o_split.stride()[:3], *lse_split.stride(), H_kv, H // H_kv, S, n_splits,
        split_rows(S, n_splits, block_n), left, D ** -0.5 * LOG2_E.value,
        HEAD_DIM=D, BLOCK_D=head_dim_block(D), BLOCK_G=max(16, power_of_2_at_least(H // H_kv)), BLOCK_N=block_n,
        BLOCK_S=power_of_2_at_least(n_splits), num_warps=DECODE_NUM_WARPS, num_stages=DECODE_NUM_STAGES)
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
