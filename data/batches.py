"""Token files on disk -> checked memmaps -> random (x, y) batches. A data folder holds train.bin
and val.bin (flat token ids) and meta.json (dtype, vocabulary, token and character counts); each
file is checked against meta.json before training, so a bad one is a clear DataError at once.
"""
import json
import os
import sys

import numpy as np
import torch

from data.shakespeare.prepare import prepare

SPLITS = ("train", "val")
# Fewer train tokens than this is a text a model learns by heart within a few hundred steps,
# where val loss says little (TinyShakespeare gives 301,966): worth a warning, not a refusal.
FEW_TRAIN_TOKENS = 100_000
TOKEN_DTYPES = ("uint8", "uint16", "uint32")  # token ids are >= 0, and int64 holds any of these


def is_positive_int(value):
    return type(value) is int and value >= 1  # bool is a subclass of int, hence no isinstance


# Every field of meta.json the readers use -> (check, what was expected). A folder whose
# meta.json lacks one (an older prepare.py wrote it) is prepared again (is_prepared).
META_FIELDS = {
    "dtype": (lambda value: value in TOKEN_DTYPES, f"one of {', '.join(TOKEN_DTYPES)}"),
    "vocab_size": (lambda value: is_positive_int(value) and value >= 2, "an int >= 2 (one token leaves nothing to predict)"),
    # Increasing, as prepare.py's DenseVocab writes them: sample.py and resume refuse any other.
    "gpt2_ids": (lambda value: isinstance(value, list) and all(type(i) is int and i >= 0 for i in value)
                 and all(a < b for a, b in zip(value, value[1:])),
                 "a list of strictly increasing GPT-2 token ids (ints >= 0)"),
    "train_tokens": (is_positive_int, "an int >= 1"),
    "val_tokens": (is_positive_int, "an int >= 1"),
    "train_chars": (is_positive_int, "an int >= 1"),
    "val_chars": (is_positive_int, "an int >= 1"),
}


class DataError(RuntimeError):
    pass


class ShortDataError(ValueError):
    """A split shorter than the block_size asked: a setting this data cannot run, which train.py
    reports as a config error (exit 2) rather than as bad data."""


def is_prepared(data_dir):
    """True when meta.json (written last) and both token files exist, and meta.json has every
    key this version reads: a folder an older prepare.py wrote is prepared again."""
    names = ["meta.json"] + [f"{split}.bin" for split in SPLITS]
    if not all(os.path.exists(os.path.join(data_dir, name)) for name in names):
        return False
    try:
        with open(os.path.join(data_dir, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return True  # there, but unreadable: read_meta says so rather than overwriting it
    return not isinstance(meta, dict) or all(key in meta for key in META_FIELDS)


def read_meta(data_dir):
    path = os.path.join(data_dir, "meta.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise DataError(f"{path} is missing: prepare the data first "
                        "(python data/shakespeare/prepare.py)") from None
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is unreadable ({e}): prepare the data again") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path} holds {type(meta).__name__}, not an object of fields: prepare the data again")
    missing = [key for key in META_FIELDS if key not in meta]
    if missing:
        raise DataError(f"{path} lacks {', '.join(missing)}: prepare the data again")
    for key, (ok, expected) in META_FIELDS.items():
        if not ok(meta[key]):
            text = repr(meta[key])  # gpt2_ids is thousands of ids long
            raise DataError(f"{path} has {key}={text if len(text) <= 60 else text[:60] + '...'}, expected {expected}: "
                            "prepare the data again")
    if len(meta["gpt2_ids"]) != meta["vocab_size"]:
        raise DataError(f"{path} has {len(meta['gpt2_ids'])} gpt2_ids for vocab_size={meta['vocab_size']}, "
                        "expected one GPT-2 id per token id: prepare the data again")
    largest_id = np.iinfo(meta["dtype"]).max
    if meta["vocab_size"] - 1 > largest_id:
        raise DataError(f"{path} has vocab_size={meta['vocab_size']}, but its dtype {meta['dtype']} holds ids up "
                        f"to {largest_id} only: prepare the data again")
    return meta


def open_split(data_dir, split, meta, block_size):
    """The split's tokens as a read-only memmap, after checking size, dtype and ids."""
    path = os.path.join(data_dir, f"{split}.bin")
    redo = "prepare the data again (python data/shakespeare/prepare.py)"
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise DataError(f"{path} is missing: {redo}") from None
    if size == 0:
        raise DataError(f"{path} is empty: {redo}")
    dtype = np.dtype(meta["dtype"])
    count = meta[f"{split}_tokens"]
    expected = count * dtype.itemsize
    if size != expected:
        if size % count == 0 and size // count != dtype.itemsize:
            found = f"{size // count} bytes per token, not {dtype.itemsize} ({dtype.name}): wrong dtype?"
        elif size < expected:
            found = "truncated"
        else:
            found = "longer than meta.json says"
        raise DataError(f"{path} is {size:,} bytes but meta.json says {count:,} {dtype.name} tokens "
                        f"= {expected:,} bytes; {found}. {redo}")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    # Both ends, so a signed TOKEN_DTYPES entry added later cannot let a negative id through.
    for token_id in (int(tokens.min()), int(tokens.max())):
        if not 0 <= token_id < meta["vocab_size"]:
            raise DataError(f"{path} holds token id {token_id}, outside the vocabulary of {meta['vocab_size']} "
                            f"(ids 0 to {meta['vocab_size'] - 1}; wrong dtype or a different tokenizer?). {redo}")
    if len(tokens) <= block_size:
        raise ShortDataError(f"block_size={block_size} needs at least {block_size + 1} tokens per sample, "
                          f"but {path} has {len(tokens):,}; use a smaller block_size")
    return tokens


class Batches:
    """Random windows of block_size tokens, y being x shifted by one. Every draw takes a
    torch.Generator, whose state a checkpoint keeps, so that a resumed run sees the same batches."""

    def __init__(self, data_dir, block_size, batch_size, device):
        meta = read_meta(data_dir)
        self.vocab_size = meta["vocab_size"]
        self.gpt2_ids = meta["gpt2_ids"]  # dense token id -> GPT-2 id, for decoding (sample.py)
        # Nats per token times tokens per character: comparable with character-level models.
        self.tokens_per_char = {split: meta[f"{split}_tokens"] / meta[f"{split}_chars"] for split in SPLITS}
        self.splits = {split: open_split(data_dir, split, meta, block_size) for split in SPLITS}
        self.data_dir = data_dir
        self.block_size = block_size
        self.batch_size = batch_size
        self.device = torch.device(device)

    def size_warning(self):
        """A warning line when the data is much smaller than TinyShakespeare, else None."""
        train, val = (len(self.splits[split]) for split in SPLITS)
        if train >= FEW_TRAIN_TOKENS:
            return None
        return (f"warning: {self.data_dir} holds only {train:,} train and {val:,} val tokens over a vocabulary of "
                f"{self.vocab_size:,} (TinyShakespeare gives 301,966 and 36,059 over 11,706): a model learns so "
                "little text by heart, and its val loss says little")

    def get(self, split, generator):
        tokens = self.splits[split]
        starts = torch.randint(len(tokens) - self.block_size, (self.batch_size,), generator=generator)
        x = torch.from_numpy(np.stack([tokens[i:i + self.block_size] for i in starts.tolist()]).astype(np.int64))
        y = torch.from_numpy(np.stack([tokens[i + 1:i + 1 + self.block_size] for i in starts.tolist()]).astype(np.int64))
        if self.device.type == "cuda":  # pinned host memory: the copy runs while the GPU is busy
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x, y


def load_batches(data_dir, block_size, batch_size, device, world):
    """The Batches of data_dir. Rank 0 prepares missing data while the others wait, and warns of
    data much smaller than TinyShakespeare."""
    if world.is_main and not is_prepared(data_dir):
        print(f"no prepared data in {data_dir} (or data an older prepare.py wrote): running data/shakespeare/prepare.py")
        meta = prepare(data_dir, skip_if=is_prepared)  # another run may have prepared it meanwhile
        if meta is not None:
            print(f"prepared {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens")
    world.barrier()
    batches = Batches(data_dir, block_size, batch_size, device)
    if world.is_main and batches.size_warning():
        print(batches.size_warning(), file=sys.stderr)
    return batches
