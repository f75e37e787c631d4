"""Which device and precision a script runs with, and what the card can do at best.

Shared by the scripts so that `device=auto` and `dtype=auto` mean the same everywhere:
the GPU when there is one, bf16 autocast on GPUs that support it, fp16 (with a gradient
scaler, see train.py) on older ones, and plain fp32 on the CPU. Generation in bf16 casts the
weights instead of autocasting (generation_precision).
"""
import contextlib

import torch

# Dense bf16 tensor-core throughput with fp32 accumulation, from NVIDIA's datasheets.
# MFU (model FLOPs utilisation) is measured against it. Matched against
# torch.cuda.get_device_name() in order, so the more specific names come first.
PEAK_BF16_FLOPS = (
    ("rtx 4070 super", 71e12),
    ("rtx 4090", 165e12),
    ("a100", 312e12),
    ("h100 pcie", 756e12),
    ("h100", 989e12),  # SXM
    ("h200", 989e12),
)


class DeviceError(RuntimeError):
    pass


def pick_device(name):
    """'auto' | 'cpu' | 'cuda' -> torch.device."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceError("device='cuda' but torch sees no CUDA GPU (use device=cpu or device=auto)")
    return torch.device(name)


def pick_dtype(name, device):
    """'auto' | 'float32' | 'bfloat16' | 'float16' -> the torch dtype autocast runs in."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name == "float16" and device.type != "cuda":
        raise DeviceError("dtype='float16' needs a CUDA device; on the CPU use float32 or bfloat16")
    if name == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError("dtype='bfloat16' is not supported by this GPU; use float16 or auto")
    return getattr(torch, name)


def autocast(device, dtype):
    """Mixed precision for the forward pass; weights and optimizer state stay fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def generation_precision(model, device, dtype):
    """Put model (fp32, on device, before its first generate) in the precision it generates
    in, and return the context to call model.generate under (reusable, one `with` at a time).
    bfloat16: the weights themselves become bf16, cast once here, and generation runs without
    autocast. Under autocast every token would cast every weight from fp32 again, as the
    decoder's CUDA graph cannot keep autocast's cache of cast weights (StaticDecoder.capture):
    a read of 4 bytes and a write of 2 per parameter, and a cast kernel per weight, at every
    token. bf16 has fp32's exponent range, so the residual stream and the logits in bf16
    overflow only where fp32 would. float16 tops out at 65504: there the weights stay fp32 under
    autocast, which keeps the embeddings, the residual stream and the LayerNorms in fp32 and
    rounds only matmul outputs to fp16, as in training (GPUs without bf16 pay the casts).
    float32: nothing to do."""
    if dtype == torch.bfloat16:
        model.to(dtype)
        return contextlib.nullcontext()
    return autocast(device, dtype)


def synchronize(device):
    """Wait for queued GPU work, so a wall-clock reading covers the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_flops(device):
    """The card's dense bf16 peak in FLOP/s, or None when the device is not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops
    return None


def peak_memory_mb(device):
    """Most GPU memory torch has held since the start (None on the CPU)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


def cap_memory(device, max_gb):
    """Let torch's CUDA allocator hold at most max_gb GiB on `device`, so a big card runs out
    of memory where a smaller one would (an H200 acting as a 12 GB card). The CUDA context and
    anything allocated outside torch are not counted. Returns the card's own GiB."""
    if device.type != "cuda":
        raise DeviceError(f"max_memory_gb={max_gb:g} caps CUDA memory, but the device is {device.type}; "
                          "leave max_memory_gb at 0 there")
    index = device.index if device.index is not None else torch.cuda.current_device()  # torch wants an index here
    total_gb = torch.cuda.get_device_properties(index).total_memory / 2**30
    # A cap above the card's size would be an error to torch; the card itself is the cap then.
    torch.cuda.set_per_process_memory_fraction(min(max_gb / total_gb, 1.0), index)
    return total_gb
