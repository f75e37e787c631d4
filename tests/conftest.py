"""Shared test setup: offline data, a prepared data folder, and running the scripts.

The scripts are run as subprocesses, as a user runs them, so exit codes, messages and
signals are the real ones.
"""
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import attention  # noqa: F401  (first: without a GPU it picks Triton's interpreter, before anything loads triton)
from data.shakespeare.prepare import use_shared_data

REPO = Path(__file__).resolve().parent.parent
# tests/exit_watchdog.py: a finished pytest process that does not exit names what holds it.
pytest_plugins = ["exit_watchdog"]

# The scripts' rule for offline data (see prepare.py): the variables CI sets, else shared/data
# beside the repo. Applied here too, for the tests that use tiktoken without prepare().
use_shared_data()

def share_the_cores_among_the_workers():
    """Under pytest-xdist, give each worker's torch, and the scripts it runs, an equal share of
    the cores (OMP_NUM_THREADS, unless already set). Each worker is busy with a test of its own
    all the time, so torch's default of a thread per core oversubscribes the cores: on 2
    cores, two train.py runs at once take 1.5x as long with 2 threads each as with 1."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, os.cpu_count() // workers)))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


share_the_cores_among_the_workers()


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """After each test, hand the caching allocator's free blocks back to the card: under xdist
    each worker otherwise keeps what its largest test took (up to 8.6 GB seen on an H100), and
    14 workers' caches fill an 80 GB card while a test of another worker needs memory."""
    yield
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def pytest_addoption(parser):
    parser.addoption("--impl", choices=("ours", "mine"), default="ours",
                     help="mine: run the repo's code with each function you have written in mine/ in place of ours "
                          "(docs/learn.md, Write it yourself)")


def pytest_configure(config):
    """--impl=mine swaps your functions in before any test is collected, so before any kernel
    compiles; xdist's workers configure themselves alike."""
    if config.getoption("impl") == "mine":
        import mine
        config.mine_swapped = mine.use_mine()


def pytest_report_header(config):
    if config.getoption("impl") == "mine":
        swapped = [f"{step.file.replace('.', '/')}.py {name}" for step, name in config.mine_swapped]
        return f"--impl=mine: yours in place of ours: {', '.join(swapped) or 'none yet'}"


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own hook, so its suffix, where it works, is seen
def pytest_collection_modifyitems(config, items):
    if getattr(config.option, "loadgroup", False):  # set on xdist's workers under --dist loadgroup
        tag_xdist_groups(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def default_run(keep):
    """Decorate a parametrized test whose grid checks the same code path many times: the default
    run (`pytest`) takes the cases keep(case) chooses (case.<name> is a parameter's value), a
    deterministic sample that still holds every mask, head dim class, backend and odd length the
    grid has; the rest are marked `full`, which `pytest -m full` runs (CI runs both)."""
    def decorate(test):
        test.default_run_keeps = keep
        return test
    return decorate


def in_default_run(test, **params):
    """Whether the default run checks test's case of these parameters."""
    keep = getattr(test, "default_run_keeps", None)
    return keep is None or keep(SimpleNamespace(**params))


def pytest_itemcollected(item):
    """Mark `full` the cases a default_run test leaves out, before -m selects (pytest.ini's
    addopts deselects them unless -m says otherwise)."""
    if hasattr(getattr(item, "function", None), "default_run_keeps"):
        if not in_default_run(item.function, **item.callspec.params):
            item.add_marker(pytest.mark.full)


def tag_xdist_groups(items):
    """Give each test marked xdist_group("name") the node id suffix "@name" that --dist loadgroup
    schedules by. pytest-xdist (3.8) writes it to item._nodeid, which pytest 9.2 no longer reads
    (it keeps a structured item._id), so without this the groups are silently ignored: a module
    fixture that trains or compiles runs once per worker that gets one of its tests
    (pytest-xdist issue #1386). Does nothing where xdist's own suffix took effect."""
    for item in items:
        names = sorted({mark.args[0] if mark.args else mark.kwargs.get("name", "default")
                        for mark in item.iter_markers("xdist_group")})
        if not names or item.nodeid.endswith("@" + "_".join(names)):
            continue
        nodeid = f"{item.nodeid}@{'_'.join(names)}"
        if hasattr(item, "_id"):
            item._id = type(item._id).parse(nodeid)
        else:
            item._nodeid = nodeid


def script_command(script, *args):
    return [sys.executable, str(REPO / script), *map(str, args)]


def run_script(script, *args, env=None, timeout=300):
    """Run a repo script to completion; returns the CompletedProcess (text output)."""
    return subprocess.run(script_command(script, *args), cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """TinyShakespeare prepared once for the whole session, outside the repo."""
    from data.shakespeare.prepare import prepare

    path = tmp_path_factory.mktemp("shakespeare")
    prepare(str(path))
    return path


@pytest.fixture
def tiny_args(data_dir, tmp_path):
    """train.py arguments for a quick tiny run in this test's own out_dir."""
    return ["configs/tiny.py", f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}", "--eval_iters=2"]


@pytest.fixture(scope="session")
def trained_out_dir(data_dir, tmp_path_factory):
    """A tiny model trained for 4 iterations with the sdpa backend (checkpoint at iter 4)."""
    out_dir = tmp_path_factory.mktemp("trained")
    result = run_script("train.py", "configs/tiny.py", f"--data_dir={data_dir}", f"--out_dir={out_dir}",
                        "--eval_iters=2", "--max_iters=4", "--eval_interval=2", "--attn=sdpa")
    assert result.returncode == 0, result.stderr
    return out_dir
