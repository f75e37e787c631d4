"""The Triton backends as PyTorch custom operators.

`triton`     triton_attention: Triton forward, Triton backward (triton_backward.py).
             triton_packed_attention: the same kernels on a fused (B, N, 3, H, D) projection.
`triton_fwd` triton_fwd_attention: Triton forward, PyTorch recompute backward
             (recompute_backward.py), kept so the two backwards can be compared.

Every kernel call is a PyTorch custom operator (torch.ops.nanofa2.*) with a fake
implementation, which tells torch.compile its outputs' shapes and strides without running it,
and `register_autograd`, which ties each forward to its backward. A compiled model with these
backends is therefore one graph (`torch.compile(model, fullgraph=True)`), CUDA graphs included.

Three routes to the same kernels:
  - Uncompiled, the backends call the kernels through an autograd.Function (TritonAttention),
    which saves the same tensors and computes the same gradients as the operators. At the
    model's shapes the host, not the GPU, sets the pace, and the operators' autograd layer
    costs the host more per call than the kernels cost the GPU (docs/benchmarks.md, "The
    operators' host cost").
  - Compiled on a GPU, they call `torch.library.triton_op`s (the *_traced operators): torch.compile
    traces into them, the graph holds the kernel launches themselves (wrap_triton, in
    TunedKernel.record) and Inductor's code makes them, with no operator dispatch and none of
    this file's Python at each call.
  - Compiled on the CPU, they call opaque operators (define_operator in triton_launch.py), whose
    kernels run in the Triton interpreter: a triton_op cannot be traced there, since the
    interpreter would run the kernel on the tracer's fake tensors.
Every operator's Python is the same function on both kinds of operator (_attention_forward and
the others below).

A custom op may not return a view of an input, and its fake outputs must have the real ones'
strides: every output is a new tensor laid out from the inputs' shapes and strides alone
(new_output_like, new_gradients), the same way by the real and the fake implementation. The
kernels write whole new tensors, never views of one: compiled, a kernel's write into a view
costs a copy of its base and a scatter back (docs/optimisation.md, "The compiled route").
The forwards save exactly (Q, K, V, O, lse) for backward (the packed one: QKV, O, lse).
Leading dims are folded into (B, H) views, so any (..., N, D) input works; q, k, v are read
through their strides, never copied, unless their layout is one TMA cannot describe (see
triton_launch.descriptor_ready).

Double backward is not supported: the backward ops' own gradient raises a clear error rather
than give a wrong number (the saved lse's gradient is not modelled).
"""
import torch
from torch import Tensor

from .inputs import check_inputs, check_triton_inputs, unpack_heads
from .recompute_backward import recompute_backward
from .triton_backward import flash_backward, gradient_views, new_gradients
from .triton_forward import flash_forward
from .triton_launch import (OPERATORS, as_4d, check_kernel_device, define_operator, dense_strides, descriptor_ready,
                            tma_describable)


def new_output_like(t):
    """An empty tensor shaped like the (B, H, N, D) t, in t's memory order (dense_strides): for
    the model's views of a (B, N, 3, H, D) projection that is (B, N, H, D), so the transpose back
    to (B, N, H * D) after attention is free. The gradients are laid out the same way."""
    return torch.empty_strided(t.shape, dense_strides(t), dtype=t.dtype, device=t.device)


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
_FORWARD_SCHEMA = "(Tensor q, Tensor k, Tensor v, bool is_causal) -> (Tensor, Tensor)"
_triton_forward_op = define_operator("triton_attention", _FORWARD_SCHEMA, _attention_forward, _attention_forward_fake)
_triton_fwd_forward_op = define_operator("triton_fwd_attention", _FORWARD_SCHEMA, _attention_forward,
                                         _attention_forward_fake)
# The backward ops return dQ, dK and dV in one flat tensor (see flash_backward), which autograd
# splits into views (_gradients): a custom op's outputs may not alias one another.
_BACKWARD_SCHEMA = "(Tensor q, Tensor k, Tensor v, Tensor o, Tensor do, Tensor lse, bool is_causal) -> Tensor"


def _new_gradients(q, k, v):
    return new_gradients(*(as_4d(t) for t in (q, k, v)))


def _attention_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, do: Tensor, lse: Tensor,
                        is_causal: bool) -> Tensor:
    grads, dq, dk, dv = _new_gradients(q, k, v)
    flash_backward(*(descriptor_ready(t) for t in (q, k, v, o, do)), _lse_for_kernels(lse, q), is_causal,
                   out=(grads, dq, dk, dv))
    return grads


def _gradients_fake(q, k, v, o, do, lse, is_causal):
    return _new_gradients(q, k, v)[0]


_triton_backward_op = define_operator("triton_attention_backward", _BACKWARD_SCHEMA, _attention_backward,
                                      _gradients_fake)


def _recomputed_attention_backward(q, k, v, o, do, lse, is_causal):
    # Opaque like the others, so that its own gradient can refuse double backward.
    grads, *views = _new_gradients(q, k, v)
    for view, g in zip(views, recompute_backward(q, k, v, o, lse, do, is_causal)):
        view.copy_(as_4d(g))
    return grads


_recompute_backward_op = define_operator("recompute_attention_backward", _BACKWARD_SCHEMA,
                                         _recomputed_attention_backward, _gradients_fake)


def _packed_attention_forward(qkv: Tensor, is_causal: bool) -> tuple[Tensor, Tensor]:
    check_kernel_device(qkv)
    o_heads, lse = _new_packed_outputs(qkv)
    flash_forward(*unpack_heads(_describable_qkv(qkv)), is_causal, out=(o_heads, lse))
    return o_heads.transpose(1, 2), lse


def _new_packed_outputs(qkv):
    """O as the kernels' (B, H, N, D), laid out (B, N, H, D) in memory, and lse (B, H, N). O is
    allocated in that layout rather than taken as a view of a (B, N, H, D) tensor: compiled, a
    kernel that writes a view costs a copy into its base (docs/optimisation.md, "The compiled
    route")."""
    B, N, _, H, D = qkv.shape
    o_heads = torch.empty_strided((B, H, N, D), (N * H * D, D, H * D, 1), dtype=qkv.dtype, device=qkv.device)
    return o_heads, torch.empty(B, H, N, dtype=torch.float32, device=qkv.device)


def _describable_qkv(qkv):
    # When TMA cannot describe qkv, it cannot describe its q, k, v views either: copy once.
    return qkv if tma_describable(qkv, row_dim=1) else qkv.clone(memory_format=torch.contiguous_format)


def _packed_attention_forward_fake(qkv, is_causal):
    o_heads, lse = _new_packed_outputs(qkv)
    return o_heads.transpose(1, 2), lse


_packed_forward_op = define_operator("triton_packed_attention", "(Tensor qkv, bool is_causal) -> (Tensor, Tensor)",
                                     _packed_attention_forward, _packed_attention_forward_fake)


def _packed_attention_backward(qkv: Tensor, o: Tensor, do: Tensor, lse: Tensor, is_causal: bool) -> Tensor:
    dqkv = qkv.new_empty(qkv.shape)  # contiguous, so its q, k, v views suit the kernels as they are
    flash_backward(*unpack_heads(_describable_qkv(qkv)), descriptor_ready(o.transpose(1, 2)),
                   descriptor_ready(do.transpose(1, 2)), lse.contiguous(), is_causal,
                   out=(dqkv, *unpack_heads(dqkv)))
    return dqkv


_packed_backward_op = define_operator(
    "triton_packed_attention_backward", "(Tensor qkv, Tensor o, Tensor do, Tensor lse, bool is_causal) -> Tensor",
    _packed_attention_backward, lambda qkv, o, do, lse, is_causal: qkv.new_empty(qkv.shape))


# ---------------------------------------------------------------- the traced twins (torch.compile on a GPU)
# The same kernel functions as torch.library.triton_ops (see the module docstring). triton_op
# takes the function itself as the fake implementation: traced, it allocates the outputs and
# records the launches (TunedKernel.record).
def _traced_operator(name, kernel):
    torch.library.triton_op(f"nanofa2::{name}_traced", kernel, mutates_args=())
    return getattr(torch.ops.nanofa2, f"{name}_traced").default


_triton_forward_traced = _traced_operator("triton_attention", _attention_forward)
_triton_fwd_forward_traced = _traced_operator("triton_fwd_attention", _attention_forward)
_triton_backward_traced = _traced_operator("triton_attention_backward", _attention_backward)
_packed_forward_traced = _traced_operator("triton_packed_attention", _packed_attention_forward)
_packed_backward_traced = _traced_operator("triton_packed_attention_backward", _packed_attention_backward)
# the opaque forward operator -> its traced twin, which torch.compile takes on a GPU
_TRACED_ON_GPU = {
    _triton_forward_op: _triton_forward_traced,
    _triton_fwd_forward_op: _triton_fwd_forward_traced,
    _packed_forward_op: _packed_forward_traced,
}


# ---------------------------------------------------------------- autograd
# Every forward op takes (inputs..., is_causal) and returns (O, lse); its backward op takes
# (inputs..., O, dO, lse, is_causal) and returns the inputs' gradients. So one setup and one
# backward serve the three forwards.

def _save_for_backward(ctx, inputs, output):
    *tensors, is_causal = inputs
    ctx.save_for_backward(*tensors, *output)  # inputs, O, lse
    ctx.is_causal = is_causal


def _gradients(ctx, backward, do):
    *inputs, o, lse = ctx.saved_tensors
    grads = backward(*inputs, o, do, lse, ctx.is_causal)
    if len(inputs) == 1:  # packed: qkv's gradient
        return (grads,)
    views = gradient_views(grads, *(as_4d(t) for t in inputs))
    return tuple(view.view(t.shape) for view, t in zip(views, inputs))


def _backward_through(backward_op):
    def backward(ctx, do, dlse):  # lse is not differentiated (see the docstring above)
        return *_gradients(ctx, backward_op, do), None
    return backward


def _refuse_double_backward(backend):
    def backward(ctx, *grads):
        raise RuntimeError(f"double backward is not supported by the {backend} backend: its backward is not "
                           "differentiable (the eager backend gives higher-order gradients)")
    return backward


# forward op -> (its kernel, its backward op, that op's kernel, the backend its errors name)
_OPERATOR_PAIRS = {
    _triton_forward_op: (_attention_forward, _triton_backward_op, _attention_backward, "triton"),
    _triton_fwd_forward_op: (_attention_forward, _recompute_backward_op, _recomputed_attention_backward, "triton_fwd"),
    _packed_forward_op: (_packed_attention_forward, _packed_backward_op, _packed_attention_backward, "triton"),
    # The traced twins. triton_fwd's backward is PyTorch code: its opaque operator serves both.
    _triton_forward_traced: (_attention_forward, _triton_backward_traced, _attention_backward, "triton"),
    _triton_fwd_forward_traced: (_attention_forward, _recompute_backward_op, _recomputed_attention_backward,
                                 "triton_fwd"),
    _packed_forward_traced: (_packed_attention_forward, _packed_backward_traced, _packed_attention_backward, "triton"),
}
for forward_op, (_, backward_op, _, backend) in _OPERATOR_PAIRS.items():
    torch.library.register_autograd(forward_op, _backward_through(backward_op), setup_context=_save_for_backward,
                                    lib=OPERATORS)
for backward_op, backend in {backward_op: backend for _, backward_op, _, backend in _OPERATOR_PAIRS.values()}.items():
    torch.library.register_autograd(backward_op, _refuse_double_backward(backend), lib=OPERATORS)


# Outside torch.compile the backends call the same kernels through an autograd.Function
# instead of the operators (see the docstring above). What it saves and how it computes the
# gradients is the code above.
class TritonAttention(torch.autograd.Function):
    """A forward operator's kernel, and in backward its backward operator's kernel, called
    directly: the uncompiled route (see the module docstring)."""

    @staticmethod
    def forward(ctx, forward_op, *inputs):
        forward_kernel, ctx.backward_op, ctx.backward_kernel, _ = _OPERATOR_PAIRS[forward_op]
        output = forward_kernel(*inputs)
        _save_for_backward(ctx, inputs, output)
        ctx.mark_non_differentiable(output[1])
        return output

    @staticmethod
    def backward(ctx, do, dlse):
        # With create_graph the gradients must carry the backward op's refusal of double backward.
        backward = ctx.backward_op if torch.is_grad_enabled() else ctx.backward_kernel
        return None, *_gradients(ctx, backward, do), None


def _attention_op(forward_op, *inputs):
    """forward_op(*inputs): while torch.compile traces, the operator (on a GPU its traced twin);
    otherwise its kernels."""
    if torch.compiler.is_compiling():
        return (_TRACED_ON_GPU[forward_op] if inputs[0].is_cuda else forward_op)(*inputs)
    return TritonAttention.apply(forward_op, *inputs)


# ---------------------------------------------------------------- the backends

def triton_attention(q, k, v, is_causal=False):
    check_inputs(q, k, v, is_causal)
    check_triton_inputs(q, k, v)
    return _attention_op(_triton_forward_op, q, k, v, is_causal)[0]


def triton_fwd_attention(q, k, v, is_causal=False):
    check_inputs(q, k, v, is_causal)
    check_triton_inputs(q, k, v)
    return _attention_op(_triton_fwd_forward_op, q, k, v, is_causal)[0]


def triton_packed_attention(qkv, is_causal=False):
    """qkv (B, N, 3, H, D) -> (B, N, H, D). q, k and v are read out of qkv in place and qkv's
    gradient is written whole, so autograd keeps one node where q, k, v views need six (an
    unbind, four transposes and the attention) and a stack of the three gradients. At the
    model's small shapes those nodes cost the CPU more than the kernels cost the GPU
    (docs/benchmarks.md)."""
    check_triton_inputs(*unpack_heads(qkv))
    return _attention_op(_packed_forward_op, qkv, is_causal)[0]
