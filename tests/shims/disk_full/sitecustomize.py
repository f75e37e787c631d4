"""A disk that fills up during a checkpoint, for tests: with this folder on PYTHONPATH,
torch.save writes part of its output, then fails as it does on a full disk (a RuntimeError
from its zip writer)."""
import torch


def _save_that_fills_the_disk(obj, f, *args, **kwargs):
    f.write(b"PK\x03\x04" + b"\0" * 100_000)  # the start of a checkpoint, left partial
    raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                       "data/0: file write failed")


torch.save = _save_that_fills_the_disk
