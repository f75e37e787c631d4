"""The Triton kernels as a torch.autograd.Function: FlashAttentionTriton, the article's interface.

    O = FlashAttentionTriton.apply(Q, K, V, is_causal)                   # (B, N, D) or (B, H, N, D)
    O = FlashAttentionTriton.apply(Q, K, V, is_causal, window_size)      # K, V may have fewer heads

forward launches triton_forward.flash_forward and saves (Q, K, V, O, lse): one logsumexp per
query row, (..., N_q), not the N_q x N_k probabilities. backward launches
triton_backward.flash_backward on them. FlashAttentionPytorch (tiled.py) is its PyTorch twin.

Between the class and the launches sit two torch.library operators, whose bodies are those
two calls: torch.compile traces with fake tensors, which no kernel can run on, so each
operator has a fake implementation that gives its outputs' shapes and strides, and a compiled
model is one graph with two opaque nodes a layer. In plain eager mode (plain_eager: nothing
tracing, no mode watching) the class calls the bodies itself: there the operator's dispatch is
host time that nothing needs, and an eager call's host time is what a learner's step waits on
(bench.py --mode=host). (torch.library.triton_op would let Inductor launch the kernels itself;
with the training step replayed from a CUDA graph the host is out of the step, so the one plain
route won.) Every output is a new tensor laid out from the inputs' shapes and strides alone
(launch.new_like), by the real and the fake implementation alike: O in q's memory order, so the
model's views need no copy.
"""
import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from .inputs import check_inputs, check_triton_inputs, first_order_only
from .launch import as_4d, new_like
from .recompute_backward import recompute_backward
from .triton_backward import flash_backward
from .triton_forward import flash_forward


def forward_kernels(q, k, v, is_causal, window_size):
    """flash_forward's O and lse, shaped as q and as q's rows: the forward operator's body."""
    o, lse = flash_forward(q, k, v, is_causal, window_size)
    return (o, lse) if q.dim() == 4 else (o.view(q.shape), lse.view(q.shape[:-1]))


def backward_kernels(q, k, v, o, do, lse, is_causal, window_size):
    """flash_backward's gradients, each shaped as its input: the backward operator's body."""
    grads = flash_backward(q, k, v, o, do, lse, is_causal, window_size)
    return grads if q.dim() == 4 else tuple(g.view(t.shape) for g, t in zip(grads, (q, k, v)))


# The two operators, declared with torch.library.Library rather than torch.library.custom_op:
# the same schema, fake implementations and opcheck, without custom_op's Python autograd and
# dynamo layers around each call, which a compiled step pays at every call (the forward's
# operator: 74 against 38 us of host time, bench.py --mode=host's stand-in driver). Neither
# needs an autograd formula: FlashAttentionTriton is the autograd, and calls them with grad off.
LIBRARY = torch.library.Library("nanofa2", "FRAGMENT")
LIBRARY.define("flash_forward(Tensor q, Tensor k, Tensor v, bool is_causal, int[] window_size) -> (Tensor, Tensor)")
LIBRARY.define("flash_backward(Tensor q, Tensor k, Tensor v, Tensor o, Tensor do, Tensor lse, bool is_causal, "
               "int[] window_size) -> (Tensor, Tensor, Tensor)")
LIBRARY.impl("flash_forward", forward_kernels, "CompositeExplicitAutograd")
LIBRARY.impl("flash_backward", backward_kernels, "CompositeExplicitAutograd")
flash_forward_op = torch.ops.nanofa2.flash_forward.default
flash_backward_op = torch.ops.nanofa2.flash_backward.default


@torch.library.register_fake("nanofa2::flash_forward", lib=LIBRARY)
def _(q, k, v, is_causal, window_size):
    return new_like(as_4d(q)).view(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.register_fake("nanofa2::flash_backward", lib=LIBRARY)
def _(q, k, v, o, do, lse, is_causal, window_size):
    return tuple(new_like(as_4d(t)).view(t.shape) for t in (q, k, v))


def plain_eager(*tensors):
    """Whether a call may run the kernels without the operators: plain tensors, with nothing
    that must see the operator (torch.compile tracing, a torch function or dispatch mode such
    as a FLOP counter or fake tensors). Then the operator's dispatch is host time for nothing."""
    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode() or torch.overrides.has_torch_function(tensors):
        return False
    for t in tensors:
        if type(t) is not Tensor:
            return False
    return True


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttentionTriton.apply(Q, K, V, is_causal=False, window_size=(-1, -1)) -> O, for Q
    (..., H, N_q, D) and K, V (..., H_kv, N_k, D). Saves exactly (Q, K, V, O, lse)."""

    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False, window_size=(-1, -1)):
        check_inputs(Q, K, V, is_causal, window_size)
        check_triton_inputs(Q, K, V)
        ctx.mask = (is_causal, list(window_size))
        run = forward_kernels if plain_eager(Q, K, V) else flash_forward_op
        O, lse = run(Q, K, V, *ctx.mask)
        ctx.save_for_backward(Q, K, V, O, lse)
        return O

    @staticmethod
    def backward(ctx, dO):
        Q, K, V, O, lse = ctx.saved_tensors
        is_causal, window_size = ctx.mask
        if plain_eager(Q, K, V, O, dO, lse):
            grads = backward_kernels(Q, K, V, O, dO, lse, is_causal, window_size)
        else:
            with torch.no_grad():  # create_graph's grad mode must not reach an operator with no autograd formula
                grads = flash_backward_op(Q, K, V, O, dO, lse, is_causal, window_size)
        return *first_order_only("triton", grads, (dO, Q, K, V)), None, None


class TritonForwardRecomputeBackward(FlashAttentionTriton):
    """The triton_fwd backend: FlashAttentionTriton's forward, and recompute_backward.py's
    backward in PyTorch, the step before the FlashAttention-2 backward (kept to compare the two)."""

    @staticmethod
    def backward(ctx, dO):
        with torch.no_grad():
            grads = recompute_backward(*ctx.saved_tensors, dO, *ctx.mask)
        return *first_order_only("triton_fwd", grads, (dO, *ctx.saved_tensors)), None, None
