"""compare.py on the CPU: every backend trains configs/tiny.py (shrunk to batches of 2
sequences of 32 tokens, one batch an evaluation, so the Triton interpreter is quick), with
grouped-query attention (one kv head for its two query heads) and a sliding window of 8 keys;
the report and figure are written, and each backend's loss curves stay within LOSS_TOLERANCE of
eager's; --from_runs compares finished runs; bad arguments stop it first."""
import json
import math
import os
import struct

import pytest

from attention import BACKENDS
from conftest import REPO, run_script
from training.run_files import read_metrics

# One worker runs this module, so its module-scoped fixture runs once (see pytest.ini).
pytestmark = pytest.mark.xdist_group("compare")

# On the CPU in float32 the backends differ from eager by about 1e-6 after 8 steps (summation
# order); a backend that computes something else is off by 1e-2 or more within a step.
LOSS_TOLERANCE = 1e-4


def table_rows(markdown):
    """{first cell: [cells]} for the rows of the markdown tables in `markdown`."""
    rows = {}
    for line in markdown.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows.setdefault(cells[0], cells)
    return rows


def curve(out_dir, key):
    return {r["iter"]: r[key] for r in read_metrics(out_dir) if key in r}


@pytest.fixture(scope="module")
def comparison(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    result = run_script("compare.py", "configs/tiny.py", f"--data_dir={data_dir}", "--block_size=32", "--batch_size=2",
                        "--max_iters=8", "--eval_interval=4", "--eval_iters=1", "--n_kv_head=1", "--window=8",
                        f"--out={out}", timeout=600)
    assert result.returncode == 0, result.stderr
    return out, result


def png_size(path):
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG")
    return struct.unpack(">II", data[16:24])  # IHDR: width, height


def test_compare_trains_every_backend_and_writes_the_report_and_figure(comparison):
    out, result = comparison
    # On the CPU, four panels (12 x 9 inches at 120 dpi): no MFU or GPU memory to show, and the
    # figure and the report say why triton ranks last.
    assert png_size(out / "compare.png") == (1440, 1080)
    assert "run in Triton's interpreter (numpy): their step time and tokens/s are the interpreter's" in \
        (out / "compare.md").read_text()
    rows = table_rows((out / "compare.md").read_text())
    for backend in BACKENDS:
        cells = rows[backend]
        final_train, final_val, val_bpc, step_ms = (float(cells[i]) for i in (1, 2, 3, 4))
        assert 5 < final_val < 10 and 5 < final_train < 10 and step_ms > 0
        assert val_bpc == pytest.approx(final_val * 36_059 / 111_540 / math.log(2), abs=1e-3)  # val tokens / chars
        assert cells[8] == "n/a"  # peak GPU memory, on the CPU
        assert f"{backend}: 100%" in result.stderr and "8/8" in result.stderr  # its progress bar finished
        assert [r["iter"] for r in read_metrics(out / "runs" / backend) if "loss" in r] == list(range(1, 9))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "eager"])
def test_loss_curves_stay_within_tolerance_of_eager(comparison, backend):
    out, _ = comparison
    for key in ("loss", "train_loss", "val_loss"):
        eager, other = curve(out / "runs" / "eager", key), curve(out / "runs" / backend, key)
        assert other.keys() == eager.keys() and eager
        assert max(abs(other[i] - eager[i]) for i in eager) < LOSS_TOLERANCE, key
    cells = table_rows((out / "compare.md").read_text())[backend]
    assert float(cells[9]) < LOSS_TOLERANCE and float(cells[10]) < LOSS_TOLERANCE  # as compare.md reports it


def test_from_runs_compares_finished_runs(comparison, tmp_path):
    out, _ = comparison
    result = run_script("compare.py", f"--from_runs={out / 'runs' / 'eager'},{out / 'runs' / 'triton'}",
                        f"--out={tmp_path}")
    assert result.returncode == 0, result.stderr
    rows = table_rows((tmp_path / "compare.md").read_text())
    assert {"eager", "triton"} <= rows.keys() and "sdpa" not in rows
    assert rows["eager"][1:4] == table_rows((out / "compare.md").read_text())["eager"][1:4]
    assert (tmp_path / "compare.png").exists()


@pytest.mark.parametrize("args, message", [
    (["--backends=eager,flash"], "backends='eager,flash': expected distinct names from eager, tiled"),
    (["--attn=triton"], "--attn: compare.py sets it for each run; use --backends=..."),
    (["--lerning_rate=1e-3"], "unknown key --lerning_rate (did you mean 'learning_rate'?)"),
    (["--n_embd=36", "--n_head=2"], "attn='triton' with n_embd=36 and n_head=2: the head dim n_embd / n_head = 18"),
], ids=["backend", "attn", "train key", "triton head dim"])
def test_bad_arguments_stop_before_any_run(args, message, tmp_path):
    result = run_script("compare.py", "configs/tiny.py", f"--out={tmp_path / 'out'}", *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_backend_that_fails_midway_is_marked_and_the_others_still_run(data_dir, tmp_path):
    # The shim makes the sdpa run raise at its first optimizer step (tests/shims/failing_backend).
    shim = REPO / "tests" / "shims" / "failing_backend"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")]),
               FAILING_BACKEND="sdpa")
    result = run_script("compare.py", "configs/tiny.py", f"--data_dir={data_dir}", "--backends=sdpa,eager",
                        "--block_size=32", "--max_iters=2", "--eval_iters=1", f"--out={tmp_path}", env=env)
    assert result.returncode == 1
    assert "error: 1 of 2 runs failed (sdpa); the others were compared" in result.stderr
    rows = table_rows((tmp_path / "compare.md").read_text())
    assert rows["sdpa"][1] == "failed, exit status 1: RuntimeError: fake kernel failure in the first step"
    assert 5 < float(rows["eager"][2]) < 11  # eager ran after the failure, and is in the report
    assert (tmp_path / "compare.png").exists()


def fake_run(tmp_path, name, source, **changes):
    """A copy of a finished run's config.json and metrics.jsonl, with config keys changed."""
    folder = tmp_path / name
    folder.mkdir()
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    (folder / "metrics.jsonl").write_text((source / "metrics.jsonl").read_text())
    return folder


def test_from_runs_of_different_settings_names_the_differing_keys(trained_out_dir, tmp_path):
    one = fake_run(tmp_path, "one", trained_out_dir, attn="eager", gradient_accumulation_steps=1)
    two = fake_run(tmp_path, "two", trained_out_dir, attn="sdpa", gradient_accumulation_steps=2)
    result = run_script("compare.py", f"--from_runs={one},{two}", f"--out={tmp_path / 'report'}")
    assert result.returncode == 0, result.stderr
    assert "warning: the runs differ in gradient_accumulation_steps (1 in eager, 2 in sdpa)" in result.stderr
    report = (tmp_path / "report" / "compare.md").read_text()
    assert "not comparable step for step:** gradient_accumulation_steps (1 in eager, 2 in sdpa)." in report
    same = fake_run(tmp_path, "same", trained_out_dir, attn="eager")
    result = run_script("compare.py", f"--from_runs={same},{trained_out_dir}", f"--out={tmp_path / 'same-report'}")
    assert result.returncode == 0, result.stderr
    assert "differ" not in result.stderr
    assert "not comparable" not in (tmp_path / "same-report" / "compare.md").read_text()


def test_from_runs_with_a_corrupt_config_json_exits_2_in_one_line(trained_out_dir, tmp_path):
    run = fake_run(tmp_path, "run", trained_out_dir)
    (run / "config.json").write_text('{"attn": "eager", "n_la')
    result = run_script("compare.py", f"--from_runs={run}", f"--out={tmp_path / 'report'}")
    assert result.returncode == 2
    assert result.stderr.startswith(f"config error: from_runs: {run / 'config.json'} cannot be read (")
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "report").exists()


PROFILE = {"device": "cpu", "steps": 3, "step_ms": 12.5, "ms": {"attention forward": 1.0, "attention backward": 2.0,
           "matmuls": 3.0, "output layer + loss": 1.0, "optimizer": 0.5, "everything else": 1.0, "idle": 0.1}}


@pytest.mark.parametrize("fault, file, field", [
    (lambda run: edit_json(run / "config.json", attn=["eager"]), "config.json", "attn=['eager'], expected a string"),
    (lambda run: edit_json(run / "config.json", n_layer="2"), "config.json", "n_layer='2', expected an int"),
    (lambda run: edit_json(run / "config.json", gpu=3), "config.json", "gpu=3, expected a string or None"),
    (lambda run: edit_json(run / "metrics.jsonl", loss="low"), "metrics.jsonl", "a record with loss='low', expected a "
                                                                                 "number"),
    (lambda run: (run / "profile.json").write_text(json.dumps(PROFILE)[:50]), "profile.json",
     "cannot be read (JSONDecodeError: "),
    (lambda run: (run / "profile.json").write_text(json.dumps({**PROFILE, "ms": {"idle": 1.0}})), "profile.json",
     "is not a train.py profile: its ms lacks attention forward"),
], ids=["attn a list", "n_layer a string", "gpu a number", "loss a string", "profile truncated", "profile's ms"])
def test_from_runs_with_a_field_train_py_did_not_write_exits_2_naming_file_and_field(fault, file, field,
                                                                                    trained_out_dir, tmp_path, capsys):
    # Each was a traceback as the report was written (a TypeError, a ValueError, a JSONDecodeError).
    from compare import parse_args

    run = fake_run(tmp_path, "run", trained_out_dir)
    (run / "profile.json").write_text(json.dumps(PROFILE))
    parse_args([f"--from_runs={run}", f"--out={tmp_path / 'report'}"])  # the faithful copy passes
    fault(run)
    with pytest.raises(SystemExit) as exit_info:
        parse_args([f"--from_runs={run}", f"--out={tmp_path / 'report'}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: from_runs: {run / file} ") and field in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "report").exists()


def edit_json(path, **changes):
    """config.json with keys changed, or every record of metrics.jsonl that has them."""
    if path.suffix == ".json":
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    else:
        records = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**r, **{k: v for k, v in changes.items() if k in r}}) + "\n"
                                for r in records))


def test_only_curves_within_a_pixel_of_eager_are_merged_into_its_curve():
    from compare import Run, coinciding_runs

    def run(label, offset):
        records = [{"iter": i, "loss": 10.0 - i + offset} for i in range(1, 6)]
        return Run(label, "", {"attn": label}, records + [{"iter": 5, "train_loss": 5.0, "val_loss": 5.5 + offset}])

    eager, same, apart = run("eager", 0.0), run("sdpa", 1e-5), run("triton", 0.1)
    assert coinciding_runs([eager, same, apart], eager) == [same]
    assert coinciding_runs([same, apart], None) == []


@pytest.mark.parametrize("fault", ["no warmup", "binary", "empty"])
def test_from_runs_whose_metrics_train_py_did_not_write_exits_2_in_one_line(fault, trained_out_dir, tmp_path):
    run = fake_run(tmp_path, "run", trained_out_dir)
    metrics = run / "metrics.jsonl"
    if fault == "no warmup":
        lines = [json.loads(line) for line in metrics.read_text().splitlines()]
        metrics.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "warmup"}) + "\n" for r in lines))
    else:
        metrics.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe" if fault == "binary" else b"")
    result = run_script("compare.py", f"--from_runs={run}", f"--out={tmp_path / 'report'}")
    assert result.returncode == 2
    expected = {"no warmup": f"{metrics} has a record without warmup",
                "binary": f"{metrics} cannot be read as train.py's metrics (UnicodeDecodeError",
                "empty": f"{metrics} holds no log records"}[fault]
    assert result.stderr.startswith(f"config error: from_runs: {expected}"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "report").exists()


def test_an_out_that_is_a_file_exits_2_in_one_line(trained_out_dir, tmp_path):
    (tmp_path / "report").write_text("not a folder")
    result = run_script("compare.py", f"--from_runs={trained_out_dir}", f"--out={tmp_path / 'report'}")
    assert result.returncode == 2
    assert result.stderr == f"config error: out='{tmp_path / 'report'}' is a file; expected a folder (made if missing)\n"


@pytest.mark.parametrize("arg, message", [
    ("--block_sizes=256,big", "block_sizes='256,big': expected ints >= 1"),
    ("--backends=eager,flash", f"backends='eager,flash': unknown ['flash']; choose from {', '.join(BACKENDS)}"),
], ids=["block sizes", "backends"])
def test_bench_step_refuses_a_bad_list_at_once(arg, message):
    # Step time and memory against context length moved to bench.py --mode=step --block_sizes=...,
    # which needs a GPU to run but checks its settings before torch loads.
    result = run_script("bench.py", "--mode=step", arg)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr
