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

from data.batches import DataError, load_batches
from data.shakespeare.prepare import PrepareError
from model import GPT, compile_model, labelled
from training.devices import (StepGraph, StopSignals, World, autocast, cap_memory, choose_cpu_threads, is_out_of_memory,
                              out_of_memory_message, peak_flops, peak_memory_mb, pick_device, pick_dtype, synchronize)
from training.profiling import OPTIMIZER_RANGE, step_profiler, stop_profiler
from training.run_files import (RunFileError, RunLog, check_fits, load_checkpoint, out_dir_lock, restore_checkpoint,
                                resume_point, rng_states, save_checkpoint, start_out_dir, start_wandb)

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


class Trainer:
    """One run: building it checks what the machine, checkpoint and data allow, writing nothing;
    run() takes out_dir and trains."""

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
        self.train_model = self.model if not world.distributed else DistributedDataParallel(
            self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.micro_steps = config.gradient_accumulation_steps // world.size
        self.tokens_per_iter = config.batch_size * config.block_size * config.gradient_accumulation_steps
        if self.device.type == "cpu":
            self.threads = choose_cpu_threads(self.raw_model.flops_per_token() * config.batch_size * config.block_size,
                                              int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        self.log = RunLog(config, self.micro_steps)

    def run(self):
        """Take out_dir (rank 0, under its lock), then train to max_iters; returns the exit status."""
        config, world = self.config, self.world
        run_config = {**asdict(config), "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                      "gpu": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None,
                      "world_size": world.size, "n_params": self.raw_model.num_params(),
                      "tokens_per_iter": self.tokens_per_iter}
        if world.is_main:
            check_no_run(config)
            # Before anything is written to out_dir, so a missing wandb login changes nothing there.
            self.log.wandb_run = start_wandb(config, run_config, self.wandb_run_id) if config.wandb_log else None
            resumed_at = self.iter_num if config.init_from == "resume" else None
            start_out_dir(config.out_dir, run_config, resumed_at, self.eval_pending)
            self.print_summary()
        # The steady steps right after the timing warm-up; their logged times include the profiler's overhead.
        batch = self.batches.get("train", torch.Generator().manual_seed(config.seed))  # for attention's memory
        profiler = (step_profiler(config.out_dir, TIMING_WARMUP_STEPS, self.raw_model, batch, self.amp, attn=config.attn,
                                  compile=config.compile) if config.profile and world.is_main else None)
        status = EXIT_ERROR  # what wandb records if an exception ends the run
        try:
            status = self.train(profiler)
            return status
        finally:
            if profiler is not None:
                stop_profiler(profiler, config.out_dir, TIMING_WARMUP_STEPS)
            if self.log.wandb_run is not None:
                self.log.wandb_run.finish(exit_code=status)

    def train(self, profiler):
        config, world = self.config, self.world
        stop = StopSignals(announce=world.is_main)
        passes = StepGraph(self.forward_backward) if config.cuda_graph else self.forward_backward
        warmup_end = self.iter_num + TIMING_WARMUP_STEPS
        step_seconds, steps_timed = 0.0, 0
        while True:
            if self.eval_pending:  # iter 0 of a new run, an evaluation's iteration, one a signal cut short
                self.evaluate(stop)
            signum = world.max(stop.received or 0)  # all processes stop at the same iteration
            if signum:
                self.save_at_signal(signum)
                return 128 + signum
            if self.iter_num >= config.max_iters:
                return 0
            lr = learning_rate_at(self.iter_num, config)
            # Between two synchronisations: on a GPU the step ends when the GPU has done its work.
            synchronize(self.device)
            start = time.perf_counter()
            loss = self.step(passes, lr)
            synchronize(self.device)
            step_seconds += time.perf_counter() - start
            steps_timed += 1
            self.iter_num += 1
            if profiler is not None:
                profiler.step()
            if not math.isfinite(loss):
                raise self.non_finite("training loss", loss)
            self.eval_pending = self.iter_num % config.eval_interval == 0 or self.iter_num == config.max_iters
            # A record at the end of the warm-up too, so that no record mixes warm-up and steady steps.
            if self.iter_num % config.log_interval == 0 or self.iter_num == warmup_end:
                self.log_step(loss, lr, step_seconds / steps_timed, warmup=self.iter_num <= warmup_end)
                step_seconds, steps_timed = 0.0, 0
            elif world.is_main and self.log.due():
                step_s = step_seconds / steps_timed
                if self.iter_num > warmup_end:  # steps past the warm-up alone: what the ETA extrapolates
                    self.log.step_s = step_s
                self.log.line(f"iter {self.iter_num}/{config.max_iters}: loss {loss:.4f}, {step_s:.1f} s/iter, "
                              f"{self.log.eta(self.iter_num, self.eval_pending)}")

    def step(self, passes, lr):
        """One optimizer step (passes: forward_backward or its CUDA graph); returns the mean loss,
        read once a step so that a NaN stops the run before the optimizer applies it. Batches are
        drawn here, not prefetched, so the sampler's state between steps is what a checkpoint stores."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batches = [self.batches.get("train", self.sampler) for _ in range(self.micro_steps)]
        mean_loss = self.world.mean_(passes(batches)).item() / self.micro_steps
        with labelled(OPTIMIZER_RANGE):
            if math.isfinite(mean_loss):
                if self.config.grad_clip > 0:
                    self.scaler.unscale_(self.optimizer)
                    torch.nn.utils.clip_grad_norm_(self.train_model.parameters(), self.config.grad_clip)
                self.scaler.step(self.optimizer)
                self.scaler.update()
        return mean_loss

    def forward_backward(self, batches):
        """Every micro-batch's forward and backward: leaves the gradients in .grad and returns the
        losses' sum, unread. Under DDP only the last micro-batch all-reduces (no_sync before it)."""
        # None: the first backward writes the gradients rather than adding them to zeros; a
        # captured step zeroes them in place, where its graph writes.
        self.optimizer.zero_grad(set_to_none=not self.config.cuda_graph)
        loss_sum = torch.zeros((), device=self.device)
        for micro_step, (x, y) in enumerate(batches):
            accumulate_only = self.world.distributed and micro_step < len(batches) - 1
            if self.config.compile:
                # Under compile's own CUDA graphs a replay reuses the previous one's outputs: done with them.
                torch.compiler.cudagraph_mark_step_begin()
            with self.train_model.no_sync() if accumulate_only else contextlib.nullcontext():
                with self.amp:
                    _, loss = self.train_model(x, y)
                loss_sum += loss.detach()
                self.scaler.scale(loss / len(batches)).backward()
        return loss_sum

    def batch_loss(self, x, y):
        """The model's loss on one batch, as a float (the caller sets evaluation mode)."""
        if self.config.compile:
            torch.compiler.cudagraph_mark_step_begin()  # see forward_backward
        with torch.no_grad(), self.amp:
            _, loss = self.model(x, y)
        return loss.item()

    def estimate_loss(self, stop):
        """Mean loss over eval_iters batches per split, or None when a signal stopped it. Each split
        draws from a generator seeded afresh: the same windows every time, training's sampler untouched."""
        config, log, losses = self.config, self.log, {}
        self.model.eval()
        for n, split in enumerate(("train", "val")):
            generator, total = torch.Generator().manual_seed(config.seed), 0.0
            for batch in range(config.eval_iters):
                if stop.received:
                    self.model.train()
                    return None
                batch_start = time.perf_counter()
                total += self.batch_loss(*self.batches.get(split, generator))
                log.time_eval_batch(time.perf_counter() - batch_start)
                if self.world.is_main and log.due():
                    progress = f"evaluating at iter {self.iter_num}: {split} batch {batch + 1}/{config.eval_iters}"
                    left, batch_s = (2 - n) * config.eval_iters - batch - 1, log.estimates()[1]
                    log.line(f"{progress}, warming up" if batch_s is None else f"{progress}, ETA "
                             f"{tqdm.format_interval(left * batch_s)}; the run's {log.eta(self.iter_num, True, left)}")
            losses[split] = total / config.eval_iters
        self.model.train()
        return losses

    def evaluate(self, stop):
        """Rank 0 evaluates, logs and saves while the others wait, having handed it their random
        streams. One a signal cuts short stays pending: the checkpoint saved at the signal runs it again."""
        config, world = self.config, self.world
        rng = world.gather(rng_states(self.sampler, self.device))
        losses = self.estimate_loss(stop) if world.is_main else {}
        stopped, losses = losses is None, losses or {}
        non_finite = [split for split, loss in losses.items() if not math.isfinite(loss)]
        if world.max(len(non_finite)):  # all processes stop together, with rank 0's message
            if not world.is_main:
                raise TrainingError(f"rank 0's evaluation at iter {self.iter_num} was not finite")
            raise self.non_finite(f"{non_finite[0]} loss", losses[non_finite[0]])
        self.eval_pending = stopped
        if not world.is_main or stopped:
            return
        # Bits per character compare across tokenizers (nanoGPT's character-level Shakespeare: 2.12).
        val_bpc = losses["val"] * self.batches.tokens_per_char["val"] / math.log(2)
        self.log.line(f"iter {self.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f} "
                      f"({val_bpc:.3f} bits/char)")
        self.log.record({"iter": self.iter_num, "train_loss": losses["train"], "val_loss": losses["val"],
                         "val_bpc": val_bpc})
        improved = losses["val"] < self.best_val_loss
        self.best_val_loss = min(self.best_val_loss, losses["val"])
        if self.iter_num > 0 and (improved or config.always_save_checkpoint):
            self.save(CHECKPOINT_NAME, rng)

    def save(self, name, rng):
        """A checkpoint of this iteration (rng: every process's random streams); a new ckpt.pt
        removes the older resume.pt."""
        path = os.path.join(self.config.out_dir, name)
        save_checkpoint({
            "model": self.raw_model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(), "model_args": asdict(self.model_args), "config": asdict(self.config),
            "iter": self.iter_num, "best_val_loss": self.best_val_loss, "eval_pending": self.eval_pending, "rng": rng,
            "wandb_run_id": self.log.wandb_run.id if self.log.wandb_run is not None else None,
            "gpt2_ids": self.batches.gpt2_ids,  # the model's token ids -> GPT-2's, for sample.py to decode
        }, path)
        if name == CHECKPOINT_NAME:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.config.out_dir, RESUME_NAME))
        self.last_saved = (path, self.iter_num, self.eval_pending)

    def save_at_signal(self, signum):
        """Rank 0 saves this iteration in resume.pt (unless a checkpoint holds it) and says how to continue."""
        name = signal.Signals(signum).name
        rng = self.world.gather(rng_states(self.sampler, self.device))
        if not self.world.is_main:
            return
        if self.last_saved is None or self.last_saved[1:] != (self.iter_num, self.eval_pending):
            # The last update has not been through a loss yet: checked, so a signal never saves diverged weights.
            self.model.eval()
            loss = self.batch_loss(*self.batches.get("val", torch.Generator().manual_seed(self.config.seed)))
            self.model.train()
            if not math.isfinite(loss):
                raise self.non_finite(f"{name}: the loss of the weights to save", loss)
            self.save(RESUME_NAME, rng)
        print(f"stopped by {name} at iter {self.iter_num}; checkpoint saved in {self.last_saved[0]}. "
              "To continue, run the same command with --init_from=resume")

    def non_finite(self, what, value):
        """The error that stops a run whose loss is NaN or inf, saying which checkpoint is left."""
        kept = (f"{self.last_saved[0]} still holds iter {self.last_saved[1]}, the last good checkpoint"
                if self.last_saved is not None else "no checkpoint was saved")
        return TrainingError(f"{what} is {value} at iter {self.iter_num}; stopped without saving ({kept}). "
                             "A lower learning_rate or a smaller grad_clip may help")

    def log_step(self, loss, lr, step_s, warmup):
        """Rank 0 prints and logs the last step's loss and lr, and the mean step time since the last record."""
        if not warmup:
            self.log.step_s = step_s
        if not self.world.is_main:
            return
        tokens_per_s = self.tokens_per_iter / step_s
        card_peak = peak_flops(self.device)
        mfu = self.raw_model.flops_per_token() * tokens_per_s / (card_peak * self.world.size) if card_peak else None
        peak_mem = peak_memory_mb(self.device)
        self.log.line(f"iter {self.iter_num}: loss {loss:.4f}, lr {lr:.2e}, {1000 * step_s:.1f} ms/iter, "
                      f"{tokens_per_s:,.0f} tok/s, mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}, "
                      f"peak mem {'n/a' if peak_mem is None else f'{peak_mem:,.0f} MB'}, "
                      f"{self.log.eta(self.iter_num, self.eval_pending)}" + (" (warm-up)" if warmup else ""))
        self.log.record({"iter": self.iter_num, "loss": loss, "lr": lr, "step_ms": 1000 * step_s,
                  "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_mem_mb": peak_mem, "warmup": warmup})

    def print_summary(self):
        """What this run trains, where; a warning when a config sized for a GPU runs on the CPU."""
        config, world = self.config, self.world
        processes = f" over {world.size} processes" if world.distributed else ""
        print(f"{self.raw_model.num_params() / 1e6:.2f}M parameters, attn={config.attn}, device={self.device}, "
              f"dtype={str(self.dtype).removeprefix('torch.')}, compile={config.compile}, "
              f"cuda_graph={config.cuda_graph}, {self.tokens_per_iter:,} tokens per iteration{processes}")
        if self.device.type == "cpu":
            print(self.threads)
        flop_per_iter = self.raw_model.flops_per_token() * self.tokens_per_iter
        if self.device.type == "cpu" and flop_per_iter > 1e11:  # the CPU trains at 1e10-1e11 FLOP/s
            print(f"warning: this config is sized for a GPU ({flop_per_iter / 1e12:.1f} TFLOP per iteration) and runs "
                  "on the CPU, where each iteration and evaluation batch may take minutes; configs/tiny.py is sized "
                  "for a CPU (python train.py configs/tiny.py)", file=sys.stderr)


def train(config, world):
    """Build the run, then run it holding out_dir. The Trainer (its DDP model holds the process
    group) must be freed before World.stop destroys the group, which collects it if a cycle holds it."""
    trainer = Trainer(config, world)
    with out_dir_lock(config.out_dir) if world.is_main else contextlib.nullcontext():
        return trainer.run()


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
    except ConfigError as e:  # one the machine or the data refuses, a held out_dir, no wandb login
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
