"""Training faults: NaN losses, signals, SIGKILL mid-write, bad checkpoints, bad data, full
disks, two runs in one out_dir.

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
import torch

from conftest import REPO, default_run, run_script, script_command
from data.batches import Batches, DataError
from training.config import EXIT_OUT_OF_MEMORY
from training.run_files import load_checkpoint, resume_point


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


# One handler takes the three signals (training/devices.py): the default run sends SIGINT (and
# the tests below SIGTERM); `pytest -m full`, SIGTERM and SIGHUP here too.
@default_run(lambda case: case.signum == signal.SIGINT)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_signal_saves_a_checkpoint_at_the_current_iteration_and_exits_128_plus_signum(signum, tiny_args, tmp_path):
    returncode, out_dir = interrupt(signum, tiny_args, tmp_path)
    assert returncode == 128 + signum
    stopped_at = load_checkpoint(resume_point(str(out_dir)))["iter"]
    assert stopped_at == max(step_losses(out_dir))  # the last iteration it finished
    stdout = (tmp_path / "stdout.txt").read_text()
    assert f"stopped by {signum.name} at iter {stopped_at}" in stdout and "--init_from=resume" in stdout
    assert "Traceback" not in (tmp_path / "stderr.txt").read_text()


# A signal's resume.pt resumed to the uninterrupted run's end: the default run checks it, bit for
# bit, in test_a_signal_keeps_the_best_checkpoint_and_the_resumed_run_ends_as_an_uninterrupted_one
# (and across processes in test_ddp.py); `pytest -m full` runs this one too.
@pytest.mark.full
def test_resume_after_an_interruption_reproduces_the_uninterrupted_losses(tiny_args, tmp_path):
    returncode, out_dir = interrupt(signal.SIGTERM, tiny_args, tmp_path)
    assert returncode == 128 + signal.SIGTERM
    stopped_at = load_checkpoint(resume_point(str(out_dir)))["iter"]
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
        saved_iters.append(load_checkpoint(str(ckpt))["iter"])  # loads: not torn
    assert killed_mid_write >= 1  # at least one kill landed inside a write
    assert saved_iters == sorted(saved_iters) and saved_iters[0] >= 1
    final = run_script("train.py", *tiny_args, "--eval_interval=1", "--eval_iters=1",
                       f"--max_iters={saved_iters[-1] + 2}", "--init_from=resume")
    assert final.returncode == 0, final.stderr
    assert load_checkpoint(str(ckpt))["iter"] == saved_iters[-1] + 2


def test_non_finite_loss_stops_naming_the_iteration_and_keeps_the_last_good_checkpoint(trained_out_dir, tiny_args,
                                                                                          tmp_path):
    out_dir = tmp_path / "out"
    shutil.copytree(trained_out_dir, out_dir)  # a good run: its checkpoint at iter 4, its metrics
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


def test_the_memory_cap_is_its_share_of_the_card_and_the_out_of_memory_line_names_it(monkeypatch, capsys):
    """The CPU twin of test_memory_cap_runs_out_like_a_smaller_card, the card mocked: the cap is
    max_memory_gb's fraction of the card's memory (the whole card at most), and a run that
    outgrows it says so in its one line."""
    from training.config import TrainConfig
    from training.devices import World, cap_memory, out_of_memory_message

    fractions = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: type("Card", (), {"total_memory": 80 * 2**30}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda fraction, index: fractions.append(fraction))
    cap_memory(torch.device("cuda"), 12, announce=True)
    cap_memory(torch.device("cuda:0"), 100, announce=False)
    assert fractions == [12 / 80, 1.0]
    assert capsys.readouterr().out == "CUDA memory capped at 12 GiB (the card has 80.0 GiB)\n"
    message = out_of_memory_message(TrainConfig(max_memory_gb=0.01, block_size=64, batch_size=8), World())
    assert message.startswith("out of memory under max_memory_gb=0.01 with attn=eager, block_size=64, batch_size=8")


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
    assert "different shape or window (n_layer=2 there, 3 here; n_embd=64 there, 96 here)" in result.stderr
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
}


def corrupted_copy(fault, data_dir, tmp_path):
    folder = tmp_path / "data"
    shutil.copytree(data_dir, folder)
    DATA_FAULTS[fault][0](folder)
    return folder


@pytest.mark.parametrize("fault", [fault for fault in DATA_FAULTS if fault != "missing"])
def test_every_data_fault_is_a_data_error_that_names_it(fault, data_dir, tmp_path):
    """The checks themselves, in this process (the missing file's message is prepare.py's, below)."""
    with pytest.raises(DataError) as info:
        Batches(str(corrupted_copy(fault, data_dir, tmp_path)), 32, 2, "cpu")
    assert DATA_FAULTS[fault][2] in str(info.value)


# train.py reports every DataError alike (the test above checks each check): the default run
# trains on an empty split and on a missing one (which prepare.py cannot make again without its
# input); `pytest -m full`, on every fault.
@default_run(lambda case: case.fault in ("empty", "missing"))
@pytest.mark.parametrize("fault", DATA_FAULTS)
def test_bad_data_is_a_clear_error_before_training(fault, data_dir, tmp_path):
    _, extra_args, message = DATA_FAULTS[fault]
    folder = corrupted_copy(fault, data_dir, tmp_path)
    # With no input.txt to be found, a missing file cannot be prepared again.
    env = dict(os.environ, TINYSHAKESPEARE_PATH=str(tmp_path / "no-input.txt"))
    out_dir = tmp_path / "out"
    result = run_script("train.py", "configs/tiny.py", f"--data_dir={folder}", f"--out_dir={out_dir}", *extra_args,
                        env=env)
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (out_dir / "metrics.jsonl").exists()  # nothing trained, nothing logged


def shim_env(name, **variables):
    """The environment with tests/shims/<name> first on PYTHONPATH, and `variables` set."""
    shim = REPO / "tests" / "shims" / name
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")]), **variables)


def test_a_signal_never_saves_weights_whose_loss_is_not_finite(trained_out_dir, tiny_args, tmp_path):
    # A diverging step gives a finite loss, then weights that do not. A SIGTERM right after
    # that step must not save them (the iter-4 checkpoint stays the last one).
    (tmp_path / "out").mkdir()
    shutil.copy(trained_out_dir / "ckpt.pt", tmp_path / "out" / "ckpt.pt")
    good_bytes = (tmp_path / "out" / "ckpt.pt").read_bytes()
    result = run_script("train.py", *tiny_args, "--init_from=resume", "--max_iters=12", "--eval_interval=100",
                        "--learning_rate=1e30", "--grad_clip=0", env=shim_env("signal_after_step", SIGNAL_AFTER_STEPS="1"))
    assert result.returncode == 1, result.stderr
    assert "SIGTERM: the loss of the weights to save is nan at iter 5; stopped without saving" in result.stderr
    assert "still holds iter 4, the last good checkpoint" in result.stderr and "Traceback" not in result.stderr
    assert (tmp_path / "out" / "ckpt.pt").read_bytes() == good_bytes


@pytest.mark.parametrize("held", ["ckpt.pt", "metrics.jsonl"])
def test_a_run_from_scratch_refuses_to_replace_a_run_unless_told_to(held, trained_out_dir, tiny_args, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    shutil.copy(trained_out_dir / held, out_dir / held)
    before = (out_dir / held).read_bytes()
    refused = run_script("train.py", *tiny_args, "--max_iters=0")
    assert refused.returncode == 2
    assert refused.stderr.startswith(f"config error: out_dir='{out_dir}' holds a run ({held}), which a run from "
                                     "scratch would replace. Continue it with --init_from=resume, replace it with "
                                     "--overwrite=True")
    assert len(refused.stderr.strip().splitlines()) == 1
    assert (out_dir / held).read_bytes() == before
    replaced = run_script("train.py", *tiny_args, "--max_iters=0", "--eval_iters=1", "--overwrite=True")
    assert replaced.returncode == 0, replaced.stderr
    assert [r["iter"] for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())] == [0]
    assert not (out_dir / "ckpt.pt").exists()  # the old run's checkpoint went with its metrics


@pytest.mark.parametrize("where", ["a file", "under a file", "read-only"])
def test_an_unusable_out_dir_is_a_config_error_before_any_work(where, tiny_args, tmp_path):
    if where == "read-only" and os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    (tmp_path / "file").write_text("not a folder")
    out_dir = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "out",
               "read-only": tmp_path / "read-only"}[where]
    if where == "read-only":
        out_dir.mkdir(mode=0o500)
    expected = {"a file": f"out_dir='{out_dir}' is a file; expected a folder",
                "under a file": f"out_dir='{out_dir}': cannot write there (Not a directory: {tmp_path / 'file'} is a file)",
                "read-only": f"out_dir='{out_dir}': cannot write there (Permission denied in {out_dir})"}[where]
    result = run_script("train.py", *tiny_args, f"--out_dir={out_dir}")
    assert result.returncode == 2
    assert result.stderr.startswith(f"config error: {expected}") and len(result.stderr.strip().splitlines()) == 1
    assert "parameters" not in result.stdout  # nothing was built
    assert where == "read-only" or not os.path.isdir(out_dir)  # nothing was made


def test_a_full_disk_during_a_checkpoint_is_one_line_and_leaves_no_partial_file(tiny_args, tmp_path):
    result = run_script("train.py", *tiny_args, "--max_iters=1", "--eval_interval=1", "--eval_iters=1",
                        env=shim_env("disk_full"))
    assert result.returncode == 1
    message = result.stderr.strip().splitlines()
    assert len(message) == 1 and "Traceback" not in result.stderr
    assert message[0].startswith(f"error: could not write {tmp_path / 'out' / 'ckpt.pt'} ([enforce fail at "
                                 "inline_container.cc:672] . PytorchStreamWriter failed writing file data/0")
    assert "the partial file was removed and the previous checkpoint, if any, is intact" in message[0]
    assert not (tmp_path / "out" / "ckpt.pt.tmp").exists() and not (tmp_path / "out" / "ckpt.pt").exists()


def test_host_out_of_memory_exits_3_with_the_out_of_memory_line(tiny_args, tmp_path):
    import resource

    def limit_address_space():  # as `ulimit -v 4000000` does: 4 GB, far below what the batch needs
        resource.setrlimit(resource.RLIMIT_AS, (4 * 10**9, 4 * 10**9))

    result = subprocess.run(script_command("train.py", *tiny_args, "--max_iters=1", "--batch_size=100000"), cwd=REPO,
                            capture_output=True, text=True, timeout=300, preexec_fn=limit_address_space)
    assert result.returncode == EXIT_OUT_OF_MEMORY == 3
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: out of memory with attn=eager, block_size=64, batch_size=100000. ")
    assert "Traceback" not in result.stderr


def test_two_signals_10_ms_apart_stop_at_once_without_saving(tiny_args, tmp_path):
    out_dir = tmp_path / "out"
    process = start_train([*tiny_args, "--max_iters=100000", "--eval_interval=100000", "--log_interval=1"], tmp_path)
    wait_until(lambda: len(step_losses(out_dir)) >= 1, process)
    process.send_signal(signal.SIGINT)
    time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=120) == 128 + signal.SIGINT
    stderr = (tmp_path / "stderr.txt").read_text()
    assert "second signal (SIGINT): stopped at once, without saving" in stderr and "Traceback" not in stderr
    assert "checkpoint saved" not in (tmp_path / "stdout.txt").read_text()
    assert not (out_dir / "ckpt.pt").exists()  # the long run had reached no evaluation


def test_a_signal_stops_a_long_evaluation_and_saves_the_iteration(tiny_args, tmp_path):
    # 100,000 evaluation batches take hours; the signal stops them after the current batch.
    # The evaluation shows its progress meanwhile, with the time left of it and of the run.
    out_dir = tmp_path / "out"
    process = start_train([*tiny_args, "--max_iters=10", "--eval_iters=100000"], tmp_path)
    stdout = tmp_path / "stdout.txt"
    wait_until(lambda: "the run's ETA" in stdout.read_text(), process)
    assert re.search(r"evaluating at iter 0: train batch \d+/100000, ETA [\d:]+; the run's ETA [\d:]+", stdout.read_text())
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=120) == 128 + signal.SIGINT
    assert f"stopped by SIGINT at iter 0; checkpoint saved in {out_dir / 'resume.pt'}" in stdout.read_text()
    assert load_checkpoint(str(out_dir / "resume.pt"))["iter"] == 0
    stderr = (tmp_path / "stderr.txt").read_text()
    assert "Traceback" not in stderr and "sized for a GPU" not in stderr  # configs/tiny.py fits a CPU


def test_a_config_sized_for_a_gpu_warns_on_the_cpu_in_one_line(data_dir, tmp_path):
    # The default model at a 512-token context: about 0.2 TFLOP per iteration even at batch_size=1.
    result = run_script("train.py", f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}", "--device=cpu",
                        "--max_iters=0", "--eval_iters=1", "--batch_size=1", "--block_size=512")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "sized for a GPU" in line]
    assert len(warnings) == 1 and "configs/tiny.py" in warnings[0]


def records(out_dir):
    """metrics.jsonl without the timings: what a resumed run must log as an uninterrupted one does."""
    timing = {"step_ms", "tokens_per_s", "mfu", "peak_mem_mb", "warmup"}
    return [{key: value for key, value in json.loads(line).items() if key not in timing}
            for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_checkpoint(path, expected_path):
    """Every entry alike, tensors bit for bit; of the settings, init_from and out_dir differ, as they must."""
    def same(a, b):
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
        return a == b

    state, expected = (torch.load(p, weights_only=True) for p in (path, expected_path))
    assert state["config"].pop("init_from") == "resume" and expected["config"].pop("init_from") == "scratch"
    assert state["config"].pop("out_dir") != expected["config"].pop("out_dir")
    assert state.keys() == expected.keys()
    assert [key for key in state if not same(state[key], expected[key])] == []


BEST_CHECKPOINT_RUN = ["--always_save_checkpoint=False", "--eval_interval=4", "--max_iters=12", "--log_interval=1",
                       "--dropout=0.1"]


@pytest.fixture(scope="module")
def uninterrupted_best_checkpoint_run(data_dir, tmp_path_factory):
    """The run the test below resumes to, uninterrupted: trained once for both signal timings."""
    out_dir = tmp_path_factory.mktemp("straight")
    straight = run_script("train.py", "configs/tiny.py", f"--data_dir={data_dir}", "--eval_iters=2",
                          *BEST_CHECKPOINT_RUN, f"--out_dir={out_dir}")
    assert straight.returncode == 0, straight.stderr
    return out_dir


# The default run signals at an evaluation, which keeps the best checkpoint and resumes as the
# other timing does and also runs the evaluation again; `pytest -m full`, between evaluations too.
@default_run(lambda case: case.signal_after == 4)
@pytest.mark.parametrize("signal_after", [6, 4], ids=["between evaluations", "at an evaluation"])
def test_a_signal_keeps_the_best_checkpoint_and_the_resumed_run_ends_as_an_uninterrupted_one(
        signal_after, uninterrupted_best_checkpoint_run, tiny_args, tmp_path):
    """ckpt.pt is the best checkpoint (always_save_checkpoint=False). A SIGTERM after step 6
    saves resume.pt and leaves ckpt.pt (iter 4) alone; one after step 4 cuts that iteration's
    evaluation short, which the resumed run runs again. Either way the resumed run logs what an
    uninterrupted one does and ends with its checkpoint, bit for bit."""
    common = [*tiny_args, *BEST_CHECKPOINT_RUN]
    straight = uninterrupted_best_checkpoint_run
    out_dir = tmp_path / "out"
    stopped = run_script("train.py", *common, env=shim_env("signal_after_step", SIGNAL_AFTER_STEPS=str(signal_after)))
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert f"stopped by SIGTERM at iter {signal_after}; checkpoint saved in {out_dir / 'resume.pt'}" in stopped.stdout
    assert load_checkpoint(str(out_dir / "resume.pt"))["iter"] == signal_after
    if signal_after == 6:
        assert load_checkpoint(str(out_dir / "ckpt.pt"))["iter"] == 4  # the best so far, not the signal's
    else:
        assert not (out_dir / "ckpt.pt").exists()  # iter 4's evaluation never finished, iter 0's saves nothing
        assert [r["iter"] for r in records(out_dir) if "val_loss" in r] == [0]
    resumed = run_script("train.py", *common, "--init_from=resume")
    assert resumed.returncode == 0, resumed.stderr
    assert ("its evaluation cut short by a signal: evaluating again" in resumed.stdout) == (signal_after == 4)
    assert records(out_dir) == records(straight)
    assert_same_checkpoint(out_dir / "ckpt.pt", straight / "ckpt.pt")
    assert not (out_dir / "resume.pt").exists()  # the later ckpt.pt superseded it


def test_two_runs_started_at_once_in_one_out_dir_one_refuses(tiny_args, tmp_path):
    out_dir = tmp_path / "out"
    commands = [script_command("train.py", *tiny_args, "--max_iters=30", "--eval_interval=30", "--log_interval=1",
                               f"--seed={seed}") for seed in (1, 2)]
    processes = [subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for command in commands]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in processes]
    assert sorted(code for code, _ in results) == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert refused.startswith(f"config error: out_dir='{out_dir}'") and len(refused.strip().splitlines()) == 1
    assert [r["iter"] for r in records(out_dir) if "loss" in r] == list(range(1, 31))  # one run's records
    assert load_checkpoint(str(out_dir / "ckpt.pt"))["config"]["seed"] == json.loads(
        (out_dir / "config.json").read_text())["seed"]


def test_a_run_told_to_overwrite_a_run_in_progress_refuses(tiny_args, tmp_path):
    out_dir = tmp_path / "out"
    process = start_train([*tiny_args, "--max_iters=100000", "--eval_interval=100000", "--log_interval=1"], tmp_path)
    try:
        wait_until(lambda: len(step_losses(out_dir)) >= 1, process)
        second = run_script("train.py", *tiny_args, "--overwrite=True", "--max_iters=1")
    finally:
        process.kill()
        process.wait(timeout=60)
    assert second.returncode == 2
    assert second.stderr == (f"config error: out_dir='{out_dir}' is in use by another train.py run; wait for it to "
                             "end, or pick another out_dir\n")


# The default run fills the disk during an append to metrics.jsonl and the atomic write of
# config.json; `pytest -m full`, during metrics.jsonl's atomic write too (config.json's path).
@default_run(lambda case: (case.name, case.modes) != ("metrics.jsonl", "w"))
@pytest.mark.parametrize("name, modes", [("metrics.jsonl", "a"), ("metrics.jsonl", "w"), ("config.json", "w")])
def test_a_full_disk_during_a_metrics_or_config_write_is_one_line(name, modes, tiny_args, tmp_path):
    result = run_script("train.py", *tiny_args, "--max_iters=2", env=shim_env("disk_full", DISK_FULL=f"{name}:{modes}"))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith(f"error: could not write {tmp_path / 'out' / name} (No space left on device; ")


def test_resume_with_a_metrics_file_that_is_not_utf8_is_one_line(trained_out_dir, tiny_args, tmp_path):
    (tmp_path / "out").mkdir()
    shutil.copy(trained_out_dir / "ckpt.pt", tmp_path / "out" / "ckpt.pt")
    (tmp_path / "out" / "metrics.jsonl").write_bytes(b'{"iter": 1, "loss": 9.1}\n\xff\xfe\x00binary\n')
    result = run_script("train.py", *tiny_args, "--init_from=resume", "--max_iters=5")
    assert result.returncode == 1
    assert result.stderr.startswith(f"error: {tmp_path / 'out' / 'metrics.jsonl'} cannot be read as train.py's "
                                    "metrics (UnicodeDecodeError")
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("text, status, message", [
    ("To be, or not to be: that is the question.\n" * 70, 0, "holds only "),
    (" the" * 1000, 1, "the text gives a vocabulary of 1 token (4,000 characters): there is nothing to predict"),
], ids=["3 kB", "one token"])
def test_data_too_small_is_warned_about_and_a_single_token_refused(text, status, message, tmp_path):
    (tmp_path / "input.txt").write_text(text)
    result = run_script("train.py", "configs/tiny.py", f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}",
                        "--max_iters=0", "--eval_iters=1", env=dict(os.environ, TINYSHAKESPEARE_PATH=str(tmp_path / "input.txt")))
    assert result.returncode == status, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    if status == 0:
        warning = next(line for line in result.stderr.splitlines() if message in line)
        assert re.search(r"holds only [\d,]+ train and [\d,]+ val tokens over a vocabulary of [\d,]+ ", warning)


def test_a_resumed_run_whose_steps_are_slow_says_how_far_it_has_got(tiny_args, tmp_path):
    """The default model on a CPU takes about a minute a step: a resumed run must not sit silent
    until its first log line. A step that ends more than 5 s after the last line prints one."""
    first = run_script("train.py", *tiny_args, "--max_iters=2", "--eval_interval=2")
    assert first.returncode == 0, first.stderr
    resumed = run_script("train.py", *tiny_args, "--init_from=resume", "--max_iters=4", "--eval_interval=100",
                         env=shim_env("slow_step", SLOW_STEP_SECONDS="6"))
    assert resumed.returncode == 0, resumed.stderr
    lines = resumed.stdout.splitlines()
    assert lines[0].startswith(f"resuming from {tmp_path / 'out' / 'ckpt.pt'} at iter 2")
    # Its steps are still the timing warm-up's (iters 3 to 5), and nothing was evaluated yet: no ETA.
    assert re.fullmatch(r"iter 3/4: loss \d+\.\d{4}, \d+\.\d s/iter, warming up", lines[3]), lines


def test_the_eta_leaves_out_the_warm_up_of_the_first_evaluation_and_steps(tiny_args, tmp_path):
    """A first evaluation batch and a first step 10 s slower, as compiling and tuning make them
    on a GPU: extrapolated, they made an ETA of minutes (hours on a GPU) of a run of seconds.
    The ETA waits for a batch past the first, then extrapolates from those."""
    result = run_script("train.py", *tiny_args, "--max_iters=20", "--eval_interval=10", "--log_interval=1",
                        env=shim_env("slow_warm_up", SLOW_WARM_UP_SECONDS="10"))
    assert result.returncode == 0, result.stderr
    assert re.search(r"^evaluating at iter 0: train batch 1/2, warming up$", result.stdout, re.MULTILINE), result.stdout
    etas = re.findall(r"ETA (\d+):(\d\d)$|ETA (\d+):(\d\d) \(warm-up\)$", result.stdout, re.MULTILINE)
    assert len(etas) >= 20  # every step's line
    seconds = [60 * int(m or m2) + int(s or s2) for m, s, m2, s2 in etas]
    assert max(seconds) < 40, result.stdout
