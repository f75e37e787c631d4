"""TinyShakespeare -> GPT-2 BPE token files train.bin and val.bin, plus meta.json.

    python data/shakespeare/prepare.py [--input PATH] [--out_dir DIR]

input.txt comes from --input, $TINYSHAKESPEARE_PATH, a copy in the output folder, or a download.
Offline, shared/data beside the repo fills in TINYSHAKESPEARE_PATH (tinyshakespeare/input.txt)
and TIKTOKEN_CACHE_DIR (tiktoken_cache/) where unset. The first 90% of characters are train,
the rest val; the GPT-2 ids the text uses are renumbered densely (DenseVocab), as uint16.
meta.json (written last) holds the dtype, gpt2_ids, token and character counts. Every file is
written atomically under the folder's lock, so running the script twice, or at once, is harmless.
"""
import argparse
import json
import os
import sys
import urllib.error
import urllib.request

from pathlib import Path

import numpy as np

if __name__ == "__main__":  # run as a script: Python puts this folder on the path, not the repo root that holds data/
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from data.files import folder_lock, write_atomically  # noqa: E402

DEFAULT_OUT_DIR = os.path.dirname(os.path.abspath(__file__))
SHARED_DATA = Path(DEFAULT_OUT_DIR).parent.parent.parent / "shared" / "data"  # beside the repo
INPUT_VAR = "TINYSHAKESPEARE_PATH"
TIKTOKEN_VAR = "TIKTOKEN_CACHE_DIR"
DOWNLOAD_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
ENCODING = "gpt2"
TOKEN_DTYPE = np.uint16
TRAIN_FRACTION = 0.9


class PrepareError(RuntimeError):
    pass


class DenseVocab:
    """The GPT-2 token ids a corpus uses, renumbered 0..V-1 in order (dense id i is GPT-2 token
    gpt2_ids[i]). TinyShakespeare uses a quarter of GPT-2's 50,257 tokens: a model over all of
    them would spend most of its output layer on logits of tokens that never occur."""

    def __init__(self, gpt2_ids):
        self.gpt2_ids = np.asarray(gpt2_ids, dtype=np.int64)
        if np.any(np.diff(self.gpt2_ids) <= 0):
            raise ValueError("gpt2_ids: expected strictly increasing GPT-2 token ids")

    def to_dense(self, gpt2_tokens):
        """GPT-2 ids -> dense ids (int64 array); ValueError naming the first id it lacks."""
        gpt2_tokens = np.asarray(gpt2_tokens, dtype=np.int64)
        dense = np.searchsorted(self.gpt2_ids, gpt2_tokens).clip(max=len(self.gpt2_ids) - 1)
        missing = gpt2_tokens[self.gpt2_ids[dense] != gpt2_tokens]
        if len(missing):
            raise ValueError(f"GPT-2 token {int(missing[0])} is not in the vocabulary (the corpus never uses it)")
        return dense

    def to_gpt2(self, dense_tokens):
        """Dense ids -> GPT-2 ids (a list, as tiktoken's decode takes)."""
        return self.gpt2_ids[np.asarray(dense_tokens, dtype=np.int64)].tolist()


def prepare(out_dir=DEFAULT_OUT_DIR, input_path=None, skip_if=None):
    """Write train.bin, val.bin and meta.json into out_dir; return the meta dict, or None when
    skip_if(out_dir), asked under the lock, is true (another process prepared it meanwhile)."""
    use_shared_data()
    try:
        os.makedirs(out_dir, exist_ok=True)
        with folder_lock(out_dir, announce=f"waiting for {out_dir}: another process holds its lock (a prepare.py "
                                           "writing the data there, or a train.py run whose out_dir it is)"):
            if skip_if is not None and skip_if(out_dir):
                return None
            return write_dataset(out_dir, input_path)
    except OSError as e:  # a file where the folder should be, no permission, a full disk
        raise PrepareError(f"cannot write the data to {out_dir!r}: {e.strerror or e} ({e.filename or out_dir})") from None


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
    vocab = DenseVocab(np.unique(np.concatenate(list(gpt2_tokens.values()))))
    if len(vocab.gpt2_ids) < 2:
        raise PrepareError(f"the text gives a vocabulary of {len(vocab.gpt2_ids)} token ({len(text):,} characters): "
                           "there is nothing to predict; use a real text")
    meta = {"encoding": ENCODING, "vocab_size": len(vocab.gpt2_ids), "dtype": np.dtype(TOKEN_DTYPE).name}
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
    for named, path in (("--input ", input_path), (f"{INPUT_VAR}=", os.environ.get(INPUT_VAR))):
        if path and not os.path.isfile(path):
            raise PrepareError(f"{named}{path!r}: no such file")
        if path:
            return path
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
