"""Every command the README and docs/ give works as written, and every exercise of the course
fails, or prints, as its chapter says.

A command is a line of a ```bash block, or `python ...` / `pytest ...` in backticks in prose (a
span may cross a line break); a ```python block is a program. A command that needs a CUDA card
says so: `*(GPU)*` right after it, or a `# GPU` comment in a bash block (every bench.py one).
- CPU commands run as written in one copy of the repo (less what .gitignore names; one a worker), each once,
  after the commands they need (PREREQUISITES), and must exit 0; the longest, whose paths default tests
  check, under `pytest -m full` (RUN_BY_FULL). A `pytest` selection
  is a part of the suite CI runs (`pytest`, the README's own command): here it must select tests.
- GPU commands name real files and keys here; the GPU test at the end runs those of the README
  and the course as written (`bash .ci/gpu course`), and every one has a stage in .ci/gpu.
- Each exercise is applied, as the course describes it, to a copy of the code and run.
- No number waits: the docs hold no *pending* marker and no "not measured".
"""
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache

import pytest

import test_attention
from conftest import REPO, in_default_run
from test_attention import SHAPES

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPTS = ("train.py", "sample.py", "compare.py", "bench.py")
COMMAND = r"(?:[A-Z_0-9]+=\S+ )*(?:python|pytest)\b"
INLINE = re.compile(rf"`({COMMAND} [^`]+)`(\s*\*\(GPU\)\*)?")
CI_GPU = (REPO / ".ci" / "gpu").read_text()


@dataclass(frozen=True)
class Command:
    doc: str
    text: str  # as written
    gpu: bool
    program: bool = False  # a ```python block: run as `python` reading it

    def __str__(self):
        return f"{self.doc}: {self.text if not self.program else 'python <<' + self.text.splitlines()[0] + ' ...'}"


def read_commands():
    found = []
    for doc in DOCS:
        block, prose = None, []
        for line in doc.read_text().splitlines() + [""]:
            if line.startswith("```"):
                if block is None:
                    block = (line[3:].strip(), [])
                    continue
                kind, lines = block
                if kind == "python":
                    found.append(Command(doc.name, "\n".join(lines) + "\n", gpu=False, program=True))
                block = None
            elif block is not None:
                block[1].append(line)
                if block[0] == "bash" and re.match(COMMAND, line):
                    command, _, comment = line.partition(" #")
                    found.append(Command(doc.name, command.strip(), gpu=comment.strip().startswith("GPU")))
            elif line.strip():
                prose.append(line.strip())
            else:  # a paragraph ends: its commands, which may cross its line breaks
                for text, mark in INLINE.findall(" ".join(prose)):
                    found.append(Command(doc.name, text, gpu=bool(mark)))
                prose = []
    return found


COMMANDS = read_commands()
# The commands a CPU command needs run first, in the same copy.
PREREQUISITES = {"python sample.py --out_dir=out-tiny --start=FILE:data/shakespeare/prompt.txt":
                 ["python train.py configs/tiny.py"]}


def words(command):
    """The command's words, environment settings and quotes taken off."""
    parts = [p.strip("'\"") for p in re.findall(r"""'[^']*'|"[^"]*"|\S+""", command)]
    while parts and re.match(r"[A-Z_0-9]+=", parts[0]):
        parts.pop(0)
    return parts


# A command and those it needs go to one xdist worker, whose one copy of the repo runs each once.
NEEDED_TOGETHER = {text for command, needed in PREREQUISITES.items() for text in (command, *needed)}


def commands_where(keep, once=False, full=(), group=None):
    """Parametrize over the commands `keep` takes, each text once (the first doc's) if `once`;
    those whose text is in `full` marked full (`pytest -m full` runs them); all of them on one
    xdist worker if `group` names one."""
    chosen = sorted({c for c in COMMANDS if keep(c)}, key=str)
    if once:
        chosen = list({c.text: c for c in reversed(chosen)}.values())[::-1]
    return pytest.mark.parametrize("command", [pytest.param(c, id=str(c), marks=(
        [pytest.mark.xdist_group(group)] if group else
        [pytest.mark.xdist_group("prerequisites")] if c.text in NEEDED_TOGETHER else []) + (
        [pytest.mark.full] if c.text in full else [])) for c in chosen])


@cache
def help_text(script):
    out = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"python {script} --help failed: {out.stderr[-500:]}"
    return out.stdout


def copy_of_the_repo(to):
    """The repo's files without what .gitignore names (runs, data, caches) or git's own: what a
    clone with your edits has. (By name: a .gitignore path is taken as its last part.)"""
    ignored = [line.strip().strip("/").split("/")[-1] for line in (REPO / ".gitignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    shutil.copytree(REPO, to, ignore=shutil.ignore_patterns(".git", *ignored), dirs_exist_ok=True)
    return to


def shell(command, cwd, timeout=900, stdin=None):
    """Run a doc's command through bash in cwd, with this Python first on PATH, as a user who
    set up the README's environment would; TRITON_INTERPRET left for the scripts to choose."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, input=stdin, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def repo_copy(tmp_path_factory):
    """The one copy of the repo (per xdist worker) that the docs' commands run in, in turn: the
    first that trains prepares the data there, once. An exercise edits a copy of its own."""
    return copy_of_the_repo(tmp_path_factory.mktemp("repo"))


RAN = {}  # (copy, command text, stdin) -> its CompletedProcess


def run_once(text, cwd, timeout, stdin=None):
    """A command as shell() runs it, once per copy: a prerequisite another command also needs
    (or that is a command of its own) is not run again, nor is its run replaced."""
    if (cwd, text, stdin) not in RAN:
        RAN[cwd, text, stdin] = shell(text, cwd, timeout, stdin)
    return RAN[cwd, text, stdin]


def run_doc_command(command, cwd, timeout=900):
    for needed in PREREQUISITES.get(command.text, []):
        ran = run_once(needed, cwd, timeout)
        assert ran.returncode == 0, f"`{needed}` (needed by `{command.text}`) failed: {ran.stderr[-2000:]}"
    return run_once("python", cwd, timeout, stdin=command.text) if command.program else run_once(command.text, cwd,
                                                                                                  timeout)


# ---------------------------------------------------------------- reading the commands


def test_the_docs_give_commands():
    assert len(COMMANDS) > 20 and {c.doc for c in COMMANDS} >= {"README.md", "learn.md"}
    assert set(RUN_BY_FULL) <= {c.text for c in COMMANDS}, "RUN_BY_FULL names a command the docs no longer give"


@commands_where(lambda c: not c.program and words(c.text)[0] == "python")
def test_script_commands_name_real_files_and_keys(command):
    script, *args = words(command.text)[1:]
    assert (REPO / script).is_file(), f"{command.doc}: {script} does not exist"
    if script not in SCRIPTS:
        return
    usage = help_text(script) + (help_text("train.py") if script == "compare.py" else "")
    for arg in args:
        if arg.startswith("--") and arg != "--help":
            key = arg[2:].split("=")[0]
            assert f"--{key}=" in usage, f"{command.doc}: {script} takes no --{key} (`{command.text}`)"
        elif arg.endswith(".py"):
            assert (REPO / arg).is_file(), f"{command.doc}: no config file {arg} (`{command.text}`)"


PYTEST_COMMANDS = sorted({c.text for c in COMMANDS if not c.program and words(c.text)[0] == "pytest"
                          and len(words(c.text)) > 1})


@cache
def collected():
    """{command text: (exit status, pytest's collection summary)} for the docs' pytest commands,
    collected one after another in one process (a process each would import torch each time)."""
    code = ("import json, sys, pytest\n"
            "for args in json.loads(sys.argv[1]):\n"
            "    print('=== collecting', flush=True)\n"
            "    status = pytest.main(['--collect-only', '-q', '-n', '0', '-p', 'no:cacheprovider', *args])\n"
            "    print('=== exit', int(status), flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code, json.dumps([words(text)[1:] for text in PYTEST_COMMANDS])],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    runs = re.findall(r"^=== collecting\n(.*?)^=== exit (\d+)$", out.stdout, re.M | re.S)
    assert len(runs) == len(PYTEST_COMMANDS), out.stdout[-2000:] + out.stderr[-2000:]
    return {text: (int(status), output) for text, (output, status) in zip(PYTEST_COMMANDS, runs)}


@commands_where(lambda c: c.text in PYTEST_COMMANDS, group="collected")  # one worker collects them all, once
def test_pytest_commands_select_tests(command):
    status, output = collected()[command.text]
    selected = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", output)
    assert status == 0 and selected and int(selected[1]) > 0, f"{command}: selects no test"


def test_the_readmes_pytest_is_what_ci_runs():
    """The bare `pytest` the README gives is the default run, and `pytest -m full` the rest of
    the exhaustive grids: the last two commands .ci/run runs."""
    assert {Command("README.md", text, gpu=False) for text in ("pytest", "pytest -m full")} <= set(COMMANDS)
    assert (REPO / ".ci" / "run").read_text().strip().splitlines()[-2:] == ["pytest", "pytest -m full"]


def test_bench_commands_are_marked_gpu():
    unmarked = [str(c) for c in COMMANDS if "bench.py" in c.text and not c.gpu]
    assert not unmarked, f"bench.py needs a CUDA card; mark these *(GPU)*: {unmarked}"


@commands_where(lambda c: c.gpu)
def test_every_gpu_command_has_a_stage_in_ci_gpu(command):
    """.ci/gpu runs each GPU command's script and mode (or grid) in some stage, and runs the
    README's and the course's GPU commands as written in its `course` stage."""
    script, *args = words(command.text)[1:]
    assert f"python {script}" in CI_GPU, f"{command}: no stage of .ci/gpu runs {script}"
    for arg in args:
        if arg.startswith(("--mode=", "--grid=")):
            assert arg in CI_GPU, f"{command}: no stage of .ci/gpu runs {script} {arg}"
    assert re.search(r"course\).*tests/test_docs\.py", CI_GPU), ".ci/gpu has no course stage running tests/test_docs.py"


def test_no_number_is_pending():
    waiting = [(doc.name, line.strip()) for doc in DOCS for line in doc.read_text().splitlines()
               if re.search(r"\*pending|pending `bash|not measured", line, re.I)]
    assert not waiting, f"numbers the docs still wait for: {waiting}"


def test_the_tests_the_docs_name_exist():
    """docs/guarantees.md names each promise's test as file::test_name (tests/test_<file>.py),
    or ::test_name for another test of the file named just before."""
    found, missing, file = 0, [], None
    for match in re.finditer(r"(\w+)?::(test_\w+)", (REPO / "docs" / "guarantees.md").read_text()):
        file, found = match[1] or file, found + 1
        if f"def {match[2]}(" not in (REPO / "tests" / f"test_{file}.py").read_text():
            missing.append(f"{file}::{match[2]}")
    assert found > 30 and not missing, f"docs/guarantees.md names tests that do not exist: {missing}"


# ---------------------------------------------------------------- the exercises


def chapter(number, raw=False):
    """Chapter `number` of the course; its words one space apart unless raw."""
    text = re.search(rf"^## {number}\. .*?(?=^## |\Z)", (REPO / "docs" / "learn.md").read_text(), re.M | re.S)[0]
    return text if raw else " ".join(text.split())


def learn_command(start):
    """The one course command that starts so (given in one chapter or several)."""
    found = {c.text: c for c in COMMANDS if c.doc == "learn.md" and c.text.startswith(start)}
    assert len(found) == 1, f"learn.md gives {len(found)} commands starting {start!r}"
    return found.popitem()[1]


@dataclass
class Exercise:
    chapter: int
    edits: list = field(default_factory=list)  # (file, old, new): each old occurs once
    quotes: tuple = ()  # how the chapter words the edit

    def apply(self, to):
        text = chapter(self.chapter)
        for quote in self.quotes:
            assert quote in text, f"chapter {self.chapter} no longer says {quote!r}: update the exercise here"
        copy = copy_of_the_repo(to)
        for file, old, new in self.edits:
            source = (copy / file).read_text()
            assert source.count(old) == 1, f"{file}: the exercise's edit no longer applies ({old!r})"
            (copy / file).write_text(source.replace(old, new))
        return copy


def pytest_in(copy, command, timeout=900):
    """A chapter's pytest command in the copy, in one process (the suite's workers are busy)."""
    return shell(f"{command.text} -n 0 -p no:cacheprovider", copy, timeout)


def failed_ids(result):
    return {line.split("::")[1].split(" ")[0] for line in result.stdout.splitlines() if line.startswith("FAILED ")}


def errors_of(result, what):
    return [float(e) for e in re.findall(rf"{what}: max abs error ([0-9.e+-]+)", result.stdout)]


def test_chapter_1_the_articles_tiles_and_its_o_l_unpacking(repo_copy):
    program, = [c for c in COMMANDS if c.program and c.doc == "learn.md" and "16, 16" in c.text]
    assert program.text in chapter(1, raw=True)
    ran = run_doc_command(program, repo_copy)
    assert ran.returncode == 0, ran.stderr[-2000:]
    difference, shapes = ran.stdout.splitlines()
    assert float(difference) < 1e-6 and shapes == "(100, 64) (100, 64)"


def test_chapter_5_quotes_the_kernels_source():
    """The port of the article's Q_block_ptr, and where its cast of P sits, are the kernels' own
    lines (whitespace aside)."""
    source = " ".join(" ".join((REPO / "attention" / f).read_text().split()) for f in ("triton_forward.py",
                                                                                         "triton_tiles.py"))
    ours = re.search(r"```\n# the article\n.*?\n# here.*?\n(.*?)```", chapter(5, raw=True), re.S)[1]
    statements = re.sub(r"\n\s+", " ", re.sub(r"^#.*\n", "", ours, flags=re.M)).splitlines()
    assert len(statements) == 3 and all(" ".join(s.split()) in source for s in statements), statements
    assert "`tl.dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None])`" in chapter(5) and \
        "tl.dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None])" in source


def test_chapter_2_without_the_rescale_every_shape_of_several_key_tiles_fails(tmp_path):
    copy = Exercise(2, [("attention/tiled.py", "alpha[..., None] * acc + pv", "acc + pv")],
                    ("`alpha[..., None] * acc`", "becomes `acc`", "(64 keys)", "0.5 or more")).apply(tmp_path)
    ran = pytest_in(copy, learn_command('pytest tests/test_attention.py -k "tiled and reference"'))
    several_tiles = {f"tiled-shape_q{i}-{n_k}-{causal}" for i, (_, n_k) in enumerate(SHAPES) if n_k > 64
                     for causal in (False, True)}
    assert {test.split("[")[1].rstrip("]") for test in failed_ids(ran)} == several_tiles, ran.stdout[-3000:]
    assert min(errors_of(ran, "tiled O")) >= 0.5


def test_chapter_3_without_tile_skipping_the_masks_still_hold_and_nothing_is_skipped(tmp_path):
    original = shell(f"python docs/figures/causal_tiles.py --out={tmp_path / 'before.png'}", REPO)
    copy = Exercise(3, [("attention/masks.py", "    _, n_k, left, right = mask\n    q_last = q_start + tile_m - 1\n",
                         "    return 0, 0, 0, mask[1]\n    _, n_k, left, right = mask\n    q_last = q_start + tile_m - 1\n")],
                    ("`return 0, 0, 0, mask[1]`", "`test_the_kernels_bounds_are_their_twins`", "0 skipped",
                     "25 of 66 causal and 34 windowed")).apply(tmp_path / "copy")
    assert pytest_in(copy, learn_command('pytest tests/test_attention.py -k "tiled and reference"')).returncode == 0
    bounds = shell("pytest tests/test_tiled.py -k bounds -x -n 0 -p no:cacheprovider", copy)
    assert failed_ids(bounds) and all(t.startswith("test_the_kernels_bounds_are_their_twins") for t in failed_ids(bounds))
    edited = shell("python docs/figures/causal_tiles.py", copy)
    forward = [line for line in edited.stdout.splitlines() if "forward" in line]
    before = [line for line in original.stdout.splitlines() if "forward" in line]
    assert len(forward) == 2 and all(line.endswith("0 full,  66 masked,   0 skipped") for line in forward), forward
    assert before[0].endswith(" 25 skipped") and before[1].endswith(" 34 skipped"), before


def test_chapter_5_without_the_guard_a_row_that_sees_no_key_is_nan(tmp_path):
    copy = Exercise(5, [("attention/triton_forward.py", 'm_shift = tl.where(m_new == float("-inf"), 0.0, m_new)',
                         "m_shift = m_new")], ("`m_shift = m_new`", "NaN")).apply(tmp_path)
    ran = pytest_in(copy, learn_command('pytest tests/test_attention.py -k "triton and rows_that_see_no_key"'))
    assert failed_ids(ran) == {"test_rows_that_see_no_key_give_zeros[triton]",
                               "test_rows_that_see_no_key_give_zeros[triton_fwd]"}, ran.stdout[-3000:]
    assert "triton O: NaN" in ran.stdout


def test_chapter_6_without_delta_dq_and_dk_fail_and_dv_stays_right(tmp_path):
    copy = Exercise(6, [("attention/tiled_backward.py", "ds = p * (dp - delta[..., q_start:q_end, None])", "ds = p * dp"),
                        ("attention/tiled_backward.py", "ds_t = p_t * (dp_t - delta[..., None, q_start:q_end])",
                         "ds_t = p_t * dp_t")],
                    ("`ds = p * dp`", "`ds_t = p_t * dp_t`", "dQ and dK in every case")).apply(tmp_path)
    ran = pytest_in(copy, learn_command("pytest tests/test_tiled.py -k tiled_backward"))
    messages = [line for line in ran.stdout.splitlines() if line.startswith("E   ") and "max abs error" in line]
    # Every case fails (the default run's sample of the grid; -m full, every case): the one test
    # that passes is test_tiled_uses_the_tiled_backward, which runs no case.
    assert len(failed_ids(ran)) > 10 and f"{len(failed_ids(ran))} failed, 1 passed" in ran.stdout.splitlines()[-1], \
        ran.stdout[-3000:]
    assert len(messages) == len(failed_ids(ran)), ran.stdout[-3000:]
    assert all("dQ: max" in m and "dK: max" in m and re.search(r"right within 1e-04: (O, )?dV$", m) for m in messages)


def test_chapter_7_a_kv_head_that_sums_one_query_head_fails_dk_and_dv_where_g_exceeds_1(tmp_path):
    copy = Exercise(7, [("attention/triton_backward.py", "    for g in range(GROUP):", "    for g in range(1):")],
                    ("`for g in range(1)`", "only where G > 1")).apply(tmp_path)
    ran = pytest_in(copy, learn_command('pytest tests/test_attention.py -k "triton and (grouped or head_dims)"'))
    grouped = {f"test_grouped_query_heads[triton-{h}-{h_kv}-{c}]" for h, h_kv in test_attention.GROUPS if h > h_kv
               for c in (False, True) if in_default_run(test_attention.test_grouped_query_heads, backend="triton",
                                                        heads=h, kv_heads=h_kv, is_causal=c)}
    # and the model's fused projection with 2 kv heads for 4, checked as one d(qkv)
    assert failed_ids(ran) == grouped | {"test_strided_views_of_a_fused_grouped_projection[triton]"}, ran.stdout[-3000:]
    messages = [line for line in ran.stdout.splitlines() if line.startswith("E   ") and "triton dK: max" in line]
    # The interpreter runs the atomic schedule, whose dK/dV loop adds dQ too: dQ fails with them.
    assert len(grouped) >= 3 and len(messages) == len(grouped)
    assert all(m.endswith("right within 1e-04: triton O") and "triton dV: max" in m and "triton dQ: max" in m
               for m in messages)


def test_chapter_8_eager_and_tiled_train_to_the_same_losses(repo_copy):
    eager, tiled = (learn_command(f"python train.py configs/tiny.py --max_iters=50 --attn={b}") for b in ("eager", "tiled"))
    # The first again (--overwrite=True lets it): run as written each time, not once.
    runs = [shell(c.text, repo_copy) for c in (eager, tiled, eager)]
    assert all(run.returncode == 0 for run in runs), [run.stderr[-2000:] for run in runs]
    losses = []
    for out_dir in ("out-eager", "out-tiled"):
        records = [json.loads(line) for line in (repo_copy / out_dir / "metrics.jsonl").read_text().splitlines()]
        losses.append([r.get("loss", r.get("val_loss")) for r in records])
    assert len(losses[0]) == len(losses[1]) > 5
    assert max(abs(a - b) for a, b in zip(*losses)) < 1e-5
    printed = [[float(loss) for loss in re.findall(r"^iter \d+: loss ([0-9.]+)", run.stdout, re.M)] for run in runs[:2]]
    assert len(printed[0]) == len(printed[1]) > 5 and all(abs(a - b) < 1.5e-4 for a, b in zip(*printed))


def test_chapter_10_a_config_too_big_for_some_head_dims_is_pruned_and_its_shared_memory_printed(tmp_path):
    config = "triton.Config(dict(BLOCK_M=128, BLOCK_N=128, USE_TMA=False), num_warps=8, num_stages=3),"
    first = '    ("consumer card", 64): [\n'
    copy = Exercise(10, [("attention/triton_forward.py", first, f"{first}        {config}\n")],
                    (f"`{config}`", 'first in `FORWARD_CONFIGS["consumer card", 64]`', "81,920 bytes at head dim 64 in bf16",
                     "101,376")).apply(tmp_path)
    ran = pytest_in(copy, learn_command('pytest tests/test_attention.py -k "consumer or hopper_keeps or short_sequences"'))
    assert ran.returncode == 0, ran.stdout[-3000:]
    # The script goes on to compile every kernel (minutes; test_triton_configs runs all of it): its first line will do.
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    with subprocess.Popen([sys.executable, *words(learn_command("python tests/test_triton_configs.py").text)[1:]],
                          cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as script:
        first = json.loads(script.stdout.readline())
        script.kill()
    assert first["config"].startswith("BLOCK_M: 128, BLOCK_N: 128, USE_TMA: False, num_warps: 8")
    assert (first["target"], first["element_type"], first["head_dim"], first["shared"], first["limit"]) == \
        ("sm_89", "bf16", 64, 81920, 101376)


def test_chapter_6_the_4x4_check_agrees_with_autograd(tmp_path):
    program, = [c for c in COMMANDS if c.program and c.doc == "learn.md" and "rowsum(dO O)" in c.text]
    assert program.text in chapter(6, raw=True)
    ran = run_doc_command(program, tmp_path)
    assert ran.returncode == 0, ran.stderr[-2000:]
    printed = dict(line.split() for line in ran.stdout.splitlines())
    assert set(printed) == {"dQ", "dK", "dV"} and all(float(v) < 1e-15 for v in printed.values()), ran.stdout


def test_chapter_11_a_merge_that_forgets_the_rescaling_fails_wherever_two_splits_see_keys(tmp_path):
    from test_decode import SPLIT_SHAPES, SPLIT_TILE
    from attention.triton_decode import split_rows
    copy = Exercise(11, [("attention/decode.py", "    weights = torch.exp(lse_split - lse_max)\n",
                          '    weights = (lse_split > float("-inf")).to(lse_split.dtype)\n')],
                    ('`weights = (lse_split > float("-inf")).to(lse_split.dtype)`', "wherever two splits see keys",
                     "at `pos` 0")).apply(tmp_path)
    ran = pytest_in(copy, learn_command('pytest tests/test_decode.py -k "split_kv_decode_matches and tiled"'))

    def splits_that_see_keys(S, pos, left, n_splits):
        rows, first = split_rows(S, n_splits, SPLIT_TILE), 0 if left < 0 else max(0, pos - left)
        return sum(start <= pos and start + rows > first for start in range(0, n_splits * rows, rows))
    expected = {f"test_split_kv_decode_matches_float64_at_every_split_count[{B}-{H}-{H_kv}-{S}-{D}-{pos}-{left}-"
                f"{n}-dtype{d}-tiled]" for B, H, H_kv, S, D, pos, left in SPLIT_SHAPES for n in (1, 2, 3, 7)
                for d in (0, 1) if splits_that_see_keys(S, pos, left, n) > 1}
    assert expected and failed_ids(ran) == expected, ran.stdout[-3000:]


# ---------------------------------------------------------------- the other commands, run

# Commands an exercise above runs (or tests/test_triton_configs.py's fixture, in full).
RUN_ABOVE = {"python train.py configs/tiny.py --max_iters=50 --attn=eager --out_dir=out-eager --overwrite=True",
             "python train.py configs/tiny.py --max_iters=50 --attn=tiled --out_dir=out-tiled --overwrite=True",
             "python tests/test_triton_configs.py", "python docs/figures/causal_tiles.py"}


# Commands whose run as written repeats, at length, a path a test of the default run checks (named
# here): `pytest -m full` runs them as written (CI runs both); the default run checks their files
# and keys (test_script_commands_name_real_files_and_keys).
RUN_BY_FULL = {
    "python compare.py configs/tiny.py --max_iters=5 --eval_iters=2":  # every backend trained, 5 iters each
        "test_compare.py::test_compare_trains_every_backend_and_writes_the_report_and_figure",
    "python compare.py configs/tiny.py --backends=eager,tiled --max_iters=20":
        "test_compare.py::test_compare_trains_every_backend_and_writes_the_report_and_figure",
    "python train.py configs/tiny.py --attn=triton --max_iters=5 --eval_iters=1 --out_dir=out-triton --overwrite=True":
        "test_compare.py's comparison, whose triton run is train.py --attn=triton",
    "python sample.py --benchmark=True --init_from=random --n_kv_head=3 --attn=sdpa --max_new_tokens=64":
        "test_kv_cache.py::test_sample_benchmark_of_grouped_heads_times_one_kv_head_per_query_head_beside_it",
    "python train.py configs/tiny.py":  # 100 iterations
        "test_train.py::test_tiny_config_loss_falls_and_metrics_have_the_documented_keys",
    "python sample.py --out_dir=out-tiny --start=FILE:data/shakespeare/prompt.txt":  # after the 100 iterations
        "test_train.py::test_sample_prints_text_from_the_checkpoint",
    "python sample.py --init_from=random":  # 10 samples of 500 tokens from the default run's model
        "test_kv_cache.py::test_sample_benchmark_of_a_random_model_of_the_gpu_run_shape",
}


@commands_where(lambda c: not c.gpu and not c.program and words(c.text)[0] == "python" and c.text not in RUN_ABOVE,
                once=True, full=RUN_BY_FULL)
def test_cpu_command_runs_as_written(command, repo_copy):
    ran = run_doc_command(command, repo_copy)
    assert ran.returncode == 0, f"`{command.text}` exited {ran.returncode}: {ran.stderr[-3000:]}"


@pytest.mark.gpu
@commands_where(lambda c: c.gpu and c.doc in ("README.md", "learn.md"), once=True)
def test_gpu_command_runs_as_written(command, repo_copy):
    ran = run_doc_command(command, repo_copy, timeout=3600)
    assert ran.returncode == 0, f"`{command.text}` exited {ran.returncode}: {ran.stderr[-3000:]}"
