"""tests/exit_watchdog.py: a pytest process that hangs after its session (a thread that keeps it
alive) closes with pytest's own summary line, then names the hang and exits; `.ci/gpu tests`
reads its logs through `| tee`, which a process that never exits holds open."""
import os
import re
import subprocess
import sys

from conftest import REPO

HANGS_AT_EXIT = """import threading, time

def hang_at_exit():
    time.sleep(600)

def test_leaves_a_thread_running():
    threading.Thread(target=hang_at_exit).start()
"""


def test_a_pytest_process_that_hangs_at_exit_closes_with_its_summary_then_names_the_hang(tmp_path):
    (tmp_path / "test_hang.py").write_text(HANGS_AT_EXIT)
    env = dict(os.environ, PYTHONPATH=str(REPO / "tests"))
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "exit_watchdog", "-o", "exit_timeout=1",
                             "-p", "no:cacheprovider", "test_hang.py"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert re.fullmatch(r"=+ 1 passed in [\d.]+s =+", result.stdout.splitlines()[-1]), result.stdout
    assert result.returncode == 1
    assert "Timeout (0:00:01)!" in result.stderr and "in hang_at_exit" in result.stderr, result.stderr
