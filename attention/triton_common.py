"""What the Triton kernels share: layout checks, the interpreter warning, tile-config limits
and the tuning that picks a config per shape. (Whether the kernels are compiled or
interpreted is decided in attention/__init__.py.)"""
import os
import sys
import warnings

import torch
import triton

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def set_tma_scratch_allocator():
    """The kernels build TMA tensor descriptors on the device, in a little global scratch memory
    Triton asks for at each launch. Its allocator is a context variable, so set it per launch."""
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


# Shared memory of the target card, the RTX 4070 Super (sm_89): 99 KB per block. Every
# config the code can pick on such a card must fit it; tests/test_triton_configs.py
# compiles each one for sm_89 and checks.
ADA_SHARED_MEMORY_BYTES = 101376


def as_4d(t):
    """(..., N, D) -> a (B, H, N, D) view (a copy only when the leading dims cannot be viewed)."""
    if t.dim() == 4:  # the common case, and a reshape costs CPU time even when it changes nothing
        return t
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 3:
        return t[:, None]
    return t.reshape(-1, *t.shape[-3:])


def descriptor_ready(t):
    """t as a (B, H, N, D) view the kernels can build TMA descriptors on (see tma_describable).
    The model's q, k, v views always qualify; anything else (an odd slice, an expanded
    gradient) is copied once."""
    t4 = as_4d(t)
    return t4 if tma_describable(t4, row_dim=2) else t4.clone(memory_format=torch.contiguous_format)


def tma_describable(t, row_dim):
    """Whether TMA (and the kernels, which take no stride along D) can describe t's matrices: a
    16-byte aligned base, a unit last stride, 16-byte aligned other strides and a non-zero stride
    between rows."""
    elem = t.element_size()
    return t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and all(s * elem % 16 == 0 for s in t.stride()[:-1]) \
        and t.stride(row_dim) > 0


def check_kernel_device(t):
    """CPU tensors run through the interpreter (with a warning); that needs the interpreter on."""
    if t.device.type == "cpu":
        if not INTERPRETING:
            raise ValueError("q is a CPU tensor but the Triton kernels were compiled for the GPU; set "
                             "TRITON_INTERPRET=1 before importing attention to run them on the CPU")
        warnings.warn("Triton attention on CPU runs through the Triton interpreter: correct but slow",
                      stacklevel=_caller_stacklevel())


# Frames a warning should not be attributed to: the libraries between the caller's attention
# call and the warning, and the code torch.compile generates (file names like "<eval_with_key>").
_LIBRARY_DIRS = tuple(os.path.dirname(module.__file__) for module in (torch, triton)) + (os.path.dirname(__file__),)


def _caller_stacklevel():
    """warnings.warn's stacklevel for the innermost frame of the code that called attention
    (a script, model.py, a test), past torch, triton, this package and generated code."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith((*_LIBRARY_DIRS, "<")):
        frame, level = frame.f_back, level + 1
    return level


def has_tma(device):
    """Hopper (sm_90) and newer copy tiles with the TMA engine; older cards use cp.async."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def tuning_key(q, k, is_causal):
    """What changes a kernel's fastest config: the lengths (as power-of-two buckets, so a KV cache
    that grows by one token a step does not re-tune at every step), head dim, mask and dtype."""
    _, _, n_q, head_dim = q.shape
    n_k = k.shape[2]
    return 1 << max(n_q - 1, 15).bit_length(), 1 << max(n_k - 1, 15).bit_length(), head_dim, is_causal, q.dtype


def shared_memory_limit(device):
    if INTERPRETING or device.type != "cuda":
        return ADA_SHARED_MEMORY_BYTES
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


# Shared memory the compiler adds beyond the tiles (barriers, layout-conversion scratch);
# the most seen in tests/test_triton_configs.py is 4 KB.
SHARED_MEMORY_SLACK_BYTES = 8192


def shared_memory_bytes(config, smem_rows, head_dim, element_size):
    """Shared memory a config needs. smem_rows(config) -> (resident, streamed): how many
    HEAD_DIM-wide rows a program keeps for its whole life, and how many each pipeline stage
    holds. TMA keeps num_stages stages in flight; cp.async num_stages - 1 (the stage being
    computed on has moved to registers). tests/test_triton_configs.py checks this bound
    against what the compiler allocates for sm_89."""
    resident, streamed = smem_rows(config)
    stages = config.num_stages if config.kwargs["USE_TMA"] else config.num_stages - 1
    return element_size * head_dim * (resident + stages * streamed) + SHARED_MEMORY_SLACK_BYTES


def prune_configs(configs, q, smem_rows):
    """The configs a kernel may run with on q's card: no TMA configs on cards without TMA, and
    none whose tiles would not fit the card's shared memory."""
    if not has_tma(q.device) and not INTERPRETING:
        configs = [c for c in configs if not c.kwargs["USE_TMA"]]
    footprint = lambda c: shared_memory_bytes(c, smem_rows, q.shape[-1], q.element_size())
    fits = [c for c in configs if footprint(c) <= shared_memory_limit(q.device)] or [min(configs, key=footprint)]
    if INTERPRETING:  # nothing to time: one config, the largest tiles (fewest interpreted programs)
        return [max(fits, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]
    return fits


class TunedKernel:
    """A Triton kernel launched with the fastest of its candidate configs, per tuning key.

    The first launch for a key times every config that fits the card, on the real arguments (each
    kernel writes its outputs whole, with no atomics, so running it several times is harmless).
    triton.autotune does the same, but re-derives its key from all ~30 arguments at every launch.

    Launching through kernel[grid](...) costs Triton's launcher about 50 us of CPU time on the
    H200's host: it binds the ~30 arguments, re-derives what the kernel was specialised on and
    looks the binary up. At the model's shapes the GPU would wait on that, so each launch's
    compiled kernel is kept and later launches with the same tuning key, grid and scalar
    arguments call it directly (about 16 us). That is safe because everything Triton specialises
    a binary on is in that key or checked: the scalars include every int argument (strides,
    heads, lengths), the tensors' dtype is the tuning key's, and their 16-byte alignment is
    checked at each launch. (The interpreter returns no compiled kernel: every launch takes the
    long way.)"""

    def __init__(self, kernel, configs, smem_rows):
        self.kernel, self.configs, self.smem_rows = kernel, configs, smem_rows
        self.best = {}  # tuning key -> config
        self.compiled = {}  # (tuning key, device, grid, scalars, constexprs) -> (launch, constexpr args)

    def __call__(self, grid, key, *args, **constexprs):
        """args: the kernel's tensors, then its scalars; constexprs: the rest but the config's."""
        config = self.best.get(key)
        if config is None:
            config = self.best[key] = self.fastest_config(grid, args, constexprs)
        num_tensors = next(i for i, a in enumerate(args) if not isinstance(a, torch.Tensor))
        grid_size = grid(config.kwargs)
        launch_key = (key, args[0].get_device(), grid_size, args[num_tensors:], *constexprs.values())
        aligned = all(t.data_ptr() % 16 == 0 for t in args[:num_tensors])
        compiled = self.compiled.get(launch_key)
        if compiled is not None and aligned:
            launch, constexpr_args = compiled
            launch(*args, *constexpr_args)
            return
        kernel = self.kernel[grid](*args, **constexprs, **config.all_kwargs())
        if kernel is not None and aligned:
            values = {**constexprs, **config.kwargs}
            constexpr_args = tuple(values[name] for name in self.kernel.arg_names[len(args):])
            self.compiled[launch_key] = kernel[(*grid_size, 1, 1)[:3]], constexpr_args

    def fastest_config(self, grid, args, constexprs):
        candidates = prune_configs(self.configs, args[0], self.smem_rows)
        if len(candidates) == 1:
            return candidates[0]

        def median_ms(config):
            try:
                return triton.testing.do_bench(lambda: self.kernel[grid](*args, **constexprs, **config.all_kwargs()),
                                               return_mode="median")
            except (triton.runtime.errors.OutOfResources, triton.runtime.errors.PTXASError):
                return float("inf")  # a limit of this card the shared-memory estimate missed: skip the config
        return min(candidates, key=median_ms)
