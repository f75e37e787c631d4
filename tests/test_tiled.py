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
from test_attention import TOLERANCE, assert_all_close, random_qkv, reference

TILES = [(16, 8), (8, 16), (7, 13), (1, 5), (64, 64)]
MASKS = [(True, (-1, -1)), (False, (-1, -1)), (True, (5, 0)), (False, (0, 3)), (False, (12, 20)), (True, (0, 0))]


@pytest.mark.parametrize("is_causal,window_size", MASKS)
@pytest.mark.parametrize("shape_q,n_k,h_kv", [((2, 2, 37, 16), 45, 1), ((1, 2, 45, 128), 37, 2), ((2, 29, 64), 29, 2)])
@pytest.mark.parametrize("tile_m,tile_n", [(16, 8), (8, 16), (7, 13)])
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


@pytest.mark.parametrize("is_causal,window_size", MASKS + [(False, (300, 2))])
@pytest.mark.parametrize("n_q,n_k", [(37, 53), (90, 12), (200, 200)])
@pytest.mark.parametrize("tile_m,tile_n", [(16, 32), (64, 16), (32, 32)])
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


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("n_q,n_k", [(37, 53), (90, 12), (200, 200), (1, 1), (300, 129)])
@pytest.mark.parametrize("rows,block", [(128, 64), (128, 128), (64, 256), (64, 128)])
def test_the_gluon_tile_rules_are_the_masks(rows, block, n_q, n_k, is_causal):
    """The Hopper kernels' rules (causal or no mask, counted in tiles) give key_tile_bounds' and
    query_tile_bounds' runs, and visible_in_tile_gl the mask, at every tile start. Gluon runs
    only on a Hopper card; the plain Python functions the rules are built from (.fn) run here."""
    mask = (n_q, n_k, UNBOUNDED, 0 if is_causal else UNBOUNDED)
    for start_m in range(0, n_q, rows):  # the forward: a query tile of `rows` rows, key tiles of `block`
        n_full, n_tiles = masks.key_tile_counts_gl.fn(start_m, n_k, is_causal, rows, block)
        start, full_start, full_end, end = key_tile_bounds(start_m, mask, rows, block)
        assert (start, full_start, full_end, -(-end // block)) == (0, 0, n_full * block, n_tiles), start_m
    for start_n in range(0, n_k + 2 * rows, block):  # the backward: a key tile of `block` keys, query tiles of `rows`
        first, masked_end, last = masks.query_tile_counts_gl.fn(start_n, n_q, is_causal, rows, block)
        start, full_start, full_end, end = query_tile_bounds(start_n, mask, rows, block)
        assert first <= masked_end <= last, start_n
        if start < end:  # visited at all: the same run (past the last query, the counts stay ordered instead)
            assert (first * rows, masked_end * rows, last * rows, -(-end // rows)) == \
                (start, full_start, full_end, last), start_n
        else:
            assert first == masked_end == last, start_n
    rows_, cols_ = torch.arange(n_q)[:, None], torch.arange(n_k + 7)[None, :]
    seen = masks.visible_in_tile_gl.fn(rows_, cols_, n_k, is_causal).broadcast_to(n_q, n_k + 7)
    assert torch.equal(seen, masks.visible_in_tile(rows_, cols_, mask))

