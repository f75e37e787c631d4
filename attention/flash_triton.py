"""The Triton backends as autograd Functions.

`triton`     FlashAttentionTriton: Triton forward, Triton backward (triton_backward.py).
`triton_fwd` FlashAttentionTritonFwd: Triton forward, PyTorch recompute backward
             (recompute_backward.py), kept so the two backwards can be compared.

Both save exactly (Q, K, V, O, L) for backward. Leading dims are folded into (B, H) views,
so any (..., N, D) input works; q, k, v are read through their strides, never copied,
unless their layout is one TMA cannot describe (see triton_common.descriptor_ready).
"""
import torch

from .inputs import check_inputs, check_triton_inputs
from .recompute_backward import recompute_backward
from .triton_backward import flash_backward
from .triton_common import check_kernel_device, descriptor_ready
from .triton_forward import flash_forward


class FlashAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False):
        check_inputs(Q, K, V, is_causal)
        check_triton_inputs(Q, K, V)
        check_kernel_device(Q)
        O, L = flash_forward(descriptor_ready(Q), descriptor_ready(K), descriptor_ready(V), is_causal)
        O, L = O.view(Q.shape), L.view(Q.shape[:-1])
        ctx.save_for_backward(Q, K, V, O, L)
        ctx.is_causal = is_causal
        return O

    @staticmethod
    def backward(ctx, dO):
        Q, K, V, O, L = ctx.saved_tensors
        dQ, dK, dV = flash_backward(*(descriptor_ready(t) for t in (Q, K, V, O, dO)), L, ctx.is_causal)
        return dQ.view(Q.shape), dK.view(K.shape), dV.view(V.shape), None


class FlashAttentionTritonFwd(FlashAttentionTriton):
    """The same forward; the backward is the PyTorch recompute."""

    @staticmethod
    def backward(ctx, dO):
        dQ, dK, dV = recompute_backward(*ctx.saved_tensors, dO, ctx.is_causal)
        return dQ, dK, dV, None
