"""What a run reads before it starts: meta.json, the checkpoint, sample.py's settings, and a
data folder several runs prepare at once. Each fault is one clear line and the right exit
status, before any work or any file is written; never a traceback."""
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import threading
from dataclasses import asdict

import pytest
import torch

from conftest import REPO, default_run, run_script, script_command
from data.batches import DataError, read_meta
from model import GPT, GPTConfig
from training.config import EXIT_BAD_CONFIG
from training.run_files import RunFileError, load_checkpoint, save_checkpoint

GOOD_META = {"encoding": "gpt2", "vocab_size": 300, "dtype": "uint16", "gpt2_ids": list(range(0, 600, 2)),
             "train_tokens": 301_966, "val_tokens": 36_059, "train_chars": 1_003_854, "val_chars": 111_540}
BAD_META = [
    ({"dtype": "int16"}, "dtype='int16', expected one of uint8, uint16, uint32"),
    ({"dtype": "float16"}, "dtype='float16', expected one of"),
    ({"dtype": "foo"}, "dtype='foo', expected one of"),
    ({"train_tokens": 0}, "train_tokens=0, expected an int >= 1"),
    ({"val_tokens": 12.5}, "val_tokens=12.5, expected an int >= 1"),
    ({"vocab_size": "300"}, "vocab_size='300', expected an int >= 2"),
    ({"train_chars": -1}, "train_chars=-1, expected an int >= 1"),
    ({"gpt2_ids": [3, "a"]}, "gpt2_ids=[3, 'a'], expected a list of strictly increasing GPT-2 token ids"),
    ({"gpt2_ids": [1, 2, 3]}, "3 gpt2_ids for vocab_size=300, expected one GPT-2 id per token id"),
    ({"vocab_size": None}, "vocab_size=None, expected an int >= 2"),
    ({"vocab_size": True}, "vocab_size=True, expected an int >= 2"),
    ({"dtype": "uint8"}, "vocab_size=300, but its dtype uint8 holds ids up to 255 only"),
    ({"vocab_size": 1, "gpt2_ids": [5]}, "vocab_size=1, expected an int >= 2 (one token leaves nothing to predict)"),
    # Not increasing: training ran to the end and saved checkpoints that sample.py and resume refused.
    ({"gpt2_ids": [0, 4, 2] + list(range(6, 600, 2))},
     "gpt2_ids=[0, 4, 2, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, ..., expected a list of strictly increasing "
     "GPT-2 token ids"),
]


@pytest.mark.parametrize("change,message", BAD_META, ids=[message.split(",")[0] for _, message in BAD_META])
def test_every_meta_field_is_checked(change, message, tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({**GOOD_META, **change}))
    with pytest.raises(DataError, match="meta.json") as info:
        read_meta(str(tmp_path))
    assert message in str(info.value)


@pytest.mark.parametrize("content", ["null", "[1, 2]", '"uint16"'])
def test_meta_that_is_not_an_object_is_an_error(content, tmp_path):
    (tmp_path / "meta.json").write_text(content)
    with pytest.raises(DataError, match="not an object of fields"):
        read_meta(str(tmp_path))


def test_bad_meta_stops_train_before_anything_is_written(data_dir, tmp_path):
    folder = tmp_path / "data"
    shutil.copytree(data_dir, folder)
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "dtype": "int16"}))
    out_dir = tmp_path / "out"
    result = run_script("train.py", "configs/tiny.py", f"--data_dir={folder}", f"--out_dir={out_dir}")
    assert result.returncode == 1
    assert "error: " in result.stderr and "dtype='int16'" in result.stderr and "Traceback" not in result.stderr
    assert not (out_dir / "config.json").exists() and not (out_dir / "metrics.jsonl").exists()


def corrupt_numpy_state(state):
    name, key, pos, has_gauss, gauss = state["rng"][0]["numpy"]
    state["rng"][0]["numpy"] = (name, key[:3], pos, has_gauss, gauss)  # a key of 3 words, not 624


BAD_CHECKPOINTS = [
    ("best_val_loss", lambda state: state.pop("best_val_loss"), "lacks best_val_loss"),
    ("iter", lambda state: state.update(iter="4"), "its iter is '4', expected an int >= 0"),
    ("model_args", lambda state: state.update(model_args="GPTConfig()"),
     "its model_args is 'GPTConfig()', expected a dict of GPTConfig fields"),
    ("unknown field", lambda state: state["model_args"].update(n_expert=4),
     "its model_args has a field 'n_expert' that GPTConfig lacks (its fields: block_size, vocab_size"),
    ("unknown attn", lambda state: state["model_args"].update(attn="flash"),
     "its model_args has attn='flash', expected one of eager, tiled, triton, triton_fwd, sdpa"),
    ("n_kv_head", lambda state: state["model_args"].update(n_kv_head=3),
     "its model_args has n_kv_head=3, which no GPT of its other fields can have"),
    ("empty rng", lambda state: state.update(rng=[]),
     "its rng is [], expected a list with one set of random states per process"),
    ("numpy rng", corrupt_numpy_state, "its rng entry 0 is not a set of random states (IndexError: "),
    ("scaler", lambda state: state.update(scaler={"scale": "big"}),
     "its scaler is {'scale': 'big'}, expected a GradScaler's state: empty, or"),
    # It passed this check, and GPT() refused it with a traceback.
    ("window", lambda state: state["model_args"].update(window=2 ** 63),
     "its model_args has window=9223372036854775808, which no GPT of its other fields can have"),
]


def corrupt_checkpoint(trained_out_dir, out_dir, corrupt):
    state = torch.load(trained_out_dir / "ckpt.pt", weights_only=True)
    corrupt(state)
    save_checkpoint(state, str(out_dir / "ckpt.pt"))


@pytest.mark.parametrize("key,corrupt,message", BAD_CHECKPOINTS, ids=[key for key, _, _ in BAD_CHECKPOINTS])
def test_checkpoint_structure_is_checked(key, corrupt, message, trained_out_dir, tmp_path):
    corrupt_checkpoint(trained_out_dir, tmp_path, corrupt)
    with pytest.raises(RunFileError, match="is not a nanoFA2 checkpoint") as info:
        load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert message in str(info.value)


# What each script meets, a subprocess each: the window's fault takes n_kv_head's path.
SCRIPT_CHECKPOINTS = [fault for fault in BAD_CHECKPOINTS[1:] if fault[0] != "window"]


# Each script refuses every checkpoint through load_checkpoint (which the test above checks for
# every fault, in this process): the default run gives each script one fault, train.py the
# first and sample.py the second; `pytest -m full`, every fault to both.
@default_run(lambda case: [key for key, _, _ in SCRIPT_CHECKPOINTS].index(case.key) == (case.script == "sample.py"))
@pytest.mark.parametrize("script", ["train.py", "sample.py"])
@pytest.mark.parametrize("key,corrupt,message", SCRIPT_CHECKPOINTS, ids=[key for key, _, _ in SCRIPT_CHECKPOINTS])
def test_a_malformed_checkpoint_is_one_line_and_exit_1_before_any_work(script, key, corrupt, message, trained_out_dir,
                                                                       data_dir, tmp_path):
    corrupt_checkpoint(trained_out_dir, tmp_path, corrupt)
    args = [f"--out_dir={tmp_path}", "--max_new_tokens=2", "--num_samples=1"]
    if script == "train.py":
        args = ["configs/tiny.py", f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--init_from=resume"]
    result = run_script(script, *args)
    assert result.returncode == 1
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "parameters" not in result.stdout and not (tmp_path / "metrics.jsonl").exists()


def test_an_empty_checkpoint_file_is_refused_as_corrupt(tmp_path):
    # torch.load's error on a 0-byte file has no text: the message's first line of it was an IndexError.
    (tmp_path / "ckpt.pt").write_bytes(b"")
    with pytest.raises(RunFileError, match=rf"^{tmp_path / 'ckpt.pt'} cannot be read, it is truncated or corrupt "
                                           r"\((\w+)(: [^\n]+)?\)\. Restore it from a copy, or train from scratch$"):
        load_checkpoint(str(tmp_path / "ckpt.pt"))


# One comparison of model_args refuses all three: the default run resumes under another window;
# `pytest -m full`, with a window added and one dropped too.
@default_run(lambda case: -1 not in (case.saved, case.given))
@pytest.mark.parametrize("saved, given", [(-1, 8), (8, -1), (8, 16)], ids=["window added", "window dropped",
                                                                         "another window"])
def test_resume_refuses_another_window_as_it_refuses_another_shape(saved, given, trained_out_dir, data_dir, tmp_path):
    """Resumed under another window, the weights went on training under another attention
    pattern, silently, and the next checkpoint named the new window."""
    corrupt_checkpoint(trained_out_dir, tmp_path, lambda state: state["model_args"].update(window=saved))
    result = run_script("train.py", "configs/tiny.py", f"--data_dir={data_dir}", f"--out_dir={tmp_path}",
                        "--init_from=resume", f"--window={given}")
    assert result.returncode == 1
    assert f"holds a model of a different shape or window (window={saved} there, {given} here)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_resume_refuses_data_of_another_token_mapping_naming_the_token(trained_out_dir, data_dir, tmp_path):
    shutil.copytree(data_dir, tmp_path / "data")
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    ids = meta["gpt2_ids"]
    first = next(i for i in range(len(ids) - 1) if ids[i] + 1 < ids[i + 1])  # one id that can move, staying sorted
    old_id = ids[first]
    ids[first] += 1  # the same size, another mapping
    (tmp_path / "data" / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "out").mkdir()
    shutil.copy(trained_out_dir / "ckpt.pt", tmp_path / "out" / "ckpt.pt")
    result = run_script("train.py", "configs/tiny.py", f"--data_dir={tmp_path / 'data'}",
                        f"--out_dir={tmp_path / 'out'}", "--init_from=resume")
    assert result.returncode == 1
    assert (f"was trained on another vocabulary than {tmp_path / 'data'} holds: token id {first} is GPT-2 token "
            f"{old_id} there and {old_id + 1} here") in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize("seed", [2**64, -1])
def test_sample_rejects_a_seed_outside_torchs_range(seed, trained_out_dir):
    result = run_script("sample.py", f"--out_dir={trained_out_dir}", f"--seed={seed}", "--max_new_tokens=2")
    assert result.returncode == EXIT_BAD_CONFIG
    assert result.stderr.startswith(f"config error: seed={seed}: expected an int in [0, 2**64 - 1]")
    assert len(result.stderr.strip().splitlines()) == 1


def test_sample_says_a_model_trained_here_has_no_end_of_text_token(trained_out_dir):
    assert "<|endoftext|>" in run_script("sample.py", "--help").stdout
    result = run_script("sample.py", f"--out_dir={trained_out_dir}", "--start=ROMEO:<|endoftext|>", "--device=cpu")
    assert result.returncode == EXIT_BAD_CONFIG
    assert "config error: start: <|endoftext|> is GPT-2's end-of-text token, which the text the model trained on " \
           "never holds" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("temperature", ["1e-45", "0.001", "0", "-1"])
def test_sample_rejects_a_temperature_that_would_overflow_the_logits(temperature, trained_out_dir):
    result = run_script("sample.py", f"--out_dir={trained_out_dir}", f"--temperature={temperature}",
                        "--max_new_tokens=2", "--num_samples=1")
    assert result.returncode == EXIT_BAD_CONFIG
    assert f"temperature={float(temperature)!r}: expected a finite float >= 0.01" in result.stderr
    assert "--top_k=1" in result.stderr and "Traceback" not in result.stderr


def test_sample_takes_the_smallest_temperature(trained_out_dir):
    result = run_script("sample.py", f"--out_dir={trained_out_dir}", "--temperature=0.01", "--max_new_tokens=4",
                        "--num_samples=1", "--device=cpu", "--dtype=float32")
    assert result.returncode == 0, result.stderr


# One check takes both Triton backends (training/config.py's TRITON_BACKENDS): the default run
# samples with triton; `pytest -m full`, with triton_fwd too.
@default_run(lambda case: case.attn == "triton")
@pytest.mark.parametrize("attn", ["triton", "triton_fwd"])
def test_sample_rejects_a_triton_backend_for_the_checkpoints_head_dim(attn, tmp_path):
    """A checkpoint of head dim 18 (n_embd=36, n_head=2), trained with eager, sampled with triton."""
    model_args = GPTConfig(block_size=16, vocab_size=50257, n_layer=1, n_head=2, n_embd=36, attn="eager")
    save_checkpoint({"model": GPT(model_args).state_dict(), "model_args": asdict(model_args), "iter": 1,
                     "best_val_loss": 9.0}, str(tmp_path / "ckpt.pt"))
    result = run_script("sample.py", f"--out_dir={tmp_path}", f"--attn={attn}", "--max_new_tokens=2")
    assert result.returncode == EXIT_BAD_CONFIG
    assert f"attn='{attn}' with n_embd=36 and n_head=2: the head dim n_embd / n_head = 18" in result.stderr
    assert "Traceback" not in result.stderr


def start_together(commands):
    processes = [subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for command in commands]
    return [(p.returncode, out, err) for p in processes for out, err in [p.communicate(timeout=600)]]


def test_three_prepares_at_once_all_succeed(data_dir, tmp_path):
    results = start_together([script_command("data/shakespeare/prepare.py", "--out_dir", tmp_path)] * 3)
    for returncode, _, stderr in results:
        assert returncode == 0, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / name).read_bytes() == (data_dir / name).read_bytes()


def test_three_runs_preparing_one_folder_at_once_all_succeed(tmp_path):
    folder = tmp_path / "data"
    commands = [script_command("train.py", "configs/tiny.py", f"--data_dir={folder}", f"--out_dir={tmp_path / str(i)}",
                               "--max_iters=0", "--eval_iters=1") for i in range(3)]
    for returncode, _, stderr in start_together(commands):
        assert returncode == 0, stderr
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "train.bin", "val.bin"]


@contextlib.contextmanager
def held_by_another_process(folder):
    """folder's lock held as another process holds it (flock on a descriptor of its own), until the
    block ends or release() is called."""
    fd = os.open(folder, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    released = []

    def release():
        if not released:
            released.append(os.close(fd))
    try:
        yield release
    finally:
        release()


def test_a_data_dir_that_is_a_run_in_progress_out_dir_is_refused_naming_the_run(tmp_path):
    # prepare.py printed "running prepare.py", then waited, silently, for the other run to end.
    from test_config import exit_before_torch

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "config.json").write_text("{}")
    with held_by_another_process(tmp_path / "busy"):
        status, stderr, torch_loaded = exit_before_torch("train.py", "configs/tiny.py", f"--data_dir={tmp_path / 'busy'}",
                                                         f"--out_dir={tmp_path / 'out'}")
    assert (status, torch_loaded) == (EXIT_BAD_CONFIG, False)
    assert stderr.startswith(f"config error: data_dir='{tmp_path / 'busy'}' is the out_dir of a train.py run in "
                             "progress (it holds the folder's lock, and its config.json is there)")
    assert len(stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_prepare_says_what_it_waits_for_and_goes_on_when_the_lock_is_free(tmp_path, capsys):
    # Another prepare.py holds the folder (several runs preparing one folder at once): worth
    # waiting for, and saying so.
    from data.shakespeare.prepare import prepare

    with held_by_another_process(tmp_path) as release:
        threading.Timer(0.3, release).start()
        assert prepare(str(tmp_path), skip_if=lambda folder: True) is None  # it took the lock, then found it done
    assert capsys.readouterr().out == (f"waiting for {tmp_path}: another process holds its lock (a prepare.py writing "
                                       "the data there, or a train.py run whose out_dir it is)\n")
