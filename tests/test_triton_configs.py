"""Every tile config the code can pick on the 12 GB target card (RTX 4070 Super, sm_89) fits
its 99 KB of shared memory, and every kernel compiles for sm_89 and for Hopper (sm_90, TMA),
the Hopper-only Gluon kernels (attention/hopper/) included. And the kernels read like Triton's
tutorials: no helper a kernel calls takes more than 16 parameters.

Triton compiles for a GPU target without a GPU; the compiler reports the shared memory each
kernel allocates. The prune in attention/launch.py keeps a config when its estimate fits; this
checks the compiler's real number against the limit at the largest head dim and element size
the estimate lets each config through for. Runs in a subprocess, because the test process runs
the kernels through the interpreter: `python tests/test_triton_configs.py` prints what it measures.
"""
import ast
import importlib
import inspect
import json
import os
import pkgutil
import subprocess
import sys
import textwrap

if __name__ == "__main__":  # compiling for GPU targets, with or without a GPU: Triton's compiler, not its interpreter
    os.environ["TRITON_INTERPRET"] = "0"  # before attention, which picks the interpreter where there is no GPU
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for attention

import pytest  # noqa: E402

from attention.hopper import backward as hopper_backward  # noqa: E402
from attention.hopper import forward as hopper_forward  # noqa: E402
from attention.launch import ADA_SHARED_MEMORY_BYTES  # noqa: E402

# One worker runs this module, so its module-scoped fixture runs once (see pytest.ini).
pytestmark = pytest.mark.xdist_group("triton_configs")

HEAD_DIMS = (16, 32, 64, 128, 256)
HOPPER_SHARED_MEMORY_BYTES = 232448  # the H100's and H200's most per block
TENSOR_POINTERS = {"Q", "K", "V", "O", "dO", "dQ", "dK", "dV"}
FLOAT32_POINTERS = {"LSE", "DELTA", "DQ"}
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


def measure():
    """Compile every config for sm_90; for each cp.async config, also compile for sm_89 at the
    largest head dim the estimate admits per element size, and report the compiler's shared
    memory. Then the Gluon kernels for sm_90, with their shared memory."""
    from attention.launch import shared_memory_bytes
    from attention.triton_backward import BACKWARD_CONFIGS, _attn_bwd, backward_smem_rows
    from attention.triton_forward import FORWARD_CONFIGS, _attn_fwd, forward_smem_rows

    results = []
    for kernel, configs, smem_rows in ((_attn_fwd.fn, FORWARD_CONFIGS, forward_smem_rows),
                                       (_attn_bwd.fn, BACKWARD_CONFIGS, backward_smem_rows)):
        for config in configs:
            compile_for(kernel, "bf16", dict(config.kwargs, HEAD_DIM=128, BLOCK_D=128, HEADS_FIRST=True), 90,
                        config.num_warps, config.num_stages)
            if config.kwargs["USE_TMA"]:  # pruned on cards without TMA
                continue
            for element_type, size in ELEMENT_TYPES.items():
                admitted = [d for d in HEAD_DIMS
                            if shared_memory_bytes(config, smem_rows, d, size) <= ADA_SHARED_MEMORY_BYTES]
                if not admitted:
                    continue
                constexprs = dict(config.kwargs, HEAD_DIM=max(admitted), BLOCK_D=max(admitted), HEADS_FIRST=True)
                compiled = compile_for(kernel, element_type, constexprs, 89, config.num_warps, config.num_stages)
                results.append(dict(kernel=kernel.__name__, config=str(config), element_type=element_type,
                                    head_dim=max(admitted), shared=compiled.metadata.shared))
    hopper = {}
    for module, kernel in ((hopper_forward, hopper_forward._attn_fwd_warp_specialized),
                           (hopper_backward, hopper_backward._attn_bwd_warp_specialized)):
        hopper[kernel.__name__] = []
        for (head_dim, is_causal), tiles in module.TILES.items():
            compiled = compile_for(kernel, "bf16", dict(tiles, **module.REGISTERS, IS_CAUSAL=is_causal,
                                                        HEAD_DIM=head_dim), 90, 4, 1, gluon=True)
            hopper[kernel.__name__].append(dict(head_dim=head_dim, is_causal=is_causal,
                                                shared=compiled.metadata.shared))
    return dict(ada=results, hopper_gluon=hopper)


@pytest.fixture(scope="module")
def compiled():
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_ada_config_fits_shared_memory(compiled):
    assert compiled["ada"], "no config was compiled"
    too_big = [r for r in compiled["ada"] if r["shared"] > ADA_SHARED_MEMORY_BYTES]
    assert not too_big, f"configs over sm_89's {ADA_SHARED_MEMORY_BYTES} bytes: {too_big}"


def test_every_kernel_has_an_ada_config_for_every_head_dim(compiled):
    """Some config is admitted at head dim 256 (and so, smaller dims) for every kernel and
    element size, so the prune never has to fall back to a config the card cannot hold."""
    for kernel in ("_attn_fwd", "_attn_bwd"):
        for element_type in ELEMENT_TYPES:
            dims = {r["head_dim"] for r in compiled["ada"]
                    if r["kernel"] == kernel and r["element_type"] == element_type}
            assert dims and max(dims) == 256, f"{kernel} {element_type}: no config admitted at head dim 256"


@pytest.mark.parametrize("module,kernel", [(hopper_forward, "_attn_fwd_warp_specialized"),
                                           (hopper_backward, "_attn_bwd_warp_specialized")], ids=("forward", "backward"))
def test_gluon_kernels_compile_for_hopper(compiled, module, kernel):
    """Each warp-specialised kernel compiles for sm_90 with the tiles of every head dim and mask
    it serves, within Hopper's 227 KB of shared memory per block."""
    assert [(r["head_dim"], r["is_causal"]) for r in compiled["hopper_gluon"][kernel]] == list(module.TILES)
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
    print(json.dumps(measure()))
