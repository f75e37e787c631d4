"""Writing files safely, for every script: a file written whole or not at all, and a folder held
by one process at a time. Here, under data/, so that the dataset scripts and training/ share it."""
import contextlib
import fcntl
import os


@contextlib.contextmanager
def folder_lock(path, wait=True, announce=None):
    """Exclusive use of a folder, by flock on the folder itself (no lock file to leave behind);
    wait=False raises BlockingIOError when another process holds it. A wait is never silent
    where the caller says what it waits for (announce, printed when the lock is held)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                raise
            if announce:
                print(announce, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


@contextlib.contextmanager
def write_atomically(path, mode="wb"):
    """`with write_atomically(path) as f:` writes `path` whole or not at all: f is `path`.tmp,
    fsynced, then renamed over `path` (atomic within a filesystem), so a process killed at any
    moment leaves the old file or the new one. A failed write removes `path`.tmp and re-raises."""
    tmp_path = path + ".tmp"
    try:
        with open(tmp_path, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp_path)
        raise
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)  # the rename is durable once its folder is
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
