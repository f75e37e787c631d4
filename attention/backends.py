"""The backends, one row each: its name, the function attention() calls and the one
decode_attention() calls (attention/__init__.py dispatches both through this table). Adding a
backend is a row here and the function it names; the scripts' --attn choices, compare.py's runs
and bench.py's providers all come from these names.

The functions are named by "module.attribute" in this package, so that this file imports
nothing heavy: training/config.py reads it as a file (runpy), for --help and the settings'
checks before torch loads. (Importing attention.backends would run attention/__init__.py first,
and with it torch.)
"""
import functools
import importlib
from typing import NamedTuple


class Backend(NamedTuple):
    train: str  # (q, k, v, is_causal, window_size) -> o, differentiable: attention()'s backend
    decode: str  # (q, k, v, k_cache, v_cache, pos, left) -> o: one token against a KV cache (decode.py)
    triton: bool  # runs the Triton kernels: head dims a multiple of 8 up to 256, interpreted without a GPU


TABLE = {
    "eager": Backend("eager.eager_attention", "decode.eager_decode_attention", triton=False),
    "tiled": Backend("tiled.FlashAttentionPytorch.apply", "decode.tiled_decode_attention", triton=False),
    "triton": Backend("triton_ops.FlashAttentionTriton.apply", "decode.triton_kernel_decode_attention", triton=True),
    # The triton forward with a PyTorch backward; a decode step has no backward, so it decodes as triton does.
    "triton_fwd": Backend("triton_ops.TritonForwardRecomputeBackward.apply", "decode.triton_kernel_decode_attention",
                          triton=True),
    "sdpa": Backend("sdpa.sdpa_attention", "decode.sdpa_decode_attention", triton=False),
}
BACKENDS = tuple(TABLE)
TRITON_BACKENDS = tuple(name for name, backend in TABLE.items() if backend.triton)


def load(path):
    """The function a row names, e.g. "tiled.FlashAttentionPytorch.apply" (imports its module)."""
    module, *attributes = path.split(".")
    return functools.reduce(getattr, attributes, importlib.import_module(f".{module}", __package__))
