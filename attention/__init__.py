"""nanoFA2's attention library: one function, five backends.

    from attention import attention
    o = attention(q, k, v, is_causal=True, backend="triton")
    o = attention(q, k, v, window_size=(256, 0), backend="triton")   # a sliding window

q is (..., H, N_q, D); k and v are (..., H_kv, N_k, D) with the same leading dims, H_kv a
divisor of H (grouped-query attention, eager.py); the mask, causal or a window, is masks.py's; the
result has q's shape and dtype. Scale 1/sqrt(D). Every backend traces under torch.compile.

Backends:
  eager       materialised softmax; the reference the others are tested against
  tiled       FlashAttention-2 forward and backward as tiled PyTorch loops (FlashAttentionPytorch)
  triton      FlashAttention-2 forward and backward Triton kernels (FlashAttentionTriton)
  triton_fwd  the Triton forward with a PyTorch recompute backward
  sdpa        torch.nn.functional.scaled_dot_product_attention, the peer to beat

Read the files in this order (docs/learn.md walks the same path):
  eager.py               the definition: softmax(Q K^T / sqrt(D)) V, grouped-query heads
  masks.py               the window, which tiles a program visits and the mask inside a tile, in
                         Python, Triton and Gluon
  tiled.py               the tiled forward in PyTorch: the online softmax
  triton_tiles.py        the tile loads and stores as @triton.jit helpers
  triton_forward.py      the forward kernel
  tiled_backward.py      the tiled backward in PyTorch: delta, a dK/dV pass, a dQ pass
  triton_backward.py     the backward kernels: delta, then both passes in one launch
  triton_ops.py          FlashAttentionTriton: the kernels as an autograd.Function
  launch.py              the host side: layouts, configs that fit a card, tuning, the consumer-card switch
  launch_plan.py         a layout seen before, launched straight from its compiled kernel (eager host time)
  cuda_graph.py          capture_graph: a step recorded once as a CUDA graph (decoding, training, bench.py)
  recompute_backward.py  triton_fwd's backward, the step before the FlashAttention-2 backward
  decode.py              decode_attention: one new token against a KV cache, every backend
  triton_decode.py       its Triton kernel
  inputs.py, sdpa.py     the input checks; torch's own attention
  backends.py            the backends' table, which attention() and decode_attention() dispatch through
  hopper/                the forward and backward for Hopper, warp-specialised in Gluon

Reproducible gradients: the triton backend's backward may add dQ up with atomics (FlashAttention-2's
schedule, where the tuner finds it faster), whose last bits differ run to run; under
torch.use_deterministic_algorithms(True) it keeps its split schedule, the same bits every run.

This package needs only torch, triton and einops. Without a GPU the Triton kernels run in
Triton's interpreter (numpy), so CPU users and CI exercise the real kernel source (_setup.py
chooses it). NANOFA2_ADA=1 runs the consumer-card path on any card (launch.py).
"""
# First: which Triton runs the kernels (the interpreter without a GPU, the consumer-card path),
# decided before any module below imports triton (_setup.py says why).
from . import _setup  # noqa: F401, I001
from . import backends
from .backends import BACKENDS, TRITON_BACKENDS
from .decode import check_decode_inputs, store_in_cache
from .eager import eager_attention, eager_attention_with_lse
from .masks import window_bounds
from .sdpa import sdpa_attention
from .tiled import FlashAttentionPytorch
from .triton_ops import FlashAttentionTriton

__all__ = ["BACKENDS", "TRITON_BACKENDS", "attention", "decode_attention", "store_in_cache", "eager_attention",
           "eager_attention_with_lse", "sdpa_attention", "FlashAttentionPytorch", "FlashAttentionTriton"]

# backends.TABLE's rows as functions: name -> (training function, decode function).
_FUNCTIONS = {name: (backends.load(row.train), backends.load(row.decode)) for name, row in backends.TABLE.items()}


def _functions(backend):
    """backend's (training function, decode function); a ValueError for a name not in BACKENDS."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    return _FUNCTIONS[backend]


def attention(q, k, v, is_causal=False, backend="triton", window_size=(-1, -1)):
    """Each backend checks its inputs itself (inputs.check_inputs), so a direct call is checked too."""
    train, _ = _functions(backend)
    return train(q, k, v, is_causal, window_size)


def decode_attention(q, k, v, k_cache, v_cache, pos, window_size=(-1, -1), backend="triton"):
    """One new token per sequence against a static KV cache: decode.py says what each argument holds."""
    _, decode = _functions(backend)
    check_decode_inputs(q, k, v, k_cache, v_cache, pos, window_size)
    left, _ = window_bounds(False, window_size)
    return decode(q, k, v, k_cache, v_cache, pos, left)
