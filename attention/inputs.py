"""What callers hand to attention() and packed_attention(): checks that give a clear ValueError
instead of a kernel fault or silent garbage, and unpack_heads, which turns packed_attention's
fused projection into every backend's q, k, v. Every backend runs check_inputs; the Triton
kernels also run check_triton_inputs for the limits of the kernels themselves."""
import torch

TRITON_HEAD_DIMS = (16, 32, 64, 128)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The float8 types are floating point too, but no backend computes in them.
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_inputs(q, k, v, is_causal):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() < 2:
            raise ValueError(f"{name} must have shape (..., N, D) with at least 2 dims, got shape {tuple(t.shape)}")
    if q.shape[-1] == 0:
        raise ValueError(f"q has head dim D=0 (shape {tuple(q.shape)}); the head dim must be at least 1")
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
    for name, t in (("k", k), ("v", v)):
        if t.shape[:-2] != q.shape[:-2]:
            raise ValueError(f"{name} leading dims {tuple(t.shape[:-2])} must equal q's {tuple(q.shape[:-2])} "
                             f"(q {tuple(q.shape)}, {name} {tuple(t.shape)}); broadcasting is not supported")
        if t.shape[-1] != q.shape[-1]:
            raise ValueError(f"{name} head dim {t.shape[-1]} must equal q's head dim {q.shape[-1]}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k and v must share one dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; q, k and v must share one device")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"v has N_k={v.shape[-2]} keys but k has N_k={k.shape[-2]}; they must match")


def check_packed_inputs(qkv, is_causal):
    """packed_attention's qkv: (B, N, 3, H, D), floating point."""
    check_tensor("qkv", qkv)
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must have shape (B, N, 3, H, D) (q, k, v = qkv.unbind(2)), got shape {tuple(qkv.shape)}")
    if qkv.shape[-1] == 0:
        raise ValueError(f"qkv has head dim D=0 (shape {tuple(qkv.shape)}); the head dim must be at least 1")
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal must be a bool, got {is_causal!r}")


def unpack_heads(qkv):
    """(B, N, 3, H, D) -> q, k, v as (B, H, N, D) views."""
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


def check_tensor(name, t):
    """A tensor with data (not on the meta device) of a dtype the backends compute in."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if t.dtype not in DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; attention takes {', '.join(map(str, DTYPES))}")
    if t.device.type == "meta":
        raise ValueError(f"{name} is on {t.device}, a device that holds no data; attention needs tensors with "
                         "values (on the CPU or a GPU)")


def check_triton_inputs(q, k, v, names=("q", "k", "v")):
    """The Triton kernels' own limits, beyond check_inputs. names: what the caller calls q, k
    and v (decode.py: the fused projection and the two caches)."""
    if q.dtype not in TRITON_DTYPES:
        raise ValueError(f"{names[0]} has dtype {q.dtype}; the Triton kernels take "
                         f"{', '.join(map(str, TRITON_DTYPES))}")
    if q.shape[-1] not in TRITON_HEAD_DIMS:
        raise ValueError(f"{names[0]} has head dim D={q.shape[-1]}; the Triton kernels support D in {TRITON_HEAD_DIMS} "
                         "(the eager, tiled and sdpa backends take any D)")
    for name, t in zip(names, (q, k, v)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} has last-dim stride {t.stride(-1)}; the Triton kernels need stride 1 "
                             f"along D (pass {name}.contiguous())")
