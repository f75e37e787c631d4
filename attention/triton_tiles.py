"""The @triton.jit helpers both FlashAttention kernels share: where a program's tile starts,
which tiles it visits and which scores in a tile it may see (tile_bounds.py's rules, under the
same names), and how it reads and writes the (N, HEAD_DIM) matrix of one head a tile at a time.

The head dim is padded to BLOCK_D, the next power of two (at least 16, what tl.dot takes): the
loads fill the padding with zeros, which add nothing to Q K^T and give zero columns of O,
never stored.
"""
import triton
import triton.language as tl

# Constants a kernel reads must be tl.constexpr; the host reads LOG2_E.value.
LOG2_E = tl.constexpr(1.4426950408889634)  # the kernels' softmax runs in base 2: exp(x) = exp2(x * LOG2_E)
LN_2 = tl.constexpr(0.6931471805599453)  # and the forwards' lse goes back: log(x) = log2(x) * LN_2


@triton.jit
def program_tile_and_head(HEADS_FIRST: tl.constexpr):
    """This program's tile, its head (a (batch, head) or (batch, kv head) index) and how many
    tile programs each head has: the grid is (tiles, heads), or (heads, tiles) with HEADS_FIRST
    (launch.heads_first), which starts the first (longest) tiles of every head before the rest."""
    tile, head, tiles = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    if HEADS_FIRST:
        tile, head, tiles = tl.program_id(1), tl.program_id(0), tl.num_programs(1)
    return tile, head, tiles


@triton.jit
def query_tile_start(program, n_programs, BLOCK_M: tl.constexpr):
    """The first query row of the program-th of n_programs query tiles, the last tile first:
    causal, the last tiles see the most keys, and the short ones started last fill the gaps at
    the end of the grid. Without a mask every tile has the same work."""
    return (n_programs - 1 - program) * BLOCK_M


@triton.jit
def tile_run(seen_from, all_see_from, all_see_to, seen_to, BLOCK: tl.constexpr):
    """tile_bounds.tile_run: (start, full_start, full_end, end) of the tiles over positions
    [seen_from, seen_to); those inside [all_see_from, all_see_to) need no mask."""
    start = seen_from // BLOCK * BLOCK
    end_tile = tl.cdiv(seen_to, BLOCK) * BLOCK
    full_start = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(all_see_from, 0), BLOCK) * BLOCK, start), end_tile)
    full_end = tl.maximum(tl.minimum(all_see_to // BLOCK * BLOCK, end_tile), full_start)
    return start, full_start, full_end, seen_to


@triton.jit
def key_tile_bounds(start_m, N_K, LEFT, RIGHT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """tile_bounds.key_tile_bounds: the key tiles the query tile from row start_m visits (the
    forward and the dQ pass)."""
    last_m = start_m + BLOCK_M - 1
    return tile_run(tl.maximum(start_m - LEFT, 0), last_m - LEFT, tl.minimum(start_m + RIGHT + 1, N_K),
                    tl.minimum(last_m + RIGHT + 1, N_K), BLOCK_N)


@triton.jit
def query_tile_bounds(start_n, N_Q, LEFT, RIGHT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """tile_bounds.query_tile_bounds: the query tiles that see the key tile from row start_n
    (the dK/dV pass)."""
    last_n = start_n + BLOCK_N - 1
    return tile_run(tl.maximum(start_n - RIGHT, 0), last_n - RIGHT,
                    tl.minimum(start_n + LEFT + 1, tl.cdiv(N_Q, BLOCK_M) * BLOCK_M),
                    tl.minimum(last_n + LEFT + 1, N_Q), BLOCK_M)


@triton.jit
def visible_in_tile(rows, cols, N_K, LEFT, RIGHT):
    """True where query row `rows` may see key `cols`. rows and cols come broadcast against each
    other: rows[:, None] and cols[None, :] for a tile of scores, the other way round for a
    transposed one."""
    return (cols < N_K) & (cols >= rows - LEFT) & (cols <= rows + RIGHT)


@triton.jit
def head_matrix(T, b, h, stride_b, stride_h, stride_n, N,
                HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """The (N, HEAD_DIM) matrix of batch b, head h, read and written in (BLOCK, BLOCK_D) tiles
    through its strides: the model's q, k, v are strided views of one fused projection and are
    never copied. On Hopper it is a TMA tensor descriptor (the copy engine moves whole tiles and
    checks bounds in hardware); elsewhere the base pointer for load_tile's masked loads, which
    Triton pipelines with cp.async."""
    matrix = T + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    if USE_TMA:  # (one return: compiled Triton wants one return type, whichever branch is taken)
        matrix = tl.make_tensor_descriptor(matrix, shape=[N, HEAD_DIM], strides=[stride_n, 1],
                                           block_shape=[BLOCK, BLOCK_D])
    return matrix


@triton.jit
def in_bounds(rows, N, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Which elements of a (rows, BLOCK_D) tile exist: rows before N, and, where the head dim is
    padded, its first HEAD_DIM columns. (Not a mask of scores: that is visible_in_tile.)"""
    mask = rows[:, None] < N
    if HEAD_DIM != BLOCK_D:
        mask = mask & (tl.arange(0, BLOCK_D)[None, :] < HEAD_DIM)
    return mask


@triton.jit
def load_tile(matrix, start, N, stride_n, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              USE_TMA: tl.constexpr):
    """Rows [start, start + BLOCK) of a head matrix; rows past N and padded columns read as zeros."""
    if USE_TMA:
        tile = matrix.load([start, 0])
    else:
        rows = start + tl.arange(0, BLOCK)
        tile = tl.load(matrix + rows[:, None] * stride_n + tl.arange(0, BLOCK_D)[None, :],
                       mask=in_bounds(rows, N, HEAD_DIM, BLOCK_D), other=0.0)
    return tile


@triton.jit
def store_tile(matrix, start, N, stride_n, tile, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Write rows [start, start + BLOCK) of a head matrix; rows past N and padded columns are dropped."""
    if USE_TMA:
        matrix.store([start, 0], tile.to(matrix.dtype))
    else:
        rows = start + tl.arange(0, BLOCK)
        tl.store(matrix + rows[:, None] * stride_n + tl.arange(0, BLOCK_D)[None, :],
                 tile.to(matrix.dtype.element_ty), mask=in_bounds(rows, N, HEAD_DIM, BLOCK_D))
