"""The @triton.jit helpers both FlashAttention kernels share: where a program's tile starts,
which tiles it visits and which scores in a tile it may see, and how it reads and writes the
(N, HEAD_DIM) matrix of one (batch, head) a tile at a time.

triton_forward.py and triton_backward.py import these; their PyTorch twins are in
tile_bounds.py, under the same names, and the tests check both against eager's causal mask.
"""
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634  # the kernels' softmax runs in base 2: exp(x) = exp2(x * LOG2_E)
LN_2 = tl.constexpr(0.6931471805599453)  # and the forwards' lse goes back: log(x) = log2(x) * LN_2


@triton.jit
def program_tile_and_head(HEADS_FIRST: tl.constexpr):
    """This program's tile, its batch-head and how many tile programs each batch-head has. The
    grid is (tiles, B * H), or (B * H, tiles) with HEADS_FIRST (triton_launch.heads_first
    says when). The GPU starts programs in grid order, x fastest: with the heads along x, the
    first (for causal: the longest) tiles of every head start before the later tiles of any."""
    tile, bh, tiles = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    if HEADS_FIRST:
        tile, bh, tiles = tl.program_id(1), tl.program_id(0), tl.num_programs(1)
    return tile, bh, tiles


@triton.jit
def query_tile_start(program, n_programs, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """The first query row of the tile of the program-th of n_programs query-tile programs.
    Causal query tiles near the end have the most keys to visit: launch them first, so the
    short ones fill the gaps at the end of the grid."""
    tile_m = program
    if IS_CAUSAL:
        tile_m = n_programs - 1 - program
    return tile_m * BLOCK_M


@triton.jit
def key_tile_bounds(start_m, N_K, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """tile_bounds.key_tile_bounds (the forward and the dQ pass): of the key tiles the query
    tile starting at row start_m visits, [0, unmasked_end) need no mask and [unmasked_end, end)
    need visible_in_tile."""
    unmasked_end = (N_K // BLOCK_N) * BLOCK_N
    end = N_K
    if IS_CAUSAL:
        unmasked_end = tl.minimum(unmasked_end, (start_m + 1) // BLOCK_N * BLOCK_N)
        end = tl.minimum(start_m + BLOCK_M, N_K)
    return unmasked_end, end


@triton.jit
def query_tile_bounds(start_n, N_Q, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """tile_bounds.query_tile_bounds (the dK/dV pass): of the query tiles the key tile starting
    at row start_n visits, [start_m, unmasked_start) need visible_in_tile and [unmasked_start, N_Q)
    need no mask."""
    start_m = 0
    unmasked_start = 0
    if IS_CAUSAL:
        start_m = start_n // BLOCK_M * BLOCK_M
        unmasked_start = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, tl.cdiv(N_Q, BLOCK_M) * BLOCK_M)
    return start_m, unmasked_start


@triton.jit
def visible_in_tile(rows, cols, N_K, IS_CAUSAL: tl.constexpr):
    """True where query row `rows` may see key `cols`: the key lies before N_K and, causal,
    eager.py's rule holds. rows and cols come broadcast against each other: rows[:, None] and
    cols[None, :] for a tile of scores, rows[None, :] and cols[:, None] for a transposed one."""
    visible = cols < N_K
    if IS_CAUSAL:
        visible = visible & (cols <= rows)
    return visible


@triton.jit
def head_matrix(T, bh, H, stride_b, stride_h, stride_n, N,
                HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, USE_TMA: tl.constexpr):
    """The (N, HEAD_DIM) matrix of batch-head bh, read and written in (BLOCK, HEAD_DIM) tiles
    through its strides: the model's q, k, v are strided views of one fused projection and are
    never copied. On Hopper it is a TMA tensor descriptor (the copy engine moves whole tiles and
    checks bounds in hardware); elsewhere the base pointer for load_tile's masked loads, which
    Triton pipelines with cp.async."""
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    if USE_TMA:
        matrix = tl.make_tensor_descriptor(T + b * stride_b + h * stride_h, shape=[N, HEAD_DIM],
                                           strides=[stride_n, 1], block_shape=[BLOCK, HEAD_DIM])
    else:
        matrix = T + b * stride_b + h * stride_h
    return matrix


@triton.jit
def load_tile(matrix, start, N, stride_n, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows [start, start + BLOCK) of a head matrix; rows past N read as zeros."""
    if USE_TMA:
        tile = matrix.load([start, 0])
    else:
        rows = start + tl.arange(0, BLOCK)
        tile = tl.load(matrix + rows[:, None] * stride_n + tl.arange(0, HEAD_DIM)[None, :],
                       mask=rows[:, None] < N, other=0.0)
    return tile


@triton.jit
def store_tile(matrix, start, N, stride_n, tile, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr):
    """Write rows [start, start + BLOCK) of a head matrix; rows past N are dropped."""
    if USE_TMA:
        matrix.store([start, 0], tile.to(matrix.dtype))
    else:
        rows = start + tl.arange(0, BLOCK)
        tl.store(matrix + rows[:, None] * stride_n + tl.arange(0, HEAD_DIM)[None, :], tile.to(matrix.dtype.element_ty),
                 mask=rows[:, None] < N)
