"""A disk that fills up, for tests: with this folder on PYTHONPATH, the write of the file that
DISK_FULL names fails as it does on a full disk. DISK_FULL=ckpt.pt (the default): torch.save
writes part of its output, then fails as its zip writer does (a RuntimeError). Another name, as
name or name:modes (e.g. metrics.jsonl:a, the appends only): opening that file (or its .tmp) to
write in one of those modes raises OSError ENOSPC."""
import builtins
import errno
import io
import os

import torch

_name, _, _modes = os.environ.get("DISK_FULL", "ckpt.pt").partition(":")


def _save_that_fills_the_disk(obj, f, *args, **kwargs):
    f.write(b"PK\x03\x04" + b"\0" * 100_000)  # the start of a checkpoint, left partial
    raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                       "data/0: file write failed")


def _open_on_a_full_disk(file, mode="r", *args, **kwargs):
    if isinstance(file, (str, os.PathLike)) and os.path.basename(file) in (_name, _name + ".tmp") \
            and any(m in mode for m in (_modes or "wax")):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
    return _open(file, mode, *args, **kwargs)


if _name == "ckpt.pt":
    torch.save = _save_that_fills_the_disk
else:
    _open = builtins.open
    builtins.open = io.open = _open_on_a_full_disk
