"""The tiled PyTorch FlashAttention (tiled.py, tiled_backward.py) with tiles of every shape,
and the tile bounds it shares with the Triton kernels (tile_bounds.py) against eager's mask.
Every backend's default path is in test_attention.py; here the tiles are small and
rectangular (tile_m != tile_n), so many tiles cross the diagonal and sequences end mid-tile."""
import pytest
import torch

from attention import FlashAttentionPytorch
from attention.eager import causal_mask
from attention.tile_bounds import key_tile_bounds, query_tile_bounds
from attention.tiled import tiled_forward
from attention.tiled_backward import tiled_backward
from test_attention import TOLERANCE, assert_close, random_qkv, reference

TILES = [(16, 8), (8, 16), (7, 13), (1, 5), (64, 64)]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape_q,n_k", [((2, 1, 37, 16), 45), ((1, 2, 45, 128), 37), ((2, 29, 64), 29)])
@pytest.mark.parametrize("tile_m,tile_n", [(16, 8), (8, 16), (7, 13)])
def test_tiled_backward_matches_float64_reference(tile_m, tile_n, shape_q, n_k, is_causal):
    q, k, v = random_qkv(shape_q, n_k, seed=tile_m * tile_n + n_k)
    o = FlashAttentionPytorch.apply(q, k, v, is_causal, tile_m, tile_n)
    do = torch.randn_like(o)
    o.backward(do)
    o_ref, _, dq_ref, dk_ref, dv_ref = reference(q, k, v, is_causal, do)
    tol = TOLERANCE[torch.float32]
    assert_close(o, o_ref, tol, "O")
    for name, t, ref in (("dQ", q, dq_ref), ("dK", k, dk_ref), ("dV", v, dv_ref)):
        assert_close(t.grad, ref, tol, name)


@pytest.mark.parametrize("tile_m,tile_n", [(16, 8), (5, 11)])
def test_tiled_backward_on_strided_views(tile_m, tile_n):
    """q, k, v as the model makes them, (B, H, T, D) views of one (B, T, 3, H, D) tensor, and
    dO a transposed view; called directly, as the Function calls it."""
    B, T, H, D = 2, 29, 3, 32
    qkv = torch.randn(B, T, 3, H, D, generator=torch.Generator().manual_seed(1))
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    o, lse = tiled_forward(q, k, v, True, tile_m, tile_n)
    do = torch.randn(B, T, H, D).transpose(1, 2)
    dq, dk, dv = tiled_backward(q, k, v, o, lse, do, True, tile_m, tile_n)
    _, _, dq_ref, dk_ref, dv_ref = reference(q, k, v, True, do)
    for name, got, ref in (("dQ", dq, dq_ref), ("dK", dk, dk_ref), ("dV", dv, dv_ref)):
        assert_close(got, ref, TOLERANCE[torch.float32], name)


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
        FlashAttentionPytorch.apply(q, k, v, True, bad, 8)
    with pytest.raises(ValueError, match="tile_n must be a positive int"):
        FlashAttentionPytorch.apply(q, k, v, True, 8, bad)


def classify(n_q, n_k, is_causal, tile_m, tile_n, pass_):
    """{(query tile start, key tile start): "unmasked" | "masked"} for the tiles one pass visits."""
    visits = {}
    if pass_ == "forward":  # and the dQ pass: each query tile walks key tiles
        for q_start in range(0, n_q, tile_m):
            unmasked_end, end = key_tile_bounds(q_start, n_k, is_causal, tile_m, tile_n)
            for k_start in range(0, end, tile_n):
                visits[q_start, k_start] = "masked" if k_start >= unmasked_end else "unmasked"
    else:  # the dK/dV pass: each key tile walks query tiles
        for k_start in range(0, n_k, tile_n):
            start, unmasked_start = query_tile_bounds(k_start, n_q, is_causal, tile_m, tile_n)
            for q_start in range(start, n_q, tile_m):
                visits[q_start, k_start] = "masked" if q_start < unmasked_start else "unmasked"
    return visits


@pytest.mark.parametrize("pass_", ["forward", "dkdv"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("n_q,n_k", [(37, 53), (53, 37), (64, 64), (1, 9), (9, 1), (30, 30)])
@pytest.mark.parametrize("tile_m,tile_n", TILES)
def test_tile_bounds_agree_with_the_causal_mask(tile_m, tile_n, n_q, n_k, is_causal, pass_):
    """Every tile holding a visible (query, key) pair is visited; an unmasked tile holds only
    visible pairs; a skipped tile holds none. The mask is eager's."""
    visible = causal_mask(n_q, n_k) if is_causal else torch.ones(n_q, n_k, dtype=torch.bool)
    visits = classify(n_q, n_k, is_causal, tile_m, tile_n, pass_)
    for q_start in range(0, n_q, tile_m):
        for k_start in range(0, n_k, tile_n):
            tile = visible[q_start:q_start + tile_m, k_start:k_start + tile_n]
            kind = visits.get((q_start, k_start), "skipped")
            if kind == "skipped":
                assert not tile.any(), f"tile ({q_start}, {k_start}) holds visible pairs but is skipped"
            if kind == "unmasked":
                assert tile.all(), f"tile ({q_start}, {k_start}) holds hidden pairs but runs unmasked"
    assert all(q < n_q and k < n_k for q, k in visits), "a tile outside the sequences is visited"


def test_causal_tiles_figure_is_drawn(tmp_path):
    """docs/causal_tiles.py, which draws the tiles from tile_bounds, runs from anywhere."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "docs" / "causal_tiles.py"
    out = tmp_path / "tiles.png"
    subprocess.run([sys.executable, str(script), "--out", str(out)], cwd=tmp_path, check=True, timeout=300)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
