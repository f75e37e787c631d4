"""Decoding attention in Triton: one new token per sequence against a static KV cache.

One program handles one (batch, head). It reads the new token's q, k and v rows out of the
fused projection, stores k and v at row pos of the caches, and computes the token's output row:
the running softmax state (m_i, l_i, acc) starts from the token's own key, which is already in
registers, and then walks the cached keys and values [0, pos) in tiles of BLOCK_N rows. pos is
read from memory: the host never learns it, so the launch is the same at every step and a CUDA
graph can replay it while the cache fills. Storing inside the kernel spares a compiled decode
step the separate kernels that would write the cache and compute the key count (three or
four a layer). The program reads only rows below the one it writes, so the store needs no
barrier.

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
def _decode_attn(QKV, K_CACHE, V_CACHE, O, POS,
                 stride_qkv_b, stride_qkv_part, stride_qkv_h, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, stride_ob, stride_oh,
                 H, N_CACHE, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    # The new token's position, clamped into the cache so that a bad value can never write or
    # read outside it.
    pos = tl.minimum(tl.maximum(tl.load(POS).to(tl.int32), 0), N_CACHE - 1)
    dims = tl.arange(0, HEAD_DIM)
    new_token = QKV + b * stride_qkv_b + h * stride_qkv_h + dims  # its q row; k and v follow
    q_row = tl.load(new_token).to(tl.float32)
    k_row = tl.load(new_token + stride_qkv_part)
    v_row = tl.load(new_token + 2 * stride_qkv_part)
    K_CACHE += b * stride_kb + h * stride_kh
    V_CACHE += b * stride_vb + h * stride_vh
    tl.store(K_CACHE + pos * stride_kn + dims, k_row)
    tl.store(V_CACHE + pos * stride_vn + dims, v_row)

    # The token's own key first: its logit is the first running max, so its weight is exp2(0) = 1.
    m_i = tl.sum(q_row * k_row.to(tl.float32), 0) * qk_scale  # running max of base-2 logits
    l_i = tl.full([], 1.0, tl.float32)  # running sum of exp2(logit - m_i)
    acc = v_row.to(tl.float32)  # running sum of exp2(logit - m_i) * v
    for tile_start in range(0, pos, BLOCK_N):  # then the cached keys, [0, pos)
        rows = tile_start + tl.arange(0, BLOCK_N)
        visible = rows < pos
        k_tile = tl.load(K_CACHE + rows[:, None] * stride_kn + dims[None, :], mask=visible[:, None], other=0.0)
        s = tl.sum(k_tile.to(tl.float32) * q_row[None, :], 1) * qk_scale  # base-2 logits, (BLOCK_N,)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp2(s - m_new)
        alpha = tl.exp2(m_i - m_new)  # how much the old maximum overstated the new one
        l_i = l_i * alpha + tl.sum(p, 0)
        v_tile = tl.load(V_CACHE + rows[:, None] * stride_vn + dims[None, :], mask=visible[:, None], other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v_tile.to(tl.float32), 0)
        m_i = m_new
    tl.store(O + b * stride_ob + h * stride_oh + dims, (acc / l_i).to(O.dtype.element_ty))


# One fixed config rather than a tuned one: the tuning would time candidates at the first call of
# each shape, which must never happen inside a CUDA graph capture. Tiles of 256 keys at D=64
# were the fastest on the H200 (docs/benchmarks.md, "Decoding"); other head dims keep the
# tile's 16K elements, so that each thread holds as many values.
DECODE_TILE_ELEMENTS = 16384
DECODE_NUM_WARPS = 4


def _decode_attention(qkv, k_cache, v_cache, pos):
    check_kernel_device(qkv)
    B, _, _, H, D = qkv.shape
    o = qkv.new_empty(B, 1, H, D)
    _decode_attn[(B * H,)](qkv, k_cache, v_cache, o, pos,
                           qkv.stride(0), qkv.stride(2), qkv.stride(3), *k_cache.stride()[:3], *v_cache.stride()[:3],
                           o.stride(0), o.stride(2),
                           H, k_cache.shape[2], D ** -0.5 * LOG2_E,
                           HEAD_DIM=D, BLOCK_N=DECODE_TILE_ELEMENTS // D, num_warps=DECODE_NUM_WARPS)
    return o


# qkv (B, 1, 3, H, D) and the caches (B, H, S, D), all with unit stride along D, pos (1,): O
# (B, 1, H, D); k_cache and v_cache are written (row pos). An opaque operator (torch.compile
# keeps it as one node of its graph and never traces into Triton's launcher), so a compiled
# decode step is one graph; its schema declares the two writes, so that the compiler orders
# them and Inductor makes them in place rather than into a copy of each cache.
triton_decode_attention = define_operator(
    "triton_decode_attention", "(Tensor qkv, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor pos) -> Tensor",
    _decode_attention, lambda qkv, k_cache, v_cache, pos: qkv.new_empty(qkv.shape[0], 1, *qkv.shape[3:]))
