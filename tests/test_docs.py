"""Every command the README and docs/ give works as written: each pytest selection selects at
least one test, each script exists and takes the --keys given (its --help lists them), each file
named on a command line exists, and where the README and the course give a bench.py command
(which needs a GPU) they mark it GPU. The docs are read, not run: a command that trains or
benchmarks is checked for what would fail at once, a typo."""
import re
import subprocess
import sys
from functools import cache

import pytest

from conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPTS = ("train.py", "sample.py", "compare.py", "bench.py")
# A command: in a ```bash block, one line; in prose, `python ...` or `pytest ...` in backticks.
INLINE = re.compile(r"`((?:[A-Z_0-9]+=\S+ )*(?:python|pytest) [^`]+)`")


def commands():
    """(doc, line text, command) for every command in the docs."""
    found = []
    for doc in DOCS:
        in_bash = False
        for line in doc.read_text().splitlines():
            if line.startswith("```"):
                in_bash = line.strip() == "```bash"
                continue
            if in_bash:
                command = line.split(" #")[0].strip()
                if re.match(r"(?:[A-Z_0-9]+=\S+ )*(?:python|pytest) ", command):
                    found.append((doc.name, line, command))
            else:
                found += [(doc.name, line, match) for match in INLINE.findall(line)]
    return found


COMMANDS = commands()


@cache
def help_text(script):
    out = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"python {script} --help failed: {out.stderr[-500:]}"
    return out.stdout


def words(command):
    """The command's words, environment settings and quotes taken off."""
    parts = re.findall(r"""'[^']*'|"[^"]*"|\S+""", command)
    parts = [p.strip("'\"") for p in parts]
    while parts and re.match(r"[A-Z_0-9]+=", parts[0]):
        parts.pop(0)
    return parts


def test_the_docs_give_commands():
    assert len(COMMANDS) > 20 and {doc for doc, _, _ in COMMANDS} >= {"README.md", "learn.md"}


def commands_of(program):
    chosen = [c for c in COMMANDS if words(c[2])[0] == program]
    return pytest.mark.parametrize("doc,line,command", chosen, ids=[f"{doc}: {command}" for doc, _, command in chosen])


@commands_of("python")
def test_script_commands_name_real_files_and_keys(doc, line, command):
    script, *args = words(command)[1:]
    assert (REPO / script).is_file(), f"{doc}: {script} does not exist"
    if script == "bench.py" and doc in ("README.md", "learn.md"):  # the other pages are all the H200's
        assert "GPU" in line, f"{doc}: bench.py needs a GPU, and `{command}` is not marked so"
    if script not in SCRIPTS:
        return
    usage = help_text(script) + (help_text("train.py") if script == "compare.py" else "")
    for arg in args:
        if arg.startswith("--") and arg != "--help":
            key = arg[2:].split("=")[0]
            assert f"--{key}=" in usage, f"{doc}: {script} takes no --{key} (`{command}`)"
        elif arg.endswith(".py"):
            assert (REPO / arg).is_file(), f"{doc}: no config file {arg} (`{command}`)"


@commands_of("pytest")
def test_pytest_commands_select_tests(doc, line, command):
    args = words(command)[1:]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    selected = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", out.stdout)
    assert out.returncode == 0 and selected and int(selected[1]) > 0, f"{doc}: `{command}` selects no test"


def test_the_tests_the_docs_name_exist():
    """docs/guarantees.md names each promise's test as file::test_name (tests/test_<file>.py),
    or ::test_name for another test of the file named just before."""
    found, missing, file = 0, [], None
    for match in re.finditer(r"(\w+)?::(test_\w+)", (REPO / "docs" / "guarantees.md").read_text()):
        file, found = match[1] or file, found + 1
        if f"def {match[2]}(" not in (REPO / "tests" / f"test_{file}.py").read_text():
            missing.append(f"{file}::{match[2]}")
    assert found > 30 and not missing, f"docs/guarantees.md names tests that do not exist: {missing}"
