"""Checks of what callers hand to attention(): a clear ValueError naming the argument, never a
kernel fault or silent garbage. Every backend runs check_inputs; the Triton ones check_triton_inputs."""
import torch

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The float8 types are floating point too, but no backend computes in them.
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The kernels pad the head dim to a power of two in registers: any multiple of 8 up to 256 (as
# FlashAttention-2 takes), 8 being the 16 bytes a 16-bit row must be aligned to.
TRITON_MAX_HEAD_DIM = 256


def check_inputs(q, k, v, is_causal, window_size=(-1, -1)):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != q.dim() or t.dim() < 2:
            raise ValueError(f"{name} must have shape (..., N, D) with at least 2 dims and as many as q, got shape "
                             f"{tuple(t.shape)} (q {tuple(q.shape)})")
    q_shape, k_shape = q.shape, k.shape  # each .shape makes a new torch.Size: read once (a call's host time)
    if q_shape[-1] == 0:
        raise ValueError(f"q has head dim D=0 (shape {tuple(q.shape)}); the head dim must be at least 1")
    check_mask(is_causal, window_size)
    for name, t in (("k", k), ("v", v)):
        t_shape = t.shape
        if t_shape[:-3] != q_shape[:-3] or t_shape[-1] != q_shape[-1]:
            raise ValueError(f"{name} {tuple(t.shape)} must match q {tuple(q.shape)} in its leading dims and head "
                             "dim (..., H, N, D); broadcasting is not supported")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k and v must share one dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; q, k and v must share one device")
    if v.shape != k_shape:
        raise ValueError(f"v has shape {tuple(v.shape)} but k has {tuple(k.shape)}; they must match")
    if q.dim() > 2 and (k_shape[-3] == 0 or q_shape[-3] % k_shape[-3]):
        raise ValueError(f"k and v have {k.shape[-3]} heads (dim -3), which must divide q's {q.shape[-3]}: query "
                         f"head h reads kv head h // (H / H_kv) (grouped-query attention)")


def check_mask(is_causal, window_size):
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
    # A side is an int64 in every backend's arguments (the Triton operators' schema, the masks' tensors).
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(type(side) is int and -1 <= side < 2 ** 63 for side in window_size)):
        raise ValueError(f"window_size must be (left, right), two ints >= -1 and below 2**63 (-1: unbounded), got "
                         f"{window_size!r}")
    if is_causal and window_size[1] > 0:
        raise ValueError(f"window_size={tuple(window_size)} with is_causal=True: causal means right = 0; pass "
                         "is_causal=False to see keys after the query")


def check_tensor(name, t):
    """A tensor with data (not on the meta device) of a dtype the backends compute in."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if t.dtype not in DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; attention takes {', '.join(map(str, DTYPES))}")
    if t.is_meta:
        raise ValueError(f"{name} is on {t.device}, a device that holds no data; attention needs tensors with "
                         "values (on the CPU or a GPU)")


def check_triton_inputs(q, *others, names=("q", "k", "v", "k_cache", "v_cache")):
    """The Triton kernels' own limits, beyond check_inputs: q's dtype and head dim, and every
    tensor's unit stride along D (others: k and v, and decode's caches)."""
    if q.dtype not in TRITON_DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; the Triton kernels take {', '.join(map(str, TRITON_DTYPES))}")
    head_dim = q.shape[-1]
    if head_dim % 8 or head_dim > TRITON_MAX_HEAD_DIM:
        raise ValueError(f"q has head dim D={head_dim}; the Triton kernels take a multiple of 8 up to "
                         f"{TRITON_MAX_HEAD_DIM} (the eager, tiled and sdpa backends take any D)")
    for name, t in zip(names, (q, *others)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} has last-dim stride {t.stride(-1)}; the Triton kernels need stride 1 "
                             f"along D (pass {name}.contiguous())")


class _RefuseSecondOrder(torch.autograd.Function):
    """The identity, whose backward refuses: see first_order_only."""

    @staticmethod
    def forward(ctx, backend, n_grads, *grads_then_inputs):
        ctx.backend = backend
        return tuple(g.view_as(g) for g in grads_then_inputs[:n_grads])

    @staticmethod
    def backward(ctx, *grad_grads):
        raise RuntimeError(f"double backward is not supported by the {ctx.backend} backend (its backward is first "
                           "order only): for higher-order gradients use the eager backend")


def first_order_only(backend, grads, inputs):
    """The gradients a first-order-only backward returns, computed from inputs (dO and the saved
    tensors). Under create_graph=True (the only time grad mode is on inside a backward) they carry
    a node, downstream of inputs, that raises if anything differentiates them: a graph through
    these backwards would miss how O and lse depend on Q, K, V, and a second-order gradient would
    be silently wrong. (torch's once_differentiable is not enough: torch.autograd.grad(...,
    inputs) prunes its error node and reports an input "not used in the graph" instead.)"""
    if not torch.is_grad_enabled():
        return grads
    return _RefuseSecondOrder.apply(backend, len(grads), *grads, *inputs)
