"""Your own FlashAttention-2, one function at a time (docs/learn.md, "Write it yourself").

Each file here is one step: the function's signature and docstring are given, its body is yours
to write. In order:

    online_softmax.py   online_softmax_update: fold one tile of scores into m_i, l_i, acc (PyTorch)
    tiled_forward.py    tiled_forward: the forward, a tile pair at a time (PyTorch)
    key_loop.py         the forward kernel's key loop, _key_tiles, and its online_softmax_update (Triton)
    dkdv_loop.py        the backward kernel's dK/dV loop, _dkdv_query_tiles (Triton)

Each function has the name and signature of the repo's function it stands in for (STEPS), so the
repo's own code runs yours. `pytest --impl=mine` puts every function you have written in place of
ours before anything runs (use_mine); `python bench.py --impl=mine` times copies of our modules
that call yours beside ours (with_mine). A function whose body still raises NotImplementedError
is not written yet: ours stays in its place, and tests/test_mine.py fails its step.
"""
import importlib
import importlib.util
import inspect
from collections import namedtuple

# file: yours; module: the repo's, whose functions of these names yours replace.
Step = namedtuple("Step", "file module functions")
STEPS = (Step("mine.online_softmax", "attention.tiled", ("online_softmax_update",)),
         Step("mine.tiled_forward", "attention.tiled", ("tiled_forward",)),
         Step("mine.key_loop", "attention.triton_forward", ("online_softmax_update", "_key_tiles")),
         Step("mine.dkdv_loop", "attention.triton_backward", ("_dkdv_query_tiles",)))


def yours(step, name):
    return getattr(importlib.import_module(step.file), name)


def is_written(function):
    """Whether its body no longer raises NotImplementedError (a @triton.jit function's too)."""
    return "NotImplementedError" not in inspect.getsource(getattr(function, "fn", function))


def written():
    """(step, function name) of every function you have written."""
    return [(step, name) for step in STEPS for name in step.functions if is_written(yours(step, name))]


def use_mine():
    """Put each function you have written in place of ours, in the repo's own modules, so that all
    of the repo's code runs yours. Call it before any kernel compiles: a compiled kernel keeps the
    functions it was compiled with. Returns what it replaced, as written() does."""
    swapped = written()
    for step, name in swapped:
        setattr(importlib.import_module(step.module), name, yours(step, name))
    return swapped


def with_mine(module_name):
    """A fresh copy of the repo's module module_name with your written functions in place of its
    own, the repo's module untouched: its kernels compile anew and call yours, beside ours."""
    spec = importlib.util.find_spec(module_name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for step, name in written():
        if step.module == module_name:
            setattr(module, name, yours(step, name))
    return module
