"""What a run reads before it starts: meta.json, the checkpoint, sample.py's settings, and a
data folder several runs prepare at once. Each fault is one clear line and the right exit
status, before any work or any file is written; never a traceback."""
import json
import shutil
import subprocess
from dataclasses import asdict

import pytest
import torch

from conftest import REPO, run_script, script_command
from data.batches import DataError, read_meta
from model import GPT, GPTConfig
from training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from training.exit_codes import EXIT_BAD_CONFIG

GOOD_META = {"encoding": "gpt2", "vocab_size": 300, "dtype": "uint16", "gpt2_ids": list(range(0, 600, 2)),
             "train_tokens": 301_966, "val_tokens": 36_059, "train_chars": 1_003_854, "val_chars": 111_540}
BAD_META = [
    ({"dtype": "int16"}, "dtype='int16', expected one of uint8, uint16, uint32"),
    ({"dtype": "float16"}, "dtype='float16', expected one of"),
    ({"dtype": "foo"}, "dtype='foo', expected one of"),
    ({"train_tokens": 0}, "train_tokens=0, expected an int >= 1"),
    ({"val_tokens": 12.5}, "val_tokens=12.5, expected an int >= 1"),
    ({"vocab_size": "300"}, "vocab_size='300', expected an int >= 1"),
    ({"train_chars": -1}, "train_chars=-1, expected an int >= 1"),
    ({"gpt2_ids": [3, "a"]}, "gpt2_ids=[3, 'a'], expected a list of GPT-2 token ids"),
    ({"gpt2_ids": [1, 2, 3]}, "3 gpt2_ids for vocab_size=300, expected one GPT-2 id per token id"),
    ({"vocab_size": None}, "vocab_size=None, expected an int >= 1"),
    ({"vocab_size": True}, "vocab_size=True, expected an int >= 1"),
    ({"dtype": "uint8"}, "vocab_size=300, but its dtype uint8 holds ids up to 255 only"),
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


BAD_CHECKPOINTS = [
    ("best_val_loss", lambda state: state.pop("best_val_loss"), "lacks best_val_loss"),
    ("iter", lambda state: state.update(iter="4"), "its iter is '4', expected an int >= 0"),
    ("model_args", lambda state: state.update(model_args="GPTConfig()"),
     "its model_args is 'GPTConfig()', expected a dict of GPTConfig fields"),
]


def corrupt_checkpoint(trained_out_dir, out_dir, corrupt):
    state = torch.load(trained_out_dir / "ckpt.pt", weights_only=True)
    corrupt(state)
    save_checkpoint(state, str(out_dir))


@pytest.mark.parametrize("key,corrupt,message", BAD_CHECKPOINTS, ids=[key for key, _, _ in BAD_CHECKPOINTS])
def test_checkpoint_structure_is_checked(key, corrupt, message, trained_out_dir, tmp_path):
    corrupt_checkpoint(trained_out_dir, tmp_path, corrupt)
    with pytest.raises(CheckpointError, match="is not a nanoFA2 checkpoint") as info:
        load_checkpoint(str(tmp_path))
    assert message in str(info.value)


@pytest.mark.parametrize("script", ["train.py", "sample.py"])
def test_a_malformed_checkpoint_is_one_line_and_exit_1(script, trained_out_dir, data_dir, tmp_path):
    key, corrupt, message = BAD_CHECKPOINTS[1]
    corrupt_checkpoint(trained_out_dir, tmp_path, corrupt)
    args = [f"--out_dir={tmp_path}", "--max_new_tokens=2", "--num_samples=1"]
    if script == "train.py":
        args = ["configs/tiny.py", f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--init_from=resume"]
    result = run_script(script, *args)
    assert result.returncode == 1
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


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


@pytest.mark.parametrize("attn", ["triton", "triton_fwd"])
def test_sample_rejects_a_triton_backend_for_the_checkpoints_head_dim(attn, tmp_path):
    """A checkpoint of head dim 24 (n_embd=48, n_head=2), trained with eager, sampled with triton."""
    model_args = GPTConfig(block_size=16, vocab_size=50257, n_layer=1, n_head=2, n_embd=48, attn="eager")
    save_checkpoint({"model": GPT(model_args).state_dict(), "model_args": asdict(model_args), "iter": 1,
                     "best_val_loss": 9.0}, str(tmp_path))
    result = run_script("sample.py", f"--out_dir={tmp_path}", f"--attn={attn}", "--max_new_tokens=2")
    assert result.returncode == EXIT_BAD_CONFIG
    assert f"attn='{attn}' with n_embd=48 and n_head=2: the head dim n_embd / n_head = 24" in result.stderr
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
