"""How the host launches the Triton kernels: the layouts they take, the device check, which
card path runs (the consumer-card switch), and the tile configs that fit a card, tuned by
triton.autotune. What runs inside the kernels is triton_tiles.py, triton_forward.py and
triton_backward.py.

The consumer-card path: NANOFA2_ADA=1 runs, on any card, the path an RTX 4070 Super (Ada,
sm_89) takes: no Hopper kernels, no TMA configs, shared memory capped at Ada's 99 KB a block,
and Ampere-class mma.sync (_setup.py sets DISABLE_MMA_V3=1). docs/learn.md says
how far that is from the card itself.
"""
import contextlib
import ctypes
import functools
import math
import os
import sys
import warnings

import torch
import triton

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
ADA_PATH = os.environ.get("NANOFA2_ADA") == "1"

# Shared memory of the target card, the RTX 4070 Super (sm_89): 99 KB per block. Every config the
# code can pick on such a card must fit it; tests/test_triton_configs.py compiles each for sm_89.
ADA_SHARED_MEMORY_BYTES = 101376
# Shared memory the compiler adds beyond the tiles (barriers, layout-conversion scratch): twice
# the most tests/test_triton_configs.py has seen.
SHARED_MEMORY_SLACK_BYTES = 8192
# The L2 cache of the target card: what the interpreter assumes (heads_first).
ADA_L2_BYTES = 48 * 2 ** 20
GRID_Y_LIMIT = 65535  # CUDA's limit on a grid's y dimension (x takes up to 2**31 - 1)
RELAXED_CAPTURE_MODE = 2  # CUDA's CU_STREAM_CAPTURE_MODE_RELAXED
TIMED_CONFIGS = 3  # a kernel's configs are listed best first; the tuner times the first few that fit


def as_4d(t):
    """(..., H, N, D) -> a (B, H, N, D) view (a copy only when the leading dims cannot be viewed);
    a 4-D tensor as it is. B is counted, not inferred (-1): with an empty dim anywhere, -1 could
    be any size."""
    if t.dim() == 4:
        return t
    if t.dim() < 4:
        return t.reshape((1,) * (4 - t.dim()) + t.shape)
    return t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])


def dense_strides(t):
    """The strides of a new dense tensor shaped like t whose dims lie in memory in t's order (as
    torch.empty_like lays out a strided t): for the model's (B, H, N, D) views of a fused (B, N,
    H + 2 * H_kv, D) projection, (B, N, H, D) order, so O goes back to (B, N, H * D) with no copy.
    Contiguous strides when that order has no unit stride along the last dim."""
    order = sorted(range(t.dim()), key=t.stride, reverse=True)  # outermost first; a stable sort keeps ties
    if order[-1] != t.dim() - 1:
        order = range(t.dim())
    strides, step = [0] * t.dim(), 1
    for dim in reversed(order):
        strides[dim], step = step, step * t.shape[dim]
    return tuple(strides)


def new_like(t):
    """An empty tensor shaped like t, in t's memory order (dense_strides)."""
    return torch.empty_strided(t.shape, dense_strides(t), dtype=t.dtype, device=t.device)


def descriptor_ready(t):
    """t as a (B, H, N, D) view the kernels can read (TMA too): a 16-byte aligned base, unit
    stride along D and 16-byte aligned other strides. The model's q, k, v views always qualify;
    anything else (an odd slice, an expanded gradient) is copied once."""
    t4 = as_4d(t)
    elem = t4.element_size()
    describable = (t4.data_ptr() % 16 == 0 and t4.stride(-1) == 1 and t4.stride(2) > 0
                   and all(s * elem % 16 == 0 for s in t4.stride()[:-1]))
    return t4 if describable else t4.clone(memory_format=torch.contiguous_format)


# The host's grid and tile arithmetic is on plain ints: triton.cdiv and triton.next_power_of_2
# are ConstexprFunctions since Triton 3.5, about 2 us a call from the host.
def cdiv(n, d):
    """ceil(n / d) for ints."""
    return -(-n // d)


def power_of_2_at_least(n):
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def head_dim_block(head_dim):
    """The head dim padded to a power of two, at least 16 (the smallest tl.dot takes)."""
    return max(16, power_of_2_at_least(head_dim))


def length_bucket(n):
    """What the tuner keys a sequence length on: n rounded up to a power of two, at least 16, so
    that a new prompt length tunes only where it starts a new bucket (FlashAttention's Triton
    kernel keys on n // 32). The kernels get the exact lengths; only the tuner's key is bucketed."""
    return max(16, power_of_2_at_least(n))


def check_kernel_device(t):
    """CPU tensors run through the interpreter (with a warning); that needs the interpreter on."""
    if t.device.type == "cpu":
        if not INTERPRETING:
            raise ValueError("q is a CPU tensor but Triton was loaded to compile for a GPU: to run the Triton "
                             "kernels on the CPU, set TRITON_INTERPRET=1 before anything imports triton, or import "
                             "attention first")
        warnings.warn("Triton attention on CPU runs through the Triton interpreter: correct but slow",
                      stacklevel=_caller_stacklevel())


# Frames a warning should not be attributed to: torch, triton, this package, and the code
# torch.compile generates (file names like "<eval_with_key>").
_LIBRARY_DIRS = tuple(os.path.dirname(path) + os.sep for path in (torch.__file__, triton.__file__, __file__))


def _caller_stacklevel():
    """warnings.warn's stacklevel for the innermost frame of the code that called attention."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith((*_LIBRARY_DIRS, "<")):
        frame, level = frame.f_back, level + 1
    return level


def has_tma(device):
    """Hopper (sm_90) and newer copy tiles with the TMA engine; older cards, and the consumer-card
    path, use cp.async."""
    return device.type == "cuda" and not ADA_PATH and torch.cuda.get_device_capability(device)[0] >= 9


def tma_scratch(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def set_tma_scratch_allocator():
    """The kernels build TMA descriptors on the device, in a little global scratch memory Triton
    asks for at each launch (tma_scratch). Its allocator is a context variable, so set it per launch."""
    triton.set_allocator(tma_scratch)


@contextlib.contextmanager
def kernels_may_load(device):
    """A kernel's first launch at a new specialization compiles it and loads its binary
    (cuModuleLoadData, cuFuncSetAttribute), driver calls that a CUDA graph capture in torch's
    default (global) mode refuses: "operation not permitted when stream is capturing", and the
    capture is lost. Inside a capture, the launches in this block run with the thread in relaxed
    mode, as torch's allocator runs its cudaMalloc in a capture: loading is no work on the
    stream, and the graph records the same launches."""
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        yield
        return
    exchange = ctypes.CDLL("libcuda.so.1").cuThreadExchangeStreamCaptureMode
    mode = ctypes.c_int(RELAXED_CAPTURE_MODE)
    if exchange(ctypes.byref(mode)) != 0:  # mode now holds the thread's own, to restore
        raise RuntimeError("cuThreadExchangeStreamCaptureMode failed: cannot load kernels inside this capture")
    try:
        yield
    finally:
        exchange(ctypes.byref(mode))


@functools.cache
def shared_memory_limit(device):
    if INTERPRETING or device.type != "cuda":
        return ADA_SHARED_MEMORY_BYTES
    card = triton.runtime.driver.active.utils.get_device_properties(device.index)["max_shared_mem"]
    return min(card, ADA_SHARED_MEMORY_BYTES) if ADA_PATH else card


@functools.cache
def l2_bytes(device):
    return ADA_L2_BYTES if device.type != "cuda" else torch.cuda.get_device_properties(device).L2_cache_size


def heads_first(k, n_heads):
    """Whether the grid puts the heads along x (triton_tiles.program_tile_and_head), so that the
    longest tiles of every head start first: when all heads' keys and values fit in half the L2
    (the model's case, a grid of one or two waves). Beyond that (the paper's shapes), programs of
    many heads at once evict each other's tiles. Also when n_heads exceeds the grid's y limit."""
    return 2 * k.numel() * k.element_size() <= l2_bytes(k.device) // 2 or n_heads > GRID_Y_LIMIT


def program_grid(tiles, heads, heads_first):
    return (heads, tiles) if heads_first else (tiles, heads)


def shared_memory_bytes(config, smem_rows, head_dim, element_size, wgmma):
    """Shared memory a config needs. smem_rows(config) -> [(resident, streamed), ...], one pair
    per job a program of the kernel may do: how many rows of BLOCK_D it keeps for its whole life,
    and how many each pipeline stage holds. TMA keeps num_stages stages in flight. cp.async keeps
    num_stages - 1 where the matrix multiplies read their operands from registers (mma.sync: Ada,
    Ampere, the consumer-card path), as the stage being computed on has moved there; Hopper's
    wgmma reads them from shared memory (wgmma=True), so that stage stays: num_stages (at head
    dim 256, 64 KB more for 64-key tiles in 16 bits)."""
    stages = config.num_stages if config.kwargs["USE_TMA"] or wgmma else config.num_stages - 1
    rows = max(resident + stages * streamed for resident, streamed in smem_rows(config))
    return element_size * head_dim_block(head_dim) * rows + SHARED_MEMORY_SLACK_BYTES


def card_path(device):
    """Which of a kernel's config lists (CONFIGS tables) a card takes: "hopper" where it copies
    tiles with TMA (has_tma), "consumer card" elsewhere: the RTX 4070 Super, any card before
    Hopper, the consumer-card path on any card, and the interpreter."""
    return "hopper" if has_tma(device) else "consumer card"


def candidates(table, device, head_dim):
    """A kernel's configs for device's card path and head_dim, best first: table maps (card path,
    the largest head dim a list is for) to a list of triton.Configs; the list of the smallest
    such head dim at least head_dim."""
    path = card_path(device)
    return table[path, min(d for p, d in table if p == path and d >= head_dim)]


def config_name(config):
    """A config as the tables and bench.py name it: the forward's "128x64 w4 s3" (BLOCK_M x
    BLOCK_N, warps, stages), the backward's "split 64x64/32 w4 s3" (the dQ job's BLOCK_M x
    BLOCK_N / the dK/dV job's DKDV_BLOCK_M) or "atomic 64x128 w8 s2" (the dK/dV job's query
    rows x key rows); " tma" where it loads with TMA."""
    kw = config.kwargs
    if "ATOMIC_DQ" not in kw:
        tiles = f"{kw['BLOCK_M']}x{kw['BLOCK_N']}"
    elif kw["ATOMIC_DQ"]:
        tiles = f"atomic {kw['DKDV_BLOCK_M']}x{kw['BLOCK_N']}"
    else:
        tiles = f"split {kw['BLOCK_M']}x{kw['BLOCK_N']}/{kw['DKDV_BLOCK_M']}"
    return f"{tiles} w{config.num_warps} s{config.num_stages}" + (" tma" if kw["USE_TMA"] else "")


def fitting_configs(configs, smem_rows, tensor, head_dim, n_q, n_k):
    """The configs a kernel may run with on tensor's card, best first: no TMA configs where the
    card has none or the head dim is padded (a TMA box would be wider than the matrix), none whose
    tiles do not fit its shared memory, none whose tiles are longer than the sequences (they
    would time mostly padding). At least the smallest config is always kept."""
    if (not has_tma(tensor.device) and not INTERPRETING) or head_dim_block(head_dim) != head_dim:
        configs = [c for c in configs if not c.kwargs["USE_TMA"]]
    wgmma = has_tma(tensor.device)  # sm_90 (a newer card is counted alike: an overestimate at worst)
    footprint = lambda c: shared_memory_bytes(c, smem_rows, head_dim, tensor.element_size(), wgmma)
    fits = [c for c in configs if footprint(c) <= shared_memory_limit(tensor.device)] or [min(configs, key=footprint)]
    short = [c for c in fits if c.kwargs["BLOCK_M"] <= max(n_q, 16) and c.kwargs["BLOCK_N"] <= max(n_k, 16)]
    return short or [min(fits, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


def time_from_cuda_graph(kernel_call, quantiles):
    """autotuned's timing. The interpreter times nothing, nor does a CUDA graph capture (a
    timing synchronises, which a capture refuses), and neither runs the kernel here: the prune
    leaves them one candidate, which Triton 3.6 still times (later releases take a lone
    candidate untimed); in a capture the launch that follows is the one the graph records."""
    if INTERPRETING or torch.cuda.is_current_stream_capturing():
        return [0.0] * len(quantiles)
    return triton.testing.do_bench_cudagraph(kernel_call, rep=20, quantiles=quantiles)


def pruned_configs(table, smem_rows, named_args, kwargs):
    """The configs autotuned times for one call: candidates() of its card path and head dim, those
    that add with atomics (ATOMIC_DQ) dropped where the call asks for DETERMINISTIC results, then
    the first TIMED_CONFIGS that fit (fitting_configs). The interpreter: of every list's configs
    that fit, the one with the largest tiles, and of those an atomic one (the fewest interpreted
    programs: the atomic schedule has no dQ programs). Inside a CUDA graph capture: the first."""
    configs = (list(dict.fromkeys(c for configs in table.values() for c in configs)) if INTERPRETING
               else candidates(table, named_args["Q"].device, kwargs["HEAD_DIM"]))
    if kwargs.get("DETERMINISTIC"):
        configs = [c for c in configs if not c.kwargs.get("ATOMIC_DQ")]
    fitting = fitting_configs(configs, smem_rows, named_args["Q"], kwargs["HEAD_DIM"], named_args["N_Q_BUCKET"],
                              named_args["N_K_BUCKET"])
    if INTERPRETING:
        return [max(fitting, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"], c.kwargs.get("ATOMIC_DQ")))]
    if torch.cuda.is_current_stream_capturing():
        return fitting[:1]
    return fitting[:TIMED_CONFIGS]


def autotuned(table, smem_rows, key, reset_to_zero=None):
    """triton.autotune over a table of configs (candidates()), keyed on key (argument names;
    Triton adds the tensors' dtypes), where the lengths are the kernel's N_Q_BUCKET and
    N_K_BUCKET (length_bucket: every length of a bucket gets the same candidates and choice), pruned to the configs of the call's card path and head dim
    that fit (pruned_configs) and timed replayed from a CUDA graph, so the ranking is of the
    kernels' GPU time, not of their launches. The choice is cached on disk (Triton's cache dir),
    so a second process does not tune; kernel.best_config is the one the last call ran. Every
    kernel tuned this way writes its outputs whole, so running it several times while timing is
    harmless, but for the arguments named in reset_to_zero, which it adds to: the tuner zeroes
    them before each timed run and after the last."""
    configs = list(dict.fromkeys(c for configs in table.values() for c in configs))

    def prune(configs, named_args, **kwargs):
        return pruned_configs(table, smem_rows, named_args, kwargs)

    return triton.autotune(configs=configs, key=key, prune_configs_by={"early_config_prune": prune},
                           reset_to_zero=reset_to_zero, do_bench=time_from_cuda_graph, cache_results=True)
