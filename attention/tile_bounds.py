"""Which tiles a FlashAttention program visits, and the mask inside a tile: a mask is a tile bound.

A program holds one tile of rows (queries in the forward and the dQ pass, keys in the dK/dV
pass) and walks the tiles of the other side that its rows can see. Under a window (left, right)
(eager.py; causal is right = 0, full attention is both sides UNBOUNDED) each of those is:
- skipped: no row of the program's tile sees any of it; never loaded;
- full: every row sees every one of its keys; no mask needed;
- masked: some rows see some of it (it crosses the diagonal or a window's edge, or runs past the
  last key); the scores get visible_in_tile.
The tiles a program visits are one run, masked, then full, then masked, given by four numbers
(start, full_start, full_end, end). tiled.py and tiled_backward.py use these; the kernels state
the same rules as @triton.jit helpers of the same names (triton_tiles.py), and the tests check
both against eager.visible_keys. A tile is taken at its nominal size: rows past the end of a
sequence are computed and never stored.
"""
import torch


def check_tile_sizes(tile_m, tile_n):
    for name, size in (("tile_m", tile_m), ("tile_n", tile_n)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")


def ceil_to(n, tile):
    return -(-n // tile) * tile


def tile_run(seen_from, all_see_from, all_see_to, seen_to, tile):
    """(start, full_start, full_end, end) of the tiles over positions [seen_from, seen_to), which
    some row sees; tiles inside [all_see_from, all_see_to), which every row sees, are full. When
    no tile is full, full_start = full_end splits the run anywhere in it."""
    start = seen_from // tile * tile
    end_tile = ceil_to(seen_to, tile)
    full_start = min(max(ceil_to(max(all_see_from, 0), tile), start), end_tile)
    full_end = max(min(all_see_to // tile * tile, end_tile), full_start)
    return start, full_start, full_end, seen_to


def key_tile_bounds(q_start, n_k, left, right, tile_m, tile_n):
    """The key tiles the query tile of rows [q_start, q_start + tile_m) visits (the forward and
    the dQ pass). Any of its rows sees keys [q_start - left, q_last + right]; all of them see
    [q_last - left, q_start + right]; keys past n_k exist for no row."""
    q_last = q_start + tile_m - 1
    return tile_run(max(q_start - left, 0), q_last - left, min(q_start + right + 1, n_k),
                    min(q_last + right + 1, n_k), tile_n)


def query_tile_bounds(k_start, n_q, left, right, tile_m, tile_n):
    """The query tiles that see the key tile of keys [k_start, k_start + tile_n) (the dK/dV
    pass). Some query sees one of its keys from row k_start - right to k_last + left; every query
    sees all of them from k_last - right to k_start + left. Rows past n_q need no mask (the
    backward gives them lse = +inf, so P = 0 there), so the last query tile can be full."""
    k_last = k_start + tile_n - 1
    return tile_run(max(k_start - right, 0), k_last - right, min(k_start + left + 1, ceil_to(n_q, tile_m)),
                    min(k_last + left + 1, n_q), tile_m)


def visible_in_tile(rows, cols, n_k, left, right):
    """True where query `rows` may see key `cols` (broadcast against each other): the key lies
    before n_k and inside the query's window."""
    return (cols < n_k) & (cols >= rows - left) & (cols <= rows + right)


def tile_mask(q_start, q_end, k_start, k_end, n_k, left, right, device=None):
    """visible_in_tile for the (q_end - q_start, k_end - k_start) tile of scores."""
    rows = torch.arange(q_start, q_end, device=device)[:, None]
    cols = torch.arange(k_start, k_end, device=device)[None, :]
    return visible_in_tile(rows, cols, n_k, left, right)
