"""nanoFA2's attention library: one function, several backends.

    from attention import attention, packed_attention
    o = attention(q, k, v, is_causal=True, backend="triton")
    y = packed_attention(qkv, is_causal=True, backend="triton")  # qkv: (B, N, 3, H, D)

q is (..., N_q, D), k and v are (..., N_k, D) with the same leading dims; the result has
q's shape and dtype. Scale 1/sqrt(D). Causal is top-left: key j is visible to query i when
j <= i (see eager.py). This package needs only torch, triton and einops.

packed_attention takes the fused projection a GPT makes, qkv of shape (B, N, 3, H, D), and
returns (B, N, H, D): the same attention, but the triton backend then reads q, k and v out of
qkv in place and hands autograd one node instead of six (see flash_triton.py).

Every backend traces under torch.compile: the Triton kernels are custom operators
(torch.ops.nanofa2.*, opaque on every device; flash_triton.py says why), so a compiled model
with triton or triton_fwd is one graph. tiled, the Python loop, may break the graph but compiles
and trains correctly.

Backends:
  eager       materialised softmax; the reference the others are tested against
  tiled       FlashAttention-2 forward as a tiled PyTorch loop (teaching version)
  triton      FlashAttention-2 forward and backward Triton kernels
  triton_fwd  the Triton forward with the PyTorch recompute backward
  sdpa        torch.nn.functional.scaled_dot_product_attention, the peer to beat
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
from .flash_triton import triton_attention, triton_fwd_attention, triton_packed_attention, unpack_heads  # noqa: E402
from .inputs import check_packed_inputs  # noqa: E402
from .sdpa import sdpa_attention  # noqa: E402
from .tiled import FlashAttentionPytorch  # noqa: E402

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


# Decoding: one new query per sequence against a static KV cache, every backend (decode.py).
from .decode import decode_attention  # noqa: E402

__all__ += ["decode_attention"]
