"""How the host launches the Triton kernels: the layouts they take (descriptor_ready), the
device check and the interpreter warning, the tile configs that fit a card, and TunedKernel,
which picks a config per shape and launches it (or, while torch.compile traces, records the
launch). Whether the kernels are compiled or interpreted is decided in attention/__init__.py;
what runs inside them is triton_tiles.py, triton_forward.py and triton_backward.py."""
import functools
import json
import os
import re
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
import triton
from torch.utils._python_dispatch import _disable_current_modes

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


def dense_strides(t):
    """The strides of a new dense tensor shaped like t whose dims lie in memory in t's order (as
    torch.empty_like lays out a strided t, computed without allocating): for the model's (B, H,
    N, D) views of a (B, N, 3, H, D) projection, (B, N, H, D) order. Contiguous strides when that
    order has no unit stride along the last dim, which the kernels need."""
    order = sorted(range(t.dim()), key=t.stride, reverse=True)  # outermost first; a stable sort keeps ties in place
    if order[-1] != t.dim() - 1:
        order = range(t.dim())
    strides, step = [0] * t.dim(), 1
    for dim in reversed(order):
        strides[dim], step = step, step * t.shape[dim]
    return tuple(strides)


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
    return aligned(t) and t.stride(-1) == 1 and all(s * elem % 16 == 0 for s in t.stride()[:-1]) \
        and t.stride(row_dim) > 0


def traced(t):
    """Whether t is one of the stand-ins torch.compile traces a torch.library.triton_op with (a
    fake or functional tensor, both torch.Tensor subclasses): it has a shape and strides but no
    memory, so a kernel launch can only be recorded for it (TunedKernel.record), not made."""
    return type(t) is not torch.Tensor


def hint(value):
    """The value a traced length or stride has in the example torch.compile traces with: a plain
    int as it is; a symbol (dynamic shapes) by its hint, which, unlike int(), adds no guard, so
    the graph stays general. (Lengths that come from input shapes always have a hint.)"""
    return value.node.hint if isinstance(value, torch.SymInt) else value


def real_stand_in(t):
    """A real tensor, of random values, with a traced tensor's dtype, device, and the shape,
    strides and storage offset it has in the traced example: what TunedKernel times a traced
    launch's configs on."""
    shape, strides, offset = [hint(n) for n in t.shape], [hint(n) for n in t.stride()], hint(t.storage_offset())
    elements = offset + sum((size - 1) * stride for size, stride in zip(shape, strides)) + 1
    return torch.randn(elements, dtype=t.dtype, device=t.device).as_strided(shape, strides, offset)


def aligned(t):
    """Whether t's first element is 16-byte aligned. A traced tensor's storage will be aligned
    (Inductor allocates aligned buffers and copies a misaligned input before the graph runs),
    so its offset into that storage decides."""
    if traced(t):
        return t.storage_offset() * t.element_size() % 16 == 0
    return t.data_ptr() % 16 == 0


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
_LIBRARY_DIRS = tuple(os.path.dirname(path) + os.sep for path in (torch.__file__, triton.__file__, __file__))


def _caller_stacklevel():
    """warnings.warn's stacklevel for the innermost frame of the code that called attention
    (a script, model.py, a test), past torch, triton, this package and generated code."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith((*_LIBRARY_DIRS, "<")):
        frame, level = frame.f_back, level + 1
    return level


# The operators torch.ops.nanofa2.* (triton_ops.py, triton_decode.py), defined with torch.library's
# low-level API rather than the torch.library.custom_op decorator, whose Python wrapper around
# each call adds host time (docs/benchmarks.md, "The operators' host cost").
OPERATORS = torch.library.Library("nanofa2", "DEF")


def define_operator(name, schema, kernel, fake):
    """torch.ops.nanofa2.<name>(<schema>): kernel on CPU (the interpreter) and CUDA, fake for the
    compiler (outputs' shapes and strides, without running it). Returns the operator."""
    OPERATORS.define(name + schema)
    for device in ("CPU", "CUDA"):
        OPERATORS.impl(name, kernel, device)
    torch.library.register_fake(f"nanofa2::{name}", fake, lib=OPERATORS)
    return getattr(torch.ops.nanofa2, name).default


def has_tma(device):
    """Hopper (sm_90) and newer copy tiles with the TMA engine; older cards use cp.async."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


# The L2 cache of the target card, the RTX 4070 Super: what the interpreter assumes.
ADA_L2_BYTES = 48 * 2 ** 20
# CUDA's limit on a grid's y dimension (x takes up to 2**31 - 1).
GRID_Y_LIMIT = 65535


@functools.cache
def l2_bytes(device):
    return ADA_L2_BYTES if device.type != "cuda" else torch.cuda.get_device_properties(device).L2_cache_size


def heads_first(k):
    """Whether the kernels' grid puts the heads along x (triton_tiles.program_tile_and_head),
    so that the longest tiles of every head start first: when the keys and values of all
    heads, which every program streams, fit in half the L2. That is the model's case, where a
    grid is one or two waves of programs and one head's tiles in a row left a tail of long
    programs at the end. Beyond that (the paper's shapes), programs of many heads at once evict
    each other's tiles, and one head's tiles together are faster (docs/optimisation.md, "The
    grid order"). Also whenever B * H exceeds what the grid's y dimension holds."""
    B, H = k.shape[:2]
    return 2 * k.numel() * k.element_size() <= l2_bytes(k.device) // 2 or B * H > GRID_Y_LIMIT


def program_grid(tiles, batch_heads, heads_first):
    return (batch_heads, tiles) if heads_first else (tiles, batch_heads)


class TuningKey(NamedTuple):
    """What changes a kernel's fastest config, the counts in power-of-two buckets: the number of
    (batch, head) pairs, which with the lengths sets how many programs the grid fills the GPU
    with; the lengths (buckets of at least 16, so a KV cache that grows by one token a step does
    not re-tune at every step); head dim, mask and dtype."""
    batch_heads: int
    n_q: int
    n_k: int
    head_dim: int
    is_causal: bool
    dtype: torch.dtype


def power_of_two_bucket(n, at_least=1):
    """The smallest power of two >= n, and >= at_least (a power of two)."""
    return 1 << max(n - 1, at_least - 1).bit_length()


def tuning_key(q, k, is_causal):
    batch, heads, n_q, head_dim = q.shape
    return TuningKey(power_of_two_bucket(batch * heads), power_of_two_bucket(n_q, 16),
                     power_of_two_bucket(k.shape[2], 16), head_dim, is_causal, q.dtype)


def shared_memory_limit(device):
    if INTERPRETING or device.type != "cuda":
        return ADA_SHARED_MEMORY_BYTES
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


# Shared memory the compiler adds beyond the tiles (barriers, layout-conversion scratch): twice
# the most tests/test_triton_configs.py has seen (docs/optimisation.md, "What the tile-config
# sweep taught us").
SHARED_MEMORY_SLACK_BYTES = 8192


def shared_memory_bytes(config, smem_rows, head_dim, element_size):
    """Shared memory a config needs. smem_rows(config) -> [(resident, streamed), ...], one pair
    per job a program of the kernel may do: how many HEAD_DIM-wide rows it keeps for its whole
    life, and how many each pipeline stage holds. The kernel needs what its largest job needs.
    TMA keeps num_stages stages in flight; cp.async num_stages - 1 (the stage being computed on
    has moved to registers). tests/test_triton_configs.py checks this bound against what the
    compiler allocates for sm_89."""
    stages = config.num_stages if config.kwargs["USE_TMA"] else config.num_stages - 1
    rows = max(resident + stages * streamed for resident, streamed in smem_rows(config))
    return element_size * head_dim * rows + SHARED_MEMORY_SLACK_BYTES


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


def capturing(device):
    """Whether work on device is being recorded into a CUDA graph: nothing may sync or be timed."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# Tuning choices persist here, one JSON file per card and torch and Triton versions, so that a
# second process does not tune at all. The folder: $NANOFA2_TUNING_CACHE, else ~/.cache/nanofa2
# (under $XDG_CACHE_HOME when that is set).
TUNING_CACHE_ENV = "NANOFA2_TUNING_CACHE"


def tuning_cache_path(device):
    folder = os.environ.get(TUNING_CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "nanofa2")
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    name = re.sub(r"[^A-Za-z0-9.]+", "-", f"{card}-torch-{torch.__version__}-triton-{triton.__version__}")
    return os.path.join(folder, f"tuning-{name}.json")


def load_tuning_choices(path):
    """{kernel and tuning key: config fields}; empty when the file is missing or unreadable (then
    the kernels tune again and the file is rewritten)."""
    try:
        with open(path) as f:
            choices = json.load(f)
        return choices if isinstance(choices, dict) else {}
    except (OSError, ValueError):
        return {}


def save_tuning_choice(path, name, config):
    """Add one choice to the file, atomically (a temporary file renamed over it): a reader never
    sees half a file. Re-read first, so choices another process saved meanwhile are kept."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    choices = {**load_tuning_choices(path), name: config_fields(config)}
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tuning-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(choices, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def config_fields(config):
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


class CompiledLaunches:
    """A kernel's launches, each through the compiled kernel Triton returned for it the first time.

    kernel[grid](...) goes through Triton's launcher, which binds the ~30 arguments, re-derives
    what the kernel was specialised on and looks the binary up, at each launch. At the model's
    shapes the GPU would wait on that CPU time, so the compiled kernel is kept, and a later
    launch with the same key, device, grid, scalar arguments and constexprs calls it directly
    (docs/optimisation.md, "The launch path", measures the saving). That is safe because
    everything Triton specialises a binary on is in that launch key or checked: the scalars
    include every int argument (strides, heads, lengths), the caller's key fixes the tensors'
    dtype, and their 16-byte alignment is checked at each launch. (The interpreter returns no
    compiled kernel: every launch takes the long way.)"""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled = {}  # launch key -> (launch, constexpr args)

    def __call__(self, grid, key, args, constexprs, config=None):
        """kernel[grid](*args, **constexprs), with config's constants and options (a
        triton.Config, which key must fix) when given. grid: a tuple; key: whatever else fixes
        the binary, the tensors' dtype at least; args: the kernel's tensors, then its scalars;
        constexprs: the rest (num_warps too, without a config), always passed in one order."""
        num_tensors = next(i for i, a in enumerate(args) if not isinstance(a, torch.Tensor))
        launch_key = (key, args[0].get_device(), grid, args[num_tensors:], *constexprs.values())
        aligned = all(t.data_ptr() % 16 == 0 for t in args[:num_tensors])
        compiled = self.compiled.get(launch_key)
        if compiled is not None and aligned:
            launch, constexpr_args = compiled
            launch(*args, *constexpr_args)
            return
        options = config.all_kwargs() if config is not None else {}
        kernel = self.kernel[grid](*args, **constexprs, **options)
        if kernel is not None and aligned:
            values = {**constexprs, **options}
            constexpr_args = tuple(values[name] for name in self.kernel.arg_names[len(args):])
            self.compiled[launch_key] = kernel[(*grid, 1, 1)[:3]], constexpr_args


# How many candidate configs a kernel times at a new tuning key (see TunedKernel.candidates).
TIMED_CANDIDATES = 3


class TunedKernel:
    """A Triton kernel launched with the fastest of its candidate configs, per tuning key.

    The first launch for a key takes the choice saved on disk by an earlier process
    (tuning_cache_path), or else times the first TIMED_CANDIDATES configs that fit the card and
    the sequence on the real arguments, replayed from a CUDA graph (each kernel writes its
    outputs whole, with no atomics, so running it several times is harmless), and saves the
    winner. While torch.compile traces, the same choice is made on real
    stand-ins for the traced tensors (traced_config). Inside a CUDA graph capture nothing is
    timed (that would sync and record the timing launches): a key met there for the first
    time, with no saved choice, keeps the first candidate for the process. `tunings` counts the
    timed tunings.

    Why not triton.autotune (with key, prune_configs_by and cache_results, which also persists):
    its launches go through kernel[grid](...), at a cost to the host at each launch that
    CompiledLaunches saves; the tuning key fixes the tensors' dtype for it."""

    def __init__(self, kernel, configs, smem_rows):
        """configs: the kernel's configs, best first; or a function of the head dim that returns
        them in the order that is best at that head dim."""
        self.kernel, self.smem_rows = kernel, smem_rows
        self.configs = configs if callable(configs) else lambda head_dim: configs
        self.best = {}  # tuning key -> config
        self.launches = CompiledLaunches(kernel)
        self.tunings = 0

    def __call__(self, grid, key, *args, **constexprs):
        """args: the kernel's tensors, then its scalars; constexprs: the rest but the config's."""
        if traced(args[0]):
            return self.record(grid, key, *args, **constexprs)
        config = self.best.get(key)
        if config is None:
            config = self.best[key] = self.choose_config(grid, key, args, constexprs)
        self.launches(grid(config.kwargs), key, args, constexprs, config)

    def candidates(self, key, q):
        """The configs worth timing for key: those that fit q's card (prune_configs), less those
        whose tiles are longer than the sequence (they would time mostly padding), which keeps
        the first call at a short sequence cheap."""
        fitting = prune_configs(self.configs(key.head_dim), q, self.smem_rows)
        short = [c for c in fitting if c.kwargs["BLOCK_M"] <= key.n_q and c.kwargs["BLOCK_N"] <= key.n_k]
        if not short:
            return [min(fitting, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]
        # Compiling a config costs far more than timing it (docs/benchmarks.md, "Tuning cost"), so
        # only the first few are timed: each kernel's list is ordered best first (bench.py --configs).
        return short[:TIMED_CANDIDATES]

    def record(self, grid, key, *args, **constexprs):
        """The launch as torch.compile records it, inside a torch.library.triton_op: through
        torch.library.wrap_triton, so that the graph holds the kernel itself and Inductor's code
        launches it."""
        config = self.traced_config(grid, key, args, constexprs)
        torch.library.wrap_triton(self.kernel)[grid(config.kwargs)](
            *args, **constexprs, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)

    def traced_config(self, grid, key, args, constexprs):
        """The config a recorded launch takes: chosen as an uncompiled launch's is (choose_config),
        on real stand-ins for the traced tensors, so that a compiled model runs the configs an
        uncompiled one would and a first compile tunes once and saves the choice. Traced with
        dynamic shapes the choice is made for the lengths of the traced example (hint), and the
        graph runs it at every length."""
        key = TuningKey(*(hint(field) for field in key))
        config = self.best.get(key)
        if config is None:
            with _disable_current_modes():  # real tensors, outside the tracer's fake-tensor mode
                stand_ins = [real_stand_in(a) if isinstance(a, torch.Tensor) else hint(a) for a in args]
                example_grid = lambda meta: tuple(hint(size) for size in grid(meta))
                config = self.best[key] = self.choose_config(example_grid, key, stand_ins, constexprs)
        return config

    def known_config(self, key, q):
        """The config for key that needs no timing: the kernel's only config, the only candidate,
        or the choice an earlier process saved (tuning_cache_path); None if only timing can tell."""
        configs = self.configs(key.head_dim)
        if len(configs) == 1:  # a kernel with one config (it needs no tuning), launched cheaply
            return configs[0]
        candidates = self.candidates(key, q)
        if len(candidates) == 1:
            return candidates[0]
        saved = load_tuning_choices(tuning_cache_path(q.device)).get(self.choice_name(key))
        return next((config for config in candidates if config_fields(config) == saved), None)

    def choice_name(self, key):
        return f"{self.kernel.__name__} {tuple(key)}"

    def choose_config(self, grid, key, args, constexprs):
        config = self.known_config(key, args[0])
        if config is not None:
            return config
        candidates = self.candidates(key, args[0])
        if capturing(args[0].device):
            return candidates[0]
        config = self.fastest_config(candidates, grid, args, constexprs)
        save_tuning_choice(tuning_cache_path(args[0].device), self.choice_name(key), config)
        return config

    def fastest_config(self, candidates, grid, args, constexprs):
        self.tunings += 1
        self.compile_side_by_side(candidates, grid, args, constexprs)

        def median_ms(config):
            try:
                # Replayed from a CUDA graph, so the ranking is of the kernels' GPU time: at the model's
                # shapes a kernel runs for less time than the host takes to launch it, and timing
                # plain launches ranked the launches (docs/benchmarks.md, "Tuning by GPU time").
                # Short runs: the ranking needs a few repetitions, not precision to the last percent.
                return triton.testing.do_bench_cudagraph(
                    lambda: self.kernel[grid](*args, **constexprs, **config.all_kwargs()), rep=20, return_mode="median")
            except (triton.runtime.errors.OutOfResources, triton.runtime.errors.PTXASError):
                return float("inf")  # a limit of this card the shared-memory estimate missed: skip the config
        return min(candidates, key=median_ms)

    def compile_side_by_side(self, candidates, grid, args, constexprs):
        """Compile every candidate at once, on threads (Triton's AsyncCompileMode): compiling a
        config costs far more than timing it, and three compiled side by side took less time
        than two one after the other (docs/benchmarks.md, "Tuning cost"). A config the card
        cannot hold fails here quietly and again, caught, when timed."""
        with ThreadPoolExecutor(len(candidates)) as pool, triton.AsyncCompileMode(pool, ignore_errors=True):
            for config in candidates:
                self.kernel.warmup(*args, grid=grid, **constexprs, **config.all_kwargs())
