"""data/shakespeare/prepare.py: the real token counts, atomic re-runs, and clear errors; and
data/ standing below training/ (scripts -> training/ -> data/, never back)."""
import hashlib
import json
import os
import subprocess
import sys
import urllib.error

import numpy as np
import pytest

from conftest import REPO, run_script
from data.shakespeare import prepare as prepare_module
from data.shakespeare.prepare import DenseVocab, PrepareError, prepare

VOCAB_SIZE = 11_706  # the GPT-2 tokens TinyShakespeare uses


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_real_data_has_the_expected_token_counts(data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    gpt2_ids = meta.pop("gpt2_ids")
    assert meta == {"encoding": "gpt2", "vocab_size": VOCAB_SIZE, "dtype": "uint16",
                    "train_tokens": 301_966, "val_tokens": 36_059, "train_chars": 1_003_854, "val_chars": 111_540}
    assert len(gpt2_ids) == VOCAB_SIZE and gpt2_ids == sorted(set(gpt2_ids)) and gpt2_ids[-1] < 50257
    train = np.fromfile(data_dir / "train.bin", dtype=np.uint16)
    val = np.fromfile(data_dir / "val.bin", dtype=np.uint16)
    assert (len(train), len(val)) == (301_966, 36_059)
    # "First Citizen:" in GPT-2 tokens, through the mapping
    assert [gpt2_ids[i] for i in train[:4]] == [5962, 22307, 25, 198]


def test_token_ids_are_dense_and_map_back_to_the_original_text(data_dir):
    import tiktoken

    meta = json.loads((data_dir / "meta.json").read_text())
    vocab = DenseVocab(meta["gpt2_ids"])
    encoder = tiktoken.get_encoding("gpt2")
    tokens = {split: np.fromfile(data_dir / f"{split}.bin", dtype=np.uint16) for split in ("train", "val")}
    # Dense: every id in [0, vocab_size) occurs in the corpus, none past it.
    assert np.array_equal(np.unique(np.concatenate(list(tokens.values()))), np.arange(meta["vocab_size"]))
    text = open(os.environ["TINYSHAKESPEARE_PATH"], encoding="utf-8").read()
    decoded = "".join(encoder.decode(vocab.to_gpt2(tokens[split])) for split in ("train", "val"))
    assert decoded == text
    assert len(decoded[:meta["train_chars"]]) + meta["val_chars"] == len(text)
    # encode -> dense -> GPT-2 ids -> text, for new text made of the corpus's tokens
    line = "ROMEO:\nWhat light through yonder window breaks?"
    assert encoder.decode(vocab.to_gpt2(vocab.to_dense(encoder.encode(line)))) == line


def test_a_token_the_corpus_never_uses_is_named():
    vocab = DenseVocab([3, 7, 50000])
    assert vocab.to_dense([50000, 3, 7]).tolist() == [2, 0, 1]
    with pytest.raises(ValueError, match="GPT-2 token 8 is not in the vocabulary"):
        vocab.to_dense([3, 8, 50256])
    with pytest.raises(ValueError, match="GPT-2 token 50256 is not in the vocabulary"):
        vocab.to_dense([50256])


def test_running_prepare_twice_gives_the_same_files_and_no_leftovers(data_dir, tmp_path):
    first = {name: digest(data_dir / name) for name in ("train.bin", "val.bin", "meta.json")}
    result = run_script("data/shakespeare/prepare.py", "--out_dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "301,966" in result.stdout and "36,059" in result.stdout
    result = run_script("data/shakespeare/prepare.py", "--out_dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert {name: digest(tmp_path / name) for name in first} == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_input_flag_beats_the_environment(tmp_path, monkeypatch):
    (tmp_path / "mine.txt").write_text("hello world\n" * 10)
    monkeypatch.setenv("TINYSHAKESPEARE_PATH", str(tmp_path / "does-not-exist.txt"))
    meta = prepare(str(tmp_path / "out"), input_path=str(tmp_path / "mine.txt"))
    assert meta["train_tokens"] + meta["val_tokens"] == 30


def test_missing_named_input_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYSHAKESPEARE_PATH", str(tmp_path / "nope.txt"))
    with pytest.raises(PrepareError, match="TINYSHAKESPEARE_PATH=.*nope.txt.*no such file"):
        prepare(str(tmp_path))
    result = run_script("data/shakespeare/prepare.py", "--input", tmp_path / "nope.txt", "--out_dir", tmp_path)
    assert result.returncode != 0
    assert "nope.txt" in result.stderr and "Traceback" not in result.stderr


def test_offline_with_no_input_says_where_to_put_the_file(tmp_path, monkeypatch):
    monkeypatch.delenv("TINYSHAKESPEARE_PATH", raising=False)
    monkeypatch.setattr(prepare_module, "SHARED_DATA", tmp_path / "no-shared-data")

    def no_network(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(prepare_module.urllib.request, "urlopen", no_network)
    with pytest.raises(PrepareError) as error:
        prepare(str(tmp_path))
    message = str(error.value)
    assert str(tmp_path / "input.txt") in message
    assert "--input" in message and "TINYSHAKESPEARE_PATH" in message
    assert not (tmp_path / "train.bin").exists()


def test_tiktoken_failure_is_said_plainly(tmp_path, monkeypatch):
    import tiktoken

    def cannot_load(name):
        raise ConnectionError("cannot reach the vocabulary host")

    monkeypatch.setattr(tiktoken, "get_encoding", cannot_load)
    with pytest.raises(PrepareError, match="(?s)tiktoken could not load.*TIKTOKEN_CACHE_DIR"):
        prepare(str(tmp_path))


def test_shared_data_beside_the_repo_fills_in_unset_variables_only(tmp_path, monkeypatch):
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_text("To be")
    (tmp_path / "tiktoken_cache").mkdir()
    monkeypatch.setattr(prepare_module, "SHARED_DATA", tmp_path)
    monkeypatch.delenv(prepare_module.INPUT_VAR, raising=False)
    monkeypatch.setenv(prepare_module.TIKTOKEN_VAR, "/my/cache")
    prepare_module.use_shared_data()
    assert os.environ[prepare_module.INPUT_VAR] == str(tmp_path / "tinyshakespeare" / "input.txt")
    assert os.environ[prepare_module.TIKTOKEN_VAR] == "/my/cache"


def test_the_data_package_imports_nothing_from_training():
    probe = ("import sys, data.batches, data.files, data.shakespeare.prepare\n"
             "print(sorted(name for name in sys.modules if name.split('.')[0] == 'training'))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]"]
