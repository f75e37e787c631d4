"""Which tiles a FlashAttention program visits, and the causal mask inside a tile.

The tiled PyTorch code (tiled.py, tiled_backward.py; recompute_backward.py for the mask) and
docs/causal_tiles.py use these; the Triton kernels state the same rules as @triton.jit helpers
of the same names (triton_tiles.py), and the tests check both against eager.py's causal mask.

Causal tiles fall in three kinds: skipped (every key is above the diagonal for every query
of the tile: never loaded), unmasked (every key visible to every query: no mask needed) and
masked (the tile crosses the diagonal, or, in the kernels, the end of the keys).
"""
import torch


def check_tile_sizes(tile_m, tile_n):
    for name, size in (("tile_m", tile_m), ("tile_n", tile_n)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")


def key_tile_bounds(q_start, n_k, is_causal, tile_m, tile_n):
    """The key tiles the query tile starting at row q_start visits (the forward and the dQ
    pass): those starting in [0, unmasked_end) are visible to every row of the query tile and
    lie inside n_k; those starting in [unmasked_end, end) need the mask. Causal: keys past the
    query tile's last row are never visited."""
    unmasked_end = n_k // tile_n * tile_n
    end = n_k
    if is_causal:
        unmasked_end = min(unmasked_end, (q_start + 1) // tile_n * tile_n)
        end = min(q_start + tile_m, n_k)
    return unmasked_end, end


def query_tile_bounds(k_start, n_q, is_causal, tile_m, tile_n):
    """The query tiles the key tile starting at row k_start visits (the dK/dV pass): those
    starting in [start, unmasked_start) cross the diagonal and need the mask; those from
    unmasked_start to n_q see every key of the tile. Causal: query tiles that end before
    k_start see none of its keys and are skipped."""
    start = unmasked_start = 0
    if is_causal:
        start = k_start // tile_m * tile_m
        n_q_tiled = -(-n_q // tile_m) * tile_m  # n_q rounded up to whole tiles
        unmasked_start = min(-(-(k_start + tile_n - 1) // tile_m) * tile_m, n_q_tiled)
    return start, unmasked_start


def visible_in_tile(q_start, q_end, k_start, k_end, device=None):
    """(q_end - q_start, k_end - k_start) bool: True where eager.py's causal rule lets query
    i in [q_start, q_end) see key j in [k_start, k_end)."""
    rows = torch.arange(q_start, q_end, device=device)[:, None]
    cols = torch.arange(k_start, k_end, device=device)[None, :]
    return cols <= rows
