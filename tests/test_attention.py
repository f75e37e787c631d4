"""Every backend against a float64 reference (eager.py's definition), forward and backward, on
awkward shapes: odd lengths, N_q != N_k both ways, 2- to 5-dim inputs, head dims from 8 to 256,
grouped-query heads, sliding windows, rows that see no key, strided views of a fused
projection. Then what the Triton path promises beyond the numbers: the layouts it writes, what
it saves, the configs it may pick on a card, the Hopper kernels' entry rules, and its errors.
On a CPU the Triton kernels run in Triton's interpreter; the tests marked gpu run on a GPU."""
import pytest
import torch
import triton

from attention import BACKENDS, FlashAttentionPytorch, FlashAttentionTriton, attention, launch
from attention.eager import eager_attention_with_lse
from attention.hopper import backward as hopper_backward
from attention.hopper import common as hopper_common
from attention.hopper import forward as hopper_forward
from attention.launch import candidates, descriptor_ready, fitting_configs, shared_memory_bytes
from attention.masks import UNBOUNDED, window_bounds
from attention.tiled import tiled_forward
from attention.triton_backward import (BACKWARD_CONFIGS, _attn_bwd, _attn_bwd_delta, atomic, backward_smem_rows,
                                      flash_backward)
from attention.triton_forward import FORWARD_CONFIGS, _attn_fwd, flash_forward, forward_smem_rows
from conftest import default_run

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 4e-2}
GPU_TOLERANCE = {torch.float32: 1e-2, torch.float16: 2e-2, torch.bfloat16: 4e-2}
gpu = pytest.mark.gpu


def random_qkv(shape_q, n_k, h_kv=None, dtype=torch.float32, device="cpu", seed=0, scale=1.0):
    """q (*shape_q) and k, v with n_k rows and h_kv heads (dim -3; default q's); never zeros."""
    g = torch.Generator().manual_seed(seed)
    *lead, _, d = shape_q
    if h_kv is not None:
        lead[-1] = h_kv
    q = torch.randn(*shape_q, generator=g) * scale
    k = torch.randn(*lead, n_k, d, generator=g) * scale
    v = torch.randn(*lead, n_k, d, generator=g)
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]


def reference(q, k, v, is_causal, do, window_size=(-1, -1)):
    """O, lse, dQ, dK, dV in float64."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, lse = eager_attention_with_lse(q64, k64, v64, is_causal, window_size)
    o.backward(do.double())
    return o, lse, q64.grad, k64.grad, v64.grad


def mismatch(actual, expected, tol, what):
    """Why actual is not the float64 reference within tol (NaN, infinities where it has none or
    the other way round, the largest error), or None where it is."""
    if actual.shape != expected.shape:
        return f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if torch.isnan(actual).any():
        return f"{what}: NaN"
    if not ((actual.double() == expected) | (actual.isfinite() & expected.isfinite())).all():
        return f"{what}: infinities where the reference has none, or the other way round"
    finite = expected.isfinite()
    err = (actual.double()[finite] - expected[finite]).abs().max().item() if finite.any() else 0.0
    return f"{what}: max abs error {err:.2e} > {tol:.0e}" if err > tol else None


def assert_close(actual, expected, tol, what):
    problem = mismatch(actual, expected, tol, what)
    if problem:
        raise AssertionError(problem)


def assert_all_close(checks, tol):
    """checks: (what, actual, expected) each. All are checked and the failure names every one
    that is off and every one that is not, so a wrong dK is seen even when dQ is wrong too."""
    problems = {what: mismatch(actual, expected, tol, what) for what, actual, expected in checks}
    if any(problems.values()):
        right = [what for what, problem in problems.items() if problem is None]
        raise AssertionError("; ".join(filter(None, problems.values()))
                             + (f"; right within {tol:.0e}: {', '.join(right)}" if right else ""))


def check_backend(backend, q, k, v, is_causal, tol, window_size=(-1, -1)):
    o = attention(q, k, v, is_causal=is_causal, backend=backend, window_size=window_size)
    assert o.dtype == q.dtype and o.shape == q.shape
    # Seeded, so a test sees the same dO whatever ran before it in its process (xdist orders vary).
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(o.numel())).to(o)
    o.backward(do)
    o_ref, _, dq_ref, dk_ref, dv_ref = reference(q, k, v, is_causal, do, window_size)
    assert_all_close([(f"{backend} O", o, o_ref), (f"{backend} dQ", q.grad, dq_ref), (f"{backend} dK", k.grad, dk_ref),
                      (f"{backend} dV", v.grad, dv_ref)], tol)


# (q shape, N_k): odd lengths, N_q != N_k both ways, 2- to 5-dim inputs.
SHAPES = [
    ((1, 1, 1, 16), 1),
    ((2, 3, 15, 16), 15),
    ((1, 2, 16, 32), 16),
    ((2, 1, 17, 64), 17),
    ((1, 2, 100, 32), 257),
    ((1, 1, 257, 64), 100),
    ((1, 2, 128, 128), 128),
    ((2, 257, 16), 257),       # 3-D (B, N, D), the article's
    ((3, 100, 64), 17),
    ((1, 15, 128), 1),
    ((33, 32), 33),            # 2-D (N, D)
    ((2, 1, 2, 17, 16), 17),   # 5-D
]


# The interpreted Triton backends, in the default run: each shape once, causal on every other
# (triton) or on the others (triton_fwd, whose forward kernel is triton's), so each sees each
# shape and both masks; the PyTorch backends every case. `pytest -m full`: the rest.
def triton_takes_every_other(shape_index, is_causal, backend):
    return backend not in ("triton", "triton_fwd") or is_causal == (shape_index % 2 == (backend == "triton"))


@default_run(lambda case: triton_takes_every_other(SHAPES.index((case.shape_q, case.n_k)), case.is_causal,
                                                   case.backend))
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape_q,n_k", SHAPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_float64_reference(backend, shape_q, n_k, is_causal):
    q, k, v = random_qkv(shape_q, n_k, seed=sum(shape_q) + n_k)
    check_backend(backend, q, k, v, is_causal, TOLERANCE[torch.float32])


GROUPS = [(4, 4), (4, 2), (4, 1), (8, 2)]


@default_run(lambda case: triton_takes_every_other(GROUPS.index((case.heads, case.kv_heads)), case.is_causal,
                                                   case.backend))
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads", GROUPS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_query_heads(backend, heads, kv_heads, is_causal):
    """H / H_kv = 1, 2 and 4, and one kv head (multi-query): query head h reads kv head h // G,
    and a kv head's dK and dV add up the parts of its G query heads."""
    q, k, v = random_qkv((2, heads, 45, 16), 61, h_kv=kv_heads, seed=heads * 10 + kv_heads)
    check_backend(backend, q, k, v, is_causal, TOLERANCE[torch.float32])


# (left, right, is_causal): windows narrower than a tile, wider than one (63, 257 against 64- and
# 128-key tiles), unbounded, on one side or both; (-1, 0) without is_causal is causal by window.
WINDOWS = [(0, 0, False), (1, 0, True), (63, 0, True), (257, 0, True), (-1, 0, False),
           (0, 7, False), (63, 70, False), (257, 3, False), (-1, 9, False), (5, -1, False)]


# In the default run eager, sdpa and triton take every window; tiled (whose masks
# tests/test_tiled.py checks tile by tile) and triton_fwd (triton's forward kernel) half each.
@default_run(lambda case: case.backend not in ("tiled", "triton_fwd") or
             WINDOWS.index((case.left, case.right, case.is_causal)) % 2 == (case.backend == "tiled"))
@pytest.mark.parametrize("left,right,is_causal", WINDOWS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_windows(backend, left, right, is_causal):
    q, k, v = random_qkv((1, 2, 300, 16), 280, h_kv=1, seed=left + 3 * right)
    check_backend(backend, q, k, v, is_causal, TOLERANCE[torch.float32], window_size=(left, right))


@pytest.mark.parametrize("head_dim", [8, 48, 80, 96, 160, 256])
@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dims_padded_to_a_power_of_two(backend, head_dim):
    """Head dims that are not powers of two (and 8, below tl.dot's 16): the kernels pad them in
    registers and mask the padding out of every load and store."""
    q, k, v = random_qkv((1, 2, 33, head_dim), 40, seed=head_dim)
    check_backend(backend, q, k, v, True, TOLERANCE[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_that_see_no_key_give_zeros(backend):
    """Queries past the keys' end plus the window see no key: O = 0 there and their gradients 0,
    never NaN, and lse = -inf (checked against the reference by check_backend)."""
    q, k, v = random_qkv((1, 2, 100, 16), 20, seed=3)
    check_backend(backend, q, k, v, False, TOLERANCE[torch.float32], window_size=(3, 2))
    o = attention(q, k, v, backend=backend, window_size=(3, 2))
    assert o[..., 23:, :].eq(0).all() and o[..., :22, :].ne(0).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_views_of_a_fused_grouped_projection(backend):
    """q, k, v as the model makes them: (B, heads, T, D) views of one (B, T, H + 2 * H_kv, D)
    projection; the gradients reach the projection through the views."""
    B, T, H, H_kv, D = 2, 37, 4, 2, 32
    leaf = torch.randn(B, T, H + 2 * H_kv, D, requires_grad=True)
    q, k, v = leaf.transpose(1, 2).split([H, H_kv, H_kv], dim=1)
    assert not q.is_contiguous()
    o = attention(q, k, v, is_causal=True, backend=backend)
    do = torch.randn_like(o)
    o.backward(do)
    o_ref, _, dq_ref, dk_ref, dv_ref = reference(q, k, v, True, do)
    assert_close(o, o_ref, 1e-4, "O")
    assert_close(leaf.grad, torch.cat((dq_ref, dk_ref, dv_ref), dim=1).transpose(1, 2), 1e-4, "d(qkv)")


@pytest.mark.parametrize("backend", ["triton", "triton_fwd"])
def test_triton_output_and_gradients_keep_the_inputs_memory_order(backend):
    """For the model's views of one (B, T, heads, D) projection, O and dQ, dK, dV come out
    (B, T, H, D) in memory: the model's transpose back to (B, T, H * D) is then free."""
    leaf = torch.randn(2, 37, 9, 32, requires_grad=True)
    q, k, v = leaf.transpose(1, 2).split([3, 3, 3], dim=1)
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


@pytest.mark.parametrize("is_causal,window_size", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 3))])
@pytest.mark.parametrize("shape_q,n_k", [((2, 3, 100, 64), 100), ((1, 2, 17, 32), 257), ((1, 1, 257, 16), 33)])
def test_logsumexp_matches_reference(shape_q, n_k, is_causal, window_size):
    q, k, v = (t.detach() for t in random_qkv(shape_q, n_k, seed=n_k))
    _, lse_ref = eager_attention_with_lse(q.double(), k.double(), v.double(), is_causal, window_size)
    for tile_size in (16, 37):
        _, lse = tiled_forward(q, k, v, is_causal, window_size, tile_size, tile_size)
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:-1]
        assert_close(lse, lse_ref, 1e-5, f"tiled lse (tile {tile_size})")
    _, lse = flash_forward(q, k, v, is_causal, window_size)
    assert lse.dtype == torch.float32
    assert_close(lse.view(q.shape[:-1]), lse_ref, 1e-5, "triton lse")


@pytest.mark.parametrize("backend", ["tiled", "triton", "triton_fwd"])
def test_saves_exactly_q_k_v_o_and_one_logsumexp(backend):
    q, k, v = random_qkv((2, 4, 33, 32), 20, h_kv=2)
    o = attention(q, k, v, True, backend)
    saved = o.grad_fn.saved_tensors
    assert len(saved) == 5
    for got, want in zip(saved[:3], (q, k, v)):
        assert got.data_ptr() == want.data_ptr() and got.shape == want.shape
    assert torch.equal(saved[3], o)
    _, lse_ref = eager_attention_with_lse(q.double(), k.double(), v.double(), True)
    assert saved[4].dtype == torch.float32 and saved[4].shape == q.shape[:-1]
    assert_close(saved[4], lse_ref, 1e-5, "saved lse")


@pytest.mark.parametrize("tile_size", [1, 16, 50, 300])
def test_tiled_any_tile_size(tile_size):
    q, k, v = random_qkv((1, 2, 70, 16), 45, seed=tile_size)
    o = FlashAttentionPytorch.apply(q, k, v, True, (-1, -1), tile_size, tile_size)
    o_ref, *_ = reference(q, k, v, True, torch.ones_like(o))
    assert_close(o, o_ref, 1e-5, f"tiled O (tile {tile_size})")


def test_tiled_sums_p_v_in_float32():
    """64 keys of equal score with V = 1024 in float16: each tile's P V sums to 65,536, past
    float16's largest value, yet O (1024) is representable: summed in float32 it stays finite."""
    q, k = torch.zeros(1, 1, 4, 16, dtype=torch.float16), torch.zeros(1, 1, 64, 16, dtype=torch.float16)
    q[..., 0] = k[..., 0] = 1.0  # every score equal, and not zero
    v = torch.full((1, 1, 64, 16), 1024.0, dtype=torch.float16)
    for backend in ("tiled", "eager", "sdpa"):
        assert attention(q, k, v, backend=backend).eq(1024).all(), backend


def test_tiled_gradients_in_float64_are_float64_accurate():
    """float64 in, float64 math: lse is kept in float64 for the backward, so the gradients match
    the float64 reference to about 1e-13, not float32's 1e-7."""
    q, k, v = random_qkv((1, 2, 50, 16), 50, dtype=torch.float64, seed=2)
    check_backend("tiled", q, k, v, True, TOLERANCE[torch.float64])


def launch_heads_first(monkeypatch, heads_first):
    """Make the kernels' launches take the given grid order (launch.heads_first)."""
    import attention.triton_backward
    import attention.triton_forward
    for module in (attention.triton_forward, attention.triton_backward):
        monkeypatch.setattr(module, "heads_first", lambda k, n_heads: heads_first)


EXPLICIT_MASKS = [(False, (-1, -1)), (True, (-1, -1)), (True, (20, 0)), (False, (9, 40))]
EXPLICIT_TILES = [(16, 16), (32, 16), (16, 32), (64, 32)]


# The default run: every tile shape with every mask once, the load path and grid order taking
# each of their 4 pairs once per tile shape and once per mask (a Latin square); `-m full`, the rest.
@default_run(lambda case: (EXPLICIT_MASKS.index((case.is_causal, case.window_size)) -
                           EXPLICIT_TILES.index((case.block_m, case.block_n))) % 4 == 2 * case.use_tma + case.heads_first)
@pytest.mark.parametrize("heads_first", [False, True])
@pytest.mark.parametrize("use_tma", [False, True])
@pytest.mark.parametrize("is_causal,window_size", EXPLICIT_MASKS)
@pytest.mark.parametrize("block_m,block_n", EXPLICIT_TILES)
def test_triton_kernels_with_explicit_tiles(block_m, block_n, is_causal, window_size, use_tma, heads_first,
                                            monkeypatch):
    """Tiles smaller than the sequence, with BLOCK_M != BLOCK_N: tiles cross the diagonal and the
    window's edges, and both sequences end mid-tile. Both load paths: TMA descriptors (Hopper)
    and masked pointer loads (other cards). Both grid orders. Two query heads per kv head. Both
    backward schedules, split and atomic, each with both load paths and both grid orders."""
    launch_heads_first(monkeypatch, heads_first)
    q, k, v = (t.detach() for t in random_qkv((1, 4, 83, 32), 71, h_kv=2, seed=block_m + block_n))
    config = triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "USE_TMA": use_tma})
    o, lse = flash_forward(q, k, v, is_causal, window_size, config=config)
    do = torch.randn_like(o)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = reference(q, k, v, is_causal, do, window_size)
    assert_close(o, o_ref, 1e-4, "O")
    assert_close(lse, lse_ref, 1e-5, "lse")
    # The dK/dV job streams query tiles of its own size: here block_n, unlike the dQ job's block_m.
    config = triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "DKDV_BLOCK_M": block_n,
                            "ATOMIC_DQ": use_tma != heads_first, "USE_TMA": use_tma})
    dq, dk, dv = flash_backward(q, k, v, o, do, lse, is_causal, window_size, config=config)
    assert_all_close([("dQ", dq, dq_ref), ("dK", dk, dk_ref), ("dV", dv, dv_ref)], 1e-4)


@pytest.mark.parametrize("head_dim", [8, 48, 160, 256])
def test_atomic_backward_at_padded_head_dims(head_dim):
    """The atomic schedule adds dQ's shares of a padded head dim: the padding's columns are
    never added, the rest are. Grouped-query heads, rows past both sequences' ends."""
    q, k, v = (t.detach() for t in random_qkv((1, 4, 37, head_dim), 29, h_kv=2, seed=head_dim))
    o, lse = flash_forward(q, k, v, True)
    do = torch.randn_like(o)
    _, _, dq_ref, dk_ref, dv_ref = reference(q, k, v, True, do)
    dq, dk, dv = flash_backward(q, k, v, o, do, lse, True, config=atomic(16, 32, warps=4, stages=2))
    assert_all_close([("dQ", dq, dq_ref), ("dK", dk, dk_ref), ("dV", dv, dv_ref)], 1e-4)


def test_the_delta_kernel_zeroes_the_dq_accumulator():
    """The atomic schedule adds into an accumulator nothing else clears: the delta kernel zeroes
    every element of it (here poisoned with NaN), padded head dim and a last tile cut short included."""
    B, H, N, D = 2, 3, 70, 24
    o, do = torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    dq_acc, delta = torch.full((B, H, N, D), float("nan")), torch.empty(B, H, N)
    _attn_bwd_delta[(triton.cdiv(N, 64), B * H)](o, do, delta, dq_acc, *o.stride()[:3], *do.stride()[:3],
                                                 *dq_acc.stride()[:3], H, N, HEAD_DIM=D, BLOCK_D=32,
                                                 HEADS_FIRST=False, BLOCK_M=64, ZERO_DQ=True)
    assert dq_acc.eq(0).all()
    assert_close(delta, (o.double() * do.double()).sum(-1), 1e-5, "delta")


@pytest.mark.parametrize("backend", ["tiled", "triton", "triton_fwd"])
def test_float16_on_cpu(backend):
    q, k, v = random_qkv((1, 2, 67, 64), 67, dtype=torch.float16, seed=3)
    check_backend(backend, q, k, v, True, TOLERANCE[torch.float16])


@pytest.mark.parametrize("backend", ["triton", "triton_fwd"])
def test_bfloat16_on_cpu_matches_float64_reference(backend):
    """The interpreter's tl.dot on bf16 is wrong upstream: on the CPU, bf16 runs in float32 and is rounded."""
    q, k, v = random_qkv((1, 4, 33, 32), 33, h_kv=2, dtype=torch.bfloat16, seed=7)
    check_backend(backend, q, k, v, True, TOLERANCE[torch.bfloat16])


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


def custom_op_calls(device, dtype, n=9, head_dim=16, cache_rows=19):
    """(operator, arguments) for every nanofa2 custom operator: flash_forward and flash_backward
    on the model's strided views of one projection (grouped-query heads, a causal window) and on
    contiguous tensors with N_k != N_q (no mask); decode_attention with the window's left side
    unbounded (the kernel's large int) and bounded. The CPU test runs them in the interpreter, the
    GPU test on the card: one list, so that neither calls an operator by a schema it lost."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)
    ops = torch.ops.nanofa2
    views = randn(1, n, 8, head_dim).transpose(1, 2).split([4, 2, 2], dim=1)
    contiguous = randn(1, 4, n, head_dim), randn(1, 2, n + 4, head_dim), randn(1, 2, n + 4, head_dim)
    calls = []
    for (q, k, v), mask in ((views, (True, [3, 0])), (contiguous, (False, [-1, -1]))):
        o, lse = ops.flash_forward(q, k, v, *mask)  # the backward's own inputs
        calls += [(ops.flash_forward.default, (q, k, v, *mask)),
                  (ops.flash_backward.default, (q, k, v, o, randn(*o.shape), lse, *mask))]
    q, k, v = randn(2, 1, 8, head_dim).transpose(1, 2).split([4, 2, 2], dim=1)
    for left in (-1, 4):
        caches = randn(2, 2, cache_rows, head_dim), randn(2, 2, cache_rows, head_dim)
        calls.append((ops.decode_attention.default, (q, k, v, *caches, torch.tensor([7], device=device),
                                                     window_bounds(False, (left, 0))[0])))
    return calls


def test_every_custom_op_passes_opcheck():
    """Schema, fake implementation with the real outputs' strides, AOT dispatch, and the inputs an
    operator writes declared in its schema (decode's caches): for every operator the package
    registers, so that a new one, or a schema changed under a caller, fails here."""
    calls = custom_op_calls("cpu", torch.float32)
    registered = {name for name in torch._C._dispatch_get_all_op_names() if name.startswith("nanofa2::")}
    assert {op.name() for op, _ in calls} == registered
    for op, args in calls:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("backend", ["tiled", "triton", "triton_fwd"])
def test_double_backward_raises_a_clear_error(backend):
    """A second-order gradient through a first-order backward must fail loudly, never be a wrong number."""
    q, k, v = random_qkv((1, 2, 20, 16), 20)
    first, = torch.autograd.grad((attention(q, k, v, True, backend) ** 2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=f"double backward is not supported by the {backend} backend"):
        (first ** 2).sum().backward()


def test_interpreter_warning_names_the_callers_line():
    q, k, v = random_qkv((1, 1, 16, 16), 16)
    with pytest.warns(UserWarning, match="Triton interpreter") as record:
        attention(q, k, v, True, "triton")
    assert record[0].filename == __file__


def test_flash_attention_triton_is_the_triton_backend():
    q, k, v = random_qkv((2, 33, 16), 33)
    assert torch.equal(FlashAttentionTriton.apply(q, k, v, True), attention(q, k, v, True, "triton"))


def pretend_hopper(monkeypatch):
    """A compiled Hopper card, as the Gluon kernels' entry rule sees it."""
    monkeypatch.setattr(hopper_common, "is_hopper", lambda device: True)
    monkeypatch.setattr(hopper_common, "INTERPRETING", False)


@pytest.mark.parametrize("kernel", [hopper_forward, hopper_backward], ids=("forward", "backward"))
@pytest.mark.parametrize("head_dim,window", [(64, False), (64, True), (128, False), (128, True)])
def test_hopper_kernels_serve_only_what_they_were_built_for(kernel, head_dim, window, monkeypatch):
    """On a (pretend) compiled Hopper card each Gluon kernel takes the head dims and lengths of
    its TILES and MIN_KEYS, under every mask (causal, any window, none) and with grouped-query
    heads; never float32, another head dim, or the consumer-card path; and on this CPU, nothing
    at all."""
    min_keys = kernel.MIN_KEYS[head_dim, window]
    q = torch.randn(1, 4, min_keys, head_dim, dtype=torch.bfloat16)
    sides = [(UNBOUNDED, 0), (100, 0), (31, 17), (UNBOUNDED, 40), (0, 0)] if window else [(UNBOUNDED, UNBOUNDED)]
    assert not kernel.serves(q, q, *sides[0])  # the interpreter: no Gluon
    pretend_hopper(monkeypatch)
    for left, right in sides:
        assert kernel.serves(q, q, left, right) and kernel.serves(q, q[:, :1], left, right), (left, right)  # MHA, MQA
        assert kernel.tiles_for(head_dim, left, right) is kernel.TILES[head_dim, window]
        assert not kernel.serves(q.float(), q.float(), left, right)
        assert not kernel.serves(q, q[:, :, :-1], left, right)  # fewer keys than MIN_KEYS
    wide = torch.randn(1, 4, min_keys, 96, dtype=torch.bfloat16)
    assert not kernel.serves(wide, wide, *sides[0])  # a head dim without tiles
    monkeypatch.setattr(hopper_common, "ADA_PATH", True)
    assert not kernel.serves(q, q, *sides[0])


@pytest.mark.parametrize("heads,kv_heads,is_causal,window_size", [
    (4, 4, True, (-1, -1)), (4, 1, False, (-1, -1)), (4, 2, True, (256, 0)), (4, 4, False, (31, 17)),
    (6, 2, False, (-1, 40)), (4, 2, False, (1000, -1))])
def test_flash_forward_and_backward_hand_windows_and_grouped_heads_to_the_hopper_kernels(
        heads, kv_heads, is_causal, window_size, monkeypatch):
    """On a (pretend) Hopper card, flash_forward and flash_backward give a 16-bit call the Gluon
    kernels serve to them, kv heads and the mask's two sides as they are (left, right from
    window_bounds); float32 goes to the Triton kernels (here, the interpreter)."""
    pretend_hopper(monkeypatch)
    monkeypatch.setattr(hopper_forward, "MIN_KEYS", dict.fromkeys(hopper_forward.MIN_KEYS, 64))
    monkeypatch.setattr(hopper_backward, "MIN_KEYS", dict.fromkeys(hopper_backward.MIN_KEYS, 64))
    launched = []
    monkeypatch.setattr(hopper_forward, "launch", lambda q, k, v, o, lse, left, right: launched.append(
        ("forward", k.shape[1], left, right)) or o.zero_())
    monkeypatch.setattr(hopper_backward, "launch", lambda q, k, v, do, lse, delta, left, right, dq, dk, dv:
                        launched.append(("backward", k.shape[1], left, right)))
    sides = window_bounds(is_causal, window_size)
    q, k, v = (t.detach() for t in random_qkv((1, heads, 70, 64), 90, h_kv=kv_heads, dtype=torch.float16))
    o, lse = flash_forward(q, k, v, is_causal, window_size)
    flash_backward(q, k, v, o, torch.randn_like(q), lse, is_causal, window_size)
    assert launched == [("forward", kv_heads, *sides), ("backward", kv_heads, *sides)]
    o, lse = flash_forward(q.float(), k.float(), v.float(), is_causal, window_size)  # no Gluon in float32
    assert len(launched) == 2 and torch.isfinite(o).all()


def test_the_hopper_backward_gives_way_to_deterministic_algorithms(monkeypatch):
    """hopper/backward.py's dQ is a sum in whatever order TMA's reduces land: under
    torch.use_deterministic_algorithms the split Triton backward runs instead."""
    pretend_hopper(monkeypatch)
    (head_dim, window), min_keys = next(iter(hopper_backward.MIN_KEYS.items()))
    q = torch.randn(1, 2, min_keys, head_dim, dtype=torch.bfloat16)
    right = 0 if window else UNBOUNDED
    assert hopper_backward.serves(q, q, UNBOUNDED, right)
    torch.use_deterministic_algorithms(True)
    try:
        assert not hopper_backward.serves(q, q, UNBOUNDED, right)
    finally:
        torch.use_deterministic_algorithms(False)


def tuner_candidates(table, smem_rows, q, head_dim):
    """The configs that fit q's card at head_dim and q's length, best first: what the tuner
    chooses among (it times the first launch.TIMED_CONFIGS), and what the GPU test of every
    config runs."""
    return fitting_configs(candidates(table, q.device, head_dim), smem_rows, q, head_dim, q.shape[2], q.shape[2])


def configs_on(monkeypatch, has_tma, limit):
    monkeypatch.setattr(launch, "has_tma", lambda device: has_tma)
    monkeypatch.setattr(launch, "shared_memory_limit", lambda device: limit)
    monkeypatch.setattr(launch, "INTERPRETING", False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [8, 32, 48, 64, 128, 160, 256])
def test_the_consumer_card_keeps_configs_that_fit_it(head_dim, dtype, monkeypatch):
    """On a card without TMA and with 99 KB of shared memory (an RTX 4070 Super, or any card
    under NANOFA2_ADA=1) each kernel keeps only cp.async configs that fit, and always has one."""
    configs_on(monkeypatch, has_tma=False, limit=launch.ADA_SHARED_MEMORY_BYTES)
    q = torch.empty(1, 1, 4096, head_dim, dtype=dtype, device="meta")
    for table, smem_rows in ((FORWARD_CONFIGS, forward_smem_rows), (BACKWARD_CONFIGS, backward_smem_rows)):
        kept = tuner_candidates(table, smem_rows, q, head_dim)
        assert kept and not any(c.kwargs["USE_TMA"] for c in kept)
        size = q.element_size()
        assert all(shared_memory_bytes(c, smem_rows, head_dim, size, False) <= launch.ADA_SHARED_MEMORY_BYTES
                   for c in kept)


def test_hopper_keeps_tma_configs_only_for_unpadded_head_dims(monkeypatch):
    configs_on(monkeypatch, has_tma=True, limit=232448)
    for head_dim, tma_kept in ((64, True), (80, False)):
        q = torch.empty(1, 1, 4096, head_dim, dtype=torch.bfloat16, device="meta")
        kept = tuner_candidates(FORWARD_CONFIGS, forward_smem_rows, q, head_dim)
        assert any(c.kwargs["USE_TMA"] for c in kept) == tma_kept


def test_short_sequences_keep_short_tiles(monkeypatch):
    configs_on(monkeypatch, has_tma=False, limit=launch.ADA_SHARED_MEMORY_BYTES)
    q = torch.empty(1, 1, 20, 64, dtype=torch.bfloat16, device="meta")
    kept = tuner_candidates(FORWARD_CONFIGS, forward_smem_rows, q, 64)
    assert kept and all(c.kwargs["BLOCK_M"] <= 20 and c.kwargs["BLOCK_N"] <= 20 for c in kept)


def timed_configs(table, smem_rows, head_dim, deterministic=False):
    """What the tuner times for a bf16 call at 4,096 tokens, on the card configs_on pretends."""
    q = torch.empty(1, 4, 4096, head_dim, dtype=torch.bfloat16, device="meta")
    return launch.pruned_configs(table, smem_rows, dict(Q=q, N_Q=4096, N_K=4096, N_Q_BUCKET=4096, N_K_BUCKET=4096),
                                 dict(HEAD_DIM=head_dim, DETERMINISTIC=deterministic))


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_the_tuner_times_both_backward_schedules_on_the_consumer_card(head_dim, monkeypatch):
    """On the consumer card the tuner may choose the atomic schedule or the split one, and FA2's
    own forward tile, 128 x 64 with 4 warps (no TMA); under torch.use_deterministic_algorithms
    it times the split alone."""
    configs_on(monkeypatch, has_tma=False, limit=launch.ADA_SHARED_MEMORY_BYTES)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    timed = timed_configs(BACKWARD_CONFIGS, backward_smem_rows, head_dim)
    assert {c.kwargs["ATOMIC_DQ"] for c in timed} == {True, False}
    deterministic = timed_configs(BACKWARD_CONFIGS, backward_smem_rows, head_dim, deterministic=True)
    assert deterministic and not any(c.kwargs["ATOMIC_DQ"] for c in deterministic)
    forward = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) for c in
               timed_configs(FORWARD_CONFIGS, forward_smem_rows, head_dim)]
    assert (128, 64, 4) in forward


def test_hopper_times_its_own_lists(monkeypatch):
    """Hopper (TMA, 227 KB) times the first three of its own lists that fit: the split backward
    only, as measured there."""
    configs_on(monkeypatch, has_tma=True, limit=232448)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    q = torch.empty(1, 4, 4096, 64, dtype=torch.bfloat16, device="meta")
    for table, smem_rows in ((FORWARD_CONFIGS, forward_smem_rows), (BACKWARD_CONFIGS, backward_smem_rows)):
        assert timed_configs(table, smem_rows, 64) == fitting_configs(table["hopper", 256], smem_rows, q, 64, 4096,
                                                                      4096)[:launch.TIMED_CONFIGS]
    assert not any(c.kwargs["ATOMIC_DQ"] for c in timed_configs(BACKWARD_CONFIGS, backward_smem_rows, 64))


def test_deterministic_algorithms_run_the_split_backward_and_repeat_its_bits():
    """In the interpreter the tuner picks the atomic schedule where it fits (the fewest programs);
    under torch.use_deterministic_algorithms(True), the split, which gives the same bits twice."""
    q, k, v = (t.detach() for t in random_qkv((1, 4, 70, 16), 70, h_kv=2, seed=11))
    o, lse = flash_forward(q, k, v, True)
    do = torch.randn_like(o)
    _, _, *grads_ref = reference(q, k, v, True, do)
    flash_backward(q, k, v, o, do, lse, True)
    assert _attn_bwd.best_config.kwargs["ATOMIC_DQ"]
    torch.use_deterministic_algorithms(True)
    try:
        first = flash_backward(q, k, v, o, do, lse, True)
        assert not _attn_bwd.best_config.kwargs["ATOMIC_DQ"]
        second = flash_backward(q, k, v, o, do, lse, True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert_all_close([(name, g, ref) for name, g, ref in zip(("dQ", "dK", "dV"), first, grads_ref)], 1e-4)


def test_the_tuner_times_and_runs_nothing_inside_a_cuda_graph_capture(monkeypatch):
    """Triton 3.6 times the one candidate the prune leaves in a capture; a timing synchronises,
    which the capture refuses, and the capture is lost."""
    monkeypatch.setattr(launch, "INTERPRETING", False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    ran = []
    for kernel in (_attn_fwd, _attn_bwd):
        assert kernel.do_bench(lambda: ran.append(kernel), quantiles=(0.5, 0.2, 0.8)) == [0.0, 0.0, 0.0]
    assert ran == []


def test_kernels_load_inside_a_capture_in_relaxed_mode_and_the_threads_mode_comes_back(monkeypatch):
    """kernels_may_load swaps the thread's capture mode (a fake driver here: global, 0) for
    relaxed inside a capture, restores it on the way out, error or not, and leaves it alone
    outside a capture."""
    thread_mode = [0]

    def exchange(pointer):
        thread_mode[0], pointer._obj.value = pointer._obj.value, thread_mode[0]
        return 0

    monkeypatch.setattr(launch.ctypes, "CDLL", lambda name: type("Driver", (), {
        "cuThreadExchangeStreamCaptureMode": staticmethod(exchange)}))
    cuda = torch.device("cuda")
    for capturing in (False, True):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
        with launch.kernels_may_load(cuda):
            assert thread_mode == [launch.RELAXED_CAPTURE_MODE if capturing else 0]
        with pytest.raises(KeyError), launch.kernels_may_load(cuda):
            raise KeyError("a failed launch")
        assert thread_mode == [0]


def test_the_interpreter_is_chosen_before_triton_loads():
    """Triton reads TRITON_INTERPRET as it defines its own helpers, when triton is imported. On a
    CPU, importing attention first chooses the interpreter; a program that imports triton first
    (torch.compile's machinery does) chooses it itself, or the Triton backends refuse in one line
    naming the fix while the others run."""
    import os
    import subprocess
    import sys

    def run(imports, **env):
        code = (f"{imports}\nq = torch.randn(1, 2, 20, 16)\no = attention(q, q, q, True, 'eager')\n"
                "print(torch.allclose(attention(q, q, q, True, 'triton'), o, atol=1e-5))")
        env = {**{name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}, **env}
        return subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True,
                              cwd=__import__("conftest").REPO)

    assert run("from attention import attention\nimport triton, torch").stdout.strip() == "True"
    assert run("import triton, torch\nfrom attention import attention", TRITON_INTERPRET="1").stdout.strip() == "True"
    refused = run("import triton, torch\nfrom attention import attention")
    assert refused.returncode != 0 and refused.stderr.strip().splitlines()[-1].startswith(
        "ValueError: q is a CPU tensor but Triton was loaded to compile for a GPU: to run the Triton kernels on the "
        "CPU, set TRITON_INTERPRET=1 before anything imports triton"), refused.stderr[-2000:]


def test_the_consumer_card_switch(tmp_path):
    """NANOFA2_ADA=1, set before attention is imported: Triton's Ampere-class MMA, no TMA, no
    Gluon, Ada's shared memory."""
    import subprocess
    import sys
    code = ("import os, torch, attention\nfrom attention import launch\n"
            "print(os.environ['DISABLE_MMA_V3'], launch.ADA_PATH, launch.has_tma(torch.device('cpu')))")
    env = {**__import__("os").environ, "NANOFA2_ADA": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=__import__("conftest").REPO)
    assert out.stdout.split() == ["1", "True", "False"]


# ---------------------------------------------------------------- GPU (run on the H200, on both paths)

@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape_q,n_k", [((2, 3, 1000, 64), 1000), ((1, 2, 8192, 128), 8192), ((1, 4, 1, 64), 4097),
                                         ((2, 2, 4097, 16), 1023), ((1, 1, 8191, 32), 8191), ((1, 2, 700, 80), 900)])
@pytest.mark.parametrize("backend", ["triton", "triton_fwd", "tiled", "sdpa", "eager"])
def test_gpu_backends_long_and_low_precision(backend, shape_q, n_k, is_causal, dtype):
    if backend == "tiled" and shape_q[-2] * n_k > 1024 * 1024:
        pytest.skip("the Python-loop teaching version is checked on the shorter shapes")
    q, k, v = random_qkv(shape_q, n_k, dtype=dtype, device="cuda", seed=n_k)
    tol = GPU_TOLERANCE[dtype]
    if backend == "triton_fwd" and dtype == torch.float32:
        # Its forward's lse comes from TF32 scores, its backward recomputes the scores in full
        # float32: P = exp(S - lse) carries their difference into every gradient.
        tol = 2 * tol
    check_backend(backend, q, k, v, is_causal, tol)


@gpu
@pytest.mark.parametrize("backend", ["triton", "triton_fwd", "sdpa", "eager"])
@pytest.mark.parametrize("kv_heads,window_size", [(4, (256, 0)), (1, (-1, -1)), (2, (1000, 0)), (4, (31, 17))])
def test_gpu_grouped_heads_and_windows_in_bfloat16(backend, kv_heads, window_size):
    q, k, v = random_qkv((2, 8, 2049, 64), 2049, h_kv=kv_heads, dtype=torch.bfloat16, device="cuda", seed=kv_heads)
    check_backend(backend, q, k, v, window_size[1] == 0, GPU_TOLERANCE[torch.bfloat16], window_size)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [48, 64, 128, 256])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("heads_first", [False, True])
def test_gpu_every_tile_config_is_correct(head_dim, is_causal, dtype, heads_first, monkeypatch):
    """Every config the tuner may pick on this card, forward and backward (on Hopper both load
    paths: TMA and cp.async; under NANOFA2_ADA=1 the consumer card's), in both grid orders."""
    launch_heads_first(monkeypatch, heads_first)
    q, k, v = (t.detach() for t in random_qkv((2, 2, 1031, head_dim), 1031, dtype=dtype, device="cuda", seed=head_dim))
    do = torch.randn_like(q)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = reference(q, k, v, is_causal, do)
    tol = GPU_TOLERANCE[dtype]
    for config in tuner_candidates(FORWARD_CONFIGS, forward_smem_rows, q, head_dim):
        o, lse = flash_forward(q, k, v, is_causal, config=config)
        assert_close(o, o_ref, tol, f"O with {config}")
    for config in tuner_candidates(BACKWARD_CONFIGS, backward_smem_rows, q, head_dim):
        dq, dk, dv = flash_backward(q, k, v, o, do, lse, is_causal, config=config)
        for name, got, ref in (("dQ", dq, dq_ref), ("dK", dk, dk_ref), ("dV", dv, dv_ref)):
            assert_close(got, ref, tol, f"{name} with {config}")


def hopper_served(kernel, n_k, head_dim, is_causal, window_size=(-1, -1), heads=1, kv_heads=1):
    if not hopper_common.is_hopper(torch.device("cuda")) or launch.ADA_PATH:
        pytest.skip("the warp-specialised kernels are Hopper's")
    q = torch.empty(1, heads, 1, head_dim, dtype=torch.bfloat16, device="cuda")
    k = torch.empty(1, kv_heads, n_k, head_dim, dtype=torch.bfloat16, device="cuda")
    assert kernel.serves(q, k, *window_bounds(is_causal, window_size))


@pytest.fixture
def hopper_from_few_keys(monkeypatch):
    """The Gluon kernels take every call they can, so the tests below check them on short
    sequences too, where they are not served for speed (MIN_KEYS)."""
    monkeypatch.setattr(hopper_forward, "MIN_KEYS", dict.fromkeys(hopper_forward.MIN_KEYS, 256))
    monkeypatch.setattr(hopper_backward, "MIN_KEYS", dict.fromkeys(hopper_backward.MIN_KEYS, 1))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,is_causal", list(hopper_forward.TILES))  # (head dim, window): causal as the window
@pytest.mark.parametrize("n_q,n_k", [(2049, 2049), (300, 4097), (5000, 2048), (1, 3001), (257, 257)])
def test_gpu_hopper_kernels(n_q, n_k, head_dim, is_causal, dtype, hopper_from_few_keys):
    """The Gluon forward and backward where they serve: O, lse, dQ, dK, dV against float64, on
    views of one projection when N_q = N_k, as the model makes them."""
    hopper_served(hopper_forward, n_k, head_dim, is_causal)
    g = torch.Generator().manual_seed(n_q + n_k)
    if n_q == n_k:
        leaf = torch.randn(2, n_q, 9, head_dim, generator=g).to("cuda", dtype)
        q, k, v = leaf.transpose(1, 2).split([3, 3, 3], dim=1)
    else:
        q, k, v = (t.detach() for t in random_qkv((2, 3, n_q, head_dim), n_k, dtype=dtype, device="cuda"))
    do = torch.randn(2, n_q, 3, head_dim, generator=g).to("cuda", dtype).transpose(1, 2)
    o, lse = flash_forward(q, k, v, is_causal)
    dq, dk, dv = flash_backward(q, k, v, o, do, lse, is_causal)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = reference(q, k, v, is_causal, do)
    assert_close(o, o_ref, GPU_TOLERANCE[dtype], "O")
    assert_close(lse, lse_ref, 1e-4, "lse")  # float32 scores of exact 16-bit products
    for name, got, ref in (("dQ", dq, dq_ref), ("dK", dk, dk_ref), ("dV", dv, dv_ref)):
        assert_close(got, ref, GPU_TOLERANCE[dtype], name)


@gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (6, 2), (3, 3)])
@pytest.mark.parametrize("is_causal,window_size", [(True, (-1, -1)), (True, (256, 0)), (False, (100, 37)),
                                                   (False, (0, 0)), (False, (-1, 40)), (False, (1000, -1))])
@pytest.mark.parametrize("n_q,n_k", [(2049, 2049), (300, 1500), (1500, 700)])
def test_gpu_hopper_kernels_grouped_heads_and_windows(n_q, n_k, is_causal, window_size, heads, kv_heads, head_dim,
                                                      hopper_from_few_keys):
    """The Gluon forward and backward on grouped-query heads (query head h reads kv head
    h // G; a kv head's dK and dV add up its G query heads' parts) and windows (masked tiles at
    both edges, rows of N_q > N_k that see no key: O = 0, lse = -inf, no gradient), against
    float64, in bfloat16."""
    hopper_served(hopper_forward, n_k, head_dim, is_causal, window_size, heads, kv_heads)
    hopper_served(hopper_backward, n_k, head_dim, is_causal, window_size, heads, kv_heads)
    g = torch.Generator().manual_seed(n_q + heads)
    q, k, v = (t.detach() for t in random_qkv((2, heads, n_q, head_dim), n_k, h_kv=kv_heads, dtype=torch.bfloat16,
                                               device="cuda", seed=n_k + kv_heads))
    do = torch.randn(q.shape, generator=g).to(q)
    o, lse = flash_forward(q, k, v, is_causal, window_size)
    dq, dk, dv = flash_backward(q, k, v, o, do, lse, is_causal, window_size)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = reference(q, k, v, is_causal, do, window_size)
    tol = GPU_TOLERANCE[torch.bfloat16]
    assert_all_close([("O", o, o_ref), ("dQ", dq, dq_ref), ("dK", dk, dk_ref), ("dV", dv, dv_ref)], tol)
    assert_close(lse, lse_ref, 1e-4, "lse")


@gpu
@pytest.mark.parametrize("head_dim,is_causal", list(hopper_forward.TILES))
def test_gpu_hopper_forward_takes_units_in_turn(head_dim, is_causal, hopper_from_few_keys):
    """The persistent Gluon forward with many more units of work than the GPU has SMs, so each
    program takes several in turn, and 9 query tiles per head, so one unit is a middle tile that
    is its own mirror."""
    hopper_served(hopper_forward, 1100, head_dim, is_causal)
    leaf = torch.randn(3, 1100, 150, head_dim, generator=torch.Generator().manual_seed(11)).to("cuda", torch.bfloat16)
    q, k, v = leaf.transpose(1, 2).split([50, 50, 50], dim=1)
    o, lse = flash_forward(q, k, v, is_causal)
    o_ref, lse_ref = eager_attention_with_lse(q.double(), k.double(), v.double(), is_causal)
    assert_close(o, o_ref, GPU_TOLERANCE[torch.bfloat16], "O")
    assert_close(lse, lse_ref, 1e-4, "lse")
