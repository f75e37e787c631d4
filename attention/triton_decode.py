"""Decoding attention in Triton: one new token per sequence against a static KV cache.

One program handles one (batch, head). It reads the new token's q row and the k and v rows of
its kv head (h // GROUP), stores k and v at row pos of the caches (one program per kv head
does), and computes the token's output row: the running softmax state (m_i, l_i, acc) starts
from the token's own key, already in registers, then walks the cached keys and values
[pos - LEFT, pos) in tiles of BLOCK_N rows. pos is read from memory: the host never learns it,
so the launch is the same at every step and a CUDA graph can replay it while the cache fills.
A program reads only rows below the one it writes, so the store needs no barrier.

One query row gives tensor cores no matrix product: the scores are a broadcast multiply and a
row sum, in float32. There is no split-K ("flash-decoding"): at the model's block_size a
program reads the cache in one or two large tiles, and waits on those loads' latency.
"""
import torch
import triton
import triton.language as tl

from .launch import check_kernel_device, head_dim_block
from .triton_tiles import LOG2_E


@triton.jit
def _decode_attn(Q, K, V, K_CACHE, V_CACHE, O, POS,
                 stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                 stride_kcb, stride_kch, stride_kcn, stride_vcb, stride_vch, stride_vcn, stride_ob, stride_oh,
                 H, GROUP, N_CACHE, LEFT, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    kv_head = h // GROUP
    # The new token's position, clamped into the cache: a bad value never writes or reads outside
    # it (decode.check_position refuses one wherever the host can read it).
    pos = tl.minimum(tl.maximum(tl.load(POS).to(tl.int32), 0), N_CACHE - 1)
    dims = tl.arange(0, BLOCK_D)
    in_head = dims < HEAD_DIM  # the head dim padded to BLOCK_D
    q_row = tl.load(Q + b * stride_qb + h * stride_qh + dims, mask=in_head, other=0.0).to(tl.float32)
    k_row = tl.load(K + b * stride_kb + kv_head * stride_kh + dims, mask=in_head, other=0.0)
    v_row = tl.load(V + b * stride_vb + kv_head * stride_vh + dims, mask=in_head, other=0.0)
    K_CACHE += b * stride_kcb + kv_head * stride_kch
    V_CACHE += b * stride_vcb + kv_head * stride_vch
    if h % GROUP == 0:  # one program per kv head stores its key and value
        tl.store(K_CACHE + pos * stride_kcn + dims, k_row, mask=in_head)
        tl.store(V_CACHE + pos * stride_vcn + dims, v_row, mask=in_head)

    # The token's own key first: its logit is the first running max, so its weight is exp2(0) = 1.
    m_i = tl.sum(q_row * k_row.to(tl.float32), 0) * qk_scale  # running max of base-2 logits
    l_i = tl.full([], 1.0, tl.float32)  # running sum of exp2(logit - m_i)
    acc = v_row.to(tl.float32)  # running sum of exp2(logit - m_i) * v
    first = tl.maximum(pos - LEFT, 0)
    for tile_start in range(first, pos, BLOCK_N):  # then the cached keys, [pos - LEFT, pos)
        rows = tile_start + tl.arange(0, BLOCK_N)
        seen = rows < pos
        mask = seen[:, None] & in_head[None, :]
        k_tile = tl.load(K_CACHE + rows[:, None] * stride_kcn + dims[None, :], mask=mask, other=0.0)
        s = tl.sum(k_tile.to(tl.float32) * q_row[None, :], 1) * qk_scale  # base-2 logits, (BLOCK_N,)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp2(s - m_new)
        alpha = tl.exp2(m_i - m_new)  # rescales the sums accumulated against the old maximum to the new one
        l_i = l_i * alpha + tl.sum(p, 0)
        v_tile = tl.load(V_CACHE + rows[:, None] * stride_vcn + dims[None, :], mask=mask, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v_tile.to(tl.float32), 0)
        m_i = m_new
    tl.store(O + b * stride_ob + h * stride_oh + dims, (acc / l_i).to(O.dtype.element_ty), mask=in_head)


# One fixed config rather than a tuned one: tuning would time candidates at the first call of
# each shape, which must never happen inside a CUDA graph capture. Tiles of 256 keys at D=64
# were the fastest on the H200; other head dims keep the tile's 16K elements, so that each thread
# holds as many values.
DECODE_TILE_ELEMENTS = 16384
DECODE_NUM_WARPS = 4


# decode.py's arguments -> O (B, H, 1, D), k_cache and v_cache written at row pos. Declared, the
# writes are ordered by the compiler and made in place, not into a copy of each cache.
@torch.library.custom_op("nanofa2::decode_attention", mutates_args=("k_cache", "v_cache"))
def triton_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, pos: torch.Tensor, left: int) -> torch.Tensor:
    check_kernel_device(q)
    B, H, _, D = q.shape
    o = q.new_empty(B, H, 1, D)
    block_d = head_dim_block(D)
    _decode_attn[(B * H,)](q, k, v, k_cache, v_cache, o, pos, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                           v.stride(0), v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], o.stride(0),
                           o.stride(1), H, H // k.shape[1], k_cache.shape[2], left, D ** -0.5 * LOG2_E.value,
                           HEAD_DIM=D, BLOCK_D=block_d, BLOCK_N=DECODE_TILE_ELEMENTS // block_d,
                           num_warps=DECODE_NUM_WARPS)
    return o


@triton_decode_attention.register_fake
def _(q, k, v, k_cache, v_cache, pos, left):
    return q.new_empty(q.shape)
