"""The article's two autograd.Functions, called as its course's tests call them:
FlashAttentionPytorch.apply(Q, K, V, is_causal) and FlashAttentionTriton.apply(Q, K, V,
is_causal) on (B, N, D) inputs in float32. Each returns O, saves exactly one logsumexp of shape
(B, N_q) for its backward, and gives dQ, dK, dV, all within 1e-2 of a float64 reference. The
same on (B, H, N, D) inputs. This is the first test a learner runs after editing a kernel:

    pytest tests/test_flash_attention_triton.py
"""
import pytest
import torch

from attention import FlashAttentionPytorch, FlashAttentionTriton
from attention.eager import eager_attention_with_lse

IMPLEMENTATIONS = {"pytorch": FlashAttentionPytorch, "triton": FlashAttentionTriton}
TOLERANCE = dict(rtol=1e-2, atol=1e-2)


def inputs(shape_q, n_keys, seed=0):
    g = torch.Generator().manual_seed(seed)
    *lead, _, d = shape_q
    q = torch.randn(*shape_q, generator=g, requires_grad=True)
    k, v = (torch.randn(*lead, n_keys, d, generator=g, requires_grad=True) for _ in range(2))
    return q, k, v


def the_saved_logsumexp(o, q):
    """The one saved tensor shaped like q without its head dim, as the course's tests find it."""
    found = [t for t in o.grad_fn.saved_tensors if t.shape == q.shape[:-1]]
    assert len(found) == 1, f"expected one saved (..., N_q) logsumexp, found {len(found)}"
    return found[0]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape_q,n_keys", [((4, 128, 64), 128), ((2, 100, 32), 70), ((1, 2, 96, 16), 130)])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_forward_output_and_saved_logsumexp(impl, shape_q, n_keys, is_causal):
    q, k, v = inputs(shape_q, n_keys)
    o = IMPLEMENTATIONS[impl].apply(q, k, v, is_causal)
    o_ref, lse_ref = eager_attention_with_lse(q.double(), k.double(), v.double(), is_causal)
    torch.testing.assert_close(o.double(), o_ref, **TOLERANCE)
    torch.testing.assert_close(the_saved_logsumexp(o, q).double(), lse_ref, **TOLERANCE)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape_q,n_keys", [((4, 128, 64), 128), ((2, 100, 32), 70), ((1, 2, 96, 16), 130)])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_backward_gradients(impl, shape_q, n_keys, is_causal):
    q, k, v = inputs(shape_q, n_keys, seed=1)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    IMPLEMENTATIONS[impl].apply(q, k, v, is_causal).backward(do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    eager_attention_with_lse(q64, k64, v64, is_causal)[0].backward(do.double())
    wrong = {}  # every gradient checked, so a wrong dK shows even when dQ is wrong too
    for name, got, want in (("dQ", q.grad, q64.grad), ("dK", k.grad, k64.grad), ("dV", v.grad, v64.grad)):
        try:
            torch.testing.assert_close(got.double(), want, **TOLERANCE)
        except AssertionError as e:
            wrong[name] = str(e).splitlines()[0]
    assert not wrong, "; ".join(f"{name} wrong: {why}" for name, why in wrong.items()) + \
        f"; right: {', '.join(name for name in ('dQ', 'dK', 'dV') if name not in wrong) or 'none'}"
