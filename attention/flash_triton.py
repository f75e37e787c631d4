"""The Triton backends as autograd Functions.

`triton`     FlashAttentionTriton: Triton forward, Triton backward (triton_backward.py).
             FlashAttentionTritonPacked: the same kernels on a fused (B, N, 3, H, D) projection.
`triton_fwd` FlashAttentionTritonFwd: Triton forward, PyTorch recompute backward
             (recompute_backward.py), kept so the two backwards can be compared.

They save exactly (Q, K, V, O, L) for backward (the packed one: QKV, O, L). Leading dims are
folded into (B, H) views, so any (..., N, D) input works; q, k, v are read through their
strides, never copied, unless their layout is one TMA cannot describe (see
triton_common.descriptor_ready).
"""
import torch

from .inputs import check_inputs, check_triton_inputs
from .recompute_backward import recompute_backward
from .triton_backward import flash_backward
from .triton_common import check_kernel_device, descriptor_ready, tma_describable
from .triton_forward import flash_forward


class FlashAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False):
        check_inputs(Q, K, V, is_causal)
        check_triton_inputs(Q, K, V)
        check_kernel_device(Q)
        O, L = flash_forward(descriptor_ready(Q), descriptor_ready(K), descriptor_ready(V), is_causal)
        if O.dim() != Q.dim():  # the kernels work on (B, H, N, D) views
            O, L = O.view(Q.shape), L.view(Q.shape[:-1])
        ctx.save_for_backward(Q, K, V, O, L)
        ctx.is_causal = is_causal
        return O

    @staticmethod
    def backward(ctx, dO):
        Q, K, V, O, L = ctx.saved_tensors
        dQ, dK, dV = flash_backward(*(descriptor_ready(t) for t in (Q, K, V, O, dO)), L, ctx.is_causal)
        if dQ.dim() != Q.dim():
            dQ, dK, dV = dQ.view(Q.shape), dK.view(K.shape), dV.view(V.shape)
        return dQ, dK, dV, None


def unpack_heads(qkv):
    """(B, N, 3, H, D) -> q, k, v as (B, H, N, D) views."""
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


class FlashAttentionTritonPacked(torch.autograd.Function):
    """FlashAttentionTriton on the fused projection qkv (B, N, 3, H, D) that a GPT's c_attn
    makes, returning (B, N, H, D). q, k and v are read out of qkv in place and qkv's gradient
    is written whole, so autograd keeps one node where q, k, v views need six (an unbind, four
    transposes and the attention) and a stack of the three gradients. At the model's small
    shapes those nodes cost the CPU more than the kernels cost the GPU (docs/benchmarks.md)."""

    @staticmethod
    def forward(ctx, QKV, is_causal):
        if not tma_describable(QKV, row_dim=1):  # then neither are its q, k, v views: copy once
            QKV = QKV.clone(memory_format=torch.contiguous_format)
        Q, K, V = unpack_heads(QKV)
        check_triton_inputs(Q, K, V)
        check_kernel_device(QKV)
        O, L = flash_forward(Q, K, V, is_causal)
        ctx.save_for_backward(QKV, O, L)
        ctx.is_causal = is_causal
        return O.transpose(1, 2)  # O is (B, N, H, D) in memory (flash_forward keeps q's order)

    @staticmethod
    def backward(ctx, dO):
        QKV, O, L = ctx.saved_tensors
        dQKV = QKV.new_empty(QKV.shape)  # contiguous, so its q, k, v views suit the kernels as they are
        flash_backward(*unpack_heads(QKV), O, descriptor_ready(dO.transpose(1, 2)), L, ctx.is_causal,
                       out=unpack_heads(dQKV))
        return dQKV, None


class FlashAttentionTritonFwd(FlashAttentionTriton):
    """The same forward; the backward is the PyTorch recompute."""

    @staticmethod
    def backward(ctx, dO):
        dQ, dK, dV = recompute_backward(*ctx.saved_tensors, dO, ctx.is_causal)
        return dQ, dK, dV, None
