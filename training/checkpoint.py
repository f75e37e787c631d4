"""Checkpoints that survive being killed mid-write, and clear errors for bad ones.

save_checkpoint writes ckpt.pt atomically (training/atomic.py): a process killed at any
moment leaves the previous complete checkpoint or the new one. A write that fails (a full
disk, an I/O error) removes its ckpt.pt.tmp and raises a CheckpointError that says so in one
line; ckpt.pt is untouched.

Checkpoints hold only tensors and plain Python values, so they load with
torch.load(weights_only=True), which cannot run code hidden in a tampered file.
"""
import os
import random
import shutil

import numpy as np
import torch

from training.atomic import write_atomically

CHECKPOINT_NAME = "ckpt.pt"
# What every reader of a checkpoint relies on (train.py's resume checks the optimizer, scaler
# and random streams as it loads them): entry -> (check, what was expected).
ENTRIES = {
    "model": (lambda value: isinstance(value, dict), "a state dict"),
    "model_args": (lambda value: isinstance(value, dict), "a dict of GPTConfig fields"),
    "iter": (lambda value: type(value) is int and value >= 0, "an int >= 0"),
    "best_val_loss": (lambda value: type(value) in (int, float) and value == value, "a number (not NaN)"),
}


class CheckpointError(RuntimeError):
    pass


def checkpoint_path(out_dir):
    return os.path.join(out_dir, CHECKPOINT_NAME)


def save_checkpoint(state, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    path = checkpoint_path(out_dir)
    try:
        with write_atomically(path, "wb") as f:
            torch.save(state, f)
    # torch.save reports a failed write as a RuntimeError ("enforce fail at
    # inline_container.cc"), flush and fsync as an OSError.
    except (OSError, RuntimeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0]
        free_mb = shutil.disk_usage(out_dir).free / 2**20
        raise CheckpointError(f"could not write {path} ({reason}; {free_mb:,.0f} MB free on its disk). "
                              "The partial file was removed and the previous checkpoint, if any, is intact; "
                              "free some space, then continue with --init_from=resume") from None


def load_checkpoint(out_dir):
    """The checkpoint in out_dir, loaded to the CPU (load_state_dict moves tensors to the
    model's device), or a CheckpointError saying what is wrong with it."""
    path = checkpoint_path(out_dir)
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}: train one first, or check out_dir")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path} cannot be read, it is truncated or corrupt ({type(e).__name__}: "
                              f"{e}). Restore it from a copy, or train from scratch") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a nanoFA2 checkpoint (it holds a {type(state).__name__})")
    missing = [key for key in ENTRIES if key not in state]
    if missing:
        raise CheckpointError(f"{path} is not a nanoFA2 checkpoint (it lacks {', '.join(missing)})")
    for key, (ok, expected) in ENTRIES.items():
        if not ok(state[key]):
            raise CheckpointError(f"{path} is not a nanoFA2 checkpoint: its {key} is {short_repr(state[key])}, "
                                  f"expected {expected}")
    return state


def short_repr(value, limit=60):
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# The GPTConfig fields that fix the weights' shapes: a checkpoint resumes only into a model
# that agrees on all of them (dropout and attn may change between runs).
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size")


def check_same_shape(saved_args, model_args, path):
    """Raise a CheckpointError naming every shape field where the checkpoint's model
    (saved_args, a dict) and this run's (model_args, a GPTConfig) differ."""
    differences = [f"{key}={saved_args.get(key)!r} there, {getattr(model_args, key)!r} here"
                   for key in SHAPE_KEYS if saved_args.get(key) != getattr(model_args, key)]
    if differences:
        raise CheckpointError(f"{path} holds a model of a different shape ({'; '.join(differences)}). "
                              "Resume with the config it was trained with, or train from scratch in another out_dir")


def rng_states(sampler, device):
    """Every random stream a training step reads, so a resumed run draws the same numbers.
    Plain values and CPU tensors only, so the checkpoint loads with weights_only=True."""
    np_name, np_key, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),  # dropout on the CPU
        # Dropout on this process's GPU; only its own, as asking for every GPU's state would
        # start a CUDA context on each of them from every process.
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": (np_name, torch.from_numpy(np_key.astype(np.int64)), np_pos, np_has_gauss, np_gauss),
        "python": random.getstate(),
        "sampler": sampler.get_state(),  # which training windows come next
    }


def restore_rng_states(states, sampler, device):
    """Set every stream back to what rng_states saved."""
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)
    np_name, np_key, np_pos, np_has_gauss, np_gauss = states["numpy"]
    np.random.set_state((np_name, np_key.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    random.setstate(states["python"])
    sampler.set_state(states["sampler"])
