"""decode_attention: one new token per sequence, stored into a static KV cache and attending over
the cached keys its window sees, every backend against a float64 reference, with grouped-query
heads, windows, odd cache lengths and any head dim; split-KV and its twin at every split count
(splits past pos, before the window and past the cache's end; the partial outputs and log-sum-exps
alike split for split), the split count the host picks, and the kernels' shared memory on the target
card; the inputs it refuses (a cache of no rows or of rows that share memory, gradients the triton
kernel cannot give, a pos of another dtype or outside the cache), an empty batch, and the cache rows
that never change its result (stale NaN outside the window); sample_next_token, the one sampling
function of every decoding path; a compiled decode step that draws exactly the tokens of the
uncompiled one, and writes the cache in place; a decoder's CUDA graph, the capture mocked on the
CPU; generation with the weights cast to bf16 once (no cast per token, the same tokens compiled or
not, the cached logits those of the whole context)."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from attention import BACKENDS, decode, decode_attention, store_in_cache, triton_decode
from attention.decode import cached_keys, tiled_decode_splits, tiled_split_kv_decode
from attention.masks import window_bounds
from attention.launch import ADA_SHARED_MEMORY_BYTES, head_dim_block
from conftest import REPO, default_run
from model import GPT, GPTConfig, sample_next_token
from test_kv_cache import GQA_WINDOW, context_sensitive_gpt, prompt
from test_step import mock_cuda_graph
# torch._dynamo imports triton: after attention, which picks the interpreter
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode
from training.devices import generation_precision

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def decode_inputs(B, H, H_kv, S, D, dtype=torch.float32, device="cpu", seed=0):
    """q (B, H, 1, D), k and v (B, H_kv, 1, D): views of the new token's fused projection, as the
    model makes them; the caches (B, H_kv, S, D) with random values everywhere, also at and past
    the new token's position, so that a backend which reads outside its window, or fails to
    store the token, gets a wrong answer."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, 1, H + 2 * H_kv, D, generator=g).to(device, dtype)
    q, k, v = qkv.transpose(1, 2).split([H, H_kv, H_kv], dim=1)
    k_cache, v_cache = (torch.randn(B, H_kv, S, D, generator=g).to(device, dtype) for _ in range(2))
    return q, k, v, k_cache, v_cache


def expected(q, k, v, k_cache, v_cache, pos, left=-1):
    """float64 on the host: the output (B, H, 1, D), the softmax over the keys
    [max(0, pos - left), pos] alone, sliced: no mask involved (query head h reads kv head
    h // (H // H_kv)); and the caches as they should be after the step (the new token's key and
    value at row pos, every other row as it was). Differentiable in float64 q, k and v."""
    q, k, v, k_cache, v_cache = (t.cpu().double() for t in (q, k, v, k_cache, v_cache))
    first = 0 if left < 0 else max(0, pos - left)
    group = q.shape[1] // k.shape[1]
    seen_k = torch.cat((k_cache[:, :, first:pos], k), dim=2).repeat_interleave(group, dim=1)
    seen_v = torch.cat((v_cache[:, :, first:pos], v), dim=2).repeat_interleave(group, dim=1)
    weights = torch.softmax(q @ seen_k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
    k_after, v_after = k_cache.detach().clone(), v_cache.detach().clone()
    k_after[:, :, pos], v_after[:, :, pos] = k[:, :, 0].detach(), v[:, :, 0].detach()
    return weights @ seen_v, k_after, v_after


# (B, H, H_kv, S, D, pos, left): query heads per kv head 1, 2 and 4, and one kv head; windows of
# 0, 1, 3 and 70 keys before the query and unbounded (-1); odd cache lengths; the first position
# (the token sees only itself), the last (a full cache), windows that start inside a 64-key tile
# or cross into the next; head dims that are not powers of two (8, 48, 80).
SHAPES = [
    (3, 2, 2, 37, 16, 0, -1),
    (3, 2, 2, 37, 16, 19, -1),
    (3, 4, 2, 37, 16, 36, 3),
    (2, 4, 1, 37, 48, 20, 1),
    (2, 8, 2, 130, 32, 64, -1),
    (2, 3, 3, 130, 32, 128, 0),
    (1, 4, 4, 5, 64, 4, 3),
    (2, 4, 1, 70, 8, 66, 3),
    (2, 2, 1, 70, 80, 2, -1),
    (1, 8, 2, 131, 80, 130, 70),
    (2, 6, 3, 33, 48, 32, 0),
]


def check_decode(backend, dtype, B, H, H_kv, S, D, pos, left, device, tolerance):
    q, k, v, k_cache, v_cache = decode_inputs(B, H, H_kv, S, D, dtype, device)
    o_expected, k_expected, v_expected = expected(q, k, v, k_cache, v_cache, pos, left)
    o = decode_attention(q, k, v, k_cache, v_cache, torch.tensor([pos], device=device), (left, 0), backend)
    assert o.shape == (B, H, 1, D) and o.dtype == dtype
    torch.testing.assert_close(o.double().cpu(), o_expected, atol=tolerance, rtol=tolerance)
    # The caches are written in place, at row pos and nowhere else: exactly the projection's values.
    assert torch.equal(k_cache.double().cpu(), k_expected) and torch.equal(v_cache.double().cpu(), v_expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B, H, H_kv, S, D, pos, left", SHAPES)
def test_decode_attention_stores_the_token_and_matches_float64_on_the_keys_of_its_window(backend, dtype, B, H, H_kv,
                                                                                       S, D, pos, left):
    check_decode(backend, dtype, B, H, H_kv, S, D, pos, left, "cpu", TOLERANCE[dtype])


@pytest.mark.parametrize("left", [-1, 3])
def test_the_eager_reference_masks_what_the_slices_leave_out(left):
    q, k, v, k_cache, v_cache = decode_inputs(2, 4, 2, 9, 16, torch.float64)
    o_expected, _, _ = expected(q, k, v, k_cache, v_cache, 6, left)
    torch.testing.assert_close(decode_attention(q, k, v, k_cache, v_cache, torch.tensor([6]), (left, 0), "eager"),
                               o_expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cache_of_no_rows_is_refused_naming_the_cache(backend):
    # There is no row for the new token: the triton kernel wrote it at row -1, outside the cache.
    q, k, v, k_cache, v_cache = decode_inputs(1, 2, 2, 0, 16)
    with pytest.raises(ValueError, match="k_cache has S=0 rows"):
        decode_attention(q, k, v, k_cache, v_cache, torch.tensor([0]), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("S", [8, 1100])  # 1,100 rows: past 4 tiles, so the split planner runs
def test_an_empty_batch_decodes_to_the_empty_result_on_every_backend(backend, S):
    # The split planner divided by the batch's programs, and the tiled twin's reshape could not
    # infer a dim of an empty tensor; eager and sdpa gave the empty result.
    q, k, v, k_cache, v_cache = decode_inputs(0, 4, 2, S, 16)
    with torch.no_grad():
        o = decode_attention(q, k, v, k_cache, v_cache, torch.tensor([5]), backend=backend)
    assert o.shape == (0, 4, 1, 16) and o.dtype == q.dtype


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache", ["k_cache", "v_cache"])
def test_a_cache_whose_rows_share_memory_is_refused_naming_it_on_every_backend(backend, cache):
    # expand() gives every sequence the same rows: the triton kernel stored each sequence's token
    # on the one shared row and returned the wrong output; the others failed inside index_copy_.
    inputs = dict(zip(("q", "k", "v", "k_cache", "v_cache"), decode_inputs(3, 4, 2, 8, 16)))
    inputs[cache] = inputs[cache][:1].expand(3, -1, -1, -1)
    with pytest.raises(ValueError, match=rf"^{cache} has rows that share memory \(stride 0 along dim 0"):
        decode_attention(**inputs, pos=torch.tensor([3]), backend=backend)


@pytest.mark.parametrize("backend", ["triton", "triton_fwd"])
@pytest.mark.parametrize("needs_grad", ["q", "k", "v", "k_cache", "v_cache"])
def test_gradients_through_the_triton_decode_are_refused_not_left_none(backend, needs_grad):
    inputs = dict(zip(("q", "k", "v", "k_cache", "v_cache"), decode_inputs(1, 4, 2, 8, 16)))
    inputs[needs_grad] = inputs[needs_grad].detach().requires_grad_()
    pos = torch.tensor([3])
    with pytest.raises(ValueError, match="computes no gradient: call it under torch.no_grad"):
        decode_attention(**inputs, pos=pos, backend=backend)
    with torch.no_grad():  # generation: the same inputs decode
        o = decode_attention(**inputs, pos=pos, backend=backend)
    o_expected, _, _ = expected(*inputs.values(), 3)
    torch.testing.assert_close(o.double(), o_expected.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "tiled", "sdpa"])
@pytest.mark.parametrize("left", [-1, 2])
def test_the_other_backends_give_the_true_gradient_through_decode(backend, left):
    qkv = torch.randn(2, 1, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3),
                      requires_grad=True)
    q, k, v = qkv.transpose(1, 2).split([4, 2, 2], dim=1)  # grouped-query heads
    _, _, _, k_cache, v_cache = decode_inputs(2, 4, 2, 11, 16, torch.float64)
    o_expected, _, _ = expected(q, k, v, k_cache, v_cache, 7, left)
    do = torch.randn_like(o_expected)
    (grad_expected,) = torch.autograd.grad(o_expected, qkv, do)
    o = decode_attention(q, k, v, k_cache, v_cache, torch.tensor([7]), (left, 0), backend)
    (grad,) = torch.autograd.grad(o, qkv, do)
    torch.testing.assert_close(o, o_expected, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(grad, grad_expected, atol=1e-12, rtol=1e-12)
    assert grad[:, :, 4:6].abs().sum() > 0 and grad[:, :, 6:].abs().sum() > 0  # k and v get theirs, not only q


def poison_outside_the_window(k_cache, v_cache, pos, left):
    """NaN and inf in the cache rows a query at pos never sees: after pos (an earlier, longer
    sequence; uninitialised memory) and before pos - left."""
    first = 0 if left < 0 else pos - left
    for cache in (k_cache, v_cache):
        cache[:, :, pos + 1::2] = float("nan")
        cache[:, :, pos + 2::2] = float("inf")
        cache[:, :, :first:2] = float("nan")
        cache[:, :, 1:first:2] = float("-inf")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("left", [-1, 3])
def test_cache_rows_outside_the_window_never_change_the_result(backend, dtype, left):
    # Stale entries past pos (an earlier, longer sequence; uninitialised memory) and before
    # pos - left: NaN and inf in keys and values. Masking a key's score is not enough, as its
    # probability 0 times a NaN value is NaN.
    pos = 40
    q, k, v, k_cache, v_cache = decode_inputs(2, 4, 2, 70, 16, dtype)
    poison_outside_the_window(k_cache, v_cache, pos, left)
    o_expected, k_expected, v_expected = expected(q, k, v, k_cache, v_cache, pos, left)
    o = decode_attention(q, k, v, k_cache, v_cache, torch.tensor([pos]), (left, 0), backend)
    assert o.isfinite().all()
    torch.testing.assert_close(o.double(), o_expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch.testing.assert_close(k_cache.double(), k_expected, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache.double(), v_expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.uint8, torch.bool])
def test_a_pos_of_another_dtype_is_refused_on_every_backend(backend, dtype):
    # triton read any integer, the others failed inside index_copy_ with a RuntimeError.
    with pytest.raises(ValueError, match="pos must be an int64 torch.Tensor"):
        decode_attention(*decode_inputs(1, 2, 1, 8, 16), torch.tensor([1], dtype=dtype), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pos", [8, 9, 1000, -1])
def test_a_pos_outside_the_cache_is_refused_naming_it_on_every_backend(backend, pos):
    # triton clamped it into the cache without a word, the others raised IndexError.
    q, k, v, k_cache, v_cache = decode_inputs(1, 2, 1, 8, 16)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    with pytest.raises(ValueError, match=rf"pos={pos} is outside the cache's S=8 rows"):
        decode_attention(q, k, v, k_cache, v_cache, torch.tensor([pos]), backend=backend)
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)  # refused before any write


@pytest.mark.parametrize("pos", [16, -1])
def test_a_models_decode_step_at_a_pos_outside_the_cache_is_refused_by_decodes_check(pos):
    # The position embedding read pos first: an IndexError (on a GPU a device-side assert).
    gpt = context_sensitive_gpt("eager")
    with pytest.raises(ValueError, match=rf"^pos={pos} is outside the cache's S=16 rows"):
        gpt.decode_step(prompt(length=1), torch.tensor([pos]), gpt.new_cache(2))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("S, pos", [(64, 63), (129, 127)])
def test_float16_values_whose_tile_sum_passes_float16s_range_give_the_true_output(backend, S, pos):
    # Every key equal, so every score is: the output is the mean of the values, 1024. Summed
    # unnormalised over a 64-key tile, P.V is 64 * 1024 = 65,536, past float16's largest finite
    # 65,504: a tile product formed in float16 gives inf.
    q, k, v, k_cache, v_cache = decode_inputs(1, 2, 1, S, 16, torch.float16)
    v.fill_(1024.0)
    v_cache.fill_(1024.0)
    k_cache.copy_(k.expand_as(k_cache))
    o = decode_attention(q, k, v, k_cache, v_cache, torch.tensor([pos]), backend=backend)
    assert torch.equal(o, torch.full_like(o, 1024.0))  # 64 or 128 keys: weights 1/64 or 1/128, exact


def bad_decode_args(**bad):
    q, k, v, k_cache, v_cache = decode_inputs(1, 4, 2, 8, 16)
    args = dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, pos=torch.tensor([3]))
    args.update(bad)
    return args


@pytest.mark.parametrize("bad, message", [
    (dict(q=torch.randn(1, 4, 2, 16)), r"q must have shape \(B, H, 1, D\), one new token"),
    (dict(k=torch.randn(1, 3, 1, 16), v=torch.randn(1, 3, 1, 16)), "k and v have 3 heads .*, which must divide q's 4"),
    (dict(v=torch.randn(1, 2, 1, 8)), r"v .* must match q \(1, 4, 1, 16\) in its leading dims and head dim"),
    (dict(pos=torch.tensor([3.0])), "pos must be an int64 torch.Tensor"),
    (dict(pos=3), "pos must be an int64 torch.Tensor"),
    (dict(pos=torch.tensor(3)), r"pos must have shape \(1,\)"),
    (dict(pos=torch.tensor([3], device="meta")), "pos is on meta but q is on cpu"),
    (dict(k_cache=torch.randn(1, 2, 8, 32)), r"k_cache must have shape \(B, H_kv, S, D\) = \(1, 2, S, 16\)"),
    (dict(k_cache=torch.randn(1, 4, 8, 16)), r"k_cache must have shape \(B, H_kv, S, D\) = \(1, 2, S, 16\)"),
    (dict(v_cache=torch.randn(1, 2, 8, 16, dtype=torch.float64)), "v_cache is torch.float64 on cpu but q is "),
    (dict(v_cache=torch.randn(1, 2, 9, 16)), r"v_cache has shape \(1, 2, 9, 16\) but k_cache has"),
    (dict(window_size=(-2, 0)), r"window_size must be \(left, right\), two ints >= -1"),
    (dict(window_size=(3,)), r"window_size must be \(left, right\)"),
])
def test_bad_decode_inputs_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        decode_attention(**bad_decode_args(**bad), backend="eager")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [("k", "v"), ("v",)], ids=["k and v", "v"])
def test_a_key_or_value_of_more_than_one_row_is_refused_naming_it_on_every_backend(backend, rows):
    """A step stores one token's key and value: the triton kernel stored and attended to the
    first of two rows alone, silently, and the others failed with an IndexError."""
    q, k, v, k_cache, v_cache = decode_inputs(1, 4, 2, 8, 16)
    two_rows = {name: torch.cat((t, t + 1), dim=2) for name, t in (("k", k), ("v", v)) if name in rows}
    args = {**dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, pos=torch.tensor([3])), **two_rows}
    with pytest.raises(ValueError, match=rf"^{rows[0]} (must have shape \(B, H_kv, 1, D\)|has shape \(1, 2, 2, 16\))"):
        decode_attention(**args, backend=backend)


@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache", "k", "v"])
def test_the_triton_decode_backend_names_an_input_it_cannot_read(name):
    # The kernel reads each row along D with unit stride: a strided input must be refused by
    # name, or read through its strides (the output then matches the reference).
    args = bad_decode_args()
    args[name] = torch.stack((args[name], torch.full_like(args[name], 1e3)), dim=-1).flatten(-2)[..., ::2]
    assert args[name].stride(-1) == 2
    o_expected, _, _ = expected(*(args[n] for n in ("q", "k", "v", "k_cache", "v_cache")), 3)
    try:
        o = decode_attention(**args, backend="triton")
    except ValueError as error:
        assert f"{name} has last-dim stride 2" in str(error) and f"pass {name}.contiguous()" in str(error)
    else:
        torch.testing.assert_close(o.double(), o_expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("D", [20, 4, 264])
def test_the_triton_decode_backend_names_a_head_dim_it_cannot_take(D):
    with pytest.raises(ValueError, match=f"q has head dim D={D}; the Triton kernels take a multiple of 8 up to 256"):
        decode_attention(*decode_inputs(1, 2, 1, 8, D), torch.tensor([3]), backend="triton")
    decode_attention(*decode_inputs(1, 2, 1, 8, D), torch.tensor([3]), backend="tiled")  # the others take any D


def test_an_unknown_decode_backend_is_named():
    with pytest.raises(ValueError, match="backend='flash' is not one of"):
        decode_attention(*decode_inputs(1, 2, 1, 8, 16), torch.tensor([3]), backend="flash")


# Split-KV (triton_decode.py) and its twin (decode.tiled_decode_splits) at split counts and tiles
# the tests choose: 16-key tiles, so that short caches have several tiles a split and splits
# past pos, before the window and past the cache's end (7 splits of a 3- or 4-tile cache).
# (B, H, H_kv, S, D, pos, left): groups G = 1, 2, 3, 4, 6, 8 (3 and 6 pad to 16 rows unevenly);
# odd caches; pos at 0 (only the first split sees a key), mid and S - 1; windows that start
# inside a split, cross a split's edge or hold the token alone; head dims 40, 64, 96, 128.
SPLIT_SHAPES = [
    (2, 4, 4, 37, 64, 0, -1),
    (1, 6, 3, 61, 40, 30, -1),
    (2, 3, 1, 61, 96, 60, -1),
    (1, 8, 2, 45, 128, 22, 9),
    (1, 6, 1, 53, 40, 52, 20),
    (2, 8, 1, 37, 64, 17, 0),
]
SPLIT_TILE = 16


class Launches:
    """Stands in for a @triton.jit kernel: records each launch's grid and arguments, then runs it."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args))
            return self.kernel[grid](*args, **kwargs)
        return launch


def cache_views(k_cache, v_cache):
    """The caches as (B, H_kv, S, D) views of (B, S, H_kv, D) buffers: strided along S and H_kv."""
    return [c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k_cache, v_cache)]


def split_decode(backend, q, k, v, k_cache, v_cache, pos, left, n_splits):
    """triton_decode.split_kv_decode, or the twin after storing the token as decode_attention does."""
    left = window_bounds(False, (left, 0))[0]
    pos = torch.tensor([pos])
    if backend == "triton":
        return triton_decode.split_kv_decode(q, k, v, k_cache, v_cache, pos, left, n_splits, SPLIT_TILE)
    return tiled_split_kv_decode(q, k, v, k_cache, v_cache, pos, left, n_splits, SPLIT_TILE)


@pytest.mark.parametrize("backend", ["triton", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("B, H, H_kv, S, D, pos, left", SPLIT_SHAPES)
def test_split_kv_decode_matches_float64_at_every_split_count(backend, dtype, n_splits, B, H, H_kv, S, D, pos, left):
    q, k, v, k_cache, v_cache = decode_inputs(B, H, H_kv, S, D, dtype)
    if n_splits == 3:  # caches read and written through strides, as well as dense ones
        k_cache, v_cache = cache_views(k_cache, v_cache)
    o_expected, k_expected, v_expected = expected(q, k, v, k_cache, v_cache, pos, left)
    o = split_decode(backend, q, k, v, k_cache, v_cache, pos, left, n_splits)
    assert o.shape == (B, H, 1, D) and o.dtype == dtype
    torch.testing.assert_close(o.double(), o_expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert torch.equal(k_cache.double(), k_expected) and torch.equal(v_cache.double(), v_expected)


@pytest.mark.parametrize("B, H, H_kv, S, D, pos, left", SPLIT_SHAPES)
def test_the_kernels_splits_are_the_twins_split_for_split(monkeypatch, B, H, H_kv, S, D, pos, left):
    # The merge's inputs, the partial outputs and log-sum-exps the split programs leave, are the
    # twin's: the same split bounds, and a split that sees no key gives lse = -inf and a zero
    # output in both. One launch, whose last program of each (batch, kv head) merges.
    launches = Launches(triton_decode._decode_split)
    monkeypatch.setattr(triton_decode, "_decode_split", launches)
    q, k, v, k_cache, v_cache = decode_inputs(B, H, H_kv, S, D)
    split_decode("triton", q, k, v, k_cache.clone(), v_cache.clone(), pos, left, 7)
    (grid, (*_, o_split, lse_split, counters, _)), = [(grid, args[:10]) for grid, args in launches.calls]
    assert grid == (B * H_kv, 7) and not counters.any()  # the merging programs leave the counters at zero
    store_in_cache(k, v, k_cache, v_cache, torch.tensor([pos]))
    visible = cached_keys(torch.tensor([pos]), window_bounds(False, (left, 0))[0], S)
    o_twin, lse_twin = tiled_decode_splits(q, k_cache, v_cache, visible, 7, SPLIT_TILE)
    torch.testing.assert_close(lse_split, lse_twin.flatten(1, 2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o_split, o_twin.flatten(1, 2), atol=1e-5, rtol=1e-5)
    empty = lse_split == float("-inf")
    assert empty[..., -1].all() and not empty[..., pos // SPLIT_TILE].any()  # past the cache; the token's split
    assert (o_split[empty] == 0).all()


@pytest.mark.parametrize("backend", ["triton", "tiled"])
@pytest.mark.parametrize("left", [-1, 3])
def test_cache_rows_outside_the_window_never_reach_any_split(backend, left):
    # As test_cache_rows_outside_the_window_never_change_the_result, with splits: NaN and inf in
    # the rows after pos (whole splits of them) and before the window.
    pos = 40
    q, k, v, k_cache, v_cache = decode_inputs(2, 6, 2, 70, 40, torch.float16)
    poison_outside_the_window(k_cache, v_cache, pos, left)
    o_expected, k_expected, v_expected = expected(q, k, v, k_cache, v_cache, pos, left)
    o = split_decode(backend, q, k, v, k_cache, v_cache, pos, left, 4)
    assert o.isfinite().all()
    torch.testing.assert_close(o.double(), o_expected, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(k_cache.double(), k_expected, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache.double(), v_expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("backend", ["triton", "tiled"])
@pytest.mark.parametrize("S, splits", [(4100, 4), (1100, 1)])
def test_the_split_count_the_host_picks_is_what_the_kernel_and_its_twin_run(monkeypatch, backend, S, splits):
    # On the CPU the plan assumes the 4070 Super's 56 SMs: 2 (batch, kv head) pairs of a
    # 4,100-row cache in 256-row tiles (D=16, float32: 512 KB of K and V a pair) take 4 splits,
    # at the 128 KB a split reads at least; a 1,100-row cache (140 KB a pair) takes one. The
    # kernel runs them in one launch; the twin cuts the same splits and tiles.
    kernel = Launches(triton_decode._decode_split)
    monkeypatch.setattr(triton_decode, "_decode_split", kernel)
    twin = []
    monkeypatch.setattr(decode, "tiled_decode_splits",
                        lambda *args: twin.append(args[-2:]) or tiled_decode_splits(*args))
    q, k, v, k_cache, v_cache = decode_inputs(1, 4, 2, S, 16)
    assert triton_decode.split_plan(k_cache) == (splits, 256)
    o_expected, _, _ = expected(q, k, v, k_cache, v_cache, S - 3, -1)
    o = decode_attention(q, k, v, k_cache, v_cache, torch.tensor([S - 3]), backend=backend)
    torch.testing.assert_close(o.double(), o_expected, atol=1e-5, rtol=1e-5)
    ran = [grid for grid, _ in kernel.calls] if backend == "triton" else twin
    assert ran == [(2, splits)] if backend == "triton" else [(splits, 256)]


# (pairs, K and V bytes a pair, tiles, splits): bench.py's decode shapes on an H100 (132 SMs,
# bf16; D=64 in 128-row tiles, D=128 in 64-row ones), the plan aiming at 264 programs of 128 KB
# or more each.
H100_PLANS = [
    (8 * 16, 1 << 20, 32, 3),     # batch 8 x 16 kv heads, 4,096 rows at D=64: 3 splits of 11 tiles, 384 programs
    (8 * 4, 1 << 20, 32, 8),      # 4 kv heads: 9 wanted, 8 cut the 32 tiles evenly (4 a split, 128 KB)
    (8 * 16, 2 << 20, 64, 3),     # D=128: 3 splits of 22 tiles
    (8 * 4, 2 << 20, 64, 8),      # 4 kv heads at D=128: 8 splits of 8 tiles (256 KB)
    (1 * 4, 16 << 20, 512, 64),   # one sequence, 32,768 rows, 4 kv heads: MAX_SPLITS, 256 programs
    (1 * 16, 16 << 20, 512, 17),  # 16 kv heads: 17 splits, 272 programs
    (264, 1 << 20, 32, 1),        # the pairs alone are 2 programs an SM
    (4, 4 * 2 ** 16, 4, 2),       # 256 KB a pair: two splits of 128 KB, whatever the SMs want
    (2 * 12, 2 * 512 * 32 * 2, 2, 1),  # sample.py's default model at batch 2, 512 rows at D=32: 64 KB a pair
]


@pytest.mark.parametrize("pairs, pair_bytes, n_tiles, splits", H100_PLANS)
def test_the_split_plan_on_an_h100(pairs, pair_bytes, n_tiles, splits):
    assert triton_decode.decode_splits(pairs, pair_bytes, n_tiles, n_sms=132) == splits


def test_the_split_plan_sizes_splits_by_their_bytes_and_none_lies_past_the_cache():
    # A split reads SPLIT_MIN_BYTES or more on average (whole tiles: the last may hold fewer);
    # the programs reach PROGRAMS_PER_SM an SM but for the bytes, MAX_SPLITS or the tiles (at
    # least half the way: whole tiles a split cost at most half the count); no split starts past
    # the cache's last tile.
    target = triton_decode.PROGRAMS_PER_SM * 132
    for pairs in range(1, 300, 7):
        for n_tiles in range(1, 700, 9):
            for tile_bytes in (16384, 32768):
                pair_bytes = 2 * n_tiles * tile_bytes
                n_splits = triton_decode.decode_splits(pairs, pair_bytes, n_tiles, n_sms=132)
                tiles_per_split = triton_decode.split_rows(n_tiles, n_splits, 1)
                assert 1 <= n_splits <= triton_decode.MAX_SPLITS and (n_splits - 1) * tiles_per_split < n_tiles
                assert n_splits == 1 or pair_bytes / n_splits >= triton_decode.SPLIT_MIN_BYTES
                most = min(pair_bytes // triton_decode.SPLIT_MIN_BYTES, n_tiles, triton_decode.MAX_SPLITS)
                assert 2 * pairs * n_splits >= min(target, pairs * max(most, 1)), (pairs, n_tiles, n_splits)


def test_the_split_programs_leave_their_counters_at_zero():
    # The last program of each (batch, kv head) merges and zeroes its counter: the next call (a
    # graph replay) starts from zero. A counter left at 1 would make a program merge early.
    q, k, v, k_cache, v_cache = decode_inputs(2, 6, 3, 61, 40)
    counters = triton_decode.split_counters(q.device)
    for pos in (60, 5):
        o_expected, _, _ = expected(q, k, v, k_cache, v_cache, pos)
        o = split_decode("triton", q, k, v, k_cache, v_cache, pos, -1, 4)
        torch.testing.assert_close(o.double(), o_expected, atol=1e-5, rtol=1e-5)
        assert not counters.any()
    counters[0] = 1
    try:
        o = split_decode("triton", q, k, v, k_cache, v_cache, 60, -1, 4)
        assert not torch.allclose(o.double(), expected(q, k, v, k_cache, v_cache, 60)[0], atol=1e-3)
    finally:
        counters.zero_()


def test_the_triton_decode_in_bfloat16_on_the_cpu_matches_float64():
    # The interpreter's tl.dot is wrong on bf16: the kernel runs in float32 there, and the token
    # still lands in the bf16 caches.
    q, k, v, k_cache, v_cache = decode_inputs(2, 6, 2, 45, 40, torch.bfloat16)
    o_expected, k_expected, v_expected = expected(q, k, v, k_cache, v_cache, 30, -1)
    o = triton_decode.split_kv_decode(q, k, v, k_cache, v_cache, torch.tensor([30]), 2 ** 30, 3, SPLIT_TILE)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.double(), o_expected, atol=2e-2, rtol=2e-2)
    assert torch.equal(k_cache.double(), k_expected) and torch.equal(v_cache.double(), v_expected)

def decode_kernel_shared_memory():
    """[(element type, head dim, bytes)]: _decode_split compiled for sm_89 with its fixed config,
    as tests/test_triton_configs.py compiles the other kernels (pointers and integer arguments
    divisible by 16, as Triton infers at launch for the model's tensors)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    kernel = triton_decode._decode_split
    results = []
    for element_type, size in (("bf16", 2), ("fp32", 4)):
        for head_dim in (16, 64, 128, 256):
            constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim_block(head_dim), BLOCK_G=16,
                              BLOCK_N=triton_decode.decode_block_n(head_dim, size), BLOCK_S=64)
            types = dict(dict.fromkeys(("Q", "K", "V", "K_CACHE", "V_CACHE", "O"), "*" + element_type),
                         O_SPLIT="*fp32", LSE_SPLIT="*fp32", COUNTS="*i32", POS="*i64", qk_scale="fp32",
                         **dict.fromkeys(constexprs, "constexpr"))
            signature = {name: types.get(name, "i32") for name in kernel.arg_names}
            attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
                     if signature[name] in ("i32", "*" + element_type)}
            compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                                      target=GPUTarget("cuda", 89, 32),
                                      options=dict(num_warps=triton_decode.DECODE_NUM_WARPS,
                                                   num_stages=triton_decode.DECODE_NUM_STAGES))
            results.append((element_type, head_dim, compiled.metadata.shared))
    return results


def test_the_decode_kernels_fixed_config_fits_the_target_cards_shared_memory():
    # Compiled for the RTX 4070 Super (sm_89) in a process without the interpreter: K and V
    # tiles in flight (cp.async) at every head dim and element size, under its 99 KB a block.
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=f"{REPO}:{REPO / 'tests'}")
    out = subprocess.run([sys.executable, "-c", "import json, test_decode; "
                          "print(json.dumps(test_decode.decode_kernel_shared_memory()))"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(results) == 8
    assert all(32 * 1024 <= shared <= ADA_SHARED_MEMORY_BYTES for _, _, shared in results), results


# The default run compiles the triton step with grouped heads and a window (its opaque operator,
# as the multi-head one); the eager and sdpa steps, compiled, draw the uncompiled tokens in
# test_bf16_weights_decode_the_tokens_of_a_step_by_step_bf16_decode_compiled_or_not (and the
# eager one in the seeded test below). `pytest -m full`: the multi-head steps here too.
@default_run(lambda case: case.heads == "gqa+window")
@pytest.mark.parametrize("attn, heads", [("eager", "multi-head"), ("triton", "multi-head"), ("sdpa", "multi-head"),
                                         ("triton", "gqa+window")])
def test_a_compiled_decode_step_draws_the_tokens_of_the_uncompiled_one(attn, heads):
    # The step compiles as one graph (fullgraph=True: the Triton kernel is an opaque custom
    # operator) and is used for every token after the prefill, across the refill at block_size.
    torch._dynamo.reset()
    gpt = context_sensitive_gpt(attn, **(GQA_WINDOW if heads == "gqa+window" else {}))
    eager_tokens = gpt.generate(prompt(), max_new_tokens=14, top_k=1)
    assert torch.equal(gpt.generate(prompt(), max_new_tokens=14, top_k=1, kv_cache=False), eager_tokens)
    gpt.compile_decode_step(backend="aot_eager")
    compiled_tokens = gpt.generate(prompt(), max_new_tokens=14, top_k=1)
    assert torch.equal(compiled_tokens, eager_tokens)
    assert all(len(set(row[5:].tolist())) > 6 for row in eager_tokens)


def test_a_seeded_sampled_decode_is_reproducible_cached_compiled_or_not():
    # Every path draws with sample_next_token, one exponential race per token, so one seed draws
    # the same tokens with the cache, without it and with the step compiled (its sampling is not).
    torch._dynamo.reset()
    gpt = context_sensitive_gpt("eager")

    def sampled(seed, **kwargs):
        torch.manual_seed(seed)
        return gpt.generate(prompt(), max_new_tokens=14, temperature=1.5, top_k=None, **kwargs)

    tokens = sampled(3)
    assert not torch.equal(sampled(4), tokens)  # it samples: another seed, other tokens
    assert torch.equal(sampled(3), tokens)
    assert torch.equal(sampled(3, kv_cache=False), tokens)
    gpt.compile_decode_step(backend="aot_eager")
    assert torch.equal(sampled(3), tokens)


def test_sampling_draws_the_softmax_probabilities_of_the_top_k_and_never_a_padding_id():
    # One row of logits, repeated: each of 20,000 rows is an independent draw. The padding
    # columns (past vocab_size) hold the largest logits; the top 4 real ones get probabilities
    # softmax([2, 1, 0.5, 0]) / temperature = 1, the rest none.
    vocab_size, top_k = 50, 4
    logits = torch.randn(vocab_size + 14, generator=torch.Generator().manual_seed(0)) - 5.0
    logits[vocab_size:] = 100.0
    best = torch.tensor([7, 31, 2, 45])
    logits[best] = torch.tensor([2.0, 1.0, 0.5, 0.0])
    torch.manual_seed(0)
    drawn = sample_next_token(logits.expand(20_000, -1), vocab_size, temperature=1.0, top_k=top_k)
    assert drawn.shape == (20_000, 1) and drawn.dtype == torch.long
    counts = torch.bincount(drawn.flatten(), minlength=vocab_size + 14)
    assert counts.sum() == counts[best].sum()  # top_k respected, padding never drawn
    frequencies = counts[best].double() / 20_000
    torch.testing.assert_close(frequencies, torch.softmax(logits[best].double(), 0), atol=0.015, rtol=0)


def test_top_k_of_one_is_the_argmax_and_temperature_sharpens():
    logits = torch.randn(64, 80, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    assert torch.equal(sample_next_token(logits, 70, top_k=1), logits[:, :70].argmax(-1, keepdim=True))
    # At temperature 0.05 the likeliest token wins almost always; at 1 often not.
    row = logits[:1].expand(2_000, -1)
    argmax = logits[0, :70].argmax()
    sharp = (sample_next_token(row, 70, temperature=0.05) == argmax).float().mean()
    flat = (sample_next_token(row, 70, temperature=1.0) == argmax).float().mean()
    assert sharp > 0.9 > 0.5 > flat


@pytest.mark.parametrize("attn", ["eager", "triton"])
def test_the_compiled_step_writes_the_cache_in_place(attn):
    # Inductor on the CPU, odd shapes so that one layer's cache has a size no other tensor has
    # (3 * 2 * 37 * 16 = 3552 elements). Had the cache been one (n_layer, ...) tensor of which
    # each layer writes a view, functionalization would copy every layer's cache into a temporary
    # (a loop over 3552 elements), write the token there and copy it all back: per token, the
    # whole cache read and written twice, which made the compiled batch-32 step slower than the
    # uncompiled one on the GPU. triton's kernel writes the cache itself: had Inductor not made
    # that write in place, it would copy each cache before the kernel and back after it.
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=37, vocab_size=64, n_layer=2, n_head=2, n_embd=32, attn=attn)).eval()
    cache = gpt.new_cache(3)
    token, pos = torch.randint(0, 64, (3, 1)), torch.tensor([5])
    step = torch.compile(gpt.decode_step, backend="inductor", fullgraph=True, dynamic=False)
    with torch.no_grad():
        expected_logits = gpt.decode_step(token, pos, gpt.new_cache(3))
        logits, (code,) = run_and_get_code(step, token, pos, cache)
    torch.testing.assert_close(logits, expected_logits)
    k, v = cache.layers[1]
    assert k[:, :, 5].abs().sum() > 0 and k[:, :, 6:].abs().sum() == 0 and v[:, :, :5].abs().sum() == 0
    assert "3552" not in code and "aten.copy_" not in code and "aten.clone" not in code


def test_the_decode_step_compiles_once_across_tokens_refills_and_generate_calls():
    # Dynamo recompiles when an input's shape, stride or offset changes; a step fed idx[:, -1:],
    # a view into the growing idx, recompiled at every token until the recompile limit.
    torch._dynamo.reset()
    gpt = context_sensitive_gpt("eager")
    compiles = CompileCounter()
    gpt.compile_decode_step(backend=compiles)
    for _ in range(2):  # 5 + 14 tokens: past block_size=16, so each call also refills the cache
        gpt.generate(prompt(), max_new_tokens=14, top_k=1)
    assert compiles.frame_count == 1
    gpt.generate(prompt(batch=3), max_new_tokens=4, top_k=1)  # a new batch size: one static graph more
    assert compiles.frame_count == 2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B, H, H_kv, S, D, pos, left", SHAPES + [
    (32, 8, 2, 256, 64, 199, -1), (1, 8, 8, 256, 128, 255, 100), (4, 8, 1, 300, 96, 299, 63),
    (2, 4, 2, 257, 160, 256, 0), (2, 8, 2, 513, 256, 512, 257),
    # Long caches for few (batch, kv head) pairs: split, some splits without a key for this pos.
    (1, 16, 4, 4096, 128, 2047, -1), (2, 12, 3, 8191, 64, 8190, 1000), (1, 8, 1, 3001, 256, 10, -1),
    (1, 6, 2, 2000, 40, 1999, 77)])
def test_decode_attention_on_the_gpu_in_bfloat16(backend, B, H, H_kv, S, D, pos, left):
    check_decode(backend, torch.bfloat16, B, H, H_kv, S, D, pos, left, "cuda", 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_a_captured_split_kv_decode_is_right_wherever_pos_moves(compiled):
    # The split count comes from S alone, so one graph, captured at one position, replays right
    # at every other: at 0 (one split sees a key), inside the cache (a window of 1,000 keys
    # leaves splits empty on both sides) and at the last row.
    B, H, H_kv, S, D, left = 1, 16, 4, 4096, 128, 1000
    q, k, v, k_cache, v_cache = decode_inputs(B, H, H_kv, S, D, torch.bfloat16, "cuda")
    assert triton_decode.split_plan(k_cache)[0] > 4
    pos = torch.tensor([S - 1], device="cuda")
    step = lambda: decode_attention(q, k, v, k_cache, v_cache, pos, (left, 0))
    step = torch.compile(step, fullgraph=True) if compiled else step
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        step()  # compiles the kernels (and the graph) before the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            o = step()
    for p in (0, 700, 2049, S - 1):
        k_before, v_before = k_cache.clone(), v_cache.clone()
        pos.fill_(p)
        graph.replay()
        o_expected, k_expected, v_expected = expected(q, k, v, k_before, v_before, p, left)
        torch.testing.assert_close(o.double().cpu(), o_expected, atol=2e-2, rtol=2e-2)
        assert torch.equal(k_cache.double().cpu(), k_expected) and torch.equal(v_cache.double().cpu(), v_expected)


def test_a_compiled_split_kv_decode_is_right_wherever_pos_moves():
    # The CPU twin of test_a_captured_split_kv_decode_is_right_wherever_pos_moves: the split count
    # comes from S alone and pos is read from memory, so one graph, traced once at the last row,
    # is right at 0 (one split sees a key), inside the cache (a window of 300 keys leaves splits
    # empty on both sides) and at the last row.
    torch._dynamo.reset()
    B, H, H_kv, S, D, left = 1, 4, 2, 1100, 64, 300
    q, k, v, k_cache, v_cache = decode_inputs(B, H, H_kv, S, D)
    assert triton_decode.split_plan(k_cache)[0] >= 4  # splits of at most 275 rows
    pos = torch.tensor([S - 1])
    compiles = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda: decode_attention(q, k, v, k_cache, v_cache, pos, (left, 0)), backend=compiles,
                         fullgraph=True)
    with torch.no_grad():
        for p in (S - 1, 0, 700):
            k_before, v_before = k_cache.clone(), v_cache.clone()
            pos.fill_(p)
            o = step()
            o_expected, k_expected, v_expected = expected(q, k, v, k_before, v_before, p, left)
            torch.testing.assert_close(o.double(), o_expected, atol=1e-5, rtol=1e-5)
            assert torch.equal(k_cache.double(), k_expected) and torch.equal(v_cache.double(), v_expected)
    assert compiles.frame_count == 1


def uncaptured_greedy(gpt, tokens, max_new_tokens):
    """Greedy decoding by hand: a prefill, then gpt.decode_step called directly, token by token,
    with no StaticDecoder and so no CUDA graph (within block_size: no refill)."""
    cache = gpt.new_cache(tokens.size(0))
    logits, _ = gpt(tokens, cache=cache)
    for _ in range(max_new_tokens):
        next_token = logits[:, -1, :gpt.config.vocab_size].argmax(dim=-1, keepdim=True)
        tokens = torch.cat((tokens, next_token), dim=1)
        logits = gpt.decode_step(next_token, torch.tensor([cache.length], device=tokens.device), cache)
        cache.length += 1
    return tokens


@pytest.mark.gpu
@pytest.mark.parametrize("attn", BACKENDS)
@pytest.mark.parametrize("batch", [1, 3])  # at 1 the compiled step's matmuls are one row: Inductor's reductions
def test_a_cuda_graph_decode_draws_the_tokens_of_the_uncaptured_one(attn, batch):
    torch._dynamo.reset()
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64, attn=attn)).cuda().eval()
    with torch.no_grad():
        for p in gpt.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5)
        tokens = prompt(batch=batch, vocab_size=gpt.config.vocab_size).cuda()
        expected_tokens = uncaptured_greedy(gpt, tokens, 20)
    assert all(len(set(row[5:].tolist())) > 10 for row in expected_tokens)
    # Captured uncompiled, then compiled; each twice: the first records the graph, the second
    # refills the same cache and replays the same graph, sampling included.
    for compiled in (False, True):
        if compiled:
            gpt.compile_decode_step()
        assert torch.equal(gpt.generate(tokens, max_new_tokens=20, top_k=1), expected_tokens)
        decoder, graph = gpt.generate_decoder, gpt.generate_decoder.graph
        assert graph is not None
        assert torch.equal(gpt.generate(tokens, max_new_tokens=20, top_k=1), expected_tokens)
        assert gpt.generate_decoder is decoder and decoder.graph is graph


def uncaptured_sampled(gpt, tokens, max_new_tokens, temperature, top_k):
    """uncaptured_greedy, sampled with sample_next_token, eager, step by step."""
    cache = gpt.new_cache(tokens.size(0))
    logits, _ = gpt(tokens, cache=cache)
    for _ in range(max_new_tokens):
        next_token = sample_next_token(logits[:, -1, :], gpt.config.vocab_size, temperature, top_k)
        tokens = torch.cat((tokens, next_token), dim=1)
        logits = gpt.decode_step(next_token, torch.tensor([cache.length], device=tokens.device), cache)
        cache.length += 1
    return tokens


@pytest.mark.gpu
def test_a_cuda_graph_draws_the_sampled_tokens_of_the_uncaptured_decode_for_one_seed():
    # A replay advances the CUDA generator as the eager step does (the capture's warm-up runs on
    # a forked generator): one seed draws the same tokens captured or not, and the same again on
    # the graph's second use.
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64, attn="sdpa")).cuda().eval()
    tokens = prompt(batch=3, vocab_size=gpt.config.vocab_size).cuda()
    with torch.no_grad():
        torch.manual_seed(5)
        expected_tokens = uncaptured_sampled(gpt, tokens, 20, temperature=1.0, top_k=50)
    assert all(len(set(row[5:].tolist())) > 10 for row in expected_tokens)
    for _ in range(2):
        torch.manual_seed(5)
        assert torch.equal(gpt.generate(tokens, max_new_tokens=20, temperature=1.0, top_k=50), expected_tokens)


@pytest.mark.gpu
def test_a_cuda_graph_captured_at_the_last_position_of_the_cache():
    # A 15-token prompt leaves room for one decode step (block_size=16): the capture and its
    # warm-up happen at the last position, and must not step past the cache; then the refills.
    gpt = context_sensitive_gpt("sdpa").cuda()
    tokens = prompt(length=15).cuda()
    expected_tokens = gpt.generate(tokens, max_new_tokens=6, top_k=1, kv_cache=False)
    assert torch.equal(gpt.generate(tokens, max_new_tokens=6, top_k=1), expected_tokens)
    assert len(set(expected_tokens[0, 15:].tolist())) > 3


def captured_on_the_cpu(monkeypatch, gpt, batch, temperature=1.0, top_k=None):
    """The StaticDecoder generate will use, capturing and replaying as on CUDA with the capture
    mocked (test_step.mock_cuda_graph): the CPU twin of the CUDA graph tests above. Its warm-up's
    forked RNG is the CPU's, which sampling draws from here. Returns the capture's call counts."""
    decoder = gpt.reusable_decoder(batch, torch.device("cpu"), temperature, top_k)
    decoder.graphed = True
    fork_rng = torch.random.fork_rng
    monkeypatch.setattr(torch.random, "fork_rng", lambda devices: fork_rng(devices=[]))
    return mock_cuda_graph(monkeypatch, decoder, "step")


def test_a_decoder_captured_once_draws_the_tokens_of_the_uncaptured_one_on_every_call(monkeypatch):
    # The CPU twin of test_a_cuda_graph_decode_draws_the_tokens_of_the_uncaptured_one: recorded
    # at its first decode, the graph is replayed for every token after, across calls.
    gpt = context_sensitive_gpt("eager", vocab_size=512)
    tokens = prompt(batch=3, vocab_size=512)
    with torch.no_grad():
        expected_tokens = uncaptured_greedy(gpt, tokens, 10)
    counts = captured_on_the_cpu(monkeypatch, gpt, batch=3, top_k=1)
    decoder = gpt.generate_decoder
    for _ in range(2):
        assert torch.equal(gpt.generate(tokens, max_new_tokens=10, top_k=1), expected_tokens)
        assert gpt.generate_decoder is decoder and decoder.graph is not None
    assert counts == {"captured": 1, "replayed": 2 * 10 - 2}  # each call: a prefill's token, then replays


def test_a_captured_decoder_draws_the_sampled_tokens_of_the_uncaptured_decode_for_one_seed(monkeypatch):
    # The CPU twin of test_a_cuda_graph_draws_the_sampled_tokens_of_the_uncaptured_decode_for_one_seed:
    # the capture's warm-up draws on a forked RNG, so the replays draw what uncaptured steps would.
    gpt = context_sensitive_gpt("sdpa", vocab_size=512)
    tokens = prompt(batch=3, vocab_size=512)
    with torch.no_grad():
        torch.manual_seed(5)
        expected_tokens = uncaptured_sampled(gpt, tokens, 10, temperature=1.0, top_k=50)
    assert all(len(set(row[5:].tolist())) > 5 for row in expected_tokens)
    captured_on_the_cpu(monkeypatch, gpt, batch=3, top_k=50)
    for _ in range(2):
        torch.manual_seed(5)
        assert torch.equal(gpt.generate(tokens, max_new_tokens=10, temperature=1.0, top_k=50), expected_tokens)


def test_a_decoder_captured_at_the_last_position_of_the_cache_never_steps_past_it(monkeypatch):
    # The CPU twin of test_a_cuda_graph_captured_at_the_last_position_of_the_cache: a 15-token
    # prompt leaves room for one step (block_size=16); its warm-up steps start from the saved pos,
    # and a step past the cache would be refused (decode_step checks pos).
    gpt = context_sensitive_gpt("sdpa", vocab_size=512)
    tokens = prompt(batch=1, length=15, vocab_size=512)
    expected_tokens = gpt.generate(tokens, max_new_tokens=6, top_k=1, kv_cache=False)
    counts = captured_on_the_cpu(monkeypatch, gpt, batch=1, top_k=1)
    assert torch.equal(gpt.generate(tokens, max_new_tokens=6, top_k=1), expected_tokens)
    assert counts["captured"] == 1 and len(set(expected_tokens[0, 15:].tolist())) > 3


def bf16_generation_gpt(attn, seed=0):
    """A tiny context-sensitive model (std 0.5 matrices, see context_sensitive_gpt) with a small
    vocabulary, its weights cast to bf16 for generation as sample.py does on a GPU."""
    torch.manual_seed(seed)
    gpt = GPT(GPTConfig(block_size=16, vocab_size=256, n_layer=2, n_head=2, n_embd=32, attn=attn)).eval()
    with torch.no_grad():
        for p in gpt.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5)
    precision = generation_precision(gpt, torch.device("cpu"), torch.bfloat16)
    return gpt, precision


def weight_casts(gpt, step):
    """The casts (aten._to_copy) of a parameter of gpt while step() runs."""
    weights = {p.data_ptr() for p in gpt.parameters()}
    casts = []

    class RecordWeightCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in weights:
                casts.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    with RecordWeightCasts():
        step()
    return casts


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_bf16_decode_step_reads_the_weights_without_casting_them(attn):
    # Under autocast a captured decode step casts every weight at every token (StaticDecoder.capture);
    # generation_precision casts them once, and the step then casts none.
    gpt, precision = bf16_generation_gpt(attn)
    assert all(p.dtype == torch.bfloat16 for p in gpt.parameters())
    assert gpt.lm_head.weight is gpt.transformer.wte.weight  # still tied
    token, pos = torch.tensor([[7]]), torch.tensor([3])
    with torch.no_grad(), precision:
        assert weight_casts(gpt, lambda: gpt.decode_step(token, pos, gpt.new_cache(1))) == []
    # The detector sees the casts of the setup before: fp32 weights under bf16 autocast.
    fp32_gpt = GPT(GPTConfig(block_size=16, vocab_size=256, n_layer=2, n_head=2, n_embd=32, attn=attn)).eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        casts = weight_casts(fp32_gpt, lambda: fp32_gpt.decode_step(token, pos, fp32_gpt.new_cache(1, torch.bfloat16)))
    assert (256, 32) in casts and (96, 32) in casts and len(casts) >= 9  # lm_head, c_attn, ...: every matmul weight


def test_float16_generation_keeps_fp32_weights_under_autocast():
    gpt = GPT(GPTConfig(block_size=16, vocab_size=256, n_layer=1, n_head=2, n_embd=32)).eval()
    precision = generation_precision(gpt, torch.device("cpu"), torch.float16)
    assert all(p.dtype == torch.float32 for p in gpt.parameters())
    with precision:
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_bf16_weights_decode_the_tokens_of_a_step_by_step_bf16_decode_compiled_or_not(attn):
    # Greedy (top_k=1) over bf16 logits meets exact ties, which argmax breaks the same way on
    # every path (the first index). The cached decode, uncompiled then compiled (aot_eager: the
    # same ops), draws the tokens of prefill + decode_step by hand, in bf16 throughout (the
    # cache holds bf16 keys: the weights', there being no autocast).
    torch._dynamo.reset()
    gpt, precision = bf16_generation_gpt(attn)
    tokens = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), precision:
        expected_tokens = uncaptured_sampled(gpt, tokens, 11, temperature=1.0, top_k=1)
        assert all(len(set(row[5:].tolist())) > 4 for row in expected_tokens)
        assert torch.equal(gpt.generate(tokens, max_new_tokens=11, top_k=1), expected_tokens)
        assert gpt.generate_decoder.cache.dtype == torch.bfloat16
        gpt.compile_decode_step(backend="aot_eager")
        assert torch.equal(gpt.generate(tokens, max_new_tokens=11, top_k=1), expected_tokens)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_bf16_cached_logits_match_the_whole_context_ones(attn):
    # Token by token through the cache, then the whole context at once, both in bf16: the
    # logits agree to bf16 rounding (greedy tokens may not: a near tie breaks either way).
    gpt, precision = bf16_generation_gpt(attn)
    tokens = torch.randint(0, 256, (2, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), precision:
        cache = gpt.new_cache(2)
        gpt(tokens[:, :4], cache=cache)
        for t in range(4, 14):
            cached, _ = gpt(tokens[:, t:t + 1], cache=cache)
            whole, _ = gpt(tokens[:, :t + 1])
            assert cached.dtype == torch.bfloat16
            scale = whole.float().abs().max()
            torch.testing.assert_close(cached.float(), whole.float(), atol=0.05 * scale, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("attn", BACKENDS)
def test_a_cuda_graph_decode_with_bf16_weights_draws_the_tokens_of_the_uncaptured_one(attn):
    # The graph recorded without autocast (generation_precision's bf16 weights) replays the
    # step's kernels: it draws the greedy tokens of the same step run token by token (bf16
    # logits tie, and argmax breaks ties alike), on the recording call and a replaying one.
    gpt, precision = bf16_generation_gpt(attn)
    gpt.cuda()
    tokens = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad(), precision:
        expected_tokens = uncaptured_sampled(gpt, tokens, 11, temperature=1.0, top_k=1)
        assert all(len(set(row[5:].tolist())) > 4 for row in expected_tokens)
        for _ in range(2):
            assert torch.equal(gpt.generate(tokens, max_new_tokens=11, top_k=1), expected_tokens)
            assert gpt.generate_decoder.graph is not None and gpt.generate_decoder.cache.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def bench():
    from unittest import mock
    with mock.patch.object(sys, "argv", ["bench.py", "--mode=decode"]):
        import bench
    return bench


def test_bench_decode_times_what_its_labels_say(bench, monkeypatch):
    # triton: the split-KV kernel with the host's split count (4 splits on the CPU, see
    # test_the_split_count_the_host_picks_is_what_the_kernel_and_its_twin_run) and no sdpa; sdpa: the sdpa
    # backend, masked; sdpa, no mask: sdpa over the whole cache. Each stores the token and is exact.
    splits = Launches(triton_decode._decode_split)
    monkeypatch.setattr(triton_decode, "_decode_split", splits)
    masks = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *args, **kwargs: masks.append(kwargs.get("attn_mask")) or sdpa(*args, **kwargs))
    ran = {}
    for label in ("triton", "sdpa", "sdpa, no mask"):
        q, k, v, k_cache, v_cache = decode_inputs(1, 4, 2, 4100, 16)
        o_expected, k_expected, _ = expected(q, k, v, k_cache, v_cache, 4099)
        steps = bench.decode_steps(q, k, v, k_cache, v_cache, torch.tensor([4099]))
        assert list(steps) == ["triton", "sdpa", "sdpa, no mask"]
        splits.calls.clear()
        masks.clear()
        o = steps[label]()
        torch.testing.assert_close(o.double(), o_expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(k_cache.double(), k_expected)
        ran[label] = ([grid for grid, _ in splits.calls], [mask is not None for mask in masks])
    assert ran == {"triton": ([(2, 4)], []), "sdpa": ([], [True]), "sdpa, no mask": ([], [False])}


@pytest.mark.parametrize("card, bandwidth", [("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H200", 4.8e12),
                                             ("NVIDIA GeForce RTX 4070 SUPER", 504e9), ("Tesla T4", None)])
def test_bench_decode_knows_the_bandwidth_of_the_repos_cards_by_name(bench, card, bandwidth):
    entry = bench.this_card(card)
    assert (entry and entry.gb_per_s * 1e9) == bandwidth


def test_bench_decode_times_triton_at_the_split_counts_it_names(bench, monkeypatch):
    # 16 (batch, kv head) pairs of a 10-tile cache (64-row tiles at D=64, float32, 300 KB of K
    # and V a pair): the plan on the CPU is 2 splits of 128 KB or more; then twice and 4 times.
    splits = Launches(triton_decode._decode_split)
    monkeypatch.setattr(triton_decode, "_decode_split", splits)
    q, k, v, k_cache, v_cache = decode_inputs(4, 8, 4, 600, 64)
    o_expected, _, _ = expected(q, k, v, k_cache, v_cache, 599)
    steps = bench.split_steps(q, k, v, k_cache, v_cache, torch.tensor([599]))
    assert list(steps) == [1, 2, 4, 8]
    for n, step in steps.items():
        splits.calls.clear()
        torch.testing.assert_close(step().double(), o_expected, atol=1e-5, rtol=1e-5)
        assert [grid for grid, _ in splits.calls] == [(16, n)]
