"""Step 1: the online-softmax update, in PyTorch (docs/learn.md, chapter 2).

Yours stands in for attention.tiled.online_softmax_update, which tiled_forward calls once per
tile pair (so the `tiled` backend runs it). Check it:

    pytest --impl=mine tests/test_mine.py -k online_softmax
"""
import torch
from einops import einsum


def online_softmax_update(m_i, l_i, acc, s, v_tile):
    """Fold one tile of scores s (..., rows, keys), hidden ones -inf, and its values v_tile
    (..., keys, D) into each row's running max m_i (..., rows), sum l_i (..., rows) and
    unnormalised output acc (..., rows, D); return the new (m_i, l_i, acc).

    l_i is the sum of exp(score - m_i) over the keys seen so far, acc the sum of
    exp(score - m_i) * v. When this tile raises a row's max from m_old to m_new, what was
    accumulated against m_old is multiplied by alpha = exp(m_old - m_new) before this tile's
    part is added. A row that has seen no key yet has max -inf, and exp(-inf - -inf) is NaN:
    measure such a row against 0 instead, so its p and alpha are exp(-inf) = 0. Round p to
    v_tile's dtype for the product and sum the product in acc's dtype, as the kernels do.
    """
    raise NotImplementedError("step 1, online_softmax_update: yours to write (docs/learn.md, Write it yourself)")
