"""The @triton.jit helpers both FlashAttention kernels share: where a program's tile starts, and
how it reads, writes and adds to the (N, HEAD_DIM) matrix of one head a tile at a time. Which tiles it
visits and which scores in a tile it may see are masks.py's.

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
def head_matrix(T, b, h, stride_b, stride_h, stride_n, N,
                HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """The (N, HEAD_DIM) matrix of batch b, head h, read and written in (BLOCK, BLOCK_D) tiles:
    T offset once to the head (in 64 bits), and its rows' stride, so that a kernel's helpers take
    one value per tensor. The model's q, k, v are strided views of one fused projection and are
    never copied. On Hopper it is a TMA tensor descriptor (the copy engine moves whole tiles and
    checks bounds in hardware); elsewhere (the head's first element, its row stride, its rows)
    for load_tile's masked loads, which Triton pipelines with cp.async."""
    base = T + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    if USE_TMA:
        matrix = tl.make_tensor_descriptor(base, shape=[N, HEAD_DIM], strides=[stride_n, 1],
                                           block_shape=[BLOCK, BLOCK_D])
    else:
        matrix = (base, stride_n, N)
    return matrix


@triton.jit
def in_bounds(rows, N, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Which elements of a (rows, BLOCK_D) tile exist: rows before N, and, where the head dim is
    padded, its first HEAD_DIM columns. (Not a mask of scores: that is masks.visible_in_tile_tl.)"""
    mask = rows[:, None] < N
    if HEAD_DIM != BLOCK_D:
        mask = mask & (tl.arange(0, BLOCK_D)[None, :] < HEAD_DIM)
    return mask


@triton.jit
def load_tile(matrix, start, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              USE_TMA: tl.constexpr):
    """Rows [start, start + BLOCK) of a head matrix; rows past its end and padded columns read as zeros."""
    if USE_TMA:
        tile = matrix.load([start, 0])
    else:
        base, stride_n, N = matrix
        rows = start + tl.arange(0, BLOCK)
        tile = tl.load(base + rows[:, None] * stride_n + tl.arange(0, BLOCK_D)[None, :],
                       mask=in_bounds(rows, N, HEAD_DIM, BLOCK_D), other=0.0)
    return tile


@triton.jit
def store_tile(matrix, start, tile, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Write rows [start, start + BLOCK) of a head matrix; rows past its end and padded columns are dropped."""
    if USE_TMA:
        matrix.store([start, 0], tile.to(matrix.dtype))
    else:
        base, stride_n, N = matrix
        rows = start + tl.arange(0, BLOCK)
        tl.store(base + rows[:, None] * stride_n + tl.arange(0, BLOCK_D)[None, :],
                 tile.to(base.dtype.element_ty), mask=in_bounds(rows, N, HEAD_DIM, BLOCK_D))


@triton.jit
def add_tile(matrix, start, tile, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Add tile to rows [start, start + BLOCK) of a float32 head matrix (pointers, never TMA),
    with atomics, as many programs add to the same rows; rows past its end and padded columns
    are dropped. Relaxed: nothing else in the launch reads the matrix, so no add has to wait for
    another to be seen (Triton's default, acq_rel, orders each add against all memory); what
    reads it is the next launch. The sum's order, and so its last bits, differs run to run."""
    base, stride_n, N = matrix
    rows = start + tl.arange(0, BLOCK)
    tl.atomic_add(base + rows[:, None] * stride_n + tl.arange(0, BLOCK_D)[None, :], tile,
                  mask=in_bounds(rows, N, HEAD_DIM, BLOCK_D), sem="relaxed")
