"""The write-it-yourself track (mine/; docs/learn.md, Write it yourself): each step's function
against the float64 reference, through the repo's own code path.

By default the repo's own functions run, and these tests hold them to what the track asks;
with `pytest --impl=mine` yours do (conftest.py swaps them in), and a step you have not written
fails, saying so. The last tests prove the track itself: the templates have the repo's
signatures, and in a copy of the repo the templates fail every step while the repo's functions,
put in their place, pass them all.
"""
import ast
import importlib
import inspect
import re
import shutil
import subprocess
import sys

import pytest
import torch
import triton

import mine
from attention import eager_attention_with_lse, tiled, triton_backward, triton_forward
from conftest import REPO, run_script
from test_attention import TOLERANCE, assert_all_close, check_backend, random_qkv, reference

TOL = TOLERANCE[torch.float32]


@pytest.fixture
def step(request):
    """Under --impl=mine, fail a step you have not written: ours would run in its place."""
    def check(file):
        if request.config.getoption("impl") == "mine":
            unwritten = [f"{name} in {file.replace('.', '/')}.py" for step in mine.STEPS if step.file == file
                         for name in step.functions if not mine.is_written(mine.yours(step, name))]
            if unwritten:
                pytest.fail(f"not written yet (its body raises NotImplementedError): {', '.join(unwritten)}")
    return check


# ---------------------------------------------------------------- step 1: online_softmax_update


def test_online_softmax_folds_tiles_into_the_softmax(step):
    """Three rows' scores in four tiles of five keys, folded one tile at a time: row 0 sees no key
    in its first tile, row 1's max grows in its last, row 2 never sees a key (O and l stay 0)."""
    step("mine.online_softmax")
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 20, generator=g, dtype=torch.float64) * 3
    s[0, :5] = float("-inf")
    s[1, 15] = 12.0
    s[2] = float("-inf")
    v = torch.randn(20, 8, generator=g, dtype=torch.float64)
    m_i, l_i, acc = torch.full((3,), float("-inf"), dtype=torch.float64), torch.zeros(3, dtype=torch.float64), \
        torch.zeros(3, 8, dtype=torch.float64)
    for start in range(0, 20, 5):
        m_i, l_i, acc = tiled.online_softmax_update(m_i, l_i, acc, s[:, start:start + 5], v[start:start + 5])
    seen = s[:2]
    assert_all_close([("m_i", m_i[:2], seen.amax(-1)), ("l_i", l_i[:2], (seen - seen.amax(-1, keepdim=True)).exp().sum(-1)),
                      ("acc / l_i", acc[:2] / l_i[:2, None], seen.softmax(-1) @ v)], 1e-12)
    assert m_i[2] == float("-inf") and l_i[2] == 0 and acc[2].eq(0).all(), "a row that sees no key: l_i = 0, acc = 0"


@pytest.mark.parametrize("shape_q,n_k,causal,window", [((1, 2, 100, 32), 257, True, (-1, -1)),
                                                       ((2, 3, 15, 16), 15, False, (-1, -1)),
                                                       ((1, 2, 100, 16), 20, False, (3, 2))])
def test_online_softmax_runs_the_tiled_backend(step, shape_q, n_k, causal, window):
    step("mine.online_softmax")
    q, k, v = random_qkv(shape_q, n_k, seed=n_k)
    check_backend("tiled", q, k, v, causal, TOL, window)


# ---------------------------------------------------------------- step 2: tiled_forward


@pytest.mark.parametrize("shape_q,n_k,h_kv,causal,window,tiles", [
    ((2, 3, 45, 16), 61, None, True, (-1, -1), (16, 32)),
    ((1, 4, 100, 32), 37, 2, False, (-1, -1), (32, 16)),
    ((2, 4, 70, 16), 70, 1, True, (20, 0), (16, 16)),
    ((1, 2, 100, 16), 20, None, False, (3, 2), (64, 64)),  # rows past the keys plus the window see none
    ((2, 100, 64), 17, None, False, (-1, -1), (64, 64)),   # (B, N, D), the article's
])
def test_tiled_forward_gives_o_and_lse(step, shape_q, n_k, h_kv, causal, window, tiles):
    step("mine.tiled_forward")
    q, k, v = (t.detach() for t in random_qkv(shape_q, n_k, h_kv, seed=sum(shape_q)))
    o, lse = tiled.tiled_forward(q, k, v, causal, window, *tiles)
    o_ref, lse_ref = eager_attention_with_lse(q.double(), k.double(), v.double(), causal, window)
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    assert_all_close([("tiled_forward O", o, o_ref), ("tiled_forward lse", lse, lse_ref)], TOL)


def test_tiled_forward_saves_what_the_backward_needs(step):
    """FlashAttentionPytorch's backward reads the lse your forward saved."""
    step("mine.tiled_forward")
    q, k, v = random_qkv((2, 4, 45, 16), 61, h_kv=2, seed=7)
    check_backend("tiled", q, k, v, True, TOL)


# ---------------------------------------------------------------- step 3: the forward kernel's key loop

# (q shape, N_k, kv heads, causal, window), each with tiles small enough that a program walks
# several key tiles of each run: through pointers and cp.async, or TMA descriptors as Hopper reads
# them (the interpreter runs those too).
CASES = [(((1, 2, 100, 32), 77, None, True, (-1, -1)), "cp.async"),
         (((2, 4, 45, 16), 61, 2, False, (-1, -1)), "TMA"),     # grouped-query heads, G = 2
         (((1, 2, 70, 16), 70, 1, False, (20, 5)), "cp.async"),  # a window, one kv head
         (((1, 2, 100, 16), 20, None, False, (3, 2)), "TMA")]    # rows that see no key
FORWARD_TILES = {"cp.async": triton.Config(dict(BLOCK_M=16, BLOCK_N=16, USE_TMA=False), num_warps=4, num_stages=2),
                 "TMA": triton.Config(dict(BLOCK_M=32, BLOCK_N=16, USE_TMA=True), num_warps=4, num_stages=2)}
# Both backward schedules: the split one (dQ by the repo's own programs) and the atomic one (dQ
# added by your loop).
BACKWARD_TILES = {"cp.async": triton_backward.split(16, 16, 16, 4, 2),
                  "TMA": triton_backward.split(32, 32, 16, 4, 2, tma=True),
                  "atomic dQ": triton_backward.atomic(16, 16, 4, 2)}
BACKWARD_CASES = CASES + [(case, "atomic dQ") for case, _ in CASES]


# ---------------------------------------------------------------- step 4: the backward kernel's dK/dV loop


@pytest.mark.parametrize("case,loads", BACKWARD_CASES)
def test_dkdv_loop_runs_the_backward_kernel(step, case, loads):
    """O and lse from the reference, so that only the backward is on trial; dQ is the repo's job
    under the split schedule and partly yours under the atomic one."""
    step("mine.dkdv_loop")
    shape_q, n_k, h_kv, causal, window = case
    q, k, v = random_qkv(shape_q, n_k, h_kv, seed=n_k)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = reference(q, k, v, causal, do, window)
    dq, dk, dv = triton_backward.flash_backward(q.detach(), k.detach(), v.detach(), o_ref.detach().float(), do,
                                                lse_ref.float(), causal, window, config=BACKWARD_TILES[loads])
    assert_all_close([("kernel dK", dk, dk_ref), ("kernel dV", dv, dv_ref), ("kernel dQ", dq, dq_ref)], TOL)


# ---------------------------------------------------------------- the track itself


def test_the_templates_take_the_repos_signatures():
    for step in mine.STEPS:
        ours = importlib.import_module(step.module)
        for name in step.functions:
            signature = lambda f: inspect.signature(getattr(f, "fn", f))
            assert signature(mine.yours(step, name)) == signature(getattr(ours, name)), f"{step.file}.{name}"


def with_the_repos_functions(template, step):
    """The template's text with each of step's functions replaced by the repo's source, its
    decorators included: its imports must be all that the repo's functions need."""
    lines = template.splitlines()
    nodes = {node.name: node for node in ast.parse(template).body if isinstance(node, ast.FunctionDef)}
    for name in sorted(step.functions, key=lambda n: nodes[n].lineno, reverse=True):  # bottom up: lines stay put
        node = nodes[name]
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        ours = getattr(importlib.import_module(step.module), name)
        lines[first - 1:node.end_lineno] = inspect.getsource(getattr(ours, "fn", ours)).splitlines()
    return "\n".join(lines) + "\n"


@pytest.fixture
def templates(request):
    """The tests of the track itself work on mine/ as the repo ships it: the templates."""
    if request.config.getoption("impl") == "mine" or mine.written():
        pytest.skip("tests the templates as the repo ships them: runs without --impl=mine and before you write")


def test_the_track_fails_on_the_templates_and_passes_on_the_repos_functions(tmp_path, templates):
    """CI's proof of the track: `pytest --impl=mine tests/test_mine.py` in a copy of the repo fails
    every step's test on the templates as shipped, and passes them all once the repo's functions
    are put in the templates' place (so the templates import all they need)."""
    copy = tmp_path / "repo"
    for part in ("attention", "data", "mine", "tests"):
        shutil.copytree(REPO / part, copy / part, ignore=shutil.ignore_patterns("__pycache__", "*.bin", "input.txt"))
    shutil.copy(REPO / "pytest.ini", copy)

    def run():  # every step's tests (the course's commands select one step each)
        out = subprocess.run([sys.executable, "-m", "pytest", "--impl=mine", "-n", "0", "-p", "no:cacheprovider",
                              "tests/test_mine.py", "-k", "online_softmax or tiled_forward or key_loop or dkdv_loop"],
                             cwd=copy, capture_output=True, text=True, timeout=900)
        counts = dict((kind, int(n)) for n, kind in re.findall(r"(\d+) (passed|failed)", out.stdout.splitlines()[-1]))
        return out, counts

    on_templates, counts = run()
    assert counts.get("failed", 0) >= 4 * len(mine.STEPS) and "passed" not in counts, on_templates.stdout[-3000:]
    assert on_templates.stdout.count("not written yet") >= counts["failed"], on_templates.stdout[-3000:]
    for step in mine.STEPS:
        path = copy / (step.file.replace(".", "/") + ".py")
        path.write_text(with_the_repos_functions(path.read_text(), step))
    solved, solved_counts = run()
    assert solved_counts == {"passed": counts["failed"]}, solved.stdout[-3000:]
    assert "yours in place of ours: mine/online_softmax.py online_softmax_update, mine/tiled_forward.py " \
           "tiled_forward, mine/key_loop.py online_softmax_update, mine/key_loop.py _key_tiles, " \
           "mine/dkdv_loop.py _dkdv_query_tiles" in solved.stdout, solved.stdout[:2000]


def test_bench_times_yours_beside_ours(tmp_path, templates):
    """`python bench.py --impl=mine` on the CPU, in a copy of the repo whose mine/ holds the repo's
    functions but a key loop that forgets to rescale: the rows labelled yours run yours (the
    forward's O is off, and only there), those labelled ours run ours."""
    copy = tmp_path / "repo"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.bin", "input.txt", "out*",
                                                               "bench-out", ".venv*"))
    for step in mine.STEPS:
        path = copy / (step.file.replace(".", "/") + ".py")
        path.write_text(with_the_repos_functions(path.read_text(), step).replace("acc * alpha[:, None])", "acc)"))
    ran = subprocess.run([sys.executable, "bench.py", "--impl=mine"], cwd=copy, capture_output=True, text=True,
                         timeout=900)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "yours: online_softmax_update (mine/online_softmax.py)" in ran.stdout and "(mine/key_loop.py)" in ran.stdout
    rows = {(label, who): {name: float(value) for name, value in re.findall(r"(O|dQ|dK|dV) ([0-9.e+-]+)", diff)}
            for label, who, diff in re.findall(r"^(.*?) +(yours|ours) .* from ours: (.*)$", ran.stdout, re.M)}
    assert len(rows) == 6 and all(value == 0 for (_, who), diff in rows.items() if who == "ours"
                                  for value in diff.values()), ran.stdout
    assert rows["tiled forward", "yours"] == {"O": 0.0}, ran.stdout  # steps 1 and 2 are the repo's own
    assert rows["Triton forward", "yours"]["O"] > 0.1 and rows["Triton forward+backward", "yours"]["O"] > 0.1, \
        ran.stdout


def test_bench_impl_mine_refuses_a_mode_in_one_line():
    ran = run_script("bench.py", "--impl=mine", "--mode=ladder", timeout=120)
    assert ran.returncode == 2 and ran.stderr.strip().splitlines() == [
        "config error: impl=mine times your functions at a shape of its own: it takes no mode (got 'ladder')"]
