"""Train a GPT on TinyShakespeare with the attention backend of your choice.

    python train.py --attn=triton                         # the default run; on a GPU compiled, each step a CUDA graph
    python train.py configs/tiny.py                       # a small model for the CPU
    python train.py configs/tiny.py --init_from=resume    # continue a stopped run
    torchrun --standalone --nproc_per_node=2 train.py --attn=triton   # data-parallel, 2 GPUs

Paths are relative to the current directory (the default data_dir is data/shakespeare in the
repo). A run holds its out_dir alone and writes there config.json, metrics.jsonl, ckpt.pt (the
best checkpoint) and, when SIGINT, SIGTERM or SIGHUP stops it after the current iteration,
resume.pt, from which --init_from=resume goes on as an uninterrupted run would. A second signal
stops at once. Under torchrun rank 0 alone logs, evaluates and saves.

Exit status:
    0              the run reached max_iters
    1              an error stopped it: bad data, an unusable checkpoint, a failed write, a NaN loss
    2              bad configuration, refused before out_dir is touched: a setting wrong in itself,
                   one this machine or data cannot run, an unusable out_dir or data_dir, an out_dir
                   another run holds
    3              out of memory
    129, 130, 143  stopped by SIGHUP, SIGINT or SIGTERM after saving (128 + the signal's number)
"""
import contextlib
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict

from training.config import (CHECKPOINT_NAME, EXIT_BAD_CONFIG, EXIT_ERROR, EXIT_OUT_OF_MEMORY, RESUME_NAME, ConfigError,
                             check_no_run, parse_train_config, resolve_switches)

# Parsed before torch loads (1.5 s or more), so that --help and a bad setting answer at once.
config = parse_train_config(usage=__doc__)

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from data.batches import DataError, ShortDataError, load_batches
from data.shakespeare.prepare import PrepareError
from model import GPT, compile_model
from training.devices import (StopSignals, World, autocast, cap_memory, choose_cpu_threads, is_out_of_memory,
                              out_of_memory_message, peak_flops, peak_memory_mb, pick_device, pick_dtype, synchronize)
from training.profiling import step_profiler, stop_profiler
from training.run_files import (RunFileError, RunLog, check_fits, load_checkpoint, out_dir_lock, restore_checkpoint,
                                resume_point, rng_states, save_checkpoint, start_out_dir, start_wandb)
from training.step import make_train_step

# The first steps pay for torch.compile, autotuning and the allocator's caches: logged apart (warmup: true).
TIMING_WARMUP_STEPS = 3


class TrainingError(RuntimeError):
    pass


def learning_rate_at(it, config):
    """Linear warmup for warmup_iters, cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if it < config.warmup_iters:
        return config.learning_rate * (it + 1) / (config.warmup_iters + 1)
    if it > config.lr_decay_iters:
        return config.min_lr
    progress = (it - config.warmup_iters) / max(config.lr_decay_iters - config.warmup_iters, 1)
    return config.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (config.learning_rate - config.min_lr)


class Run:
    """What a run holds: its settings, device, data, model, optimizer and scaler, the step it
    takes, and where it stands (iter_num, best_val_loss, eval_pending, last_saved). Building it
    checks what the machine, checkpoint and data allow, writing nothing; the functions below
    train it."""

    def __init__(self, config, world):
        self.world = world
        self.device = world.start(pick_device(config.device))
        self.config = config = resolve_switches(config, self.device.type, world.size)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.amp = autocast(self.device, self.dtype)
        if config.max_memory_gb:
            cap_memory(self.device, config.max_memory_gb, announce=world.is_main)
        # Each process seeds its own streams, so that dropout and batches differ (DDP copies rank 0's weights).
        seed = config.seed + world.rank
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        self.sampler = torch.Generator().manual_seed(seed)  # which training windows come next
        resume_path = resume_point(config.out_dir)
        ckpt = load_checkpoint(resume_path, resume=True) if config.init_from == "resume" else None
        self.batches = load_batches(config.data_dir, config.block_size, config.batch_size, self.device, world)
        self.model_args = config.model_config(self.batches.vocab_size)
        if ckpt is not None:
            check_fits(ckpt, resume_path, self.model_args, self.batches.gpt2_ids, config.data_dir)
        self.raw_model = GPT(self.model_args).to(self.device)  # checkpoints hold its state dict
        self.optimizer = self.raw_model.configure_optimizers(config.weight_decay, config.learning_rate,
                                                             (config.beta1, config.beta2), self.device.type)
        # fp16 gradients underflow without loss scaling; bf16 and fp32 have the range to go without.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)
        self.iter_num, self.best_val_loss, self.eval_pending = 0, math.inf, True
        self.last_saved, self.wandb_run_id = None, None  # (path, iter, eval_pending) of the last checkpoint
        if ckpt is not None:
            restore_checkpoint(ckpt, resume_path, self.raw_model, self.optimizer, self.scaler, self.sampler,
                               self.device, world)
            self.iter_num, self.best_val_loss = ckpt["iter"], ckpt["best_val_loss"]
            self.eval_pending, self.wandb_run_id = ckpt["eval_pending"], ckpt.get("wandb_run_id")
            self.last_saved = (resume_path, self.iter_num, self.eval_pending)
        self.model = compile_model(self.raw_model, config.compile_mode) if config.compile else self.raw_model
        # Rank 0 evaluates self.model on its own; training goes through DDP, which averages gradients.
        train_model = self.model if not world.distributed else DistributedDataParallel(
            self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.step = make_train_step(train_model, self.optimizer, self.scaler, self.amp, world, config.grad_clip,
                                    compiled=config.compile, cuda_graph=config.cuda_graph)
        self.micro_steps = config.gradient_accumulation_steps // world.size
        self.tokens_per_iter = config.batch_size * config.block_size * config.gradient_accumulation_steps
        if self.device.type == "cpu":
            self.threads = choose_cpu_threads(self.raw_model.flops_per_token() * config.batch_size * config.block_size,
                                              int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        self.log = RunLog(config, self.micro_steps)


def train(config, world):
    """Build the run, then train it holding out_dir. The Run (its DDP model holds the process
    group) must be freed before World.stop destroys the group, which collects it if a cycle holds it."""
    run = Run(config, world)
    with out_dir_lock(config.out_dir) if world.is_main else contextlib.nullcontext():
        return run_training(run)


def run_training(run):
    """Take out_dir (rank 0, under its lock), then train to max_iters; returns the exit status."""
    config, world = run.config, run.world
    run_config = {**asdict(config), "device": str(run.device), "dtype": str(run.dtype).removeprefix("torch."),
                  "gpu": torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else None,
                  "world_size": world.size, "n_params": run.raw_model.num_params(),
                  "tokens_per_iter": run.tokens_per_iter}
    if world.is_main:
        check_no_run(config)
        # Before anything is written to out_dir, so a missing wandb login changes nothing there.
        run.log.wandb_run = start_wandb(config, run_config, run.wandb_run_id) if config.wandb_log else None
        resumed_at = run.iter_num if config.init_from == "resume" else None
        start_out_dir(config.out_dir, run_config, resumed_at, run.eval_pending)
        print_summary(run)
    # The steady steps right after the timing warm-up; their logged times include the profiler's overhead.
    batch = run.batches.get("train", torch.Generator().manual_seed(config.seed))  # for attention's memory
    profiler = (step_profiler(config.out_dir, TIMING_WARMUP_STEPS, run.raw_model, batch, run.amp, attn=config.attn,
                              compile=config.compile) if config.profile and world.is_main else None)
    status = EXIT_ERROR  # what wandb records if an exception ends the run
    try:
        status = training_loop(run, profiler)
        return status
    finally:
        if profiler is not None:
            stop_profiler(profiler, config.out_dir, TIMING_WARMUP_STEPS)
        if run.log.wandb_run is not None:
            run.log.wandb_run.finish(exit_code=status)


def training_loop(run, profiler):
    """Evaluate when due, stop at a signal or at max_iters, else take a step; returns the exit status."""
    config, world = run.config, run.world
    stop = StopSignals(announce=world.is_main)
    warmup_end = run.iter_num + TIMING_WARMUP_STEPS
    step_seconds, steps_timed = 0.0, 0
    while True:
        if run.eval_pending:  # iter 0 of a new run, an evaluation's iteration, one a signal cut short
            evaluate(run, stop)
        signum = world.max(stop.received or 0)  # all processes stop at the same iteration
        if signum:
            save_at_signal(run, signum)
            return 128 + signum
        if run.iter_num >= config.max_iters:
            return 0
        lr = learning_rate_at(run.iter_num, config)
        # Between two synchronisations: on a GPU the step ends when the GPU has done its work.
        synchronize(run.device)
        start = time.perf_counter()
        # Drawn here, not prefetched, so the sampler's state between steps is what a checkpoint stores.
        batches = [run.batches.get("train", run.sampler) for _ in range(run.micro_steps)]
        loss = run.step(batches, lr)
        synchronize(run.device)
        step_seconds += time.perf_counter() - start
        steps_timed += 1
        run.iter_num += 1
        if profiler is not None:
            profiler.step()
        if not math.isfinite(loss):
            raise non_finite(run, "training loss", loss)
        run.eval_pending = run.iter_num % config.eval_interval == 0 or run.iter_num == config.max_iters
        # A record at the end of the warm-up too, so that no record mixes warm-up and steady steps.
        if run.iter_num % config.log_interval == 0 or run.iter_num == warmup_end:
            log_step(run, loss, lr, step_seconds / steps_timed, warmup=run.iter_num <= warmup_end)
            step_seconds, steps_timed = 0.0, 0
        elif world.is_main and run.log.due():
            step_s = step_seconds / steps_timed
            if run.iter_num > warmup_end:  # steps past the warm-up alone: what the ETA extrapolates
                run.log.step_s = step_s
            run.log.line(f"iter {run.iter_num}/{config.max_iters}: loss {loss:.4f}, {step_s:.1f} s/iter, "
                         f"{run.log.eta(run.iter_num, run.eval_pending)}")


def batch_loss(run, x, y):
    """The model's loss on one batch, as a float (the caller sets evaluation mode)."""
    if run.config.compile:
        torch.compiler.cudagraph_mark_step_begin()  # see training/step.py's forward_backward
    with torch.no_grad(), run.amp:
        _, loss = run.model(x, y)
    return loss.item()


def estimate_loss(run, stop):
    """Mean loss over eval_iters batches per split, or None when a signal stopped it. Each split
    draws from a generator seeded afresh: the same windows every time, training's sampler untouched."""
    config, log, losses = run.config, run.log, {}
    run.model.eval()
    for n, split in enumerate(("train", "val")):
        generator, total = torch.Generator().manual_seed(config.seed), 0.0
        for batch in range(config.eval_iters):
            if stop.received:
                run.model.train()
                return None
            batch_start = time.perf_counter()
            total += batch_loss(run, *run.batches.get(split, generator))
            log.time_eval_batch(time.perf_counter() - batch_start)
            if run.world.is_main and log.due():
                progress = f"evaluating at iter {run.iter_num}: {split} batch {batch + 1}/{config.eval_iters}"
                left, batch_s = (2 - n) * config.eval_iters - batch - 1, log.estimates()[1]
                log.line(f"{progress}, warming up" if batch_s is None else f"{progress}, ETA "
                         f"{tqdm.format_interval(left * batch_s)}; the run's {log.eta(run.iter_num, True, left)}")
        losses[split] = total / config.eval_iters
    run.model.train()
    return losses


def evaluate(run, stop):
    """Rank 0 evaluates, logs and saves while the others wait, having handed it their random
    streams. One a signal cuts short stays pending: the checkpoint saved at the signal runs it again."""
    config, world = run.config, run.world
    rng = world.gather(rng_states(run.sampler, run.device))
    losses = estimate_loss(run, stop) if world.is_main else {}
    stopped, losses = losses is None, losses or {}
    non_finite_splits = [split for split, loss in losses.items() if not math.isfinite(loss)]
    if world.max(len(non_finite_splits)):  # all processes stop together, with rank 0's message
        if not world.is_main:
            raise TrainingError(f"rank 0's evaluation at iter {run.iter_num} was not finite")
        raise non_finite(run, f"{non_finite_splits[0]} loss", losses[non_finite_splits[0]])
    run.eval_pending = stopped
    if not world.is_main or stopped:
        return
    # Bits per character compare across tokenizers (nanoGPT's character-level Shakespeare: 2.12).
    val_bpc = losses["val"] * run.batches.tokens_per_char["val"] / math.log(2)
    run.log.line(f"iter {run.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f} "
                 f"({val_bpc:.3f} bits/char)")
    run.log.record({"iter": run.iter_num, "train_loss": losses["train"], "val_loss": losses["val"],
                    "val_bpc": val_bpc})
    improved = losses["val"] < run.best_val_loss
    run.best_val_loss = min(run.best_val_loss, losses["val"])
    if run.iter_num > 0 and (improved or config.always_save_checkpoint):
        save(run, CHECKPOINT_NAME, rng)


def save(run, name, rng):
    """A checkpoint of this iteration (rng: every process's random streams); a new ckpt.pt
    removes the older resume.pt."""
    path = os.path.join(run.config.out_dir, name)
    save_checkpoint({
        "model": run.raw_model.state_dict(), "optimizer": run.optimizer.state_dict(),
        "scaler": run.scaler.state_dict(), "model_args": asdict(run.model_args), "config": asdict(run.config),
        "iter": run.iter_num, "best_val_loss": run.best_val_loss, "eval_pending": run.eval_pending, "rng": rng,
        "wandb_run_id": run.log.wandb_run.id if run.log.wandb_run is not None else None,
        "gpt2_ids": run.batches.gpt2_ids,  # the model's token ids -> GPT-2's, for sample.py to decode
    }, path)
    if name == CHECKPOINT_NAME:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(run.config.out_dir, RESUME_NAME))
    run.last_saved = (path, run.iter_num, run.eval_pending)


def save_at_signal(run, signum):
    """Rank 0 saves this iteration in resume.pt (unless a checkpoint holds it) and says how to continue."""
    name = signal.Signals(signum).name
    rng = run.world.gather(rng_states(run.sampler, run.device))
    if not run.world.is_main:
        return
    if run.last_saved is None or run.last_saved[1:] != (run.iter_num, run.eval_pending):
        # The last update has not been through a loss yet: checked, so a signal never saves diverged weights.
        run.model.eval()
        loss = batch_loss(run, *run.batches.get("val", torch.Generator().manual_seed(run.config.seed)))
        run.model.train()
        if not math.isfinite(loss):
            raise non_finite(run, f"{name}: the loss of the weights to save", loss)
        save(run, RESUME_NAME, rng)
    print(f"stopped by {name} at iter {run.iter_num}; checkpoint saved in {run.last_saved[0]}. "
          "To continue, run the same command with --init_from=resume")


def non_finite(run, what, value):
    """The error that stops a run whose loss is NaN or inf, saying which checkpoint is left."""
    kept = (f"{run.last_saved[0]} still holds iter {run.last_saved[1]}, the last good checkpoint"
            if run.last_saved is not None else "no checkpoint was saved")
    return TrainingError(f"{what} is {value} at iter {run.iter_num}; stopped without saving ({kept}). "
                         "A lower learning_rate or a smaller grad_clip may help")


def log_step(run, loss, lr, step_s, warmup):
    """Rank 0 prints and logs the last step's loss and lr, and the mean step time since the last record."""
    if not warmup:
        run.log.step_s = step_s
    if not run.world.is_main:
        return
    tokens_per_s = run.tokens_per_iter / step_s
    card_peak = peak_flops(run.device)
    mfu = run.raw_model.flops_per_token() * tokens_per_s / (card_peak * run.world.size) if card_peak else None
    peak_mem = peak_memory_mb(run.device)
    run.log.line(f"iter {run.iter_num}: loss {loss:.4f}, lr {lr:.2e}, {1000 * step_s:.1f} ms/iter, "
                 f"{tokens_per_s:,.0f} tok/s, mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}, "
                 f"peak mem {'n/a' if peak_mem is None else f'{peak_mem:,.0f} MB'}, "
                 f"{run.log.eta(run.iter_num, run.eval_pending)}" + (" (warm-up)" if warmup else ""))
    run.log.record({"iter": run.iter_num, "loss": loss, "lr": lr, "step_ms": 1000 * step_s,
                    "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_mem_mb": peak_mem, "warmup": warmup})


def print_summary(run):
    """What this run trains, where; a warning when a config sized for a GPU runs on the CPU."""
    config, world = run.config, run.world
    processes = f" over {world.size} processes" if world.distributed else ""
    print(f"{run.raw_model.num_params() / 1e6:.2f}M parameters, attn={config.attn}, device={run.device}, "
          f"dtype={str(run.dtype).removeprefix('torch.')}, compile={config.compile}, "
          f"cuda_graph={config.cuda_graph}, {run.tokens_per_iter:,} tokens per iteration{processes}")
    if run.device.type == "cpu":
        print(run.threads)
    flop_per_iter = run.raw_model.flops_per_token() * run.tokens_per_iter
    if run.device.type == "cpu" and flop_per_iter > 1e11:  # the CPU trains at 1e10-1e11 FLOP/s
        print(f"warning: this config is sized for a GPU ({flop_per_iter / 1e12:.1f} TFLOP per iteration) and runs "
              "on the CPU, where each iteration and evaluation batch may take minutes; configs/tiny.py is sized "
              "for a CPU (python train.py configs/tiny.py)", file=sys.stderr)


def main():
    sys.stdout.reconfigure(line_buffering=True)  # log lines show up at once, even through a pipe
    world = World()
    status = EXIT_ERROR
    try:
        status = train(config, world)
    except (DataError, PrepareError, RunFileError, TrainingError) as e:
        # These meet every process alike, so rank 0 speaks for all.
        if world.is_main:
            print(f"error: {e}", file=sys.stderr)
    except (ConfigError, ShortDataError) as e:  # one the machine or the data refuses, a held out_dir, no wandb login
        print(f"config error: {e}", file=sys.stderr)
        status = EXIT_BAD_CONFIG
    except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e):
            raise
        print(f"error: {out_of_memory_message(config, world)}", file=sys.stderr)  # any process, on its own
        status = EXIT_OUT_OF_MEMORY
    finally:
        world.stop()
    sys.exit(status)


if __name__ == "__main__":
    main()
