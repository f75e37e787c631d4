"""What a training run keeps in its out_dir (and sends to wandb), checked when read, written
whole or not at all: ckpt.pt (the best checkpoint by val loss, what sample.py reads), resume.pt
(where a signal stopped the run, never over ckpt.pt), config.json (the settings, resolved) and
metrics.jsonl (a JSON record a line: LOG_KEYS and EVAL_KEYS). Rank 0 alone writes, holding
out_dir's lock; a failed write or an unusable file is a one-line RunFileError. Checkpoints hold
only tensors and plain values (torch.load's weights_only=True), checked before anything trusts them.
"""
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from data.files import folder_lock, write_atomically
from model import GPTConfig
from training.config import BACKENDS, CHECKPOINT_NAME, CONFIG_NAME, METRICS_NAME, RESUME_NAME, ConfigError
from training.profiling import remove_profile

LOG_KEYS = ("iter", "loss", "lr", "step_ms", "tokens_per_s", "mfu", "peak_mem_mb", "warmup")
EVAL_KEYS = ("iter", "train_loss", "val_loss", "val_bpc")
# A GradScaler's state: empty when it is off (fp32 and bf16), else these five numbers.
SCALER_KEYS = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
PROGRESS_SECONDS = 5  # a step or an evaluation that runs this long past the last line prints its progress


class RunFileError(RuntimeError):
    pass


@contextlib.contextmanager
def out_dir_lock(out_dir):
    """Make out_dir and hold it for this run: a second run on it is refused (exit 2) rather than
    interleaving its files with this one's. flock, which the OS releases however the process ends."""
    os.makedirs(out_dir, exist_ok=True)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(folder_lock(out_dir, wait=False))
        except BlockingIOError:
            raise ConfigError(f"out_dir={out_dir!r} is in use by another train.py run; wait for it to end, "
                              "or pick another out_dir") from None
        yield


@contextlib.contextmanager
def writing(path, left="free some space and run again", errors=(OSError,)):
    """Turn a failed write of `path` into a RunFileError saying in one line what to do."""
    try:
        yield
    except errors as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else first_line(e)
        free_mb = shutil.disk_usage(os.path.dirname(path) or ".").free / 2**20
        raise RunFileError(f"could not write {path} ({reason}; {free_mb:,.0f} MB free on its disk); {left}") from None


def first_line(error):
    """The first line of error's text; its type's name where it has none (torch.load's EOFError
    on an empty file)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def save_checkpoint(state, path):
    # torch.save reports a failed write as a RuntimeError ("enforce fail at inline_container.cc").
    with writing(path, "the partial file was removed and the previous checkpoint, if any, is intact; free some "
                       "space, then continue with --init_from=resume", (OSError, RuntimeError)):
        with write_atomically(path) as f:
            torch.save(state, f)


def resume_point(out_dir):
    """The checkpoint --init_from=resume continues from: resume.pt where a signal left one, else ckpt.pt."""
    path = os.path.join(out_dir, RESUME_NAME)
    return path if os.path.exists(path) else os.path.join(out_dir, CHECKPOINT_NAME)


def load_checkpoint(path, resume=False):
    """The checkpoint at path, loaded to the CPU and checked; resume=True asks for what training needs too."""
    if not os.path.exists(path):
        raise RunFileError(f"no checkpoint at {path}: train one first, or check out_dir")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        reason = f"{type(e).__name__}: {first_line(e)}" if str(e).strip() else type(e).__name__
        raise RunFileError(f"{path} cannot be read, it is truncated or corrupt ({reason}). Restore it from a copy, "
                           "or train from scratch") from None
    check_checkpoint(state, path, resume)
    return state


def check_checkpoint(state, path, resume):
    """Raise a RunFileError naming the first entry of the checkpoint that is missing or wrong."""
    if not isinstance(state, dict):
        raise RunFileError(f"{path} is not a nanoFA2 checkpoint (it holds a {type(state).__name__})")
    needed = ["model", "model_args", "iter", "best_val_loss"]
    needed += ["optimizer", "scaler", "rng", "gpt2_ids", "eval_pending"] if resume else []
    missing = [key for key in needed if key not in state]
    if missing:
        raise RunFileError(f"{path} is not a nanoFA2 checkpoint (it lacks {', '.join(missing)})")
    for key, check in CHECKS.items():
        problem = check(state[key]) if key in state else None
        if problem:
            raise RunFileError(f"{path} is not a nanoFA2 checkpoint: its {key} {problem}")
    if resume and state["gpt2_ids"] is None:
        raise RunFileError(f"{path} has no gpt2_ids (a checkpoint over GPT-2's own ids, from before prepare.py "
                           "renumbered them): it cannot resume on today's data; train from scratch")
    ids = state.get("gpt2_ids")
    if ids is not None and len(ids) != state["model_args"].get("vocab_size", GPTConfig.vocab_size):
        raise RunFileError(f"{path} is not a nanoFA2 checkpoint: its {len(ids)} gpt2_ids do not match its "
                           f"model's vocab_size={state['model_args'].get('vocab_size')}")


def expect(ok, value, expected):
    """None when ok, else what was wrong: "is <value>, expected <expected>"."""
    text = repr(value)
    return None if ok else f"is {text if len(text) <= 60 else text[:60] + '...'}, expected {expected}"


def check_model_args(args):
    """Every field is GPTConfig's (one added since takes its default), of its type and a value a
    model can have, and attn is a backend."""
    if not isinstance(args, dict):
        return expect(False, args, "a dict of GPTConfig fields")
    fields = {field.name: field for field in dataclasses.fields(GPTConfig)}
    for key, value in args.items():
        if key not in fields:
            return f"has a field {key!r} that GPTConfig lacks (its fields: {', '.join(fields)})"
        kind = fields[key].type
        if not (type(value) is kind or kind is float and type(value) is int):
            return f"has {key}={value!r}, expected {kind.__name__}"
    if args.get("attn", "eager") not in BACKENDS:
        return f"has attn={args['attn']!r}, expected one of {', '.join(BACKENDS)}"
    c = GPTConfig(**args)
    broken = [key for key, ok in [
        ("block_size", c.block_size >= 1), ("vocab_size", c.vocab_size >= 1), ("n_layer", c.n_layer >= 1),
        ("n_head", c.n_head >= 1 and c.n_embd % c.n_head == 0),
        ("n_kv_head", c.n_kv_head >= 1 and c.n_head % c.n_kv_head == 0),
        ("window", -1 <= c.window < 2 ** 63), ("dropout", 0 <= c.dropout < 1)] if not ok]
    return f"has {broken[0]}={args.get(broken[0])!r}, which no GPT of its other fields can have" if broken else None


def check_rng(states):
    """One dict of random states per process that saved it, each tried on a generator of its own."""
    if not isinstance(states, list) or not states:
        return expect(False, states, "a list with one set of random states per process")
    for rank, state in enumerate(states):
        try:
            torch.Generator().set_state(state["torch"])
            torch.Generator().set_state(state["sampler"])
            if state["cuda"] is not None and not (isinstance(state["cuda"], torch.Tensor)
                                                  and state["cuda"].dtype == torch.uint8):
                raise TypeError("not a byte tensor")
            np.random.RandomState().set_state(numpy_state(state["numpy"]))
            random.Random().setstate(state["python"])
        except Exception as e:
            return f"entry {rank} is not a set of random states ({type(e).__name__}: {e})"
    return None


CHECKS = {
    "model": lambda value: expect(isinstance(value, dict) and all(isinstance(t, torch.Tensor) for t in value.values()),
                                  value, "a state dict of tensors"),
    "model_args": check_model_args,
    "iter": lambda value: expect(type(value) is int and value >= 0, value, "an int >= 0"),
    "best_val_loss": lambda value: expect(type(value) in (int, float) and value == value, value, "a number (not NaN)"),
    "optimizer": lambda value: expect(isinstance(value, dict) and isinstance(value.get("state"), dict)
                                      and isinstance(value.get("param_groups"), list), value, "an optimizer state dict"),
    "scaler": lambda value: expect(isinstance(value, dict) and (not value or set(value) == SCALER_KEYS and all(
        type(v) in (int, float) and math.isfinite(v) and v >= 0 for v in value.values())), value,
        f"a GradScaler's state: empty, or {', '.join(sorted(SCALER_KEYS))} as numbers"),
    "rng": check_rng,
    "gpt2_ids": lambda value: expect(value is None or isinstance(value, list) and all(type(i) is int for i in value)
                                     and all(a < b for a, b in zip(value, value[1:])), value,
                                     "None or a list of increasing GPT-2 token ids"),
    "eval_pending": lambda value: expect(type(value) is bool, value, "a bool"),
    "config": lambda value: expect(isinstance(value, dict), value, "a dict of settings"),
    "wandb_run_id": lambda value: expect(value is None or isinstance(value, str), value, "None or a string"),
}


def check_fits(ckpt, path, model_args, gpt2_ids, data_dir):
    """Refuse to resume into a model of another shape or window (dropout and attn may change), or
    on data whose token ids mean other GPT-2 tokens. The window shapes no weight, but weights
    trained under one attention pattern would go on under another, and the next checkpoint name it."""
    model_keys = ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "bias", "vocab_size", "window")
    saved = dataclasses.asdict(GPTConfig(**ckpt["model_args"]))  # fields it lacks take their defaults
    differences = [f"{key}={saved[key]!r} there, {getattr(model_args, key)!r} here"
                   for key in model_keys if saved[key] != getattr(model_args, key)]
    if differences:
        raise RunFileError(f"{path} holds a model of a different shape or window ({'; '.join(differences)}). "
                           "Resume with the config it was trained with, or train from scratch in another out_dir")
    saved_ids = ckpt["gpt2_ids"]
    if saved_ids != gpt2_ids:
        first = next(i for i, (a, b) in enumerate(zip(saved_ids, gpt2_ids)) if a != b)  # same size: shapes agree
        raise RunFileError(f"{path} was trained on another vocabulary than {data_dir} holds: token id {first} is GPT-2 "
                           f"token {saved_ids[first]} there and {gpt2_ids[first]} here. Resume on the data it trained "
                           "on, or train from scratch")


def restore_checkpoint(ckpt, path, model, optimizer, scaler, sampler, device, world):
    """Load a checkpoint into the model, optimizer, scaler and this process's random streams."""
    saved_rng = ckpt["rng"]
    try:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        if world.rank < len(saved_rng):  # every stream rng_states saved
            states = saved_rng[world.rank]
            torch.set_rng_state(states["torch"])
            if states["cuda"] is not None and device.type == "cuda":
                torch.cuda.set_rng_state(states["cuda"], device)
            np.random.set_state(numpy_state(states["numpy"]))
            random.setstate(states["python"])
            sampler.set_state(states["sampler"])
    except (KeyError, RuntimeError, TypeError, ValueError) as e:
        raise RunFileError(f"{path} does not fit this model and optimizer: {e}") from None
    if world.is_main:
        print(f"resuming from {path} at iter {ckpt['iter']} (best val loss {ckpt['best_val_loss']:.4f})"
              + (", its evaluation cut short by a signal: evaluating again" if ckpt["eval_pending"] else "")
              + ("" if len(saved_rng) == world.size else f"; saved by {len(saved_rng)} processes, not {world.size}, "
                 "so the batches from here on differ from an uninterrupted run's"))


def numpy_state(saved):
    """numpy's get_state() tuple from the checkpoint's form of it (the key as a tensor)."""
    name, key, pos, has_gauss, gauss = saved
    return name, key.numpy().astype(np.uint32), pos, has_gauss, gauss


def rng_states(sampler, device):
    """Every random stream a training step reads, as plain values and CPU tensors (weights_only=True)."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),  # dropout on the CPU
        # Dropout on this process's GPU only: every GPU's state would start a context on each.
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": (name, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, gauss),
        "python": random.getstate(),
        "sampler": sampler.get_state(),  # which training windows come next
    }


def start_out_dir(out_dir, run_config, resumed_at, eval_pending):
    """Make out_dir this run's (rank 0, under its lock): a run from scratch (resumed_at None)
    removes the checkpoints there; a resumed run keeps the metrics up to its checkpoint's
    iteration (the stopped run may have logged past it), less that iteration's evaluation if it
    is to run again. metrics.jsonl is rewritten atomically, so that it reads as one run."""
    if resumed_at is None:
        for name in (CHECKPOINT_NAME, RESUME_NAME):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(out_dir, name))
    remove_profile(out_dir)
    metrics_path, config_path = os.path.join(out_dir, METRICS_NAME), os.path.join(out_dir, CONFIG_NAME)
    kept = []
    if resumed_at is not None and os.path.exists(metrics_path):
        kept = [record for record in read_metrics(out_dir) if record.get("iter", math.inf) < resumed_at
                or record.get("iter") == resumed_at and not (eval_pending and "val_loss" in record)]
    with writing(metrics_path), write_atomically(metrics_path, "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in kept)
    with writing(config_path), open(config_path, "w") as f:
        f.write(json.dumps(run_config, indent=2) + "\n")


def start_wandb(config, run_config, run_id):
    """A wandb run in out_dir/wandb logging what metrics.jsonl gets (run_id: the one a resumed run
    continues), or None, with a warning, when wandb cannot be imported."""
    try:
        import wandb
    except ImportError:
        print(f"warning: wandb_log=True but wandb cannot be imported (pip install wandb); "
              f"logging to {config.out_dir}/metrics.jsonl only", file=sys.stderr)
        return None
    try:
        return wandb.init(project=config.wandb_project, name=config.wandb_run_name, config=run_config,
                          dir=config.out_dir, id=run_id, resume="allow" if run_id else None)
    except wandb.errors.UsageError as e:  # no API key (online, and no terminal to ask for one)
        raise ConfigError(f"wandb_log=True but wandb cannot start a run ({e}). Run `wandb login` once, or set "
                          "WANDB_MODE=offline to keep the run in out_dir/wandb for a later `wandb sync`") from None


class RunLog:
    """What rank 0 reports: lines on stdout, records in metrics.jsonl and wandb. It keeps the
    timings behind the ETA, and the time of the last line, so that a step or evaluation running
    PROGRESS_SECONDS past it can say how far it has got: a slow run never sits silent."""

    def __init__(self, config, micro_steps):
        self.config, self.micro_steps = config, micro_steps
        self.wandb_run = None
        # Timed past their warm-up (compiling, tuning, the allocator's caches), which would make
        # an ETA of hours of a run of minutes: step_s, a step's mean after train.py's timing
        # warm-up; batch_s, an evaluation batch's mean over every batch but this process's first.
        self.step_s = self.batch_s = None
        self.eval_batches = 0
        self.last_line = time.perf_counter()

    def line(self, text):
        print(text)
        self.last_line = time.perf_counter()

    def record(self, record):
        path = os.path.join(self.config.out_dir, METRICS_NAME)
        with writing(path), open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({key: value for key, value in record.items() if key != "iter"}, step=record["iter"])

    def due(self):
        return time.perf_counter() - self.last_line > PROGRESS_SECONDS

    def time_eval_batch(self, seconds):
        self.eval_batches += 1
        if self.eval_batches > 1:  # the first compiles and tunes
            self.batch_s = seconds if self.batch_s is None else self.batch_s + (seconds - self.batch_s) / (
                self.eval_batches - 1)

    def estimates(self):
        """(step_s, batch_s), or (None, None) before either is timed. Until one is, the other
        stands in for it: a micro-batch's forward and backward cost about three evaluation batches."""
        if self.step_s is None and self.batch_s is None:
            return None, None
        step_s = self.step_s or 3 * self.micro_steps * self.batch_s
        return step_s, self.batch_s or step_s / (3 * self.micro_steps)

    def eta(self, it, eval_pending, eval_batches_left=None):
        """'ETA h:mm:ss', the time left after iteration it: the steps to go, the evaluations due,
        and eval_batches_left batches of the one running; 'warming up' before anything is timed
        past its warm-up."""
        step_s, batch_s = self.estimates()
        if step_s is None:
            return "warming up"
        config = self.config
        evaluations = config.max_iters // config.eval_interval + (config.max_iters % config.eval_interval > 0)
        evaluations = evaluations - it // config.eval_interval if it < config.max_iters else 0  # after iteration it
        evaluations += eval_pending if eval_batches_left is None else 0  # iteration it's, not started yet
        batches = (eval_batches_left or 0) + evaluations * 2 * config.eval_iters
        return "ETA " + tqdm.format_interval((config.max_iters - it) * step_s + batches * batch_s)


def read_run_config(out_dir):
    with open(os.path.join(out_dir, CONFIG_NAME), encoding="utf-8") as f:
        return json.load(f)


def read_metrics(out_dir):
    """The records of out_dir/metrics.jsonl, skipping a line cut short by a kill; a RunFileError
    for a file that is not UTF-8 text."""
    path = os.path.join(out_dir, METRICS_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise RunFileError(f"{path} cannot be read as train.py's metrics ({type(e).__name__}: {e})") from None
    records = []
    for line in lines:
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    return [record for record in records if isinstance(record, dict)]
