"""A GPU that runs out of memory at long contexts, for tests on the CPU: with this folder on
PYTHONPATH, Python imports this module at startup, and torch.softmax over rows of
FAKE_OOM_ROW_LENGTH or more entries raises torch.OutOfMemoryError, as CUDA's allocator does.
Only the eager backend calls torch.softmax on whole score rows (block_size wide), so eager
runs out of memory from that block_size on and the other backends do not."""
import os

import torch

_row_length = int(os.environ["FAKE_OOM_ROW_LENGTH"])
_softmax = torch.softmax


def _softmax_that_runs_out(input, dim, *args, **kwargs):
    if input.shape[dim] >= _row_length:
        raise torch.OutOfMemoryError(f"fake out of memory (FAKE_OOM_ROW_LENGTH={_row_length})")
    return _softmax(input, dim, *args, **kwargs)


torch.softmax = _softmax_that_runs_out
