"""What a mask is, in one place: which keys each query sees, and which tiles a FlashAttention
program visits. Every backend, kernel and test takes its mask from here.

The window. attention(..., window_size=(left, right)), as FlashAttention-2: query i sees keys
i - left <= j <= i + right, -1 leaving that side unbounded; causal is right = 0. window_bounds
turns it into two ints >= 0 (UNBOUNDED where there is no bound), the sides that every rule
below and every kernel takes: one rule covers causal, windowed and full attention. Causal and
windows are top-left, as torch's scaled_dot_product_attention: i and j both count from the start
of their sequences (decode.py handles one new query against a KV cache). FlashAttention-2 takes
the same (left, right) but aligns both to the bottom-right when N_q != N_k (query i sits at key
i + N_k - N_q); top-left is torch's is_causal, so sdpa agrees with every backend, and training
has N_q = N_k, where the two are the same.

A mask is four numbers, mask = (n_q, n_k, left, right): the n_q x n_k scores of one head, each
query seeing the keys of its window that exist (j < n_k). A query that sees no key gets O = 0.

The tiles. A program holds one tile of rows (queries in the forward and the dQ pass, keys in
the dK/dV pass) and walks the tiles of the other side that its rows can see. Each is:
- skipped: no row of the program's tile sees any of it; never loaded;
- full: every row sees every one of its keys; no mask needed;
- masked: some rows see some of it (it crosses the diagonal or a window's edge, or runs past the
  last key); the scores get visible_in_tile.
The tiles a program visits are one run, masked, then full, then masked, given by four numbers
(start, full_start, full_end, end). A tile is taken at its nominal size: rows past the end of a
sequence are computed and never stored.

Each rule is written three times, with the same names: in Python (eager.py, tiled.py and
tiled_backward.py use it), as a @triton.jit twin with the suffix _tl (the Triton kernels, the
decode kernel's too), and as a @gluon.jit twin with the suffix _gl (the Hopper kernels).
tests/test_tiled.py holds the twins to the Python rules, and those to the mask itself.
"""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# What a window side of -1 becomes: farther than any sequence. The kernels take the same number
# (a 32-bit int), so one rule covers causal, windowed and full attention.
UNBOUNDED = 2 ** 30


def window_bounds(is_causal, window_size):
    """(left, right), each an int in [0, UNBOUNDED]: the keys a query sees before and after its
    own position. A side of UNBOUNDED or more reaches as far as -1 does, and is UNBOUNDED: the
    kernels add the sides to 32-bit positions, where a side near 2**31 would wrap around."""
    left, right = (UNBOUNDED if side < 0 else min(side, UNBOUNDED) for side in window_size)
    return left, 0 if is_causal else right


def visible_in_tile(rows, cols, mask):
    """True where query `rows` sees key `cols` (broadcast against each other): the key lies
    before n_k and inside the query's window."""
    _, n_k, left, right = mask
    return (cols < n_k) & (cols >= rows - left) & (cols <= rows + right)


def tile_mask(q_start, q_end, k_start, k_end, mask, device=None):
    """visible_in_tile for the (q_end - q_start, k_end - k_start) tile of scores."""
    rows = torch.arange(q_start, q_end, device=device)[:, None]
    cols = torch.arange(k_start, k_end, device=device)[None, :]
    return visible_in_tile(rows, cols, mask)


def visible_keys(mask, device=None):
    """The whole (n_q, n_k) mask, bool: True where query i sees key j."""
    n_q, n_k, _, _ = mask
    return tile_mask(0, n_q, 0, n_k, mask, device)


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


def key_tile_bounds(q_start, mask, tile_m, tile_n):
    """The key tiles the query tile of rows [q_start, q_start + tile_m) visits (the forward and
    the dQ pass). Any of its rows sees keys [q_start - left, q_last + right]; all of them see
    [q_last - left, q_start + right]; keys past n_k exist for no row."""
    _, n_k, left, right = mask
    q_last = q_start + tile_m - 1
    return tile_run(max(q_start - left, 0), q_last - left, min(q_start + right + 1, n_k),
                    min(q_last + right + 1, n_k), tile_n)


def query_tile_bounds(k_start, mask, tile_m, tile_n):
    """The query tiles that see the key tile of keys [k_start, k_start + tile_n) (the dK/dV
    pass). Some query sees one of its keys from row k_start - right to k_last + left; every query
    sees all of them from k_last - right to k_start + left. Rows past n_q need no mask (the
    backward gives them lse = +inf, so P = 0 there), so the last query tile can be full."""
    n_q, _, left, right = mask
    k_last = k_start + tile_n - 1
    return tile_run(max(k_start - right, 0), k_last - right, min(k_start + left + 1, ceil_to(n_q, tile_m)),
                    min(k_last + left + 1, n_q), tile_m)


# ---------------------------------------------------------------- the Triton kernels' twins

@triton.jit
def visible_in_tile_tl(rows, cols, mask):
    """visible_in_tile. rows and cols come broadcast against each other: rows[:, None] and
    cols[None, :] for a tile of scores, the other way round for a transposed one."""
    _, N_K, left, right = mask
    return (cols < N_K) & (cols >= rows - left) & (cols <= rows + right)


@triton.jit
def tile_run_tl(seen_from, all_see_from, all_see_to, seen_to, BLOCK: tl.constexpr):
    """tile_run."""
    start = seen_from // BLOCK * BLOCK
    end_tile = tl.cdiv(seen_to, BLOCK) * BLOCK
    full_start = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(all_see_from, 0), BLOCK) * BLOCK, start), end_tile)
    full_end = tl.maximum(tl.minimum(all_see_to // BLOCK * BLOCK, end_tile), full_start)
    return start, full_start, full_end, seen_to


@triton.jit
def key_tile_bounds_tl(start_m, mask, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """key_tile_bounds: the key tiles the query tile from row start_m visits."""
    _, N_K, left, right = mask
    last_m = start_m + BLOCK_M - 1
    return tile_run_tl(tl.maximum(start_m - left, 0), last_m - left, tl.minimum(start_m + right + 1, N_K),
                       tl.minimum(last_m + right + 1, N_K), BLOCK_N)


@triton.jit
def query_tile_bounds_tl(start_n, mask, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """query_tile_bounds: the query tiles that see the key tile from row start_n."""
    N_Q, _, left, right = mask
    last_n = start_n + BLOCK_N - 1
    return tile_run_tl(tl.maximum(start_n - right, 0), last_n - right,
                       tl.minimum(start_n + left + 1, tl.cdiv(N_Q, BLOCK_M) * BLOCK_M),
                       tl.minimum(last_n + left + 1, N_Q), BLOCK_M)


# ---------------------------------------------------------------- the Gluon kernels' twins
# The same rules for the Hopper kernels, in Gluon. Written with Python's min, max and // on ints
# >= 0 (which Gluon compiles as gl.minimum, gl.maximum and integer division, equal there), so
# that the functions these are built from (.fn) run in plain Python too, and
# tests/test_tiled.py holds them to the Python rules on the CPU.

@gluon.jit
def visible_in_tile_gl(rows, cols, mask, WINDOW: gl.constexpr):
    """visible_in_tile (rows and cols broadcast against each other, as visible_in_tile_tl's).
    WINDOW=False compiles the rule of a mask with no window (left = right = UNBOUNDED, not
    causal), where only the end of the keys hides any: a test per score against each row's
    bounds costs the Hopper kernels registers they spill."""
    _, N_K, left, right = mask
    seen = cols < N_K
    if WINDOW:
        seen = seen & (cols >= rows - left) & (cols <= rows + right)
    return seen


@gluon.jit
def tile_run_gl(seen_from, all_see_from, all_see_to, seen_to, BLOCK: gl.constexpr):
    """tile_run."""
    start = seen_from // BLOCK * BLOCK
    end_tile = (seen_to + BLOCK - 1) // BLOCK * BLOCK
    full_start = min(max((max(all_see_from, 0) + BLOCK - 1) // BLOCK * BLOCK, start), end_tile)
    full_end = max(min(all_see_to // BLOCK * BLOCK, end_tile), full_start)
    return start, full_start, full_end, seen_to


@gluon.jit
def key_tile_bounds_gl(start_m, mask, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """key_tile_bounds: the key tiles the query tile from row start_m visits."""
    _, N_K, left, right = mask
    last_m = start_m + BLOCK_M - 1
    return tile_run_gl(max(start_m - left, 0), last_m - left, min(start_m + right + 1, N_K),
                       min(last_m + right + 1, N_K), BLOCK_N)


@gluon.jit
def query_tile_bounds_gl(start_n, mask, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """query_tile_bounds: the query tiles that see the key tile from row start_n."""
    N_Q, _, left, right = mask
    last_n = start_n + BLOCK_N - 1
    return tile_run_gl(max(start_n - right, 0), last_n - right,
                       min(start_n + left + 1, (N_Q + BLOCK_M - 1) // BLOCK_M * BLOCK_M),
                       min(last_n + left + 1, N_Q), BLOCK_M)


@gluon.jit
def tile_numbers_gl(bounds, BLOCK: gl.constexpr):
    """A run of bounds = (start, full_start, full_end, end) in tile numbers, first <= full_first
    <= full_last <= last: tiles [first, full_first) and [full_last, last) are masked,
    [full_first, full_last) full. The Hopper kernels count tiles, as their loaders fill a ring
    of them; a run that holds no tile (no row of the tile sees a key: end <= start) gives
    first = last, which their mbarrier phases count on."""
    start, full_start, full_end, end = bounds
    first = start // BLOCK
    last = max((end + BLOCK - 1) // BLOCK, first)
    full_first = min(max(full_start // BLOCK, first), last)
    full_last = min(max(full_end // BLOCK, full_first), last)
    return first, full_first, full_last, last
