"""The Triton backends as PyTorch custom operators.

`triton`     triton_attention: Triton forward, Triton backward (triton_backward.py).
             triton_packed_attention: the same kernels on a fused (B, N, 3, H, D) projection.
`triton_fwd` triton_fwd_attention: Triton forward, PyTorch recompute backward
             (recompute_backward.py), kept so the two backwards can be compared.

Every kernel call is a `torch.library.custom_op` (torch.ops.nanofa2.*) with a fake
implementation, which tells torch.compile its outputs' shapes and strides without running it,
and `register_autograd`, which ties each forward to its backward. A compiled model with these
backends is therefore one graph (`torch.compile(model, fullgraph=True)`), CUDA graphs included.

The ops are opaque on every device: the compiler schedules around them but does not look
inside. `torch.library.triton_op`, which lets Inductor see the kernels, was not chosen:
  (a) it does not trace when the kernels run in the CPU interpreter, so CI could not check
      the compiled path;
  (b) its launches go through wrap_triton, losing TunedKernel's direct launches, which keep the
      uncompiled model's host cost low (triton_launch.py);
  (c) opaque ops already give a compiled model compiled sdpa's GPU time per step
      (docs/optimisation.md, "Tried and rejected").

A custom op may not return a view of an input, and its fake outputs must have the real ones'
strides: every output is a new tensor laid out from the inputs' shapes and strides alone
(new_output_like), the same way by the real and the fake implementation. The forwards save
exactly (Q, K, V, O, lse) for backward (the packed one: QKV, O, lse). Leading dims are folded into
(B, H) views, so any (..., N, D) input works; q, k, v are read through their strides, never
copied, unless their layout is one TMA cannot describe (see triton_launch.descriptor_ready).

Double backward is not supported: the backward ops' own gradient raises a clear error rather
than give a wrong number (the saved lse's gradient is not modelled).
"""
import torch
from torch import Tensor

from .inputs import check_inputs, check_triton_inputs, unpack_heads
from .recompute_backward import recompute_backward
from .triton_backward import flash_backward
from .triton_forward import flash_forward
from .triton_launch import as_4d, check_kernel_device, descriptor_ready, tma_describable


def new_output_like(t):
    """An empty tensor shaped like the (B, H, N, D) t, in t's memory order: for the model's views
    of a (B, N, 3, H, D) projection that is (B, N, H, D), so the transpose back to (B, N, H * D)
    after attention is free, and so is autograd's stacking of the three gradients. Contiguous
    if that order has no unit stride along D (the kernels take none)."""
    out = torch.empty_like(t)
    return out if out.stride(-1) == 1 else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _new_attention_outputs(q):
    """O (in q's memory order) and lse (float32, contiguous) as the kernels' (B, H, N, D) and (B, H, N)."""
    q4 = as_4d(q)
    return new_output_like(q4), torch.empty(q4.shape[:-1], dtype=torch.float32, device=q.device)


def _lse_for_kernels(lse, q):
    return lse.reshape(as_4d(q).shape[:-1]).contiguous()


# ---------------------------------------------------------------- the operators

def _attention_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> tuple[Tensor, Tensor]:
    check_kernel_device(q)
    o, lse = _new_attention_outputs(q)
    flash_forward(descriptor_ready(q), descriptor_ready(k), descriptor_ready(v), is_causal, out=(o, lse))
    return o.view(q.shape), lse.view(q.shape[:-1])


def _attention_forward_fake(q, k, v, is_causal):
    o, lse = _new_attention_outputs(q)
    return o.view(q.shape), lse.view(q.shape[:-1])


# One forward, two operators: the backend names which backward autograd runs.
_triton_forward_op = torch.library.custom_op("nanofa2::triton_attention", _attention_forward, mutates_args=())
_triton_fwd_forward_op = torch.library.custom_op("nanofa2::triton_fwd_attention", _attention_forward, mutates_args=())
_triton_forward_op.register_fake(_attention_forward_fake)
_triton_fwd_forward_op.register_fake(_attention_forward_fake)


@torch.library.custom_op("nanofa2::triton_attention_backward", mutates_args=())
def _triton_backward_op(q: Tensor, k: Tensor, v: Tensor, o: Tensor, do: Tensor, lse: Tensor,
                        is_causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = (new_output_like(as_4d(t)) for t in (q, k, v))
    flash_backward(*(descriptor_ready(t) for t in (q, k, v, o, do)), _lse_for_kernels(lse, q), is_causal,
                   out=(dq, dk, dv))
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


def _gradients_fake(q, k, v, o, do, lse, is_causal):
    return tuple(new_output_like(as_4d(t)).view(t.shape) for t in (q, k, v))


_triton_backward_op.register_fake(_gradients_fake)


@torch.library.custom_op("nanofa2::recompute_attention_backward", mutates_args=())
def _recompute_backward_op(q: Tensor, k: Tensor, v: Tensor, o: Tensor, do: Tensor, lse: Tensor,
                           is_causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    # Opaque like the others, so that its own gradient can refuse double backward.
    grads = recompute_backward(q, k, v, o, lse, do, is_causal)
    return tuple(new_output_like(as_4d(t)).view(t.shape).copy_(g) for t, g in zip((q, k, v), grads))


_recompute_backward_op.register_fake(_gradients_fake)


@torch.library.custom_op("nanofa2::triton_packed_attention", mutates_args=())
def _packed_forward_op(qkv: Tensor, is_causal: bool) -> tuple[Tensor, Tensor]:
    check_kernel_device(qkv)
    o, lse = _new_packed_outputs(qkv)
    flash_forward(*unpack_heads(_describable_qkv(qkv)), is_causal, out=(o.transpose(1, 2), lse))
    return o, lse


def _new_packed_outputs(qkv):
    """O (B, N, H, D) contiguous, which the kernels write through its (B, H, N, D) view, and lse (B, H, N)."""
    B, N, _, H, D = qkv.shape
    return qkv.new_empty(B, N, H, D), torch.empty(B, H, N, dtype=torch.float32, device=qkv.device)


def _describable_qkv(qkv):
    # When TMA cannot describe qkv, it cannot describe its q, k, v views either: copy once.
    return qkv if tma_describable(qkv, row_dim=1) else qkv.clone(memory_format=torch.contiguous_format)


_packed_forward_op.register_fake(lambda qkv, is_causal: _new_packed_outputs(qkv))


@torch.library.custom_op("nanofa2::triton_packed_attention_backward", mutates_args=())
def _packed_backward_op(qkv: Tensor, o: Tensor, do: Tensor, lse: Tensor, is_causal: bool) -> Tensor:
    dqkv = qkv.new_empty(qkv.shape)  # contiguous, so its q, k, v views suit the kernels as they are
    flash_backward(*unpack_heads(_describable_qkv(qkv)), descriptor_ready(o.transpose(1, 2)),
                   descriptor_ready(do.transpose(1, 2)), lse.contiguous(), is_causal, out=unpack_heads(dqkv))
    return dqkv


_packed_backward_op.register_fake(lambda qkv, o, do, lse, is_causal: qkv.new_empty(qkv.shape))


# ---------------------------------------------------------------- autograd

def _save_attention(ctx, inputs, output):
    q, k, v, is_causal = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.is_causal = is_causal


def _triton_backward(ctx, do, dlse):
    dq, dk, dv = _triton_backward_op(*ctx.saved_tensors[:4], do, ctx.saved_tensors[4], ctx.is_causal)
    return dq, dk, dv, None


def _recompute_backward(ctx, do, dlse):
    dq, dk, dv = _recompute_backward_op(*ctx.saved_tensors[:4], do, ctx.saved_tensors[4], ctx.is_causal)
    return dq, dk, dv, None


def _save_packed(ctx, inputs, output):
    qkv, is_causal = inputs
    o, lse = output
    ctx.save_for_backward(qkv, o, lse)
    ctx.is_causal = is_causal


def _packed_backward(ctx, do, dlse):
    qkv, o, lse = ctx.saved_tensors
    return _packed_backward_op(qkv, o, do, lse, ctx.is_causal), None


def _refuse_double_backward(backend):
    def backward(ctx, *grads):
        raise RuntimeError(f"double backward is not supported by the {backend} backend: its backward is not "
                           "differentiable (the eager backend gives higher-order gradients)")
    return backward


_triton_forward_op.register_autograd(_triton_backward, setup_context=_save_attention)
_triton_fwd_forward_op.register_autograd(_recompute_backward, setup_context=_save_attention)
_packed_forward_op.register_autograd(_packed_backward, setup_context=_save_packed)
_triton_backward_op.register_autograd(_refuse_double_backward("triton"))
_recompute_backward_op.register_autograd(_refuse_double_backward("triton_fwd"))
_packed_backward_op.register_autograd(_refuse_double_backward("triton"))


# ---------------------------------------------------------------- the backends

def triton_attention(q, k, v, is_causal=False):
    check_inputs(q, k, v, is_causal)
    check_triton_inputs(q, k, v)
    return _triton_forward_op(q, k, v, is_causal)[0]


def triton_fwd_attention(q, k, v, is_causal=False):
    check_inputs(q, k, v, is_causal)
    check_triton_inputs(q, k, v)
    return _triton_fwd_forward_op(q, k, v, is_causal)[0]


def triton_packed_attention(qkv, is_causal=False):
    """qkv (B, N, 3, H, D) -> (B, N, H, D). q, k and v are read out of qkv in place and qkv's
    gradient is written whole, so autograd keeps one node where q, k, v views need six (an
    unbind, four transposes and the attention) and a stack of the three gradients. At the
    model's small shapes those nodes cost the CPU more than the kernels cost the GPU
    (docs/benchmarks.md)."""
    check_triton_inputs(*unpack_heads(qkv))
    return _packed_forward_op(qkv, is_causal)[0]
