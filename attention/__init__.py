"""nanoFA2's attention library: one function, several backends.

    from attention import attention
    o = attention(q, k, v, is_causal=True, backend="triton")

q is (..., N_q, D), k and v are (..., N_k, D) with the same leading dims; the result has
q's shape and dtype. Scale 1/sqrt(D). Causal is top-left: key j is visible to query i when
j <= i (see eager.py). This package needs only torch, triton and einops.
"""
from .eager import eager_attention
from .inputs import check_inputs
from .sdpa import sdpa_attention

BACKENDS = ("eager", "sdpa")

_BACKEND_FUNCTIONS = {
    "eager": eager_attention,
    "sdpa": sdpa_attention,
}


def attention(q, k, v, is_causal=False, backend="triton"):
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    check_inputs(q, k, v, is_causal)
    return _BACKEND_FUNCTIONS[backend](q, k, v, is_causal)
