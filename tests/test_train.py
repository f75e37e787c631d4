"""train.py and sample.py end to end on the CPU, with configs/tiny.py on the real data."""
import json
import math
import os
import re

import pytest
import torch

from conftest import run_script

LOG_KEYS = {"iter", "loss", "lr", "step_ms", "tokens_per_s", "mfu", "peak_mem_mb", "warmup"}
EVAL_KEYS = {"iter", "train_loss", "val_loss", "val_bpc"}


def read_metrics(out_dir):
    with open(out_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def step_losses(records):
    return {r["iter"]: r["loss"] for r in records if "loss" in r}


def test_tiny_config_loss_falls_and_metrics_have_the_documented_keys(tiny_args, tmp_path):
    # OMP_NUM_THREADS unset (the test workers set it), as a user runs it, so train.py picks the threads.
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    result = run_script("train.py", *tiny_args, "--max_iters=40", "--eval_interval=40", env=env)
    assert result.returncode == 0, result.stderr
    records = read_metrics(tmp_path / "out")
    evals = [r for r in records if "val_loss" in r]
    logs = [r for r in records if "loss" in r]
    assert all(set(r) == EVAL_KEYS for r in evals) and all(set(r) == LOG_KEYS for r in logs)
    assert [r["iter"] for r in evals] == [0, 40] and [r["iter"] for r in logs] == [3, 10, 20, 30, 40]
    assert [r["warmup"] for r in logs] == [True, False, False, False, False]  # iters 1-3 logged apart
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 2.0  # from ~9.4 (uniform over 11,706) to below 7.4
    # bits/char = nats/token x tokens/char / ln 2, with TinyShakespeare's 36,059 val tokens in 111,540 chars
    assert all(r["val_bpc"] == pytest.approx(r["val_loss"] * 36_059 / 111_540 / math.log(2)) for r in evals)
    assert f"({evals[-1]['val_bpc']:.3f} bits/char)" in result.stdout
    assert logs[-1]["step_ms"] > 0 and logs[-1]["tokens_per_s"] > 0
    assert logs[-1]["mfu"] is None and logs[-1]["peak_mem_mb"] is None  # no GPU peak to compare with
    assert "iter 40: loss" in result.stdout and "tok/s" in result.stdout
    assert re.search(r"^iter 10: loss .*, ETA \d\d:\d\d$", result.stdout, re.MULTILINE)  # time left, as tqdm says it
    # A tiny model's step is too small to share among cores: one thread, and a line that says so.
    assert re.search(r"^CPU threads: 1 of \d+ cores: a call of 2.7 GFLOP is too small to share", result.stdout, re.MULTILINE)
    ckpt = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    assert ckpt["iter"] == 40 and ckpt["config"]["attn"] == "eager"
    assert len(ckpt["gpt2_ids"]) == ckpt["model_args"]["vocab_size"] == 11_706  # sample.py decodes with it
    run_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert run_config["attn"] == "eager" and run_config["wandb_run_name"] == "eager-tiny"
    assert run_config["device"] == "cpu" and run_config["world_size"] == 1 and run_config["tokens_per_iter"] == 512


def test_resume_continues_with_the_same_losses(tiny_args, tmp_path):
    # Dropout makes the losses depend on the saved torch RNG state as well as the sampler's.
    common = [*tiny_args, "--log_interval=1", "--eval_interval=3", "--dropout=0.1"]
    straight = run_script("train.py", *common, f"--out_dir={tmp_path / 'straight'}", "--max_iters=6")
    assert straight.returncode == 0, straight.stderr
    first = run_script("train.py", *common, f"--out_dir={tmp_path / 'split'}", "--max_iters=3")
    assert first.returncode == 0, first.stderr
    second = run_script("train.py", *common, f"--out_dir={tmp_path / 'split'}", "--max_iters=6",
                        "--init_from=resume")
    assert second.returncode == 0, second.stderr
    assert "resuming from" in second.stdout and "at iter 3" in second.stdout
    expected = read_metrics(tmp_path / "straight")
    resumed = read_metrics(tmp_path / "split")
    assert step_losses(resumed) == step_losses(expected)
    assert sorted(step_losses(resumed)) == [1, 2, 3, 4, 5, 6]
    assert [r for r in resumed if "val_loss" in r] == [r for r in expected if "val_loss" in r]


def test_train_prepares_missing_data(data_dir, tmp_path):
    empty = tmp_path / "data"
    result = run_script("train.py", "configs/tiny.py", f"--data_dir={empty}", f"--out_dir={tmp_path / 'out'}",
                        "--max_iters=1", "--eval_iters=1")
    assert result.returncode == 0, result.stderr
    assert "running data/shakespeare/prepare.py" in result.stdout
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (empty / name).read_bytes() == (data_dir / name).read_bytes()


def test_train_prepares_again_data_an_older_prepare_wrote(data_dir, tmp_path):
    old = tmp_path / "data"
    old.mkdir()
    meta = json.loads((data_dir / "meta.json").read_text())
    for key in ("gpt2_ids", "train_chars", "val_chars"):
        del meta[key]
    (old / "meta.json").write_text(json.dumps({**meta, "vocab_size": 50257}))
    for name in ("train.bin", "val.bin"):
        (old / name).write_bytes((data_dir / name).read_bytes())
    result = run_script("train.py", "configs/tiny.py", f"--data_dir={old}", f"--out_dir={tmp_path / 'out'}",
                        "--max_iters=1", "--eval_iters=1")
    assert result.returncode == 0, result.stderr
    assert "an older prepare.py" in result.stdout
    assert (old / "meta.json").read_bytes() == (data_dir / "meta.json").read_bytes()


def test_sample_names_a_prompt_token_the_corpus_never_used(trained_out_dir):
    result = run_script("sample.py", f"--out_dir={trained_out_dir}", "--start=ROMEO: 🎉", "--device=cpu")
    assert result.returncode == 2
    assert "never occurs in the text the model trained on" in result.stderr and "GPT-2 id" in result.stderr
    assert "Traceback" not in result.stderr


def test_sample_prints_text_from_the_checkpoint(trained_out_dir, tmp_path):
    result = run_script("sample.py", f"--out_dir={trained_out_dir}", "--start=ROMEO:", "--num_samples=2",
                        "--max_new_tokens=20", "--device=cpu")
    assert result.returncode == 0, result.stderr
    assert re.findall(r"sample (\d)/2: 20 tokens in [\d.]+ s \([\d,]+ tok/s\)", result.stderr) == ["1", "2"]
    samples = result.stdout.split("---------------\n")
    assert len(samples) == 3 and samples[-1] == ""  # two samples, each closed by a separator
    assert all(s.startswith("ROMEO:") and len(s) > len("ROMEO:\n") for s in samples[:2])
    assert "attn=sdpa" in result.stderr  # the backend the checkpoint was trained with

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("JULIET:")
    result = run_script("sample.py", f"--out_dir={trained_out_dir}", f"--start=FILE:{prompt}",
                        "--num_samples=1", "--max_new_tokens=5", "--attn=eager", "--device=cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("JULIET:") and "attn=eager" in result.stderr


def test_sample_without_checkpoint_is_a_clear_error(tmp_path):
    result = run_script("sample.py", f"--out_dir={tmp_path}", "--device=cpu")
    assert result.returncode == 1
    assert f"no checkpoint at {tmp_path / 'ckpt.pt'}" in result.stderr and "Traceback" not in result.stderr


def test_sample_same_seed_same_text(trained_out_dir):
    args = [f"--out_dir={trained_out_dir}", "--num_samples=1", "--max_new_tokens=10", "--device=cpu", "--seed=7"]
    assert run_script("sample.py", *args).stdout == run_script("sample.py", *args).stdout


@pytest.mark.gpu
def test_trains_on_the_gpu_with_mixed_precision(tiny_args, tmp_path):
    result = run_script("train.py", *tiny_args, "--device=cuda", "--dtype=auto", "--max_iters=10",
                        "--log_interval=5", "--attn=sdpa")
    assert result.returncode == 0, result.stderr
    logs = [r for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert logs[-1]["peak_mem_mb"] > 0
    assert "dtype=bfloat16" in result.stdout or "dtype=float16" in result.stdout


@pytest.mark.gpu
def test_the_default_gpu_run_compiles_and_replays_a_cuda_graph_with_the_warm_up_apart(tiny_args, tmp_path):
    result = run_script("train.py", *tiny_args, "--device=cuda", "--max_iters=6", "--eval_interval=6",
                        "--log_interval=1", "--attn=sdpa", timeout=900)
    assert result.returncode == 0, result.stderr
    run_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert run_config["compile"] is True and run_config["cuda_graph"] is True
    assert [r["warmup"] for r in read_metrics(tmp_path / "out") if "loss" in r] == [True] * 3 + [False] * 3


def test_compiled_training_with_cuda_graph_mode_and_accumulation_on_the_cpu(tiny_args, tmp_path):
    """compile_mode=reduce-overhead with gradient accumulation and evaluation: on the CPU there
    are no CUDA graphs, and the run still trains, with the losses of the uncompiled run (the
    Triton kernels are custom operators inside the compiled graph)."""
    args = [*tiny_args, "--attn=triton", "--batch_size=2", "--block_size=32", "--gradient_accumulation_steps=2",
            "--max_iters=2", "--eval_interval=2", "--eval_iters=1", "--log_interval=1"]
    losses = []
    for name, extra in (("plain", []), ("compiled", ["--compile=True", "--compile_mode=reduce-overhead"])):
        result = run_script("train.py", *args, f"--out_dir={tmp_path / name}", *extra, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        losses.append(step_losses(read_metrics(tmp_path / name)))
    assert losses[1].keys() == {1, 2}
    for it in (1, 2):
        assert losses[1][it] == pytest.approx(losses[0][it], rel=1e-4)


def test_the_decode_benchmark_on_the_cpu_leaves_out_the_interpreted_triton_backends():
    result = run_script("sample.py", "--benchmark=True", "--init_from=random", "--max_new_tokens=2", "--num_samples=1",
                        "--device=cpu")
    assert result.returncode == 0, result.stderr
    rows = [line.split()[0] for line in result.stdout.splitlines()[2:]]
    assert rows == ["eager", "tiled", "sdpa"]
