"""TinyShakespeare -> GPT-2 BPE token files train.bin and val.bin, plus meta.json.

    python data/shakespeare/prepare.py [--input PATH] [--out_dir DIR]

input.txt comes from the first of: --input PATH, the environment variable
TINYSHAKESPEARE_PATH, a copy already in the output folder, or a download of the char-rnn
copy nanoGPT uses.

Offline, the data is found by one rule, the same for the scripts and the tests
(use_shared_data): the environment variables TINYSHAKESPEARE_PATH (input.txt) and
TIKTOKEN_CACHE_DIR (tiktoken's cached gpt2 vocabulary) win; where one is unset, a folder
shared/data beside the repo fills it in if it holds the copy (the layout CI uses):

    shared/data/tinyshakespeare/input.txt
    shared/data/tiktoken_cache/
    nanoFA2/                      <- this repo

The first 90% of characters become train, the last 10% val; with the
real file that is 301,966 and 36,059 tokens. The GPT-2 ids the corpus uses are renumbered
densely (DenseVocab below) and stored as uint16. meta.json records the dtype, the vocabulary
(vocab_size and gpt2_ids, dense id -> GPT-2 id, which sample.py decodes with), the token
counts, so the trainer can tell a truncated or wrong-dtype file from a good one, and the
character counts, so a loss in nats per token converts to bits per character.

Every file is written to a temporary name in the same folder and renamed into place
(write_atomically, which train.py's checkpoints use too), so a run killed half way leaves
either the old file or the new one, never a torn one; meta.json is removed first and written
last, so its presence means the bins beside it are complete. Running the script twice is
harmless, and so is running it several times at once: each preparation holds a lock on the
folder (folder_lock: flock, released by the OS if the process dies).
"""
import argparse
import contextlib
import fcntl
import json
import os
import sys
import urllib.error
import urllib.request

from pathlib import Path

import numpy as np

DEFAULT_OUT_DIR = os.path.dirname(os.path.abspath(__file__))
SHARED_DATA = Path(DEFAULT_OUT_DIR).parent.parent.parent / "shared" / "data"  # beside the repo
INPUT_VAR = "TINYSHAKESPEARE_PATH"
TIKTOKEN_VAR = "TIKTOKEN_CACHE_DIR"
DOWNLOAD_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
ENCODING = "gpt2"
TOKEN_DTYPE = np.uint16
TRAIN_FRACTION = 0.9
# How many of GPT-2's tokens the real input.txt uses: the model's vocabulary after the remap, for
# code that builds the default model without the data (benchmarks); meta.json is the authority.
SHAKESPEARE_VOCAB_SIZE = 11706


class PrepareError(RuntimeError):
    pass


class DenseVocab:
    """The GPT-2 token ids a corpus uses, renumbered 0..V-1 in order of GPT-2 id.

    TinyShakespeare uses about a quarter of GPT-2's 50,257 tokens. A model over all of them
    spends most of its output layer, and much of its step, on logits of tokens that never
    occur (and learns to rule them out, which is all it ever learns about them). Text still
    goes through tiktoken's GPT-2 BPE; only the numbering of its tokens changes, and
    gpt2_ids (dense id i is GPT-2 token gpt2_ids[i]) turns it back."""

    def __init__(self, gpt2_ids):
        self.gpt2_ids = np.asarray(gpt2_ids, dtype=np.int64)
        if np.any(np.diff(self.gpt2_ids) <= 0):
            raise ValueError("gpt2_ids: expected strictly increasing GPT-2 token ids")

    @classmethod
    def of_corpus(cls, token_arrays):
        """The vocabulary of every GPT-2 id that occurs in any of the arrays."""
        return cls(np.unique(np.concatenate([np.asarray(tokens, dtype=np.int64) for tokens in token_arrays])))

    def __len__(self):
        return len(self.gpt2_ids)

    def to_dense(self, gpt2_tokens):
        """GPT-2 ids -> dense ids (int64 array); ValueError naming the first id it lacks."""
        gpt2_tokens = np.asarray(gpt2_tokens, dtype=np.int64)
        dense = np.searchsorted(self.gpt2_ids, gpt2_tokens).clip(max=len(self) - 1)
        missing = gpt2_tokens[self.gpt2_ids[dense] != gpt2_tokens]
        if len(missing):
            raise ValueError(f"GPT-2 token {int(missing[0])} is not in the vocabulary (the corpus never uses it)")
        return dense

    def to_gpt2(self, dense_tokens):
        """Dense ids -> GPT-2 ids (a list, as tiktoken's decode takes)."""
        return self.gpt2_ids[np.asarray(dense_tokens, dtype=np.int64)].tolist()


def prepare(out_dir=DEFAULT_OUT_DIR, input_path=None, skip_if=None):
    """Write train.bin, val.bin and meta.json into out_dir; return the meta dict.

    skip_if(out_dir) -> bool, asked under the folder's lock: when it is true the folder is left
    as it is and None returned. For callers that found the folder unprepared and may have
    waited for the lock while another process prepared it (re-preparing would delete the
    meta.json that process is about to read)."""
    use_shared_data()
    try:
        os.makedirs(out_dir, exist_ok=True)
        with folder_lock(out_dir):
            if skip_if is not None and skip_if(out_dir):
                return None
            return write_dataset(out_dir, input_path)
    except OSError as e:  # a file where the folder should be, no permission, a full disk
        raise PrepareError(f"cannot write the data to {out_dir!r}: {e.strerror or e} ({e.filename or out_dir})") from None


@contextlib.contextmanager
def folder_lock(path, wait=True):
    """Exclusive use of a folder among processes that ask for it, without a lock file to leave
    behind: flock on the folder itself. wait=False raises BlockingIOError when another process
    holds it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        yield
    finally:
        os.close(fd)  # closing releases the lock


def write_dataset(out_dir, input_path):
    text = read_text(find_input(out_dir, input_path))
    encoder = load_encoder()
    split_at = int(len(text) * TRAIN_FRACTION)
    splits = {"train": text[:split_at], "val": text[split_at:]}

    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.exists(meta_path):
        os.remove(meta_path)
    gpt2_tokens = {split: np.array(encoder.encode_ordinary(split_text), dtype=np.int64)
                   for split, split_text in splits.items()}
    vocab = DenseVocab.of_corpus(gpt2_tokens.values())
    if len(vocab) < 2:
        raise PrepareError(f"the text gives a vocabulary of {len(vocab)} token ({len(text):,} characters): "
                           "there is nothing to predict; use a real text")
    meta = {"encoding": ENCODING, "vocab_size": len(vocab), "dtype": np.dtype(TOKEN_DTYPE).name}
    for split, tokens in gpt2_tokens.items():
        dense = vocab.to_dense(tokens).astype(TOKEN_DTYPE)
        with write_atomically(os.path.join(out_dir, f"{split}.bin")) as f:
            f.write(dense.tobytes())
        meta[f"{split}_tokens"] = len(dense)
        meta[f"{split}_chars"] = len(splits[split])
    meta["gpt2_ids"] = vocab.gpt2_ids.tolist()
    with write_atomically(meta_path, "w") as f:
        f.write(json.dumps(meta, indent=2) + "\n")
    return meta


def use_shared_data():
    """Point the unset data variables at the copies in shared/data beside the repo, where they exist."""
    if (SHARED_DATA / "tinyshakespeare" / "input.txt").is_file():
        os.environ.setdefault(INPUT_VAR, str(SHARED_DATA / "tinyshakespeare" / "input.txt"))
    if (SHARED_DATA / "tiktoken_cache").is_dir():
        os.environ.setdefault(TIKTOKEN_VAR, str(SHARED_DATA / "tiktoken_cache"))


def find_input(out_dir, input_path):
    """The path of input.txt, downloading it into out_dir when no local copy is named or found."""
    if input_path is not None:
        if not os.path.isfile(input_path):
            raise PrepareError(f"--input {input_path!r}: no such file")
        return input_path
    env_path = os.environ.get(INPUT_VAR)
    if env_path:
        if not os.path.isfile(env_path):
            raise PrepareError(f"{INPUT_VAR}={env_path!r}: no such file")
        return env_path
    local_path = os.path.join(out_dir, "input.txt")
    if os.path.isfile(local_path):
        return local_path
    print(f"downloading {DOWNLOAD_URL}")
    try:
        with urllib.request.urlopen(DOWNLOAD_URL, timeout=60) as response:
            body = response.read()
    except (urllib.error.URLError, OSError) as e:
        raise PrepareError(
            f"no TinyShakespeare input.txt found and the download failed ({e}).\n"
            f"Put the file at {local_path}, or pass --input PATH, or set {INPUT_VAR}=PATH "
            "(see README.md, 'Offline data')."
        ) from None
    with write_atomically(local_path) as f:
        f.write(body)
    return local_path


def read_text(path):
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise PrepareError(f"cannot read {path!r} as UTF-8 text: {e}") from None
    if not text:
        raise PrepareError(f"{path!r} is empty")
    return text


def load_encoder():
    """tiktoken's gpt2 encoding; a clear error when offline without a cached copy."""
    import tiktoken  # imported here so the error below can say plainly what is missing

    use_shared_data()
    try:
        return tiktoken.get_encoding(ENCODING)
    except Exception as e:
        raise PrepareError(
            f"tiktoken could not load the {ENCODING!r} encoding ({type(e).__name__}: {e}).\n"
            "tiktoken downloads its vocabulary files once and caches them; offline, set "
            "TIKTOKEN_CACHE_DIR to a folder that holds them (see README.md, 'Offline data')."
        ) from None


@contextlib.contextmanager
def write_atomically(path, mode="wb"):
    """`with write_atomically(path) as f:` writes f to `path` all at once, or not at all. f is
    `path`.tmp in the same folder, flushed and fsynced, then renamed over `path`: a rename within
    one filesystem is atomic, so a process killed at any moment (SIGKILL included) leaves either
    the previous complete file or the new one, and at worst a stale `path`.tmp, which the next
    write replaces. A write that fails (a full disk) removes `path`.tmp and re-raises. One writer
    per folder at a time: callers hold the folder's lock (folder_lock)."""
    tmp_path = path + ".tmp"
    try:
        with open(tmp_path, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp_path)
        raise
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)  # the rename is durable once its folder is
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", help=f"path of input.txt (else ${INPUT_VAR}, a copy in --out_dir, or a download)")
    parser.add_argument("--out_dir", default=DEFAULT_OUT_DIR, help="folder for train.bin, val.bin, meta.json")
    args = parser.parse_args()
    try:
        meta = prepare(args.out_dir, args.input)
    except PrepareError as e:
        sys.exit(f"prepare error: {e}")
    print(f"train.bin has {meta['train_tokens']:,} tokens, val.bin has {meta['val_tokens']:,} tokens "
          f"({meta['dtype']}, {meta['vocab_size']:,} of {meta['encoding']}'s tokens) in {args.out_dir}")


if __name__ == "__main__":
    main()
