"""Every tile config the code can pick on the 12 GB target card (RTX 4070 Super, sm_89) fits
its 99 KB of shared memory, and every one it can pick on Hopper (sm_90, TMA) fits that card's
227 KB; every kernel compiles for both, the Hopper-only Gluon kernels (attention/hopper/)
included. And the kernels read like Triton's tutorials: no helper a kernel calls takes more
than 16 parameters.

Triton compiles for a GPU target without a GPU; the compiler reports the shared memory each
kernel allocates. The prune in attention/launch.py keeps a config when its estimate fits; this
checks the compiler's real number against the limit at the largest head dim and element size
the estimate lets each config through for. Runs in a subprocess, because the test process runs
the kernels through the interpreter; as a script it prints a JSON line per kernel as it compiles:

    python tests/test_triton_configs.py
"""
import ast
import importlib
import inspect
import json
import os
import pkgutil
import sys
import textwrap

if __name__ == "__main__":  # a script: kernels compiled for GPU targets (never interpreted), the repo importable
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402

from attention.hopper import backward as hopper_backward  # noqa: E402
from attention.hopper import forward as hopper_forward  # noqa: E402
from attention.launch import ADA_SHARED_MEMORY_BYTES  # noqa: E402
from conftest import run_script  # noqa: E402

# One worker runs this module, so its module-scoped fixture runs once (see pytest.ini).
pytestmark = pytest.mark.xdist_group("triton_configs")

HEAD_DIMS = (16, 32, 64, 128, 256)
HOPPER_SHARED_MEMORY_BYTES = 232448  # the H100's and H200's most per block
TENSOR_POINTERS = {"Q", "K", "V", "O", "dO", "dQ", "dK", "dV"}
FLOAT32_POINTERS = {"LSE", "DELTA", "DQ", "DQ_ACC"}
ELEMENT_TYPES = {"bf16": 2, "fp32": 4}


def compile_for(kernel, element_type, constexprs, capability, num_warps, num_stages, gluon=False):
    """triton.compile one kernel for a GPU target, with the alignment Triton infers at launch
    for the model's tensors (pointers and integer arguments divisible by 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("qk_scale", "sm_scale"):
            signature[name] = "fp32"
        else:
            signature[name] = ("*fp32" if name in FLOAT32_POINTERS else "*" + element_type
                               if name in TENSOR_POINTERS else "i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = (GluonASTSource if gluon else ASTSource)(kernel, signature, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", capability, 64 if capability >= 90 else 32)
    return triton.compile(source, target=target, options=dict(num_warps=num_warps, num_stages=num_stages))


# The cards each config must fit where the prune keeps it: (the card path whose lists it takes,
# capability, shared memory per block, the wgmma flag the prune passes). The consumer-card path
# compiles as sm_89 does (mma.sync).
CARDS = {"sm_89": ("consumer card", 89, ADA_SHARED_MEMORY_BYTES, False),
         "sm_90": ("hopper", 90, HOPPER_SHARED_MEMORY_BYTES, True)}


def measure():
    """For each card (sm_89 first), kernel, config of the card's lists (once, where several lists
    hold it) and element size: compile the config at the largest head dim a list holding it is for
    that the estimate admits on that card (TMA configs on sm_90 alone) and yield the compiler's
    shared memory, config by config in the lists' order. Then the Gluon kernels for sm_90, with theirs."""
    from attention.launch import shared_memory_bytes
    from attention.triton_backward import BACKWARD_CONFIGS, _attn_bwd, backward_smem_rows
    from attention.triton_forward import FORWARD_CONFIGS, _attn_fwd, forward_smem_rows

    for card, (path, capability, limit, wgmma) in CARDS.items():
        for kernel, table, smem_rows in ((_attn_fwd.fn, FORWARD_CONFIGS, forward_smem_rows),
                                         (_attn_bwd.fn, BACKWARD_CONFIGS, backward_smem_rows)):
            largest = {}  # config -> the largest head dim of the lists that hold it
            for (list_path, list_largest), configs in table.items():
                for config in configs if list_path == path else ():
                    largest[config] = max(largest.get(config, 0), list_largest)
            for config, list_largest in largest.items():
                if config.kwargs["USE_TMA"] and capability < 90:  # pruned on cards without TMA
                    continue
                for element_type, size in ELEMENT_TYPES.items():
                    admitted = [d for d in HEAD_DIMS if d <= list_largest
                                and shared_memory_bytes(config, smem_rows, d, size, wgmma) <= limit]
                    if not admitted:
                        continue
                    constexprs = dict(config.kwargs, HEAD_DIM=max(admitted), BLOCK_D=max(admitted), HEADS_FIRST=True)
                    if "ATOMIC_DQ" in config.kwargs:
                        constexprs["DETERMINISTIC"] = False
                    compiled = compile_for(kernel, element_type, constexprs, capability, config.num_warps,
                                           config.num_stages)
                    yield dict(target=card, kernel=kernel.__name__, config=str(config), element_type=element_type,
                               head_dim=max(admitted), shared=compiled.metadata.shared, limit=limit)
    for module, kernel in ((hopper_forward, hopper_forward._attn_fwd_warp_specialized),
                           (hopper_backward, hopper_backward._attn_bwd_warp_specialized)):
        for (head_dim, window), tiles in module.TILES.items():
            compiled = compile_for(kernel, "bf16", dict(tiles, **module.REGISTERS, WINDOW=window, HEAD_DIM=head_dim),
                                   90, 4, 1, gluon=True)
            yield dict(target="sm_90", gluon=True, kernel=kernel.__name__, head_dim=head_dim, window=window,
                       shared=compiled.metadata.shared, limit=HOPPER_SHARED_MEMORY_BYTES)


@pytest.fixture(scope="module")
def compiled():
    """The script's lines, run as docs/learn.md gives it: {"configs": [each config's builds],
    "hopper_gluon": {kernel: [its builds]}}."""
    out = run_script("tests/test_triton_configs.py", timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    hopper = {}
    for line in lines:
        if line.get("gluon"):
            hopper.setdefault(line["kernel"], []).append(line)
    return dict(configs=[line for line in lines if not line.get("gluon")], hopper_gluon=hopper)


@pytest.mark.parametrize("card", CARDS)
def test_every_config_the_prune_keeps_fits_the_cards_shared_memory(compiled, card):
    """At every head dim and element size the estimate admits a config for, on the 4070 Super
    (99 KB) and on Hopper (227 KB, where wgmma keeps one more pipeline stage in shared memory)."""
    _, _, limit, _ = CARDS[card]
    results = [r for r in compiled["configs"] if r["target"] == card]
    assert {r["head_dim"] for r in results} >= {64, 128, 256}, "too few configs were compiled"
    too_big = [r for r in results if r["shared"] > limit]
    assert not too_big, f"configs over {card}'s {limit} bytes: {too_big}"


def test_every_kernel_has_an_ada_config_for_every_head_dim(compiled):
    """Some config is admitted at head dim 256 (and so, smaller dims) for every kernel and
    element size, so the prune never has to fall back to a config the card cannot hold."""
    for kernel in ("_attn_fwd", "_attn_bwd"):
        for element_type in ELEMENT_TYPES:
            dims = {r["head_dim"] for r in compiled["configs"]
                    if r["target"] == "sm_89" and r["kernel"] == kernel and r["element_type"] == element_type}
            assert dims and max(dims) == 256, f"{kernel} {element_type}: no config admitted at head dim 256"


def test_both_backward_schedules_compile_for_the_consumer_card(compiled):
    """The atomic schedule's configs (tl.atomic_add, dS K) and the split's, in the lists sm_89 takes."""
    configs = {r["config"] for r in compiled["configs"] if r["target"] == "sm_89" and r["kernel"] == "_attn_bwd"}
    assert any("ATOMIC_DQ: True" in c for c in configs) and any("ATOMIC_DQ: False" in c for c in configs), configs


@pytest.mark.parametrize("module,kernel", [(hopper_forward, "_attn_fwd_warp_specialized"),
                                           (hopper_backward, "_attn_bwd_warp_specialized")], ids=("forward", "backward"))
def test_gluon_kernels_compile_for_hopper(compiled, module, kernel):
    """Each warp-specialised kernel compiles for sm_90 with the tiles of every head dim and mask
    it serves, within Hopper's 227 KB of shared memory per block. The mask's sides and the
    query heads per kv head are runtime ints: one build serves every window and group size."""
    assert [(r["head_dim"], r["window"]) for r in compiled["hopper_gluon"][kernel]] == list(module.TILES)
    for r in compiled["hopper_gluon"][kernel]:
        assert r["shared"] <= HOPPER_SHARED_MEMORY_BYTES, r


def python_function(kernel):
    """The Python function under a @triton.jit, @gluon.jit or triton.autotune object."""
    while not inspect.isfunction(kernel):
        kernel = kernel.fn
    return kernel


def called_jit_functions():
    """{name: Python function} of every @triton.jit and @gluon.jit function of the attention
    package that another one calls (or hands to gl.warp_specialize): all but the kernels the
    host launches."""
    import attention
    from triton.runtime.jit import KernelInterface

    called = {}
    for info in pkgutil.walk_packages(attention.__path__, "attention."):
        for obj in vars(importlib.import_module(info.name)).values():
            if not isinstance(obj, KernelInterface) or python_function(obj).__module__ != info.name:
                continue
            caller = python_function(obj)
            for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(caller)))):
                callee = caller.__globals__.get(node.id) if isinstance(node, ast.Name) else None
                if isinstance(callee, KernelInterface):
                    called[f"{python_function(callee).__module__}.{node.id}"] = python_function(callee)
    return called


def test_no_kernel_helper_takes_more_than_16_parameters():
    """A kernel offsets its pointers once and hands its helpers what they need: a head's matrix,
    a mask, a bundle of buffers (tuples), not every stride and constant one by one."""
    called = called_jit_functions()
    assert {"attention.masks.key_tile_bounds_tl", "attention.triton_forward.online_softmax_update",
            "attention.hopper.backward._query_tiles"} <= set(called)  # the search finds the helpers
    too_many = {name: len(inspect.signature(fn).parameters) for name, fn in called.items()
                if len(inspect.signature(fn).parameters) > 16}
    assert not too_many, f"helpers with more than 16 parameters: {too_many}"


if __name__ == "__main__":
    for line in measure():
        print(json.dumps(line), flush=True)
