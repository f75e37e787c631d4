"""Files a killed run never leaves half written: ckpt.pt, metrics.jsonl when it is reset,
profile.json.

write_atomically writes to `path`.tmp in the same folder, flushes and fsyncs it, then
os.replace()s it over `path`. A rename within one filesystem is atomic, so a process killed at
any moment (SIGKILL included) leaves `path` as either the previous complete file or the new
one; at worst a stale `path`.tmp stays behind, and the next write overwrites it. A write that
fails (a full disk, an I/O error) removes its `path`.tmp and re-raises; `path` is untouched.

Two writers stay apart, each for one reason: attention/'s tuning cache (attention/ is a
standalone library that imports nothing outside itself) and data/shakespeare/prepare.py's
(a script that runs on its own, before any training). Both may have several processes saving
at once, hence their unique temporary names; here rank 0 alone writes.
"""
import contextlib
import os


@contextlib.contextmanager
def write_atomically(path, mode="w"):
    """`with write_atomically(path, "wb") as f:` writes f to `path` all at once, or not at all."""
    tmp_path = path + ".tmp"
    try:
        with open(tmp_path, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise
    # Make the rename itself durable too (it lives in the directory entry).
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
