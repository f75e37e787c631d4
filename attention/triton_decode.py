"""Decoding attention in Triton: one new query per sequence against a static KV cache.

One program computes the output row of one (batch, head): it keeps the query q_row (HEAD_DIM,)
and the running softmax state (m_i, l_i, acc) in registers, and walks the cached keys and
values in tiles of BLOCK_N rows up to n_keys, which it reads from memory. The host never
learns how many keys there are, so the launch is the same at every step and a CUDA graph can
replay it while the cache fills.

A decode step has one query row, so there is no matrix product to give tensor cores: the
scores are a broadcast multiply and a row sum, in float32. There is no split-K ("flash-
decoding") either: at the model's shapes (a block_size of a few hundred tokens) a program
reads the cache in one or two large tiles, and the kernel waits on those loads' latency,
which larger tiles cut (docs/benchmarks.md, "Decoding"); we did not try splitting the keys.
"""
import torch
import triton
import triton.language as tl

from .triton_launch import check_kernel_device, define_operator

LOG2_E = 1.4426950408889634


@triton.jit
def _decode_attn(Q, K, V, O, N_KEYS,
                 stride_qb, stride_qh, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_nk,
                 H, N_CACHE, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    # How many cached keys this sequence's query sees, clamped to the cache so that a bad value
    # can never read past it.
    n_keys = tl.minimum(tl.load(N_KEYS + b * stride_nk).to(tl.int32), N_CACHE)
    dims = tl.arange(0, HEAD_DIM)
    q_row = tl.load(Q + b * stride_qb + h * stride_qh + dims).to(tl.float32)
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh

    m_i = tl.full([], float("-inf"), tl.float32)  # running max of base-2 logits
    l_i = tl.full([], 0.0, tl.float32)  # running sum of exp2(logit - m_i)
    acc = tl.zeros([HEAD_DIM], tl.float32)  # running sum of exp2(logit - m_i) * v
    for tile_start in range(0, n_keys, BLOCK_N):
        rows = tile_start + tl.arange(0, BLOCK_N)
        visible = rows < n_keys
        k_tile = tl.load(K + rows[:, None] * stride_kn + dims[None, :], mask=visible[:, None], other=0.0)
        s = tl.sum(k_tile.to(tl.float32) * q_row[None, :], 1) * qk_scale  # base-2 logits, (BLOCK_N,)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp2(s - m_new)
        alpha = tl.exp2(m_i - m_new)  # how much the old maximum overstated the new one
        l_i = l_i * alpha + tl.sum(p, 0)
        v_tile = tl.load(V + rows[:, None] * stride_vn + dims[None, :], mask=visible[:, None], other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v_tile.to(tl.float32), 0)
        m_i = m_new
    tl.store(O + b * stride_ob + h * stride_oh + dims, (acc / l_i).to(O.dtype.element_ty))


# One fixed config rather than a tuned one: the tuning would time candidates at the first call of
# each shape, which must never happen inside a CUDA graph capture. Tiles of 256 keys at D=64
# were the fastest on the H200 (docs/benchmarks.md, "Decoding"); other head dims keep the
# tile's 16K elements, so that each thread holds as many values.
DECODE_TILE_ELEMENTS = 16384
DECODE_NUM_WARPS = 4


def _decode_attention(q, k_cache, v_cache, n_keys):
    check_kernel_device(q)
    B, H, _, D = q.shape
    o = torch.empty_like(q)
    _decode_attn[(B * H,)](q, k_cache, v_cache, o, n_keys,
                           q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
                           o.stride(0), o.stride(1), n_keys.stride(0),
                           H, k_cache.shape[2], D ** -0.5 * LOG2_E,
                           HEAD_DIM=D, BLOCK_N=DECODE_TILE_ELEMENTS // D, num_warps=DECODE_NUM_WARPS)
    return o


# q (B, H, 1, D), k_cache and v_cache (B, H, S, D) with unit stride along D, n_keys (B,)
# integers: O (B, H, 1, D). An opaque operator (torch.compile keeps it as one node of its graph
# and never traces into Triton's launcher), so a compiled decode step is one graph.
triton_decode_attention = define_operator(
    "triton_decode_attention", "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor n_keys) -> Tensor",
    _decode_attention, lambda q, k_cache, v_cache, n_keys: torch.empty_like(q))
