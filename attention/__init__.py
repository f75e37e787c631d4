"""nanoFA2's attention library: one function, several backends.

    from attention import attention, packed_attention
    o = attention(q, k, v, is_causal=True, backend="triton")
    y = packed_attention(qkv, is_causal=True, backend="triton")  # qkv: (B, N, 3, H, D)

q is (..., N_q, D), k and v are (..., N_k, D) with the same leading dims; the result has
q's shape and dtype. Scale 1/sqrt(D). is_causal=True is the top-left causal mask that eager.py
defines. This package needs only torch, triton and einops.

packed_attention takes the fused projection a GPT makes, qkv of shape (B, N, 3, H, D), and
returns (B, N, H, D): the same attention, but the triton backend then reads q, k and v out of
qkv in place and hands autograd one node instead of six (see triton_ops.py).

Every backend traces under torch.compile: the Triton kernels are custom operators
(torch.ops.nanofa2.*; on a GPU torch.library.triton_ops, whose kernel launches Inductor makes
itself; triton_ops.py says more), so a compiled model with triton or triton_fwd is one graph. tiled, the Python loop, may break the graph but compiles
and trains correctly.

Backends:
  eager       materialised softmax; the reference the others are tested against
  tiled       FlashAttention-2 forward and backward as tiled PyTorch loops (teaching version)
  triton      FlashAttention-2 forward and backward Triton kernels
  triton_fwd  the Triton forward with the PyTorch recompute backward
  sdpa        torch.nn.functional.scaled_dot_product_attention, the peer to beat

The files, in reading order:
  eager.py               the definition: softmax(Q K^T / sqrt(D)) V, and the causal rule
  tile_bounds.py         which tiles a program visits, and the mask inside a tile
  tiled.py               the tiled forward in PyTorch (the online softmax)
  tiled_backward.py      the tiled backward in PyTorch: delta, a dK/dV pass, a dQ pass
  triton_tiles.py        the @triton.jit helpers both kernels share (bounds, mask, loads, stores)
  triton_forward.py      the forward kernel
  gluon_forward.py       the forward warp-specialised and persistent in Gluon, for Hopper (gluon_forward.TILES)
  triton_backward.py     the backward kernels: delta, then both passes in one launch
  gluon_backward.py      the backward warp-specialised in Gluon, for Hopper at long sequences: dQ by TMA's reduce
  triton_ops.py          the kernels as torch.library custom operators, with their autograd
  triton_launch.py       the host side of a launch: layouts, device checks, config tuning
  recompute_backward.py  triton_fwd's backward, the step before the FlashAttention-2 backward
  decode.py              decode_attention: one new token's step against a KV cache, every backend
  triton_decode.py       its Triton kernel
  inputs.py, sdpa.py     the input checks and unpack_heads; torch's own attention

docs/flash_attention.md walks the same files with the forwards first: tiled.py,
triton_forward.py, then tiled_backward.py, triton_backward.py.
"""
import os
import sys

import torch

# With no GPU, the Triton backends run their kernels through Triton's interpreter (numpy), so
# CPU users and CI exercise the real kernel source. Triton fixes that choice when its modules
# are first imported, so it is made here, before anything below imports triton.
if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    if "triton" in sys.modules:
        raise ImportError("triton was imported before attention on a machine without a GPU, so its kernels "
                          "cannot run in the Triton interpreter: import attention first, or set TRITON_INTERPRET=1")
    os.environ["TRITON_INTERPRET"] = "1"

from .eager import eager_attention, eager_attention_with_lse  # noqa: E402
from .inputs import check_packed_inputs, unpack_heads  # noqa: E402
from .sdpa import sdpa_attention  # noqa: E402
from .tiled import FlashAttentionPytorch  # noqa: E402
from .triton_ops import triton_attention, triton_fwd_attention, triton_packed_attention  # noqa: E402

__all__ = ["BACKENDS", "attention", "packed_attention", "eager_attention", "eager_attention_with_lse", "sdpa_attention",
           "FlashAttentionPytorch", "triton_attention", "triton_fwd_attention", "triton_packed_attention"]

BACKENDS = ("eager", "tiled", "triton", "triton_fwd", "sdpa")

_BACKEND_FUNCTIONS = {
    "eager": eager_attention,
    "tiled": FlashAttentionPytorch.apply,
    "triton": triton_attention,
    "triton_fwd": triton_fwd_attention,
    "sdpa": sdpa_attention,
}


def attention(q, k, v, is_causal=False, backend="triton"):
    """Each backend's function checks its inputs itself (check_inputs), so that a direct call
    is checked too and a call through here is checked once."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    return _BACKEND_FUNCTIONS[backend](q, k, v, is_causal)


def packed_attention(qkv, is_causal=False, backend="triton"):
    """Attention over a fused projection qkv (B, N, 3, H, D), where q, k, v = qkv.unbind(2);
    returns (B, N, H, D). The triton backend takes qkv whole; the others get (B, H, N, D) views."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    check_packed_inputs(qkv, is_causal)
    if backend == "triton":
        return triton_packed_attention(qkv, is_causal)
    return _BACKEND_FUNCTIONS[backend](*unpack_heads(qkv), is_causal).transpose(1, 2)


# Decoding: one new token per sequence against a static KV cache, every backend (decode.py).
from .decode import decode_attention, store_in_cache  # noqa: E402

__all__ += ["decode_attention", "store_in_cache"]
