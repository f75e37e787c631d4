"""Train a GPT on TinyShakespeare with the attention backend of your choice.

    python train.py --attn=sdpa                              # the defaults: the GPU run
    python train.py configs/tiny.py --max_iters=100          # a small model on the CPU
    python train.py configs/tiny.py --init_from=resume       # continue from out_dir/ckpt.pt

Settings are the TrainConfig fields below: set them in config files and with --key=value
(see configurator.py; `python train.py --help` lists them). Each run appends its log lines
and evaluations to out_dir/metrics.jsonl and saves out_dir/ckpt.pt at evaluations.

Exit status:
    0          the run reached max_iters
    1          an error stopped it: bad data, an unusable checkpoint, a non-finite loss
    2          bad configuration (unknown key, wrong type, value not allowed)
    130, 143   stopped by SIGINT (Ctrl-C) or SIGTERM after saving a checkpoint (128 + signal
               number, the shell's convention for "ended by a signal")
"""
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from attention import BACKENDS
from checkpoint import CheckpointError, checkpoint_path, load_checkpoint, save_checkpoint
from configurator import ConfigError, choice, parse_config
from data.batches import Batches, DataError, is_prepared
from data.shakespeare.prepare import PrepareError, prepare
from devices import DeviceError, autocast, peak_flops, peak_memory_mb, pick_device, pick_dtype, synchronize
from model import GPT, GPTConfig


@dataclass
class TrainConfig:
    # output, evaluation, checkpoints
    out_dir: str = "out-shakespeare"
    init_from: str = choice("scratch", ("scratch", "resume"))
    eval_interval: int = 250  # evaluate (and checkpoint) every this many iterations
    eval_iters: int = 200  # batches per split in each evaluation
    log_interval: int = 10
    always_save_checkpoint: bool = False  # True: save at every evaluation, not only when val loss improves
    # data
    data_dir: str = "data/shakespeare"  # prepared here on first use
    batch_size: int = 32
    gradient_accumulation_steps: int = 2
    block_size: int = 256
    # model
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.2
    bias: bool = False
    attn: str = choice("eager", BACKENDS)
    # optimizer and schedule: linear warmup, then cosine decay to min_lr at lr_decay_iters
    learning_rate: float = 1e-3
    max_iters: int = 2000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # clip the gradient norm to this; 0 turns clipping off
    warmup_iters: int = 100
    lr_decay_iters: int = 2000
    min_lr: float = 1e-4
    # system
    device: str = choice("auto", ("auto", "cpu", "cuda"))
    dtype: str = choice("auto", ("auto", "float32", "bfloat16", "float16"))
    compile: bool = False  # torch.compile the model
    seed: int = 1337


EXIT_ERROR = 1
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size")


class TrainingError(RuntimeError):
    pass


def check_config(config):
    rules = [
        ("max_iters", config.max_iters >= 0, "an int >= 0"),
        ("eval_interval", config.eval_interval >= 1, "an int >= 1"),
        ("eval_iters", config.eval_iters >= 1, "an int >= 1"),
        ("log_interval", config.log_interval >= 1, "an int >= 1"),
        ("batch_size", config.batch_size >= 1, "an int >= 1"),
        ("gradient_accumulation_steps", config.gradient_accumulation_steps >= 1, "an int >= 1"),
        ("block_size", config.block_size >= 1, "an int >= 1"),
        ("n_layer", config.n_layer >= 1, "an int >= 1"),
        ("n_head", config.n_head >= 1, "an int >= 1"),
        ("n_embd", config.n_embd >= 1 and config.n_embd % max(config.n_head, 1) == 0,
         f"a positive multiple of n_head={config.n_head}"),
        ("dropout", 0.0 <= config.dropout < 1.0, "in [0, 1)"),
        ("learning_rate", 0.0 < config.learning_rate < math.inf, "a finite float > 0"),
        ("min_lr", 0.0 <= config.min_lr < math.inf, "a finite float >= 0"),
        ("warmup_iters", config.warmup_iters >= 0, "an int >= 0"),
        ("lr_decay_iters", config.lr_decay_iters >= 1, "an int >= 1"),
        ("weight_decay", 0.0 <= config.weight_decay < math.inf, "a finite float >= 0"),
        ("beta1", 0.0 <= config.beta1 < 1.0, "in [0, 1)"),
        ("beta2", 0.0 <= config.beta2 < 1.0, "in [0, 1)"),
        ("grad_clip", 0.0 <= config.grad_clip < math.inf, "a finite float >= 0 (0: no clipping)"),
    ]
    for key, ok, expected in rules:
        if not ok:
            raise ConfigError(f"{key}={getattr(config, key)!r}: expected {expected}")


def learning_rate_at(it, config):
    """Linear warmup for warmup_iters, cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if it < config.warmup_iters:
        return config.learning_rate * (it + 1) / (config.warmup_iters + 1)
    if it > config.lr_decay_iters:
        return config.min_lr
    progress = (it - config.warmup_iters) / max(config.lr_decay_iters - config.warmup_iters, 1)
    return config.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (config.learning_rate - config.min_lr)


def load_data(config, device):
    if not is_prepared(config.data_dir):
        print(f"no prepared data in {config.data_dir}: running data/shakespeare/prepare.py")
        meta = prepare(config.data_dir)
        print(f"prepared {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens")
    return Batches(config.data_dir, config.block_size, config.batch_size, device)


def rng_states(sampler):
    """Every random stream a training step reads, so a resumed run draws the same numbers."""
    np_name, np_key, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),  # dropout on the CPU
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],  # dropout on GPUs
        "numpy": (np_name, torch.from_numpy(np_key.astype(np.int64)), np_pos, np_has_gauss, np_gauss),
        "python": random.getstate(),
        "sampler": sampler.get_state(),  # which training windows come next
    }


def restore_rng_states(states, sampler):
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    np_name, np_key, np_pos, np_has_gauss, np_gauss = states["numpy"]
    np.random.set_state((np_name, np_key.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    random.setstate(states["python"])
    sampler.set_state(states["sampler"])


def check_same_shape(saved_args, model_args, path):
    differences = [f"{key}={saved_args.get(key)!r} there, {getattr(model_args, key)!r} here"
                   for key in SHAPE_KEYS if saved_args.get(key) != getattr(model_args, key)]
    if differences:
        raise CheckpointError(f"{path} holds a model of a different shape ({'; '.join(differences)}). "
                              "Resume with the config it was trained with, or train from scratch in another out_dir")


def reset_metrics(path, keep_through_iter):
    """Start out_dir/metrics.jsonl for this run. A fresh run starts it empty. A resumed run
    keeps the records up to the checkpoint's iteration and drops the rest (the interrupted
    run may have logged past its last checkpoint, or been killed mid-line), so the file
    reads as one run."""
    kept = []
    if keep_through_iter is not None and os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("iter", math.inf) <= keep_through_iter:
                    kept.append(json.dumps(record) + "\n")
    tmp_path = path + ".tmp"
    with open(tmp_path, "w") as f:
        f.writelines(kept)
    os.replace(tmp_path, path)


def append_metrics(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM (`kill`, job schedulers) ask the loop to stop at the next
    iteration boundary, the one point where model, optimizer and random streams agree, so
    the checkpoint saved there resumes exactly. A second signal of the same kind stops the
    process at once (the last checkpoint on disk is intact either way)."""

    def __init__(self):
        self.received = None
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        self.received = signum
        signal.signal(signum, signal.SIG_DFL)
        # os.write, not print: print is not safe to re-enter from a signal handler.
        os.write(2, f"\n{signal.Signals(signum).name}: saving a checkpoint after this iteration "
                    "(send it again to stop at once)\n".encode())


@torch.no_grad()
def estimate_loss(model, batches, config, amp):
    """Mean loss over eval_iters batches per split. The batches come from a generator seeded
    afresh each time: every evaluation sees the same windows (comparable across iterations
    and backends), and the training sampler is left untouched."""
    model.eval()
    losses = {}
    for split in ("train", "val"):
        generator = torch.Generator().manual_seed(config.seed)
        total = 0.0
        for _ in range(config.eval_iters):
            x, y = batches.get(split, generator)
            with amp:
                _, loss = model(x, y)
            total += loss.item()
        losses[split] = total / config.eval_iters
    model.train()
    return losses


def train_step(model, optimizer, scaler, batches, sampler, config, amp, device):
    """One optimizer step over gradient_accumulation_steps micro-batches; returns the mean loss.

    The loss is read on the host once per step (a device sync), so a NaN or inf is caught
    at the iteration it appears, before the optimizer applies it; a non-finite loss is
    returned without stepping. Batches are drawn inside the step, not prefetched across
    steps, so the sampler's state at a step boundary is exactly what a checkpoint stores.
    """
    loss_sum = torch.zeros((), device=device)
    for _ in range(config.gradient_accumulation_steps):
        x, y = batches.get("train", sampler)
        with amp:
            _, loss = model(x, y)
        loss_sum += loss.detach()
        scaler.scale(loss / config.gradient_accumulation_steps).backward()
    mean_loss = loss_sum.item() / config.gradient_accumulation_steps
    if math.isfinite(mean_loss):
        if config.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return mean_loss


def run(config):
    """Train; return the process exit status (0, or 128 + signal number when stopped)."""
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    amp = autocast(device, dtype)
    torch.manual_seed(config.seed)
    np.random.seed(config.seed)
    random.seed(config.seed)
    os.makedirs(config.out_dir, exist_ok=True)
    ckpt_path = checkpoint_path(config.out_dir)
    metrics_path = os.path.join(config.out_dir, "metrics.jsonl")

    batches = load_data(config, device)
    model_args = GPTConfig(block_size=config.block_size, vocab_size=batches.vocab_size, n_layer=config.n_layer,
                           n_head=config.n_head, n_embd=config.n_embd, dropout=config.dropout, bias=config.bias,
                           attn=config.attn)
    model = GPT(model_args).to(device)
    optimizer = model.configure_optimizers(config.weight_decay, config.learning_rate,
                                           (config.beta1, config.beta2), device.type)
    # fp16 gradients underflow without loss scaling; bf16 and fp32 have the range to go without.
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    sampler = torch.Generator().manual_seed(config.seed)
    it, best_val_loss, last_saved_iter = 0, math.inf, None

    if config.init_from == "resume":
        # Loaded to the CPU: RNG states must stay CPU tensors, and load_state_dict moves
        # weights and optimizer state to the model's device itself.
        ckpt = load_checkpoint(config.out_dir)
        check_same_shape(ckpt["model_args"], model_args, ckpt_path)
        try:
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            scaler.load_state_dict(ckpt["scaler"])
            restore_rng_states(ckpt["rng"], sampler)
        except (KeyError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{ckpt_path} does not fit this model and optimizer: {e}") from None
        it, best_val_loss, last_saved_iter = ckpt["iter"], ckpt["best_val_loss"], ckpt["iter"]
        print(f"resuming from {ckpt_path} at iter {it} (best val loss {best_val_loss:.4f})")
        del ckpt
    reset_metrics(metrics_path, keep_through_iter=it if config.init_from == "resume" else None)

    raw_model = model
    if config.compile:
        model = torch.compile(model)
    tokens_per_iter = config.batch_size * config.block_size * config.gradient_accumulation_steps
    flops_per_token = raw_model.flops_per_token()
    card_peak = peak_flops(device)
    print(f"{raw_model.num_params() / 1e6:.2f}M parameters, attn={config.attn}, device={device}, "
          f"dtype={str(dtype).removeprefix('torch.')}, {tokens_per_iter:,} tokens per iteration")

    def save(it):
        nonlocal last_saved_iter
        save_checkpoint({
            "model": raw_model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
            "model_args": asdict(model_args),
            "config": asdict(config),
            "iter": it,
            "best_val_loss": best_val_loss,
            "rng": rng_states(sampler),
        }, config.out_dir)
        last_saved_iter = it

    def stop_for_non_finite(what, value, it):
        kept = (f"{ckpt_path} still holds iter {last_saved_iter}, the last good checkpoint"
                if last_saved_iter is not None else "no checkpoint was saved")
        raise TrainingError(f"{what} is {value} at iter {it}; stopped without saving ({kept}). "
                            "A lower learning_rate or a smaller grad_clip may help")

    def evaluate(it):
        nonlocal best_val_loss
        losses = estimate_loss(model, batches, config, amp)
        print(f"iter {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        for split in ("train", "val"):
            if not math.isfinite(losses[split]):
                stop_for_non_finite(f"{split} loss", losses[split], it)
        append_metrics(metrics_path, {"iter": it, "train_loss": losses["train"], "val_loss": losses["val"]})
        improved = losses["val"] < best_val_loss
        best_val_loss = min(best_val_loss, losses["val"])
        if it > 0 and (improved or config.always_save_checkpoint):
            save(it)

    stop = StopSignals()
    if config.init_from == "scratch":
        evaluate(0)
    step_seconds, steps_timed = 0.0, 0
    while True:
        if stop.received is not None:
            if last_saved_iter != it:
                save(it)
            name = signal.Signals(stop.received).name
            print(f"stopped by {name} at iter {it}; checkpoint saved in {ckpt_path}. "
                  "To continue, run the same command with --init_from=resume")
            return 128 + stop.received
        if it >= config.max_iters:
            return 0

        lr = learning_rate_at(it, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        start = time.perf_counter()
        loss = train_step(model, optimizer, scaler, batches, sampler, config, amp, device)
        synchronize(device)
        step_seconds += time.perf_counter() - start
        steps_timed += 1
        it += 1
        if not math.isfinite(loss):
            stop_for_non_finite("training loss", loss, it)

        if it % config.log_interval == 0:
            step_ms = 1000 * step_seconds / steps_timed
            tokens_per_s = tokens_per_iter / (step_seconds / steps_timed)
            mfu = flops_per_token * tokens_per_s / card_peak if card_peak else None
            peak_mem = peak_memory_mb(device)
            print(f"iter {it}: loss {loss:.4f}, lr {lr:.2e}, {step_ms:.1f} ms/iter, {tokens_per_s:,.0f} tok/s, "
                  f"mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}, "
                  f"peak mem {'n/a' if peak_mem is None else f'{peak_mem:,.0f} MB'}")
            append_metrics(metrics_path, {"iter": it, "loss": loss, "lr": lr, "step_ms": step_ms,
                                          "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_mem_mb": peak_mem})
            step_seconds, steps_timed = 0.0, 0
        if it % config.eval_interval == 0 or it == config.max_iters:
            evaluate(it)


def main(argv=None):
    sys.stdout.reconfigure(line_buffering=True)  # log lines show up at once, even through a pipe
    config = parse_config(TrainConfig, argv, check=check_config)
    try:
        status = run(config)
    except (DataError, PrepareError, DeviceError, CheckpointError, TrainingError) as e:
        print(f"error: {e}", file=sys.stderr)
        status = EXIT_ERROR
    sys.exit(status)


if __name__ == "__main__":
    main()
