"""Every attention backend against the float64 reference (eager attention run in float64),
forward O and L and backward dQ, dK, dV, on random inputs of awkward shapes.

On CPU the Triton backends run their real kernels through the Triton interpreter. Tests
marked `gpu` run on a CUDA card (bf16/fp16, long sequences, every tile config).

Tolerances (max abs error, with inputs ~N(0, 1)): float32 1e-4 on CPU, where every backend
computes in float32 (the interpreter's dots are exact float32); float16 2e-2 and bfloat16
4e-2, from rounding P and the outputs to 8 or 11 significant bits. On the GPU, float32 dots
use TF32 tensor cores (10-bit mantissa), so float32 is held to 1e-2 there.
"""
import json

import pytest
import torch

from attention import (BACKENDS, FlashAttentionPytorch, attention, packed_attention, triton_attention,
                       triton_fwd_attention)
from attention import gluon_backward, gluon_forward, triton_launch
from attention.eager import eager_attention_with_lse
from attention.inputs import unpack_heads
from attention.tiled import tiled_forward
from attention.triton_backward import BACKWARD_CONFIGS, backward_configs, backward_smem_rows, flash_backward
from attention.triton_forward import FORWARD_CONFIGS, flash_forward, forward_smem_rows
from attention.triton_launch import (CompiledLaunches, TunedKernel, TuningKey, descriptor_ready, prune_configs,
                                     tuning_key)
from training.train_config import TrainConfig

import triton  # noqa: E402, I001  (after attention, which decides whether Triton interprets)

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 4e-2}
GPU_TOLERANCE = {torch.float32: 1e-2, torch.float16: 2e-2, torch.bfloat16: 4e-2}
gpu = pytest.mark.gpu


def random_qkv(shape_q, n_k, dtype=torch.float32, device="cpu", seed=0, scale=1.0):
    """q (*shape_q) and k, v with n_k rows; never zeros."""
    g = torch.Generator().manual_seed(seed)
    *lead, _, d = shape_q
    q = torch.randn(*shape_q, generator=g) * scale
    k = torch.randn(*lead, n_k, d, generator=g) * scale
    v = torch.randn(*lead, n_k, d, generator=g)
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]


def reference(q, k, v, is_causal, do):
    """O, L, dQ, dK, dV in float64."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, lse = eager_attention_with_lse(q64, k64, v64, is_causal)
    o.backward(do.double())
    return o, lse, q64.grad, k64.grad, v64.grad


def assert_close(actual, expected, tol, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - expected).abs().max().item() if actual.numel() else 0.0
    assert err <= tol, f"{what}: max abs error {err:.2e} > {tol:.0e}"


def check_backend(backend, q, k, v, is_causal, tol):
    o = attention(q, k, v, is_causal=is_causal, backend=backend)
    assert o.dtype == q.dtype and o.shape == q.shape
    # Seeded, so a test sees the same dO whatever ran before it in its process (xdist orders vary).
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(o.numel())).to(o)
    o.backward(do)
    o_ref, _, dq_ref, dk_ref, dv_ref = reference(q, k, v, is_causal, do)
    assert_close(o, o_ref, tol, f"{backend} O")
    for name, t, ref in (("dQ", q, dq_ref), ("dK", k, dk_ref), ("dV", v, dv_ref)):
        assert_close(t.grad, ref, tol, f"{backend} {name}")


# (q shape, N_k): odd lengths, N_q != N_k both ways, every head dim, 3-D and 4-D, 2-D and 5-D.
SHAPES = [
    ((1, 1, 1, 16), 1),
    ((2, 3, 15, 16), 15),
    ((1, 2, 16, 32), 16),
    ((2, 1, 17, 64), 17),
    ((1, 2, 100, 32), 257),
    ((1, 1, 257, 64), 100),
    ((1, 2, 128, 128), 128),
    ((2, 257, 16), 257),       # 3-D (B, N, D)
    ((3, 100, 64), 17),
    ((1, 15, 128), 1),
    ((33, 32), 33),            # 2-D (N, D)
    ((2, 1, 2, 17, 16), 17),   # 5-D
]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape_q,n_k", SHAPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_float64_reference(backend, shape_q, n_k, is_causal):
    q, k, v = random_qkv(shape_q, n_k, seed=sum(shape_q) + n_k)
    check_backend(backend, q, k, v, is_causal, TOLERANCE[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_views_from_fused_projection(backend):
    """q, k, v as the model makes them: (B, H, T, D) views of one (B, T, 3, H, D) tensor."""
    B, T, H, D = 2, 37, 3, 32
    leaf = torch.randn(B, T, 3, H, D, requires_grad=True)
    q, k, v = (leaf[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    o = attention(q, k, v, is_causal=True, backend=backend)
    do = torch.randn_like(o)
    o.backward(do)
    o_ref, _, dq_ref, dk_ref, dv_ref = reference(q, k, v, True, do)
    assert_close(o, o_ref, 1e-4, "O")
    dqkv_ref = torch.stack([g.transpose(1, 2) for g in (dq_ref, dk_ref, dv_ref)], dim=2)
    assert_close(leaf.grad, dqkv_ref, 1e-4, "d(qkv)")


def check_packed(backend, qkv, is_causal, tol):
    """packed_attention on qkv (B, N, 3, H, D) against the float64 reference on its views."""
    y = packed_attention(qkv, is_causal=is_causal, backend=backend)
    B, N, _, H, D = qkv.shape
    assert y.shape == (B, N, H, D) and y.dtype == qkv.dtype
    dy = torch.randn_like(y)
    y.backward(dy)
    q, k, v = (t.transpose(1, 2) for t in qkv.detach().unbind(2))
    o_ref, _, dq_ref, dk_ref, dv_ref = reference(q, k, v, is_causal, dy.transpose(1, 2))
    assert_close(y, o_ref.transpose(1, 2), tol, f"{backend} packed O")
    assert_close(qkv.grad, torch.stack([g.transpose(1, 2) for g in (dq_ref, dk_ref, dv_ref)], dim=2), tol,
                 f"{backend} packed d(qkv)")


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 37, 3, 3, 32), (1, 1, 3, 1, 16), (3, 65, 3, 2, 64), (1, 17, 3, 1, 128)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_attention_matches_float64_reference(backend, shape, is_causal):
    qkv = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).requires_grad_()
    check_packed(backend, qkv, is_causal, TOLERANCE[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_attention_takes_strided_and_misaligned_projections(backend):
    """A qkv that is a view with gaps (the batch axis strided) and one whose rows start one
    element off 16 bytes (the Triton backend copies that one once)."""
    gapped = torch.randn(4, 21, 3, 2, 32)[::2].detach().requires_grad_()
    misaligned = torch.randn(2, 21, 3, 2, 33)[..., 1:].detach().requires_grad_()
    for qkv in (gapped, misaligned):
        assert not qkv.is_contiguous()
        check_packed(backend, qkv, True, TOLERANCE[torch.float32])


def test_packed_triton_keeps_one_autograd_node_and_contiguous_tensors():
    """The point of the packed entry: one node between qkv and the output (no unbind, no
    transposes, no stack), the output (B, N, H, D) contiguous, qkv's gradient written whole."""
    qkv = torch.randn(2, 37, 3, 3, 32, requires_grad=True)
    y = packed_attention(qkv, is_causal=True, backend="triton")
    assert y.is_contiguous()
    node = y.grad_fn
    assert node.name() == "TritonAttentionBackward"
    assert len(node.next_functions) == 1 and node.next_functions[0][0].variable is qkv
    saved_qkv, saved_o, saved_l = node.saved_tensors
    assert saved_qkv.data_ptr() == qkv.data_ptr() and saved_l.dtype == torch.float32
    y.backward(torch.randn_like(y))
    assert qkv.grad.is_contiguous()


def test_the_operator_routes_and_the_uncompiled_route_agree():
    """torch.compile traces the operators (on a GPU their traced twins); uncompiled calls go
    through TritonAttention to the same kernels. All must give the same output and the same
    gradient, bit for bit. (The traced twins run here as a plain call runs them; traced, they
    need a GPU: tests/test_compile_gpu.py.)"""
    qkv = torch.randn(2, 29, 3, 2, 16, generator=torch.Generator().manual_seed(3))
    do = torch.randn(2, 29, 2, 16, generator=torch.Generator().manual_seed(4))
    results = []
    for route in (lambda x: torch.ops.nanofa2.triton_packed_attention(x, True)[0],
                  lambda x: torch.ops.nanofa2.triton_packed_attention_traced(x, True)[0],
                  lambda x: packed_attention(x, is_causal=True, backend="triton")):
        x = qkv.clone().requires_grad_()
        o = route(x)
        o.backward(do)
        results.append((o.detach(), x.grad))
    assert o.grad_fn.name() == "TritonAttentionBackward"
    for route in results[1:]:
        for a, b in zip(results[0], route):
            assert torch.equal(a, b)


class FakeKernel:
    """Stands in for a Triton kernel to check TunedKernel's launch cache: kernel[grid](...) records
    a full launch and returns a stand-in compiled kernel, whose [grid](...) records a direct one."""
    arg_names = ["X", "n", "BLOCK_M"]
    __name__ = "fake_kernel"
    last_config = None  # the config of the latest full launch of any FakeKernel

    def __init__(self):
        self.launches = []
        self.compiled_configs = []  # BLOCK_M of each warmup (TunedKernel compiles candidates before timing)

    def warmup(self, *args, grid, **kwargs):
        self.compiled_configs.append(kwargs["BLOCK_M"])

    def __getitem__(self, grid):
        def full_launch(*args, **kwargs):
            self.launches.append("full")
            FakeKernel.last_config = kwargs
            return self.Compiled(self)
        return full_launch

    class Compiled:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args: self.kernel.launches.append(("direct", grid, args))


def test_tuned_kernel_reuses_a_compiled_kernel_only_for_the_same_launch():
    kernel = FakeKernel()
    tuned = TunedKernel(kernel, [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "USE_TMA": False})], lambda config: [(0, 0)])
    x = torch.randn(64, 16)
    grid = lambda meta: (64 // meta["BLOCK_M"], 1)
    key = TuningKey(1, 64, 64, 16, True, torch.float32)
    tuned(grid, key, x, 64)                            # the first launch: full
    tuned(grid, key, torch.randn(64, 16), 64)          # the same launch on other data: direct
    tuned(grid, key, x, 32)                            # another scalar: full
    tuned(lambda meta: (2, 1), key, x, 64)             # another grid: full
    tuned(grid, key, torch.randn(1025)[1:].view(64, 16), 64)  # a tensor off 16-byte alignment: full
    assert [launch if launch == "full" else launch[0] for launch in kernel.launches] == \
        ["full", "direct", "full", "full", "full"]
    _, grid_size, args = kernel.launches[1]
    assert grid_size == (4, 1, 1) and args[1:] == (64, 16)  # the scalar, then the constexpr BLOCK_M


def test_compiled_launches_without_a_config_pass_the_constexprs_and_tell_them_apart():
    """The Gluon kernels' route (no config): a direct launch hands the compiled kernel the
    constexprs after the arguments, in the kernel's order; another constexpr value, key (dtype)
    or scalar is a full launch."""
    kernel = FakeKernel()
    launches = CompiledLaunches(kernel)
    x = torch.randn(64, 16)
    launches((4,), torch.float32, (x, 64), dict(BLOCK_M=16, num_warps=4))             # full
    launches((4,), torch.float32, (torch.randn(64, 16), 64), dict(BLOCK_M=16, num_warps=4))  # direct
    launches((4,), torch.float32, (x, 64), dict(BLOCK_M=32, num_warps=4))             # another constexpr: full
    launches((4,), torch.bfloat16, (x, 64), dict(BLOCK_M=16, num_warps=4))            # another key: full
    launches((4,), torch.float32, (x, 65), dict(BLOCK_M=16, num_warps=4))             # another scalar: full
    assert [launch if launch == "full" else launch[0] for launch in kernel.launches] == \
        ["full", "direct", "full", "full", "full"]
    _, grid_size, args = kernel.launches[1]
    assert grid_size == (4, 1, 1) and args[1:] == (64, 16)  # the scalar, then the constexpr BLOCK_M


def test_tuning_key_buckets_the_heads_and_lengths():
    """Lengths in power-of-two buckets (a growing KV cache keeps its key), and so the number of
    (batch, head) pairs: a grid of a few heads and one of hundreds at the same lengths get
    choices of their own (a config best for one can be far from best for the other)."""
    def key(batch, heads, n_q, n_k):
        return tuning_key(torch.empty(batch, heads, n_q, 16), torch.empty(batch, heads, n_k, 16), True)
    assert key(1, 3, 17, 100) == key(2, 2, 32, 128) == TuningKey(4, 32, 128, 16, True, torch.float32)
    assert key(1, 1, 1, 1) == TuningKey(1, 16, 16, 16, True, torch.float32)
    assert key(4, 16, 4096, 4096) != key(2, 3, 4096, 4096)


TIMING_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "USE_TMA": False}, num_warps=4, num_stages=2)
                  for m, n in ((16, 16), (32, 16), (128, 16), (64, 16))]


@pytest.fixture
def timed_configs(tmp_path, monkeypatch):
    """TunedKernel on a FakeKernel as on a GPU (several candidates to time; the interpreter has
    one), its choices persisted under tmp_path. Returns the list of timed configs' BLOCK_M: the
    stand-in do_bench_cudagraph runs the launch once and reports BLOCK_M 32 as the fastest."""
    monkeypatch.setenv(triton_launch.TUNING_CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(triton_launch, "INTERPRETING", False)
    timed = []

    def fake_do_bench(fn, **kwargs):
        fn()
        block_m = FakeKernel.last_config["BLOCK_M"]
        timed.append(block_m)
        return abs(block_m - 32) + 1.0
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", fake_do_bench)
    return timed


def test_tuning_is_persisted_and_a_second_process_does_not_tune(timed_configs, tmp_path):
    x, grid = torch.randn(64, 16), lambda meta: (1, 1)
    key = TuningKey(1, 128, 128, 16, True, torch.float32)
    first = TunedKernel(FakeKernel(), TIMING_CONFIGS, lambda config: [(0, 0)])
    first(grid, key, x, 64)
    first(grid, key, x, 64)
    # Once per key, and only the first TIMED_CANDIDATES (3) of the list, though every tile fits N = 128;
    # each compiled before any is timed.
    assert first.tunings == 1 and timed_configs == [16, 32, 128] and first.kernel.compiled_configs == [16, 32, 128]
    assert FakeKernel.last_config["BLOCK_M"] == 32
    [path] = tmp_path.glob("tuning-*.json")
    assert "torch" in path.name and "triton" in path.name
    saved = {"BLOCK_M": 32, "BLOCK_N": 16, "USE_TMA": False, "num_warps": 4, "num_stages": 2}
    assert json.loads(path.read_text()) == {f"fake_kernel {tuple(key)}": saved}
    second = TunedKernel(FakeKernel(), TIMING_CONFIGS, lambda config: [(0, 0)])  # all a new process has: the file
    second(grid, key, x, 64)
    assert second.tunings == 0 and len(timed_configs) == 3 and FakeKernel.last_config["BLOCK_M"] == 32
    # A short sequence does not time tiles longer than itself.
    second(grid, TuningKey(1, 16, 16, 16, True, torch.float32), x, 64)
    assert second.tunings == 0 and FakeKernel.last_config["BLOCK_M"] == 16  # the only candidate left
    second(grid, TuningKey(1, 32, 64, 16, True, torch.float32), x, 64)
    assert second.tunings == 1 and timed_configs[3:] == [16, 32]
    assert len(json.loads(path.read_text())) == 2  # both choices kept


def test_the_configs_timed_depend_on_the_head_dim(timed_configs):
    """Given a function of the head dim, TunedKernel times the first configs of its order for
    the key's head dim. The backward's order: every config at every head dim, its own first
    three above 64, and the same three cp.async configs first on cards without TMA (sm_89's
    choice unchanged by the order)."""
    x, grid = torch.randn(64, 16), lambda meta: (1, 1)
    tuned = TunedKernel(FakeKernel(), lambda head_dim: TIMING_CONFIGS[::-1] if head_dim > 64 else TIMING_CONFIGS,
                        lambda config: [(0, 0)])
    tuned(grid, TuningKey(1, 128, 128, 64, True, torch.float32), x, 64)
    tuned(grid, TuningKey(1, 128, 128, 128, True, torch.float32), x, 64)
    assert timed_configs == [16, 32, 128, 64, 128, 32]
    for head_dim in (16, 32, 64, 128):
        order = backward_configs(head_dim)
        assert sorted(map(id, order)) == sorted(map(id, BACKWARD_CONFIGS))
        first_cp_async = lambda configs: {id(c) for c in [c for c in configs if not c.kwargs["USE_TMA"]][:3]}
        assert first_cp_async(order) == first_cp_async(BACKWARD_CONFIGS)
    assert backward_configs(64)[:3] == BACKWARD_CONFIGS[:3] != backward_configs(128)[:3]


def test_tuning_never_times_inside_a_cuda_graph_capture(timed_configs, monkeypatch):
    monkeypatch.setattr(triton_launch, "capturing", lambda device: True)
    tuned = TunedKernel(FakeKernel(), TIMING_CONFIGS, lambda config: [(0, 0)])
    tuned(lambda meta: (1, 1), TuningKey(1, 64, 64, 16, True, torch.float32), torch.randn(64, 16), 64)
    assert tuned.tunings == 0 and timed_configs == [] and tuned.kernel.launches == ["full"]
    assert FakeKernel.last_config["BLOCK_M"] == 16  # the first candidate


def test_a_traced_launch_is_tuned_on_real_stand_ins_and_recorded(timed_configs, monkeypatch):
    """While torch.compile traces a triton_op, TunedKernel records the launch (wrap_triton)
    instead of making it. A new key is tuned first, as an uncompiled launch would be, on real
    tensors shaped and strided like the traced ones, and the choice is saved; a later trace
    takes the saved choice untimed. Traced with dynamic shapes, the lengths' hints (the traced
    example's) stand in for the symbols, so the graph gets the config an uncompiled call at
    that length takes, and the recorded grid stays symbolic."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    recorded, timed_on = [], []

    class Recorder:
        def __init__(self, kernel):
            assert isinstance(kernel, FakeKernel)

        def __getitem__(self, grid):
            return lambda *args, **kwargs: recorded.append((grid, kwargs["BLOCK_M"], kwargs["num_warps"]))
    monkeypatch.setattr(torch.library, "wrap_triton", Recorder)
    monkeypatch.setattr(FakeKernel, "warmup", lambda self, *args, grid, **kwargs: timed_on.append((args, grid(kwargs))))
    new_kernel = lambda: TunedKernel(FakeKernel(), TIMING_CONFIGS, lambda config: [(0, 0)])
    grid, key = lambda meta: (128 // meta["BLOCK_M"], 1), TuningKey(1, 128, 128, 16, True, torch.float32)
    x = torch.randn(80, 16)[8:72]  # a view: offset 128, strides (16, 1)
    with FakeTensorMode() as mode:
        fake_x = mode.from_tensor(x)
    new_kernel()(grid, key, fake_x, 64)
    assert recorded == [((4, 1), 32, 4)] and timed_configs == [16, 32, 128]  # tuned: the fastest is recorded
    (stand_in, n), _ = timed_on[0]
    assert type(stand_in) is torch.Tensor and stand_in.std() > 0.5 and n == 64
    assert (stand_in.shape, stand_in.stride(), stand_in.storage_offset()) == ((64, 16), (16, 1), 128)
    new_kernel()(grid, key, fake_x, 64)
    assert recorded[1] == ((4, 1), 32, 4) and len(timed_configs) == 3  # another process: the saved choice

    with FakeTensorMode(shape_env=ShapeEnv(), static_shapes=False) as mode:
        dynamic_x = mode.from_tensor(x)
    rows = dynamic_x.shape[0]  # a symbol, whose hint is 64
    symbolic_grid = lambda meta: (2 * rows // meta["BLOCK_M"], 1)
    new_kernel()(symbolic_grid, TuningKey(1, 2 * rows, 2 * rows, 16, True, torch.float32), dynamic_x, rows)
    assert isinstance(rows, torch.SymInt) and recorded[2][1] == 32 and len(timed_configs) == 3  # the saved choice
    assert isinstance(recorded[2][0][0], torch.SymInt)
    new_kernel()(symbolic_grid, TuningKey(1, rows, rows, 16, True, torch.float32), dynamic_x, rows)  # a new key: tuned
    assert timed_configs[3:] == [16, 32, 64] and recorded[3][1] == 32
    (stand_in, n), example_grid = timed_on[-1]
    assert type(stand_in) is torch.Tensor and stand_in.shape == (64, 16) and n == 64 and example_grid == (2, 1)
    one_config = triton.Config({"BLOCK_M": 64}, num_warps=2)  # a kernel with one config: nothing to choose
    TunedKernel(FakeKernel(), [one_config], None)(symbolic_grid, TuningKey(1, rows, rows, 16, True, torch.float32),
                                                  dynamic_x, rows)
    assert recorded[4][1:] == (64, 2) and len(timed_configs) == 6


@pytest.mark.parametrize("backend", ["triton", "triton_fwd"])
def test_triton_output_and_gradients_keep_the_inputs_memory_order(backend):
    """For the model's views of one (B, T, 3, H, D) projection, O and dQ, dK, dV come out
    (B, T, H, D) in memory: the model's transpose back to (B, T, H * D) is then free, and so
    is autograd's stacking of the three gradients into the projection's."""
    leaf = torch.randn(2, 37, 3, 3, 32, requires_grad=True)
    q, k, v = (leaf[:, :, i].transpose(1, 2) for i in range(3))
    grads = []
    for t in (q, k, v):
        t.register_hook(grads.append)
    o = attention(q, k, v, is_causal=True, backend=backend)
    assert o.transpose(1, 2).is_contiguous()
    o.backward(torch.randn_like(o))
    if backend == "triton":  # triton_fwd's gradients come from the PyTorch recompute
        assert len(grads) == 3 and all(g.transpose(1, 2).is_contiguous() for g in grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_views_tma_cannot_describe_are_handled(backend):
    """A slice starting one element into each row: misaligned base and row stride (copied once
    for the Triton kernels), and a sequence slice with a gap."""
    q = torch.randn(2, 2, 40, 33)[..., 1:]
    k = torch.randn(2, 2, 80, 32)[:, :, ::2]
    v = torch.randn(2, 2, 40, 32)
    assert descriptor_ready(q).data_ptr() != q.data_ptr()  # the copy path
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    check_backend(backend, q, k, v, True, TOLERANCE[torch.float32])


def test_descriptor_ready_copies_a_non_unit_last_stride():
    """Every other stride 16-byte aligned, but every second element along D: the kernels take
    no stride along D, so this must be copied, not read as if contiguous."""
    t = torch.randn(1, 2, 40, 64)[..., ::2]
    ready = descriptor_ready(t)
    assert ready.stride(-1) == 1 and torch.equal(ready, t)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_arriving_in_any_layout(backend, device):
    """The output's gradient as autograd delivers it after a transpose (unit stride along N, not
    D) or a sum over D (stride 0 along D): the kernels, which take no stride along D, get a copy."""
    q, k, v = random_qkv((2, 2, 40, 32), 40, device=device, seed=5)
    w = torch.randn(2, 2, 32, 40, device=device)
    for loss_of in (lambda o: (o.transpose(-1, -2) * w).sum(), lambda o: (o.sum(-1) * w[..., 0, :]).sum()):
        for t in (q, k, v):
            t.grad = None
        o = attention(q, k, v, is_causal=True, backend=backend)
        loss_of(o).backward()
        o_ref = attention(*(t.detach().double().requires_grad_() for t in (q, k, v)), is_causal=True, backend="eager")
        do = torch.autograd.grad(loss_of(o_ref), o_ref)[0]
        _, _, dq_ref, dk_ref, dv_ref = reference(q, k, v, True, do)
        tol = TOLERANCE[torch.float32] if device == "cpu" else GPU_TOLERANCE[torch.float32]
        for name, t, ref in (("dQ", q, dq_ref), ("dK", k, dk_ref), ("dV", v, dv_ref)):
            assert_close(t.grad, ref, tol, f"{backend} {name}")


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape_q,n_k", [((2, 3, 100, 64), 100), ((1, 2, 17, 32), 257), ((1, 1, 257, 16), 33)])
def test_logsumexp_matches_reference(shape_q, n_k, is_causal):
    q, k, v = (t.detach() for t in random_qkv(shape_q, n_k, seed=n_k))
    _, lse_ref = eager_attention_with_lse(q.double(), k.double(), v.double(), is_causal)
    for tile_size in (16, 37):
        _, lse = tiled_forward(q, k, v, is_causal, tile_size, tile_size)
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:-1]
        assert_close(lse, lse_ref, 1e-5, f"tiled L (tile {tile_size})")
    _, lse = flash_forward(q, k, v, is_causal)
    assert lse.dtype == torch.float32
    assert_close(lse, lse_ref, 1e-5, "triton L")


@pytest.mark.parametrize("function", [FlashAttentionPytorch.apply, triton_attention, triton_fwd_attention])
def test_saves_exactly_q_k_v_o_l(function):
    q, k, v = random_qkv((2, 3, 33, 32), 20)
    o = function(q, k, v, True)
    saved = o.grad_fn.saved_tensors
    assert len(saved) == 5
    for got, want in zip(saved[:3], (q, k, v)):
        assert got.data_ptr() == want.data_ptr() and got.shape == want.shape
    assert torch.equal(saved[3], o)
    _, lse_ref = eager_attention_with_lse(q.double(), k.double(), v.double(), True)
    assert saved[4].dtype == torch.float32 and saved[4].shape == q.shape[:-1]
    assert_close(saved[4], lse_ref, 1e-5, "saved L")


@pytest.mark.parametrize("tile_size", [1, 16, 50, 300])
def test_tiled_any_tile_size(tile_size):
    q, k, v = random_qkv((1, 2, 70, 16), 45, seed=tile_size)
    o = FlashAttentionPytorch.apply(q, k, v, True, tile_size, tile_size)
    o_ref, *_ = reference(q, k, v, True, torch.ones_like(o))
    assert_close(o, o_ref, 1e-5, f"tiled O (tile {tile_size})")


def test_the_grid_puts_heads_first_when_all_keys_and_values_fit_in_half_the_l2():
    """The interpreter assumes the target card's 48 MB L2 (meta tensors: shapes without memory)."""
    keys = lambda *shape: torch.empty(shape, dtype=torch.bfloat16, device="meta")
    assert triton_launch.heads_first(keys(1, 6, 4096, 64))  # the model's long context: 6 MB of K and V
    assert not triton_launch.heads_first(keys(16, 32, 1024, 64))  # the paper's: 134 MB
    assert triton_launch.heads_first(keys(70000, 1, 64, 64))  # more (batch, head)s than the grid's y holds


def launch_heads_first(monkeypatch, heads_first):
    """Make the kernels' launches take the given grid order (triton_launch.heads_first)."""
    import attention.triton_backward
    import attention.triton_forward
    for module in (attention.triton_forward, attention.triton_backward):
        monkeypatch.setattr(module, "heads_first", lambda k: heads_first)


@pytest.mark.parametrize("heads_first", [False, True])
@pytest.mark.parametrize("use_tma", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 32), (64, 32)])
def test_triton_kernels_with_explicit_tiles(block_m, block_n, is_causal, use_tma, heads_first, monkeypatch):
    """Tiles smaller than the sequence, with BLOCK_M != BLOCK_N: several tiles cross the
    diagonal, and both sequences end mid-tile. Both load paths: TMA descriptors (Hopper) and
    masked pointer loads (older cards). Both grid orders."""
    launch_heads_first(monkeypatch, heads_first)
    q, k, v = (t.detach() for t in random_qkv((1, 2, 83, 32), 71, seed=block_m + block_n))
    config = triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "USE_TMA": use_tma})
    o, lse = flash_forward(q, k, v, is_causal, config=config)
    do = torch.randn_like(o)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = reference(q, k, v, is_causal, do)
    assert_close(o, o_ref, 1e-4, "O")
    assert_close(lse, lse_ref, 1e-5, "L")
    # The dK/dV job streams query tiles of its own size: here block_n, unlike the dQ job's block_m.
    config = triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "DKDV_BLOCK_M": block_n, "USE_TMA": use_tma})
    dq, dk, dv = flash_backward(q, k, v, o, do, lse, is_causal, config=config)
    for name, got, ref in (("dQ", dq, dq_ref), ("dK", dk, dk_ref), ("dV", dv, dv_ref)):
        assert_close(got, ref, 1e-4, name)


@pytest.mark.parametrize("backend", ["tiled", "triton", "triton_fwd"])
def test_float16_on_cpu(backend):
    q, k, v = random_qkv((1, 2, 67, 64), 67, dtype=torch.float16, seed=3)
    check_backend(backend, q, k, v, True, TOLERANCE[torch.float16])


def test_triton_gradients_come_from_triton_kernels(monkeypatch):
    """`triton` must use the Triton backward, `triton_fwd` the PyTorch one: poison the other."""
    import attention.triton_ops as triton_ops

    def poisoned(*args, **kwargs):
        raise AssertionError("wrong backward ran")

    q, k, v = random_qkv((1, 2, 20, 16), 20)
    monkeypatch.setattr(triton_ops, "recompute_backward", poisoned)
    attention(q, k, v, True, "triton").sum().backward()
    with pytest.raises(AssertionError, match="wrong backward"):
        attention(q, k, v, True, "triton_fwd").sum().backward()
    monkeypatch.undo()
    monkeypatch.setattr(triton_ops, "flash_backward", poisoned)
    attention(q, k, v, True, "triton_fwd").sum().backward()
    with pytest.raises(AssertionError, match="wrong backward"):
        attention(q, k, v, True, "triton").sum().backward()


def projection_views(B=1, N=17, H=2, D=16, seed=0):
    """q, k, v as the model makes them: (B, H, N, D) views of one (B, N, 3, H, D) projection."""
    qkv = torch.randn(B, N, 3, H, D, generator=torch.Generator().manual_seed(seed))
    return unpack_heads(qkv)


def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) implementation with the real outputs' strides, autograd registration
    and AOT dispatch, for every op, on the model's strided views and on contiguous tensors."""
    q, k, v = projection_views()
    do = torch.randn(1, 2, 17, 16)
    for op in (torch.ops.nanofa2.triton_attention, torch.ops.nanofa2.triton_fwd_attention):
        for args in ((q, k, v, True), (q.contiguous(), k.contiguous(), v.contiguous(), False)):
            torch.library.opcheck(op, (*(t.detach().requires_grad_() for t in args[:3]), args[3]))
    o, lse = torch.ops.nanofa2.triton_attention(q, k, v, True)
    for op in (torch.ops.nanofa2.triton_attention_backward, torch.ops.nanofa2.recompute_attention_backward):
        torch.library.opcheck(op, (q, k, v, o, do, lse, True))
    qkv = torch.randn(2, 17, 3, 2, 16)
    torch.library.opcheck(torch.ops.nanofa2.triton_packed_attention, (qkv.requires_grad_(), True))
    o, lse = torch.ops.nanofa2.triton_packed_attention(qkv.detach(), True)
    torch.library.opcheck(torch.ops.nanofa2.triton_packed_attention_backward,
                          (qkv.detach(), o, torch.randn_like(o), lse, True))


@pytest.mark.parametrize("backend", ["triton", "triton_fwd", "packed"])
def test_double_backward_raises_a_clear_error(backend):
    """A second-order gradient through a Triton backend must fail loudly, never be a wrong number."""
    q, k, v = random_qkv((1, 2, 20, 16), 20)
    if backend == "packed":
        qkv = torch.stack((q, k, v), dim=2).transpose(1, 3).detach().requires_grad_()  # (B, N, 3, H, D)
        inputs, o = qkv, packed_attention(qkv, is_causal=True, backend="triton")
    else:
        inputs, o = q, attention(q, k, v, True, backend)
    first, = torch.autograd.grad((o ** 2).sum(), inputs, create_graph=True)
    name = "triton" if backend == "packed" else backend
    with pytest.raises(RuntimeError, match=f"double backward is not supported by the {name} backend"):
        (first ** 2).sum().backward()


@pytest.mark.parametrize("backend", ["triton", "triton_fwd", "packed"])
def test_bfloat16_on_cpu_matches_float64_reference(backend):
    """The interpreter's tl.dot on bf16 is garbage: on the CPU, bf16 runs in float32 and is rounded."""
    if backend == "packed":
        qkv = torch.randn(1, 33, 3, 2, 32, generator=torch.Generator().manual_seed(7)).bfloat16().requires_grad_()
        check_packed("triton", qkv, True, TOLERANCE[torch.bfloat16])
    else:
        q, k, v = random_qkv((1, 2, 33, 32), 33, dtype=torch.bfloat16, seed=7)
        check_backend(backend, q, k, v, True, TOLERANCE[torch.bfloat16])


def test_interpreter_warning_names_the_callers_line():
    q, k, v = random_qkv((1, 1, 16, 16), 16)
    with pytest.warns(UserWarning, match="Triton interpreter") as record:
        attention(q, k, v, True, "triton")
    assert record[0].filename == __file__


@pytest.mark.parametrize("kernel", [gluon_forward, gluon_backward], ids=lambda m: m.__name__.split(".")[-1])
def test_warp_specialized_kernels_serve_only_compiled_hopper_kernels(kernel):
    """The Gluon kernels have no interpreter path: off a Hopper card (here, on the CPU)
    flash_forward and flash_backward keep the Triton kernels even at the shapes they serve on Hopper."""
    for head_dim, is_causal in kernel.TILES:
        q = torch.randn(1, 2, kernel.MIN_KEYS[head_dim, is_causal], head_dim, dtype=torch.bfloat16)
        assert not kernel.serves(q, q, is_causal)


def test_warp_specialized_backward_gives_way_to_deterministic_algorithms(monkeypatch):
    """gluon_backward.py's dQ is a sum in whatever order TMA's reduces land: where a Hopper card
    would run it (stood in for here), torch.use_deterministic_algorithms(True) keeps the split."""
    monkeypatch.setattr(gluon_forward, "is_hopper", lambda device: True)
    monkeypatch.setattr(gluon_forward, "INTERPRETING", False)
    (head_dim, is_causal), min_keys = next(iter(gluon_backward.MIN_KEYS.items()))
    q = torch.randn(1, 2, min_keys, head_dim, dtype=torch.bfloat16)
    assert gluon_backward.serves(q, q, is_causal)
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert not gluon_backward.serves(q, q, is_causal)
    finally:
        torch.use_deterministic_algorithms(deterministic)


# ---------------------------------------------------------------- GPU (run on the H200)

@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape_q,n_k", [((2, 3, 1000, 64), 1000), ((1, 2, 8192, 128), 8192), ((1, 4, 1, 64), 4097),
                                         ((2, 2, 4097, 16), 1023), ((1, 1, 8191, 32), 8191)])
@pytest.mark.parametrize("backend", ["triton", "triton_fwd", "tiled", "sdpa", "eager"])
def test_gpu_backends_long_and_low_precision(backend, shape_q, n_k, is_causal, dtype):
    if backend == "tiled" and shape_q[-2] * n_k > 1024 * 1024:
        pytest.skip("the Python-loop teaching version is checked on the shorter shapes")
    q, k, v = random_qkv(shape_q, n_k, dtype=dtype, device="cuda", seed=n_k)
    tol = GPU_TOLERANCE[dtype]
    if backend == "triton_fwd" and dtype == torch.float32:
        # Its forward's lse comes from TF32 scores, its backward recomputes the scores in full
        # float32: P = exp(S - lse) carries their difference into every gradient, which the
        # all-TF32 triton backend does not (seen: dQ off by 1.1e-2 at N_q=4097, N_k=1023, D=16).
        tol = 2 * tol
    check_backend(backend, q, k, v, is_causal, tol)


def _enabled(configs, smem_rows, q):
    """The configs the autotuner may pick for q on this card."""
    return prune_configs(configs, q, smem_rows)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("heads_first", [False, True])
def test_gpu_every_tile_config_is_correct(head_dim, is_causal, dtype, heads_first, monkeypatch):
    """Every config the autotuner may pick on this card, forward and backward (on Hopper both
    load paths: TMA and cp.async), in both grid orders."""
    launch_heads_first(monkeypatch, heads_first)
    q, k, v = (t.detach() for t in random_qkv((2, 2, 1031, head_dim), 1031, dtype=dtype, device="cuda", seed=head_dim))
    do = torch.randn_like(q)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = reference(q, k, v, is_causal, do)
    tol = GPU_TOLERANCE[dtype]
    for config in _enabled(FORWARD_CONFIGS, forward_smem_rows, q):
        o, lse = flash_forward(q, k, v, is_causal, config=config)
        assert_close(o, o_ref, tol, f"O with {config}")
    for config in _enabled(BACKWARD_CONFIGS, backward_smem_rows, q):
        dq, dk, dv = flash_backward(q, k, v, o, do, lse, is_causal, config=config)
        for name, got, ref in (("dQ", dq, dq_ref), ("dK", dk, dk_ref), ("dV", dv, dv_ref)):
            assert_close(got, ref, tol, f"{name} with {config}")


SERVED = pytest.mark.parametrize("head_dim,is_causal", list(gluon_forward.TILES))


@pytest.fixture
def gluon_from_256_keys(monkeypatch):
    """flash_forward sends the warp-specialised kernel every call it can take from 256 keys, so
    the tests below check it on short sequences too, where it is not served for speed
    (gluon_forward.MIN_KEYS)."""
    monkeypatch.setattr(gluon_forward, "MIN_KEYS", dict.fromkeys(gluon_forward.MIN_KEYS, 256))


def served_inputs(n_q, n_k, head_dim, dtype):
    """q, k, v and an output gradient do for the Gluon kernels' tests (B = 2, H = 3): q, k, v
    views of one projection when n_q = n_k, as the model makes them, separate tensors else;
    do (B, N, H, D) memory order, as autograd hands it to the packed path."""
    B, H, D = 2, 3, head_dim
    g = torch.Generator(device="cuda").manual_seed(n_q + n_k)
    if n_q == n_k:
        qkv = torch.randn(B, n_q, 3, H, D, device="cuda", dtype=dtype, generator=g)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    else:
        q = torch.randn(B, H, n_q, D, device="cuda", dtype=dtype, generator=g)
        k, v = (torch.randn(B, H, n_k, D, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    do = torch.randn(B, n_q, H, D, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    return q, k, v, do


def check_served_packed(kernel, n, head_dim, is_causal, seed):
    """The model's route (packed_attention: q, k, v views of one projection, O and the gradients
    written with its strides) where kernel (gluon_forward or gluon_backward) serves the call,
    against float64 (B = 2, H = 2, bf16)."""
    if not gluon_forward.is_hopper(torch.device("cuda")):
        pytest.skip("the warp-specialised kernels are Hopper's")
    qkv = torch.randn(2, n, 3, 2, head_dim, device="cuda", dtype=torch.bfloat16,
                      generator=torch.Generator(device="cuda").manual_seed(seed))
    q, k, _ = (t.transpose(1, 2) for t in qkv.unbind(2))
    assert kernel.serves(q, k, is_causal)
    check_packed("triton", qkv.requires_grad_(), is_causal, GPU_TOLERANCE[torch.bfloat16])


@gpu
@pytest.mark.parametrize("kernel", [gluon_forward, gluon_backward], ids=lambda m: m.__name__.split(".")[-1])
def test_gpu_warp_specialized_kernels_are_served_from_their_min_keys(kernel):
    """flash_forward and flash_backward take each Gluon kernel at each entry of its TILES from
    that entry's MIN_KEYS keys, and keep the Triton kernel one key short of it."""
    if not gluon_forward.is_hopper(torch.device("cuda")):
        pytest.skip("the warp-specialised kernels are Hopper's")
    for (head_dim, is_causal), min_keys in kernel.MIN_KEYS.items():
        for n_k, served in ((min_keys - 1, False), (min_keys, True)):
            q = torch.randn(1, 2, n_k, head_dim, device="cuda", dtype=torch.bfloat16)
            assert kernel.serves(q, q, is_causal) == served, (head_dim, is_causal, n_k)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@SERVED
@pytest.mark.parametrize("n_q,n_k", [(2049, 2049), (300, 4097), (5000, 2048), (1, 3001), (257, 257)])
def test_gpu_warp_specialized_forward(n_q, n_k, head_dim, is_causal, dtype, gluon_from_256_keys):
    """gluon_forward.py's kernel, which flash_forward runs on Hopper at the head dims and masks
    of its TILES: O and lse against float64, on views of one projection when N_q = N_k."""
    if not gluon_forward.is_hopper(torch.device("cuda")):
        pytest.skip("the warp-specialised forward is Hopper's")
    q, k, v, _ = served_inputs(n_q, n_k, head_dim, dtype)
    assert gluon_forward.serves(q, k, is_causal)
    o, lse = flash_forward(q, k, v, is_causal)
    o_ref, lse_ref = eager_attention_with_lse(q.double(), k.double(), v.double(), is_causal)
    assert_close(o, o_ref, GPU_TOLERANCE[dtype], "O")
    assert_close(lse, lse_ref, 1e-4, "lse")  # float32 scores of exact 16-bit products


@gpu
@SERVED
def test_gpu_warp_specialized_forward_takes_units_in_turn(head_dim, is_causal, gluon_from_256_keys):
    """gluon_forward.py's kernel with many more units of work than the GPU has SMs, so each
    program takes several in turn, and 9 query tiles per head, so one unit is a middle tile that
    is its own mirror."""
    if not gluon_forward.is_hopper(torch.device("cuda")):
        pytest.skip("the warp-specialised forward is Hopper's")
    B, H, n, D = 3, 50, 1100, head_dim
    qkv = torch.randn(B, n, 3, H, D, device="cuda", dtype=torch.bfloat16,
                      generator=torch.Generator(device="cuda").manual_seed(11))
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    assert gluon_forward.serves(q, k, is_causal)
    o, lse = flash_forward(q, k, v, is_causal)
    o_ref, lse_ref = eager_attention_with_lse(q.double(), k.double(), v.double(), is_causal)
    assert_close(o, o_ref, GPU_TOLERANCE[torch.bfloat16], "O")
    assert_close(lse, lse_ref, 1e-4, "lse")


@gpu
@SERVED
def test_gpu_warp_specialized_forward_in_the_packed_path(head_dim, is_causal, gluon_from_256_keys):
    """The warp-specialised forward in the model's route, triton_backward.py's backward after it."""
    check_served_packed(gluon_forward, 257, head_dim, is_causal, seed=17)


BACKWARD_SERVED = pytest.mark.parametrize("head_dim,is_causal", list(gluon_backward.TILES))


@pytest.fixture
def gluon_backward_from_one_key(monkeypatch):
    """flash_backward sends the warp-specialised backward every call it can take, so the tests
    below check it on short sequences too (gluon_backward.MIN_KEYS)."""
    monkeypatch.setattr(gluon_backward, "MIN_KEYS", dict.fromkeys(gluon_backward.MIN_KEYS, 1))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@BACKWARD_SERVED
@pytest.mark.parametrize("n_q,n_k", [(2049, 2049), (300, 4097), (5000, 2048), (1, 3001), (100, 100), (129, 257)])
def test_gpu_warp_specialized_backward(n_q, n_k, head_dim, is_causal, dtype, gluon_backward_from_one_key):
    """gluon_backward.py's kernel, which flash_backward runs on Hopper at the head dims and
    masks of its TILES: dQ, dK, dV against float64, on views of one projection when N_q = N_k."""
    if not gluon_forward.is_hopper(torch.device("cuda")):
        pytest.skip("the warp-specialised backward is Hopper's")
    q, k, v, do = served_inputs(n_q, n_k, head_dim, dtype)
    assert gluon_backward.serves(q, k, is_causal)
    o, lse = flash_forward(q, k, v, is_causal)
    dq, dk, dv = flash_backward(q, k, v, o, do, lse, is_causal)
    _, _, dq_ref, dk_ref, dv_ref = reference(q, k, v, is_causal, do)
    for name, got, ref in (("dQ", dq, dq_ref), ("dK", dk, dk_ref), ("dV", dv, dv_ref)):
        assert_close(got, ref, GPU_TOLERANCE[dtype], name)


@gpu
@BACKWARD_SERVED
def test_gpu_warp_specialized_backward_in_the_packed_path(head_dim, is_causal, gluon_backward_from_one_key):
    """The warp-specialised backward in the model's route, its gradients written into the fused
    projection's."""
    check_served_packed(gluon_backward, 1031, head_dim, is_causal, seed=19)


@gpu
@SERVED
def test_gpu_warp_specialized_kernels_launched_again(head_dim, is_causal, gluon_from_256_keys,
                                                     gluon_backward_from_one_key):
    """Both Gluon kernels called again at one shape with new data, which goes through the
    compiled kernels kept by the first call (CompiledLaunches keeps no new one), then at another
    batch size, which keeps as many new ones as the first call."""
    if not gluon_forward.is_hopper(torch.device("cuda")):
        pytest.skip("the warp-specialised kernels are Hopper's")
    launches = (gluon_forward._forward_launches, gluon_backward._backward_launches)
    kept = []  # per call: how many compiled kernels each Gluon kernel newly kept
    for batch, seed in ((2, 0), (2, 1), (1, 2)):
        qkv = torch.randn(batch, 300, 3, 2, head_dim, device="cuda", dtype=torch.bfloat16,
                          generator=torch.Generator(device="cuda").manual_seed(seed))
        q, k, _ = (t.transpose(1, 2) for t in qkv.unbind(2))
        assert gluon_forward.serves(q, k, is_causal) and gluon_backward.serves(q, k, is_causal)
        before = [len(launch.compiled) for launch in launches]
        check_packed("triton", qkv.requires_grad_(), is_causal, GPU_TOLERANCE[torch.bfloat16])
        kept.append([len(launch.compiled) - n for launch, n in zip(launches, before)])
    first, again, other_batch = kept
    assert all(n > 0 for n in first) and again == [0, 0] and other_batch == first


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_packed_attention_at_the_models_shape(dtype):
    """The default model's call (TrainConfig's batch, context and heads) twice with new data:
    the second time the kernels go through TunedKernel's direct launch."""
    default = TrainConfig()
    shape = (default.batch_size, default.block_size, 3, default.n_head, default.n_embd // default.n_head)
    for seed in (0, 1):
        qkv = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
        check_packed("triton", qkv.to(device="cuda", dtype=dtype).requires_grad_(), True, GPU_TOLERANCE[dtype])


@gpu
def test_gpu_direct_launch_is_not_reused_for_another_grid():
    """Contiguous q, k, v of another batch size have the same strides, lengths and heads, so the
    same scalar arguments: only the grid tells the launches apart."""
    for batch in (1, 3, 1):
        q, k, v = random_qkv((batch, 2, 300, 64), 300, dtype=torch.bfloat16, device="cuda", seed=batch)
        check_backend("triton", q, k, v, True, GPU_TOLERANCE[torch.bfloat16])

