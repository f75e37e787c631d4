"""Data-parallel training on the CPU: two processes started by torchrun (gloo), each taking
one of the two micro-batches of a configs/tiny.py step."""
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO
from training.config import ConfigError, TrainConfig, check_config
from training.run_files import load_checkpoint, read_metrics, read_run_config, resume_point

# One worker runs this module, so its module-scoped fixture runs once (see pytest.ini).
pytestmark = pytest.mark.xdist_group("ddp")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", str(REPO / "train.py"), *map(str, args)]


def torchrun(args):
    return subprocess.run(torchrun_command(args), cwd=REPO, capture_output=True, text=True, timeout=300)


def step_losses(out_dir):
    return {r["iter"]: r["loss"] for r in read_metrics(out_dir) if "loss" in r}


@pytest.fixture(scope="module")
def ddp_args(data_dir):
    # Dropout, so that each process's saved torch RNG state matters after a resume.
    return ["configs/tiny.py", f"--data_dir={data_dir}", "--eval_iters=2", "--gradient_accumulation_steps=2",
            "--log_interval=1", "--dropout=0.1", "--max_iters=16", "--eval_interval=8"]


@pytest.fixture(scope="module")
def straight_run(ddp_args, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ddp")
    result = torchrun([*ddp_args, f"--out_dir={out_dir}"])
    assert result.returncode == 0, result.stderr
    return out_dir, result


def test_two_processes_train_and_only_rank_0_logs_and_saves(straight_run):
    out_dir, result = straight_run
    evals = [r for r in read_metrics(out_dir) if "val_loss" in r]
    assert [r["iter"] for r in evals] == [0, 8, 16]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 1.0  # from ~10.8 (uniform)
    assert sorted(step_losses(out_dir)) == list(range(1, 17))  # one record per iteration: one writer
    assert result.stdout.count("iter 16: loss") == 1 and result.stdout.count("parameters, attn=eager") == 1
    assert "1,024 tokens per iteration over 2 processes" in result.stdout  # 2 x 8 sequences x 64 tokens
    assert read_run_config(out_dir)["world_size"] == 2
    saved_rng = load_checkpoint(str(out_dir / "ckpt.pt"))["rng"]
    assert len(saved_rng) == 2  # each process's random streams, for an exact resume
    assert not torch.equal(saved_rng[0]["sampler"], saved_rng[1]["sampler"])  # different batches per process


def test_sigterm_to_torchrun_stops_every_process_and_the_resumed_run_matches(straight_run, ddp_args, tmp_path):
    out_dir = tmp_path / "out"
    with open(tmp_path / "stdout.txt", "w") as stdout, open(tmp_path / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(torchrun_command([*ddp_args, f"--out_dir={out_dir}", "--max_iters=100000"]),
                                   cwd=REPO, stdout=stdout, stderr=stderr)
        output = tmp_path / "stdout.txt"
        deadline = time.monotonic() + 120
        while not re.search(r"^iter 3: loss", output.read_text(), re.MULTILINE):
            assert process.poll() is None, (tmp_path / "stderr.txt").read_text()
            assert time.monotonic() < deadline, "timed out waiting for iter 3"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)  # torchrun passes it on to both processes
        process.wait(timeout=120)
    stopped_at = load_checkpoint(resume_point(str(out_dir)))["iter"]
    assert stopped_at == max(step_losses(out_dir)) >= 3
    assert output.read_text().count(f"stopped by SIGTERM at iter {stopped_at}") == 1  # rank 0 alone

    resumed = torchrun([*ddp_args, f"--out_dir={out_dir}", "--init_from=resume"])
    assert resumed.returncode == 0, resumed.stderr
    straight_dir, _ = straight_run
    assert step_losses(out_dir) == step_losses(straight_dir)


def test_non_finite_loss_stops_every_process_with_one_message(ddp_args, tmp_path):
    result = torchrun([*ddp_args, f"--out_dir={tmp_path}", "--learning_rate=1e30", "--min_lr=1e30"])
    assert result.returncode != 0
    messages = re.findall(r"error: training loss is (?:nan|inf|-inf) at iter (\d+)", result.stderr)
    assert len(messages) == 1, result.stderr  # every process stopped there; rank 0 said so
    assert max(step_losses(tmp_path)) == int(messages[0]) - 1
    assert not (tmp_path / "ckpt.pt").exists()


def test_non_finite_evaluation_stops_every_process_with_one_message(ddp_args, tmp_path):
    """Rank 0 alone evaluates. The first update at this learning rate ruins the weights, so the
    evaluation right after it is not finite while that step's training loss was: every
    process must stop there, cleanly, rather than wait for rank 0 or crash. (Without the fix,
    rank 1 dies in its next collective with a traceback, unless torchrun's SIGTERM wins the
    race: the test then passes by luck.)"""
    result = torchrun([*ddp_args, f"--out_dir={tmp_path}", "--learning_rate=1e30", "--min_lr=1e30",
                       "--eval_interval=1"])
    assert result.returncode != 0
    messages = re.findall(r"error: (?:train|val) loss is (?:nan|inf|-inf) at iter 1\b", result.stderr)
    assert len(messages) == 1, result.stderr
    # No process dies of a broken collective (torchrun then reports the failure with a
    # traceback of its own, and may SIGTERM rank 1 as it leaves on its own: exit code 1 or -15).
    assert not re.search(r"\[rank\d\]: Traceback", result.stderr), result.stderr
    assert not (tmp_path / "ckpt.pt").exists()


def test_accumulation_steps_must_divide_among_the_processes():
    check_config(TrainConfig(gradient_accumulation_steps=4), world_size=2)
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=3: expected a multiple of the 2 processes"):
        check_config(TrainConfig(gradient_accumulation_steps=3), world_size=2)
