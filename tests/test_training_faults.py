"""Training faults (issue 7): NaN losses, signals, SIGKILL mid-write, bad checkpoints, bad data.

Every test runs train.py as a real subprocess; the signal tests send real signals.
docs/guarantees.md lists the guarantee each test checks.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from checkpoint import load_checkpoint
from conftest import REPO, run_script, script_command
from devices import EXIT_OUT_OF_MEMORY


def start_train(args, log_dir):
    """train.py in the background, its output going to files (a pipe nobody reads can fill up)."""
    with open(log_dir / "stdout.txt", "w") as stdout, open(log_dir / "stderr.txt", "w") as stderr:
        return subprocess.Popen(script_command("train.py", *args), cwd=REPO, stdout=stdout, stderr=stderr)


def wait_until(condition, process, timeout=120, poll=0.005):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"train.py exited early with {process.returncode}"
        assert time.monotonic() < deadline, "timed out waiting for train.py"
        time.sleep(poll)


def step_losses(out_dir):
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    losses = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line being written right now
            continue
        if "loss" in record:
            losses[record["iter"]] = record["loss"]
    return losses


def interrupt(signum, tiny_args, tmp_path):
    """Start a long run, send `signum` once it has logged two iterations, return (exit code, out_dir)."""
    out_dir = tmp_path / "out"
    # Dropout, so that the saved torch RNG state matters for the losses after a resume.
    args = [*tiny_args, "--max_iters=100000", "--eval_interval=100000", "--log_interval=1", "--dropout=0.1"]
    process = start_train(args, tmp_path)
    wait_until(lambda: len(step_losses(out_dir)) >= 2, process)
    process.send_signal(signum)
    return process.wait(timeout=120), out_dir


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_saves_a_checkpoint_at_the_current_iteration_and_exits_128_plus_signum(signum, tiny_args, tmp_path):
    returncode, out_dir = interrupt(signum, tiny_args, tmp_path)
    assert returncode == 128 + signum
    stopped_at = load_checkpoint(str(out_dir))["iter"]
    assert stopped_at == max(step_losses(out_dir))  # the last iteration it finished
    stdout = (tmp_path / "stdout.txt").read_text()
    assert f"stopped by {signum.name} at iter {stopped_at}" in stdout and "--init_from=resume" in stdout
    assert "Traceback" not in (tmp_path / "stderr.txt").read_text()


def test_resume_after_an_interruption_reproduces_the_uninterrupted_losses(tiny_args, tmp_path):
    returncode, out_dir = interrupt(signal.SIGTERM, tiny_args, tmp_path)
    assert returncode == 128 + signal.SIGTERM
    stopped_at = load_checkpoint(str(out_dir))["iter"]
    common = [*tiny_args, "--eval_interval=100000", "--log_interval=1", "--dropout=0.1",
              f"--max_iters={stopped_at + 3}"]
    resumed = run_script("train.py", *common, "--init_from=resume")
    assert resumed.returncode == 0, resumed.stderr
    straight = run_script("train.py", *common, f"--out_dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr
    expected = step_losses(tmp_path / "straight")
    assert sorted(expected) == list(range(1, stopped_at + 4))
    assert step_losses(out_dir) == expected


def test_sigkill_during_checkpoint_writes_leaves_a_loadable_checkpoint(tiny_args, tmp_path):
    out_dir = tmp_path / "out"
    ckpt, partial = out_dir / "ckpt.pt", out_dir / "ckpt.pt.tmp"
    # A checkpoint every iteration, so writes take a good share of the run.
    args = [*tiny_args, "--max_iters=100000", "--eval_interval=1", "--eval_iters=1", "--log_interval=1"]
    saved_iters, killed_mid_write = [], 0
    for round_ in range(3):
        process = start_train(args + (["--init_from=resume"] if round_ else []), tmp_path)
        # Wait for this process to complete one save of its own, then kill it while it
        # writes the next one (the temporary file exists only during a write).
        previous = ckpt.stat().st_mtime_ns if ckpt.exists() else None
        wait_until(lambda: ckpt.exists() and ckpt.stat().st_mtime_ns != previous, process)
        wait_until(partial.exists, process, poll=0.0005)
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=60) == -signal.SIGKILL
        killed_mid_write += partial.exists()
        saved_iters.append(load_checkpoint(str(out_dir))["iter"])  # loads: not torn
    assert killed_mid_write >= 1  # at least one kill landed inside a write
    assert saved_iters == sorted(saved_iters) and saved_iters[0] >= 1
    final = run_script("train.py", *tiny_args, "--eval_interval=1", "--eval_iters=1",
                       f"--max_iters={saved_iters[-1] + 2}", "--init_from=resume")
    assert final.returncode == 0, final.stderr
    assert load_checkpoint(str(out_dir))["iter"] == saved_iters[-1] + 2


def test_non_finite_loss_stops_naming_the_iteration_and_keeps_the_last_good_checkpoint(tiny_args, tmp_path):
    out_dir = tmp_path / "out"
    good = run_script("train.py", *tiny_args, "--max_iters=4", "--eval_interval=2")
    assert good.returncode == 0, good.stderr
    good_bytes = (out_dir / "ckpt.pt").read_bytes()
    # An absurd learning rate makes the weights overflow within a step or two.
    diverging = run_script("train.py", *tiny_args, "--init_from=resume", "--max_iters=20", "--eval_interval=2",
                           "--log_interval=1", "--learning_rate=1e30", "--min_lr=1e30")
    assert diverging.returncode == 1
    match = re.search(r"training loss is (nan|inf|-inf) at iter (\d+)", diverging.stderr)
    assert match, diverging.stderr
    stopped_at = int(match.group(2))
    assert 5 <= stopped_at <= 20
    assert "still holds iter 4, the last good checkpoint" in diverging.stderr
    assert "Traceback" not in diverging.stderr
    assert (out_dir / "ckpt.pt").read_bytes() == good_bytes
    assert max(step_losses(out_dir)) == stopped_at - 1  # the bad iteration was not logged as a loss


def test_out_of_memory_names_backend_block_size_and_batch_size_and_exits_3(tiny_args, tmp_path):
    # A shim makes eager's softmax over 64-wide score rows raise torch.OutOfMemoryError, as
    # CUDA's allocator does when a run outgrows --max_memory_gb (tests/shims/fake_oom).
    shim = REPO / "tests" / "shims" / "fake_oom"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")]),
               FAKE_OOM_ROW_LENGTH="64")
    result = run_script("train.py", *tiny_args, "--max_iters=2", env=env)
    assert result.returncode == EXIT_OUT_OF_MEMORY == 3
    assert result.stderr.startswith("error: out of memory with attn=eager, block_size=64, batch_size=8. ")
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


@pytest.mark.gpu
def test_memory_cap_runs_out_like_a_smaller_card(tiny_args, tmp_path):
    # 10 MiB cannot hold the tiny model's 13 MB of weights: the real CUDA allocator refuses.
    result = run_script("train.py", *tiny_args, "--device=cuda", "--max_iters=2", "--max_memory_gb=0.01")
    assert result.returncode == EXIT_OUT_OF_MEMORY
    assert "error: out of memory under max_memory_gb=0.01 with attn=eager, block_size=64, batch_size=8" in result.stderr
    assert "Traceback" not in result.stderr


def test_resume_without_a_checkpoint_is_a_clear_error(tiny_args, tmp_path):
    result = run_script("train.py", *tiny_args, "--init_from=resume")
    assert result.returncode == 1
    assert f"no checkpoint at {tmp_path / 'out' / 'ckpt.pt'}" in result.stderr
    assert "Traceback" not in result.stderr


def test_resume_from_a_truncated_checkpoint_is_a_clear_error(trained_out_dir, tiny_args, tmp_path):
    (tmp_path / "out").mkdir()
    data = (trained_out_dir / "ckpt.pt").read_bytes()
    (tmp_path / "out" / "ckpt.pt").write_bytes(data[: len(data) // 2])
    result = run_script("train.py", *tiny_args, "--init_from=resume")
    assert result.returncode == 1
    assert "ckpt.pt cannot be read, it is truncated or corrupt" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_resume_with_a_different_model_shape_is_a_clear_error(trained_out_dir, tiny_args, tmp_path):
    (tmp_path / "out").mkdir()
    shutil.copy(trained_out_dir / "ckpt.pt", tmp_path / "out" / "ckpt.pt")
    result = run_script("train.py", *tiny_args, "--init_from=resume", "--n_layer=3", "--n_embd=96")
    assert result.returncode == 1
    assert "different shape (n_layer=2 there, 3 here; n_embd=64 there, 96 here)" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def corrupt_empty(folder):
    (folder / "train.bin").write_bytes(b"")


def corrupt_truncated(folder):
    data = (folder / "val.bin").read_bytes()
    (folder / "val.bin").write_bytes(data[:-100])


def corrupt_wrong_dtype(folder):
    tokens = np.fromfile(folder / "train.bin", dtype=np.uint16)
    tokens.astype(np.int32).tofile(folder / "train.bin")


def corrupt_token_ids(folder):
    tokens = np.fromfile(folder / "val.bin", dtype=np.uint16)
    tokens[123] = 60000
    tokens.tofile(folder / "val.bin")


def corrupt_missing_without_source(folder):
    (folder / "val.bin").unlink()


DATA_FAULTS = {
    "empty": (corrupt_empty, [], "train.bin is empty"),
    "truncated": (corrupt_truncated, [], "val.bin is 72,018 bytes but meta.json says 36,059 uint16 tokens "
                                         "= 72,118 bytes; truncated"),
    "wrong dtype": (corrupt_wrong_dtype, [], "4 bytes per token, not 2 (uint16): wrong dtype?"),
    "token ids": (corrupt_token_ids, [], "val.bin holds token id 60000, outside the vocabulary of 11706"),
    "missing": (corrupt_missing_without_source, [], "TINYSHAKESPEARE_PATH="),
    "block_size too long": (lambda folder: None, ["--block_size=40000"],
                            "block_size=40000 needs at least 40001 tokens per sample, but"),
}


@pytest.mark.parametrize("fault", DATA_FAULTS)
def test_bad_data_is_a_clear_error_before_training(fault, data_dir, tmp_path):
    corrupt, extra_args, message = DATA_FAULTS[fault]
    folder = tmp_path / "data"
    shutil.copytree(data_dir, folder)
    corrupt(folder)
    # With no input.txt to be found, a missing file cannot be prepared again.
    env = dict(os.environ, TINYSHAKESPEARE_PATH=str(tmp_path / "no-input.txt"))
    out_dir = tmp_path / "out"
    result = run_script("train.py", "configs/tiny.py", f"--data_dir={folder}", f"--out_dir={out_dir}", *extra_args,
                        env=env)
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (out_dir / "metrics.jsonl").exists()  # nothing trained, nothing logged
