"""The tiled PyTorch FlashAttention (tiled.py, tiled_backward.py) with tiles of every shape, and
the tile bounds it shares with the kernels: masks.py's rules against the mask itself (a skipped
tile holds no visible pair, a full one only visible pairs), and their Triton and Gluon twins
against them, number for number. Every backend's default path is in test_attention.py; here the
tiles are small and rectangular (tile_m != tile_n), so many tiles cross the diagonal and a
window's edges, and sequences end mid-tile."""
import pytest
import torch
import triton
import triton.language as tl

from attention import FlashAttentionPytorch, masks
from attention.masks import UNBOUNDED, key_tile_bounds, query_tile_bounds, visible_keys, window_bounds
from attention.tiled import tiled_forward
from attention.tiled_backward import tiled_backward
from conftest import default_run
from test_attention import TOLERANCE, assert_all_close, random_qkv, reference

TILES = [(16, 8), (8, 16), (7, 13), (1, 5), (64, 64)]
MASKS = [(True, (-1, -1)), (False, (-1, -1)), (True, (5, 0)), (False, (0, 3)), (False, (12, 20)), (True, (0, 0))]
BACKWARD_TILES = [(16, 8), (8, 16), (7, 13)]
BACKWARD_SHAPES = [((2, 2, 37, 16), 45, 1), ((1, 2, 45, 128), 37, 2), ((2, 29, 64), 29, 2)]


# The default run: each third of the masks with one shape per tile shape, so that every pair of
# tile shape, shape and mask is checked (18 of 54 cases); `pytest -m full`, the rest.
@default_run(lambda case: MASKS.index((case.is_causal, case.window_size)) % 3 == (
    BACKWARD_TILES.index((case.tile_m, case.tile_n)) + BACKWARD_SHAPES.index((case.shape_q, case.n_k, case.h_kv))) % 3)
@pytest.mark.parametrize("is_causal,window_size", MASKS)
@pytest.mark.parametrize("shape_q,n_k,h_kv", BACKWARD_SHAPES)
@pytest.mark.parametrize("tile_m,tile_n", BACKWARD_TILES)
def test_tiled_backward_matches_float64_reference(tile_m, tile_n, shape_q, n_k, h_kv, is_causal, window_size):
    q, k, v = random_qkv(shape_q, n_k, h_kv=h_kv, seed=tile_m * tile_n + n_k)
    o = FlashAttentionPytorch.apply(q, k, v, is_causal, window_size, tile_m, tile_n)
    do = torch.randn_like(o)
    o.backward(do)
    o_ref, _, dq_ref, dk_ref, dv_ref = reference(q, k, v, is_causal, do, window_size)
    assert_all_close([("O", o, o_ref), ("dQ", q.grad, dq_ref), ("dK", k.grad, dk_ref), ("dV", v.grad, dv_ref)],
                     TOLERANCE[torch.float32])


@pytest.mark.parametrize("is_causal,window_size", MASKS)
@pytest.mark.parametrize("shape_q,n_k,h_kv", [((2, 4, 37, 16), 45, 2), ((1, 2, 45, 24), 37, 1)])
def test_tiled_backward_atomic_dq_matches_float64_reference(shape_q, n_k, h_kv, is_causal, window_size):
    """The five-matmul schedule (atomic_dq: dQ's shares added in the dK/dV pass), twin of the
    kernel's ATOMIC_DQ configs, with rectangular tiles."""
    q, k, v = (t.detach() for t in random_qkv(shape_q, n_k, h_kv=h_kv, seed=n_k))
    o, lse = tiled_forward(q, k, v, is_causal, window_size, 16, 8)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(2))
    dq, dk, dv = tiled_backward(q, k, v, o, lse, do, is_causal, window_size, 8, 16, atomic_dq=True)
    _, _, dq_ref, dk_ref, dv_ref = reference(q, k, v, is_causal, do, window_size)
    assert_all_close([("dQ", dq, dq_ref), ("dK", dk, dk_ref), ("dV", dv, dv_ref)], TOLERANCE[torch.float32])


@pytest.mark.parametrize("tile_m,tile_n", [(16, 8), (5, 11)])
def test_tiled_backward_on_strided_views(tile_m, tile_n):
    """q, k, v as the model makes them, (B, heads, T, D) views of one (B, T, H + 2 * H_kv, D)
    tensor, and dO a transposed view; called directly, as the Function calls it."""
    B, T, H, H_kv, D = 2, 29, 4, 2, 32
    qkv = torch.randn(B, T, H + 2 * H_kv, D, generator=torch.Generator().manual_seed(1))
    q, k, v = qkv.transpose(1, 2).split([H, H_kv, H_kv], dim=1)
    o, lse = tiled_forward(q, k, v, True, (-1, -1), tile_m, tile_n)
    do = torch.randn(B, T, H, D).transpose(1, 2)
    dq, dk, dv = tiled_backward(q, k, v, o, lse, do, True, (-1, -1), tile_m, tile_n)
    _, _, dq_ref, dk_ref, dv_ref = reference(q, k, v, True, do)
    assert_all_close([("dQ", dq, dq_ref), ("dK", dk, dk_ref), ("dV", dv, dv_ref)], TOLERANCE[torch.float32])


def test_tiled_uses_the_tiled_backward(monkeypatch):
    import attention.tiled as tiled

    def poisoned(*args, **kwargs):
        raise AssertionError("tiled_backward ran")

    monkeypatch.setattr(tiled, "tiled_backward", poisoned)
    q, k, v = random_qkv((1, 2, 20, 16), 20)
    with pytest.raises(AssertionError, match="tiled_backward ran"):
        FlashAttentionPytorch.apply(q, k, v, True).sum().backward()


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_tile_sizes_must_be_positive_ints(bad):
    q, k, v = random_qkv((1, 1, 8, 16), 8)
    with pytest.raises(ValueError, match="tile_m must be a positive int"):
        FlashAttentionPytorch.apply(q, k, v, True, (-1, -1), bad, 8)
    with pytest.raises(ValueError, match="tile_n must be a positive int"):
        FlashAttentionPytorch.apply(q, k, v, True, (-1, -1), 8, bad)


def classify(mask, tile_m, tile_n, pass_):
    """{(query tile start, key tile start): "full" | "masked"} for the tiles one pass visits."""
    n_q, n_k, _, _ = mask
    visits = {}
    if pass_ == "forward":  # and the dQ pass: each query tile walks key tiles
        for q_start in range(0, n_q, tile_m):
            start, full_start, full_end, end = key_tile_bounds(q_start, mask, tile_m, tile_n)
            for k_start in range(start, end, tile_n):
                visits[q_start, k_start] = "full" if full_start <= k_start < full_end else "masked"
    else:  # the dK/dV pass: each key tile walks query tiles
        for k_start in range(0, n_k, tile_n):
            start, full_start, full_end, end = query_tile_bounds(k_start, mask, tile_m, tile_n)
            for q_start in range(start, end, tile_m):
                visits[q_start, k_start] = "full" if full_start <= q_start < full_end else "masked"
    return visits


@pytest.mark.parametrize("pass_", ["forward", "dkdv"])
@pytest.mark.parametrize("is_causal,window_size", MASKS)
@pytest.mark.parametrize("n_q,n_k", [(37, 53), (53, 37), (64, 64), (1, 9), (9, 1), (30, 30), (90, 12)])
@pytest.mark.parametrize("tile_m,tile_n", TILES)
def test_tile_bounds_agree_with_the_mask(tile_m, tile_n, n_q, n_k, is_causal, window_size, pass_):
    """Every tile holding a visible (query, key) pair is visited; a full tile holds only visible
    pairs, and in the forward no key past n_k (it would add to the softmax; the dK/dV pass only
    drops those keys' rows); a skipped tile holds none. The mask is the definition's, i - left <=
    j <= i + right, written here apart from masks.py's."""
    left, right = window_bounds(is_causal, window_size)
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    visible = (j >= i - left) & (j <= i + right)
    assert torch.equal(visible, visible_keys((n_q, n_k, left, right)))
    visits = classify((n_q, n_k, left, right), tile_m, tile_n, pass_)
    for q_start in range(0, n_q, tile_m):
        for k_start in range(0, n_k, tile_n):
            tile = visible[q_start:q_start + tile_m, k_start:k_start + tile_n]
            kind = visits.get((q_start, k_start), "skipped")
            assert kind != "skipped" or not tile.any(), f"tile ({q_start}, {k_start}) holds visible pairs, skipped"
            whole = tile.shape[1] == tile_n or pass_ == "dkdv"
            assert kind != "full" or (tile.all() and whole), f"tile ({q_start}, {k_start}) needs a mask, runs without"
    assert all(q < n_q and k < n_k for q, k in visits), "a tile outside the sequences is visited"


@triton.jit
def _bounds_probe(OUT, START, N_Q, N_K, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The Triton twins of the two bound rules for the tile starting at START[i], written to
    OUT[i, :8]."""
    i = tl.program_id(0)
    start = tl.load(START + i)
    mask = (N_Q, N_K, left, right)
    key_bounds = masks.key_tile_bounds_tl(start, mask, BLOCK_M, BLOCK_N)
    query_bounds = masks.query_tile_bounds_tl(start, mask, BLOCK_M, BLOCK_N)
    for j in tl.static_range(4):
        tl.store(OUT + i * 8 + j, key_bounds[j])
        tl.store(OUT + i * 8 + 4 + j, query_bounds[j])


@triton.jit
def _visible_probe(OUT, N_Q, N_K, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The Triton twin of visible_in_tile over the whole (BLOCK_M, BLOCK_N) grid of pairs."""
    rows, cols = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
    seen = masks.visible_in_tile_tl(rows[:, None], cols[None, :], (N_Q, N_K, left, right))
    tl.store(OUT + rows[:, None] * BLOCK_N + cols[None, :], seen.to(tl.int32))


TWIN_MASKS = MASKS + [(False, (300, 2))]
TWIN_LENGTHS = [(37, 53), (90, 12), (200, 200)]
TWIN_TILES = [(16, 32), (64, 16), (32, 32)]


# The default run: every mask with every tile shape, at one of the lengths, so that every pair of
# tile shape, lengths and mask is checked (21 of 63 cases); `pytest -m full`, the rest.
@default_run(lambda case: TWIN_LENGTHS.index((case.n_q, case.n_k)) ==
             (TWIN_TILES.index((case.tile_m, case.tile_n)) + TWIN_MASKS.index((case.is_causal, case.window_size))) % 3)
@pytest.mark.parametrize("is_causal,window_size", TWIN_MASKS)
@pytest.mark.parametrize("n_q,n_k", TWIN_LENGTHS)
@pytest.mark.parametrize("tile_m,tile_n", TWIN_TILES)
def test_the_kernels_bounds_are_their_twins(tile_m, tile_n, n_q, n_k, is_causal, window_size):
    """masks.key_tile_bounds_tl and query_tile_bounds_tl, run in a kernel, give the Python
    rules' numbers at every tile start, and visible_in_tile_tl the mask itself."""
    mask = (n_q, n_k, *window_bounds(is_causal, window_size))
    starts = torch.arange(0, max(n_q, n_k) + tile_m, 16, dtype=torch.int32)
    out = torch.empty(len(starts), 8, dtype=torch.int32)
    _bounds_probe[(len(starts),)](out, starts, *mask, BLOCK_M=tile_m, BLOCK_N=tile_n)
    for start, row in zip(starts.tolist(), out.tolist()):
        twins = (*key_tile_bounds(start, mask, tile_m, tile_n), *query_tile_bounds(start, mask, tile_m, tile_n))
        assert tuple(row) == twins, f"tile start {start}"
    seen = torch.empty(256, 256, dtype=torch.int32)
    _visible_probe[(1,)](seen, *mask, BLOCK_M=256, BLOCK_N=256)
    assert torch.equal(seen[:n_q, :].bool(), masks.tile_mask(0, n_q, 0, 256, mask))


@pytest.fixture
def gluon_rules_in_python(monkeypatch):
    """The Gluon rules as the plain Python functions they are built from (.fn), calling each
    other as such: Gluon runs only on a Hopper card, these run here."""
    for name in ("visible_in_tile_gl", "tile_run_gl", "key_tile_bounds_gl", "query_tile_bounds_gl", "tile_numbers_gl"):
        monkeypatch.setattr(masks, name, getattr(masks, name).fn)
    return masks


def tiles_of_run(bounds, tile):
    """{tile number: "full" | "masked"} of the tiles a Python run (start, full_start, full_end, end) visits."""
    start, full_start, full_end, end = bounds
    return {k // tile: "full" if full_start <= k < full_end else "masked" for k in range(start, end, tile)}


def tiles_of_numbers(numbers):
    """The same from the Gluon kernels' tile numbers (first, full_first, full_last, last)."""
    first, full_first, full_last, last = numbers
    assert first <= full_first <= full_last <= last, numbers
    return {j: "full" if full_first <= j < full_last else "masked" for j in range(first, last)}


@pytest.mark.parametrize("is_causal,window_size", MASKS + [(False, (300, 2)), (False, (-1, 40))])
@pytest.mark.parametrize("n_q,n_k", [(37, 53), (90, 12), (200, 200), (1, 1), (300, 129), (700, 300)])
@pytest.mark.parametrize("rows,block", [(128, 64), (128, 128), (64, 256), (64, 128), (16, 32)])
def test_the_gluon_tile_rules_are_the_masks(rows, block, n_q, n_k, is_causal, window_size, gluon_rules_in_python):
    """The Hopper kernels' rules (masks.py's _gl twins) give key_tile_bounds' and
    query_tile_bounds' numbers at every tile start, their tile numbers the same tiles (each full
    or masked as the Python run says), and visible_in_tile_gl the mask (with WINDOW=False, for a
    mask without a window)."""
    mask = (n_q, n_k, *window_bounds(is_causal, window_size))
    for start in range(0, max(n_q, n_k) + 2 * rows, 16):
        for python_rule, gluon_rule, tile in ((key_tile_bounds, masks.key_tile_bounds_gl, block),
                                              (query_tile_bounds, masks.query_tile_bounds_gl, rows)):
            bounds = python_rule(start, mask, rows, block)
            assert gluon_rule(start, mask, rows, block) == bounds, (gluon_rule.__name__, start)
            assert tiles_of_numbers(masks.tile_numbers_gl(bounds, tile)) == tiles_of_run(bounds, tile), start
    rows_, cols_ = torch.arange(n_q)[:, None], torch.arange(n_k + 7)[None, :]
    seen = masks.visible_in_tile(rows_, cols_, mask)
    assert torch.equal(masks.visible_in_tile_gl(rows_, cols_, mask, True), seen)
    if mask[2:] == (UNBOUNDED, UNBOUNDED):
        assert torch.equal(masks.visible_in_tile_gl(rows_, cols_, mask, False).broadcast_to(seen.shape), seen)


@pytest.mark.parametrize("numbers", [(0, 0, 0, 0), (0, 0, 5, 5), (0, 3, 3, 4), (2, 3, 7, 9), (4, 4, 4, 6),
                                     (1, 5, 5, 5), (0, 0, 3, 4), (3, 4, 4, 4)])
@pytest.mark.parametrize("group", [1, 3])
def test_the_gluon_kernels_visit_each_tile_of_the_run_once(numbers, group):
    """The order the Hopper kernels' loaders and compute partitions walk a run in: the forward's
    key tiles (full ones first, ascending) and the backward's query tiles of every query head
    of a kv head (full ones first, head by head, the last tile first): each tile of each head
    once, all the full ones before any masked one."""
    from attention.hopper import backward, forward
    first, full_first, full_last, last = numbers
    full = list(range(full_first, full_last))
    masked = [j for j in range(first, last) if not full_first <= j < full_last]
    assert [forward.key_tile_visited.fn(t, numbers) for t in range(last - first)] == full + masked
    masked_desc = sorted(masked, reverse=True)  # the left edge's [full_last, last), then the diagonal's
    expected = ([(g, m) for g in range(group) for m in reversed(full)]
                + [(g, m) for g in range(group) for m in masked_desc])
    visits = [backward.query_tile_visited.fn(u, numbers, group) for u in range(group * (last - first))]
    assert visits == expected

