"""Bad inputs get a ValueError that names the argument; odd but valid inputs (empty batch, no
keys, huge scores) give the right answer, never NaN or silent garbage."""
import pytest
import torch

from attention import BACKENDS, FlashAttentionPytorch, FlashAttentionTriton, attention
from attention.eager import eager_attention_with_lse

ENTRY_POINTS = {
    "attention": lambda q, k, v, is_causal=False, window_size=(-1, -1): attention(q, k, v, is_causal, "triton",
                                                                                   window_size),
    "FlashAttentionPytorch": FlashAttentionPytorch.apply,
    "FlashAttentionTriton": FlashAttentionTriton.apply,
}


def qkv(*shape, dtype=torch.float32):
    return [torch.randn(*shape, dtype=dtype) for _ in range(3)]


q, k, v = qkv(2, 4, 8, 16)
BAD_INPUTS = [
    ("q", "at least 2 dims", (torch.randn(16), k, v)),
    ("k", "at least 2 dims", (q, torch.randn(16), v)),
    ("k", "leading dims", (q, torch.randn(3, 4, 8, 16), v)),
    ("k", "as many as q", (q, torch.randn(4, 8, 16), v)),
    ("k", "head dim", (q, torch.randn(2, 4, 8, 32), v)),
    ("v", "head dim", (q, k, torch.randn(2, 4, 8, 32))),
    ("v", "but k has", (q, k, torch.randn(2, 4, 9, 16))),
    ("k", "must divide q's 4", (q, torch.randn(2, 3, 8, 16), torch.randn(2, 3, 8, 16))),
    ("k", "dtype", (q, k.double(), v)),
    ("q", "floating-point", (q.long(), k.long(), v.long())),
    ("v", "dtype", (q, k, v.half())),
]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("name,expected,args", BAD_INPUTS, ids=[f"{n}-{e}" for n, e, _ in BAD_INPUTS])
def test_bad_inputs_name_the_argument(entry, name, expected, args):
    with pytest.raises(ValueError, match=name) as info:
        ENTRY_POINTS[entry](*args)
    assert expected in str(info.value)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_is_causal_must_be_a_bool(entry):
    with pytest.raises(ValueError, match="is_causal"):
        ENTRY_POINTS[entry](q, k, v, "yes")


@pytest.mark.parametrize("window_size,expected", [((2,), "two ints"), ((1.5, 0), "two ints"), ((-2, 0), ">= -1"),
                                                  ((0, 2 ** 63), "below 2**63"),
                                                  ("wide", "two ints"), ((3, 4), "causal means right = 0")])
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_bad_windows_are_named(entry, window_size, expected):
    with pytest.raises(ValueError, match="window_size") as info:
        ENTRY_POINTS[entry](q, k, v, expected.startswith("causal"), window_size)
    assert expected in str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_checks_its_inputs(backend):
    with pytest.raises(ValueError, match="must divide"):
        attention(q, torch.randn(2, 3, 8, 16), torch.randn(2, 3, 8, 16), backend=backend)
    with pytest.raises(ValueError, match="window_size"):
        attention(q, k, v, backend=backend, window_size=(-5, 0))
    # Past int64 (the Triton operators' schema, the masks' tensors): once an OverflowError or a RuntimeError.
    for window_size in ((2 ** 63, 0), (-1, 2 ** 70)):
        with pytest.raises(ValueError, match=r"window_size must be .*below 2\*\*63"):
            attention(q, k, v, backend=backend, window_size=window_size)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_causal,window_size", [(False, (-1, 2 ** 31 - 1)), (True, (2 ** 31 - 1, 0)),
                                                   (False, (2 ** 31 - 1, 2 ** 62))])
def test_a_window_side_past_every_sequence_is_unbounded_on_every_backend(backend, is_causal, window_size):
    """A side near 2**31 once wrapped around in the Triton kernels, which add it to 32-bit
    positions: the forward dropped keys, the backward query tiles of dK and dV, silently."""
    g = torch.Generator().manual_seed(5)
    q1, k1, v1 = (torch.randn(1, 2, 70, 16, generator=g).requires_grad_() for _ in range(3))
    do = torch.randn(1, 2, 70, 16, generator=g)
    o = attention(q1, k1, v1, is_causal, backend, window_size)
    grads = torch.autograd.grad(o, (q1, k1, v1), do)
    inputs64 = [t.detach().double().requires_grad_() for t in (q1, k1, v1)]
    o_ref = attention(*inputs64, is_causal, "eager", (-1, 0 if is_causal else -1))
    refs = (o_ref, *torch.autograd.grad(o_ref, inputs64, do.double()))
    for name, got, ref in zip(("O", "dQ", "dK", "dV"), (o, *grads), refs):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("backend", ["triton", "triton_fwd"])
@pytest.mark.parametrize("q_shape,kv_shape", [((2, 2, 0, 16), (2, 2, 5, 16)), ((2, 2, 5, 16), (2, 2, 0, 16)),
                                              ((2, 0, 5, 16), (2, 2, 5, 16))],
                         ids=["no query rows", "no keys", "no query heads"])
def test_a_4d_input_with_an_empty_dim_gives_what_eager_gives(backend, q_shape, kv_shape):
    """Forward and backward; the Triton backends once failed in a reshape (-1 is ambiguous for
    a tensor of no elements)."""
    g = torch.Generator().manual_seed(6)
    inputs = [torch.randn(*shape, generator=g) for shape in (q_shape, kv_shape, kv_shape)]
    results = []
    for b in ("eager", backend):
        q1, k1, v1 = (t.clone().requires_grad_() for t in inputs)
        o = attention(q1, k1, v1, is_causal=True, backend=b)
        o.backward(torch.ones_like(o))
        results.append((o, q1.grad, k1.grad, v1.grad))
    for got, ref in zip(results[1], results[0]):
        assert got.shape == ref.shape and torch.equal(got, ref)


def test_unknown_backend_lists_the_valid_ones():
    with pytest.raises(ValueError, match="flash3") as info:
        attention(q, k, v, backend="flash3")
    for name in BACKENDS:
        assert name in str(info.value)


@pytest.mark.parametrize("backend", ["triton", "triton_fwd"])
def test_triton_limits(backend):
    for head_dim in (12, 264):
        with pytest.raises(ValueError, match=f"head dim D={head_dim}; the Triton kernels take a multiple of 8"):
            attention(*qkv(1, 8, head_dim), backend=backend)
    with pytest.raises(ValueError, match="float64"):
        attention(*qkv(1, 8, 16, dtype=torch.float64), backend=backend)
    strided = torch.randn(1, 16, 8).transpose(1, 2)  # (1, 8, 16) with last-dim stride 8
    with pytest.raises(ValueError, match="q has last-dim stride 8"):
        attention(strided, *qkv(1, 8, 16)[1:], backend=backend)


UNUSABLE = [
    ("head dim D=0", lambda: torch.randn(2, 8, 0)),
    ("float8_e4m3fn", lambda: torch.randn(2, 8, 16).to(torch.float8_e4m3fn)),
    ("float8_e5m2", lambda: torch.randn(2, 8, 16).to(torch.float8_e5m2)),
    ("meta", lambda: torch.randn(2, 8, 16, device="meta")),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("expected,make", UNUSABLE, ids=[e for e, _ in UNUSABLE])
def test_unusable_tensors_name_the_head_dim_dtype_or_device(backend, expected, make):
    with pytest.raises(ValueError, match="q ") as info:
        attention(make(), make(), make(), backend=backend)
    assert expected in str(info.value)


def test_different_devices_are_rejected():
    meta = torch.randn(2, 8, 16, device="meta")
    with pytest.raises(ValueError, match="k is on meta"):
        attention(torch.randn(2, 8, 16), meta, torch.randn(2, 8, 16), backend="eager")


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_returns_empty(backend):
    q0, k0, v0 = (t.requires_grad_() for t in qkv(0, 2, 8, 16))
    o = attention(q0, k0, v0, is_causal=True, backend=backend)
    assert o.shape == (0, 2, 8, 16)
    o.sum().backward()
    assert q0.grad.shape == q0.shape


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "sdpa"])
def test_no_keys_gives_zeros_not_nan(backend):
    """N_k = 0: no query has a visible key. (With N_k >= 1 and the top-left causal mask every
    query sees key 0, so this is the only way a row can have none.)"""
    q1 = torch.randn(2, 5, 16, requires_grad=True)
    k0, v0 = (torch.randn(2, 0, 16, requires_grad=True) for _ in range(2))
    o = attention(q1, k0, v0, is_causal=True, backend=backend)
    assert torch.equal(o, torch.zeros_like(o))
    o.sum().backward()
    assert torch.equal(q1.grad, torch.zeros_like(q1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_scores_stay_finite_and_correct(backend, dtype):
    """Scores scaled up 100x (softmax saturates to one-hot rows): finite, matching float64."""
    g = torch.Generator().manual_seed(1)
    q1, k1, v1 = (torch.randn(1, 2, 37, 32, generator=g) for _ in range(3))
    q1, k1 = q1 * 10, k1 * 10  # scores 100x larger
    q1, k1, v1 = (t.to(dtype).requires_grad_() for t in (q1, k1, v1))
    o = attention(q1, k1, v1, is_causal=True, backend=backend)
    o.backward(torch.ones_like(o))
    ref, _ = eager_attention_with_lse(q1.double(), k1.double(), v1.double(), True)
    assert torch.isfinite(o).all() and all(torch.isfinite(t.grad).all() for t in (q1, k1, v1))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert (o.double() - ref).abs().max() < tol


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_scores_past_its_range_stay_finite(backend):
    """q and k 100x larger: scores around 1e4 * sqrt(D), past float16's 65504 before the scale.
    Every backend must form them in float32 (eager once formed them in float16: inf, then NaN)."""
    g = torch.Generator().manual_seed(3)
    q1, k1 = (torch.randn(1, 2, 40, 32, generator=g) * 100 for _ in range(2))
    v1 = torch.randn(1, 2, 40, 32, generator=g)
    o = attention(q1.half(), k1.half(), v1.half(), backend=backend)
    ref, _ = eager_attention_with_lse(q1.half().double(), k1.half().double(), v1.half().double())
    assert torch.isfinite(o).all()
    assert (o.double() - ref).abs().max() < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["triton", "triton_fwd", "tiled", "sdpa", "eager"])
def test_gpu_huge_scores_stay_finite_and_correct(backend, dtype):
    g = torch.Generator().manual_seed(2)
    q1, k1, v1 = (torch.randn(2, 4, 1000, 64, generator=g) for _ in range(3))
    q1, k1 = q1 * 10, k1 * 10
    q1, k1, v1 = (t.to("cuda", dtype).requires_grad_() for t in (q1, k1, v1))
    o = attention(q1, k1, v1, is_causal=True, backend=backend)
    o.backward(torch.ones_like(o))
    ref, _ = eager_attention_with_lse(q1.double(), k1.double(), v1.double(), True)
    assert torch.isfinite(o).all() and all(torch.isfinite(t.grad).all() for t in (q1, k1, v1))
    assert (o.double() - ref).abs().max() < 5e-2


def second_order_gradients(backend, q1, k1, v1):
    """d/d(q, k, v) of sum(dq**2), where dq = d sum(o**2) / dq."""
    o = attention(q1, k1, v1, is_causal=True, backend=backend)
    dq, = torch.autograd.grad((o ** 2).sum(), q1, create_graph=True)
    return torch.autograd.grad((dq ** 2).sum(), (q1, k1, v1))


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_double_backward_matches_float64_or_is_torchs_error(backend):
    """eager differentiates twice through autograd. sdpa does when torch picks its math kernel;
    its fused kernels (the CPU flash kernel among them) raise torch's 'not implemented'."""
    g = torch.Generator().manual_seed(4)
    q1, k1, v1 = (torch.randn(1, 2, 7, 16, generator=g) for _ in range(3))
    ref = second_order_gradients("eager", *(t.double().requires_grad_() for t in (q1, k1, v1)))
    try:
        got = second_order_gradients(backend, *(t.clone().requires_grad_() for t in (q1, k1, v1)))
    except RuntimeError as e:
        assert backend == "sdpa" and "not implemented" in str(e)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            got = second_order_gradients(backend, *(t.clone().requires_grad_() for t in (q1, k1, v1)))
    assert all(r.abs().max() > 1 for r in ref)  # second-order gradients worth comparing
    for name, a, r in zip("qkv", got, ref):
        assert (a.double() - r).abs().max() < 1e-3, name


def test_tiled_double_backward_is_a_clear_error():
    q1, k1, v1 = (torch.randn(1, 2, 7, 16, requires_grad=True) for _ in range(3))
    with pytest.raises(RuntimeError, match="double backward is not supported by the tiled backend"):
        second_order_gradients("tiled", q1, k1, v1)
    # First-order gradients are unaffected.
    o = attention(q1, k1, v1, is_causal=True, backend="tiled")
    dq, = torch.autograd.grad((o ** 2).sum(), q1)
    assert torch.isfinite(dq).all()
