"""A pytest plugin (tests/conftest.py loads it): once a pytest process, or an xdist worker, has
finished its session, its output goes out at once, and if it is still alive exit_timeout seconds
later (a thread that keeps it from exiting: a compile pool shutting down, a CUDA or wandb
thread), every thread's stack is dumped to stderr and the process exits with status 1. A hang
at exit names itself, and never holds open a pipe the run's log is read through.

    python -m pytest -o exit_timeout=10 ...     # the default is 60 s
"""
import faulthandler
import sys


def pytest_addoption(parser):
    parser.addini("exit_timeout", "seconds a finished pytest process may take to exit before its threads' stacks "
                  "are dumped and it exits with status 1", default="60")


def pytest_unconfigure(config):
    # pytest_unconfigure runs after the closing summary line is written; the controller's stdout
    # is a block-buffered pipe under `| tee`, which a process killed later would never flush.
    sys.stdout.flush()
    sys.stderr.flush()
    faulthandler.dump_traceback_later(float(config.getini("exit_timeout")), exit=True, file=sys.__stderr__)
