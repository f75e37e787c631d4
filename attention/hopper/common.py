"""What the two Hopper kernels share: when they serve a call, their TMA descriptors over whole
(B, H, N, D) tensors, and the ring of shared-memory slots a loader fills. Their tile rules are
masks.py's (the _gl twins)."""
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from ..launch import ADA_PATH, INTERPRETING
from ..masks import UNBOUNDED

# The TMA copies are named async_copy_global_to_shared / async_copy_shared_to_global in Triton 3.6
# and async_load / async_store in later releases.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


def has_window(left, right):
    """Whether a call's mask has a window, causal included (a bound on either side): the TILES
    key's second half, and the kernels' WINDOW. Such a call visits masked tiles at its window's
    edges; one without, only at the end of the keys."""
    return (left, right) != (UNBOUNDED, UNBOUNDED)


def hopper_entry(q, k, left, right, tiles, min_keys):
    """What both Gluon kernels ask of a call: 16-bit, a head dim and mask (has_window) in tiles
    with its min_keys keys or more, compiled (not interpreted) for a Hopper card, and not the
    consumer-card path. Any window and grouped-query heads are served. The rest goes to the
    plain Triton kernels."""
    key = (q.shape[-1], has_window(left, right))
    return (q.dtype in (torch.bfloat16, torch.float16) and key in tiles and k.shape[2] >= min_keys[key]
            and not INTERPRETING and not ADA_PATH and is_hopper(q.device))


@functools.cache
def is_hopper(device):
    """sm_90 exactly: wgmma, which the kernels are built on, is Hopper's alone."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


@functools.cache
def sm_count(device):
    """The persistent grid's size: one program per SM."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@gluon.jit
def tensor_matrices(T, B, H, N, stride_b, stride_h, stride_n, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr):
    """A TMA descriptor of a (B, H, N, HEAD_DIM) tensor, read and written in (1, 1, BLOCK, HEAD_DIM)
    tiles: the (N, HEAD_DIM) matrix of every batch-head at once. Rows past N read as zeros and
    are dropped on a store."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK, HEAD_DIM], T.dtype.element_ty)
    return tma.make_tensor_descriptor(T, shape=[B, H, N, HEAD_DIM], strides=[stride_b, stride_h, stride_n, 1],
                                      block_shape=[1, 1, BLOCK, HEAD_DIM], layout=layout)


@gluon.jit
def ring_slot(index, STAGES: gl.constexpr):
    """Where a ring of STAGES slots keeps the program's tile number `index` (the forward's K/V
    tiles, the backward's Q/dO tiles): slot index % STAGES, and the phase of that slot's
    mbarriers for this tile (each slot serves every STAGES-th tile)."""
    return index % STAGES, (index // STAGES) & 1


@gluon.jit
def load_into_ring(X, Y, ring, index, b, h, row):
    """A loader's step in a ring of two tensors' tiles, ring = (x_bufs, y_bufs, x_ready, y_ready,
    empty) (the forward's K and V, the backward's Q and dO): the program's tile number `index`,
    rows from `row` of batch-head (b, h) of X and of Y, into ring slot index % STAGES once the
    consumers have let go of it (mbarrier empty), each copy arriving on its own ready mbarrier."""
    x_bufs, y_bufs, x_ready, y_ready, empty = ring
    STAGES: gl.constexpr = x_bufs.shape[0]
    slot, phase = ring_slot(index, STAGES)
    # An mbarrier's phase flips each time it completes; waiting on the phase before the first
    # passes at once, so the first wait on an "empty" barrier does not block.
    mbarrier.wait(empty.index(slot), phase ^ 1)
    mbarrier.expect(x_ready.index(slot), X.block_type.nbytes)
    tma_load(X, [b, h, row, 0], x_ready.index(slot), x_bufs.index(slot))
    mbarrier.expect(y_ready.index(slot), Y.block_type.nbytes)
    tma_load(Y, [b, h, row, 0], y_ready.index(slot), y_bufs.index(slot))
