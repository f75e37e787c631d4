"""Launch plans: the host's work for a Triton launch, done once per layout.

Every eager call of flash_forward or flash_backward at a layout it has seen before would redo
the same work: read the layouts, ask the tuner for its config, bind the arguments and let Triton
find the compiled kernel for their specialisation, compute the grid. At the model's shape that
was most of a call's host time, several times what the GPU spends. A plan keeps what that work
found for one key: each launch as the compiled kernel bound to its grid (CompiledKernel[grid],
the launcher Triton's own launch calls) with its arguments after the tensors (strides, sizes,
the tuned config), which the next call with the same key launches directly.

A plan runs only where Triton's own launch would run the same compiled kernel with the same
arguments, so its key holds everything those depend on:
- the tensors' dtypes, shapes and strides, and the mask: Triton's integer arguments (strides,
  lengths, heads), which it specialises on being 1 or a multiple of 16, come from them, and so
  do the tuner's key, the grid and the outputs' layouts;
- the device Triton launches on (its driver's current device), which loaded the kernel;
- Triton's settings that change the kernel it compiles (debug, instrumentation).
Triton also specialises on each pointer being 16-byte aligned, which a view at an odd offset
changes with no change of layout: the key is None unless every pointer is aligned, and a call
without a key takes the full path (which copies such a view). The stream is read at each
launch, and a profiler's launch hooks run, by Triton's launcher itself.

In the interpreter (no GPU) Triton compiles nothing, so no plan is made: every call takes the
full path.
"""
import triton

from .launch import INTERPRETING


def current_device():
    """Triton's current device: where it launches, and where it loaded the compiled kernel."""
    return None if INTERPRETING else triton.runtime.driver.active.get_current_device()


def plan_key(tensors, *rest):
    """The key of a call on tensors (each 16-byte aligned) and the other arguments rest, or None
    where a pointer is not aligned."""
    for t in tensors:
        if t.data_ptr() % 16:
            return None
    knobs = triton.knobs
    return (current_device(), knobs.runtime.debug, knobs.compilation.instrumentation_mode,
            *[(t.dtype, t.device, t.shape, t.stride()) for t in tensors], *rest)


def same_memory(tensors, launched):
    """Whether the tensors a launch took are the caller's (views at most, where descriptor_ready
    made no copy): only then may the next call's tensors go to a plan's launch as they are."""
    return all(t.data_ptr() == view.data_ptr() for t, view in zip(tensors, launched))


class Launch:
    """One launch of a plan: launch(*tensors) runs the compiled kernel on its grid with tensors
    first, then the arguments Triton was given after them."""

    def __init__(self, kernel, compiled, grid, args, kwargs, n_tensors):
        """From Triton's launch kernel[grid](*args, **kwargs), which returned compiled (kernel a
        JITFunction or an Autotuner over one): every argument by name in the kernel's order, the
        tuner's config included, and the grid they give."""
        jit_function = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel
        named = dict(zip(jit_function.arg_names, args)) | kwargs
        if jit_function is not kernel:
            named |= kernel.best_config.all_kwargs()
        grid = grid(named) if callable(grid) else grid
        self.run = compiled[(*grid, 1, 1)[:3]]  # CompiledKernel[grid] takes all three dims
        self.args = tuple(named[name] for name in jit_function.arg_names[n_tensors:])

    def __call__(self, *tensors):
        self.run(*tensors, *self.args)
