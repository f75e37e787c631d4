"""Train a GPT on TinyShakespeare with the attention backend of your choice.

    python train.py --attn=sdpa                              # the defaults: the GPU run
    python train.py --attn=triton --cuda_graph=True          # each step replayed from one CUDA graph
    python train.py configs/tiny.py --max_iters=100          # a small model on the CPU
    python train.py configs/tiny.py --init_from=resume       # continue from out_dir/ckpt.pt
    torchrun --standalone --nproc_per_node=2 train.py --attn=triton   # data-parallel, 2 GPUs

Settings are the TrainConfig fields of training/train_config.py: set them in config files and with
--key=value (see training/configurator.py; `python train.py --help` lists them). Each run writes
out_dir/config.json, appends its log lines and evaluations to out_dir/metrics.jsonl (see
training/metrics.py), saves out_dir/ckpt.pt at evaluations and, with --wandb_log=True, logs the
same to wandb; --profile=True also writes where a few steady steps' time went
(out_dir/profile.json, see training/profiling.py). Under torchrun (see training/ddp.py) every process trains on batches of its own and
rank 0 alone logs, evaluates and saves.

Paths: out_dir, config files and an explicit data_dir are relative to the current
directory; the default data_dir is data/shakespeare inside the repo, wherever you run from.

Exit status:
    0          the run reached max_iters
    1          an error stopped it: bad data, an unusable checkpoint, a non-finite loss
    2          bad configuration (unknown key, wrong type, value not allowed)
    3          out of memory
    130, 143   stopped by SIGINT (Ctrl-C) or SIGTERM after saving a checkpoint (128 + signal
               number, the shell's convention for "ended by a signal")
"""
import contextlib
import functools
import math
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from data.batches import Batches, DataError, is_prepared
from data.shakespeare.prepare import PrepareError, prepare
from model import GPT, GPTConfig, compile_model, labelled
from training.checkpoint import (CHECKPOINT_NAME, CheckpointError, check_same_shape, checkpoint_path, load_checkpoint,
                                 restore_rng_states, rng_states, save_checkpoint)
from training.configurator import ConfigError, config_files, parse_config
from training.ddp import World
from training.devices import (DeviceError, autocast, cap_memory, peak_flops, peak_memory_mb, pick_device, pick_dtype,
                              synchronize)
from training.exit_codes import EXIT_BAD_CONFIG, EXIT_ERROR, EXIT_OUT_OF_MEMORY, exit_status_of_signal
from training.metrics import METRICS_NAME, append_metrics, reset_metrics, write_run_config
from training.profiling import (OPTIMIZER_RANGE, PROFILE_NAME, PROFILE_STEPS, attention_saved_mb, remove_profile,
                                step_profiler, write_profile)
from training.step_graph import StepGraph
from training.train_config import TrainConfig, check_config


# The first steps of every process pay for torch.compile, Triton autotuning and the CUDA
# allocator filling its caches. They are logged apart (warmup: true) and left out of the
# steady-state step time.
TIMING_WARMUP_STEPS = 3
DEFAULT_CONFIG_NAME = "shakespeare"  # train.py's defaults are configs/shakespeare.py
EVAL_PROGRESS_SECONDS = 5  # an evaluation running longer prints its progress this often
# A CPU does some 1e10-1e11 FLOP/s in training: above this many FLOP per iteration a step
# takes seconds to minutes, which is a config sized for a GPU.
CPU_FLOP_PER_ITER_WARNING = 1e11


class TrainingError(RuntimeError):
    pass


@dataclass
class TrainState:
    """Where training stands, advanced by the loop; checkpoints store iter_num and best_val_loss."""
    iter_num: int = 0  # optimizer steps taken
    best_val_loss: float = math.inf
    last_saved_iter: int | None = None  # the iteration ckpt.pt holds; None until a save or a resume


@dataclass
class Training:
    """What run builds before its loop, read by the loop's parts; TrainState is what changes."""
    config: TrainConfig
    world: World
    device: torch.device
    amp: contextlib.AbstractContextManager  # autocast to the run's dtype (nothing in float32)
    batches: Batches
    sampler: torch.Generator  # which training windows come next; checkpoints store its state
    model_args: GPTConfig
    raw_model: GPT  # the plain module: checkpoints hold its state dict
    model: torch.nn.Module  # raw_model, compiled when config.compile: rank 0 evaluates it on its own
    train_model: torch.nn.Module  # model, in DDP under torchrun, which averages gradients across processes
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    wandb_run: object  # the wandb run rank 0 logs to, or None


def learning_rate_at(it, config):
    """Linear warmup for warmup_iters, cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if it < config.warmup_iters:
        return config.learning_rate * (it + 1) / (config.warmup_iters + 1)
    if it > config.lr_decay_iters:
        return config.min_lr
    progress = (it - config.warmup_iters) / max(config.lr_decay_iters - config.warmup_iters, 1)
    return config.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (config.learning_rate - config.min_lr)


def bits_per_char(loss, tokens_per_char):
    """A mean cross-entropy in nats per token -> bits per character of the text, the unit
    that compares across tokenizers (nanoGPT's char-level Shakespeare: 1.4697 nats/char,
    2.12 bits/char)."""
    return loss * tokens_per_char / math.log(2)


def load_data(config, device, world):
    """The token batches. Rank 0 prepares missing data while the other processes wait, so
    none of them reads a file being written."""
    if world.is_main and not is_prepared(config.data_dir):
        print(f"no prepared data in {config.data_dir} (or data an older prepare.py wrote): "
              "running data/shakespeare/prepare.py")
        # skip_if: another run started at the same time may have prepared it meanwhile.
        meta = prepare(config.data_dir, skip_if=is_prepared)
        if meta is not None:
            print(f"prepared {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens")
    world.barrier()
    return Batches(config.data_dir, config.block_size, config.batch_size, device)


def check_out_dir(config):
    """Raise ConfigError unless out_dir is a folder this process can write (made here if
    missing), and unless a run from scratch would replace no run there (a checkpoint, or
    logged metrics) or overwrite=True says it may. Checked before any work starts."""
    out_dir = config.out_dir
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"out_dir={out_dir!r} is a file; expected a folder (made if missing)")
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as e:
        raise ConfigError(f"out_dir={out_dir!r}: cannot write there ({e.strerror or e}); "
                          "expected a folder this user can write (made if missing)") from None
    metrics_path = os.path.join(out_dir, METRICS_NAME)
    held = [name for name, held in [(CHECKPOINT_NAME, os.path.exists(os.path.join(out_dir, CHECKPOINT_NAME))),
                                    (METRICS_NAME, os.path.isfile(metrics_path) and os.path.getsize(metrics_path))]
            if held]
    if config.init_from == "scratch" and held and not config.overwrite:
        raise ConfigError(f"out_dir={out_dir!r} holds a run ({', '.join(held)}), which a run from scratch would "
                          "replace. Continue it with --init_from=resume, replace it with --overwrite=True, "
                          "or pick another out_dir")


def start_device(config, world):
    """This process's device, its dtype and the autocast context for the forward pass."""
    device = world.start(pick_device(config.device))
    if config.cuda_graph and device.type != "cuda":
        raise DeviceError(f"cuda_graph=True needs a CUDA device; this run is on {device.type} (use cuda_graph=False)")
    dtype = pick_dtype(config.dtype, device)
    amp = autocast(device, dtype)
    if config.max_memory_gb:
        card_gb = cap_memory(device, config.max_memory_gb)
        if world.is_main:
            print(f"CUDA memory capped at {config.max_memory_gb:g} GiB (the card has {card_gb:.1f} GiB)")
    return device, dtype, amp


def build_model(config, vocab_size, device, dtype):
    """A freshly initialised model on `device`, with its optimizer and gradient scaler."""
    model_args = config.model_config(vocab_size)
    model = GPT(model_args).to(device)
    optimizer = model.configure_optimizers(config.weight_decay, config.learning_rate,
                                           (config.beta1, config.beta2), device.type)
    # fp16 gradients underflow without loss scaling; bf16 and fp32 have the range to go without.
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    return model_args, model, optimizer, scaler


def resume(config, world, device, sampler, model_args, model, optimizer, scaler):
    """Load out_dir's checkpoint into the model, optimizer, scaler and this process's random
    streams (before compiling and DDP wrap the model); return the TrainState it was saved at
    and the wandb run it logged to."""
    ckpt_path = checkpoint_path(config.out_dir)
    # Loaded to the CPU: RNG states must stay CPU tensors, and load_state_dict moves
    # weights and optimizer state to the model's device itself.
    ckpt = load_checkpoint(config.out_dir)
    check_same_shape(ckpt["model_args"], model_args, ckpt_path)
    try:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        saved_rng = ckpt["rng"]  # one entry per process of the run that saved it
        if world.rank < len(saved_rng):
            restore_rng_states(saved_rng[world.rank], sampler, device)
    except (KeyError, RuntimeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{ckpt_path} does not fit this model and optimizer: {e}") from None
    state = TrainState(iter_num=ckpt["iter"], best_val_loss=ckpt["best_val_loss"], last_saved_iter=ckpt["iter"])
    if world.is_main:
        print(f"resuming from {ckpt_path} at iter {state.iter_num} (best val loss {state.best_val_loss:.4f})")
        if len(saved_rng) != world.size:
            print(f"the checkpoint was saved by {len(saved_rng)} processes and this run has {world.size}: "
                  "the batches from here on differ from those of an uninterrupted run")
    return state, ckpt.get("wandb_run_id")  # checkpoints from before wandb resumed have none


def tokens_per_iter(config):
    """Tokens one optimizer step trains on, over all processes together."""
    return config.batch_size * config.block_size * config.gradient_accumulation_steps


def start_wandb(config, run_config, run_id):
    """A wandb run for this training run, or None when wandb cannot be imported: then a
    one-line warning, and training goes on with the local metrics. run_id: the wandb run a
    resumed training run continues (saved in its checkpoint), or None for a new one."""
    try:
        import wandb
    except ImportError:
        print(f"warning: wandb_log=True but wandb cannot be imported (pip install wandb); "
              f"logging to {config.out_dir}/metrics.jsonl only", file=sys.stderr)
        return None
    # dir=out_dir puts the run folder (out_dir/wandb/) beside the run's other files; with
    # WANDB_MODE=offline it stays there until `wandb sync` uploads it.
    try:
        return wandb.init(project=config.wandb_project, name=config.wandb_run_name, config=run_config,
                          dir=config.out_dir, id=run_id, resume="allow" if run_id else None)
    except wandb.errors.UsageError as e:  # no API key (online, and no terminal to ask for one)
        raise ConfigError(f"wandb_log=True but wandb cannot start a run ({e}). Run `wandb login` once, or set "
                          "WANDB_MODE=offline to keep the run in out_dir/wandb for a later `wandb sync`") from None


def start_out_dir(config, state, run_config):
    """Rank 0 makes out_dir this run's: metrics past the resumed iteration, an old profile and
    (from scratch) an old checkpoint go, and config.json describes this run."""
    ckpt_path = checkpoint_path(config.out_dir)
    if config.init_from == "scratch" and os.path.exists(ckpt_path):
        os.remove(ckpt_path)  # overwrite=True (check_out_dir): the old run's checkpoint goes with its metrics
    reset_metrics(config.out_dir, keep_through_iter=state.iter_num if config.init_from == "resume" else None)
    remove_profile(config.out_dir)
    write_run_config(config.out_dir, run_config)


def print_run_summary(config, world, device, raw_model, run_config):
    """What this run trains, where; and a warning when a config sized for a GPU runs on the CPU."""
    processes = f" over {world.size} processes" if world.distributed else ""
    print(f"{raw_model.num_params() / 1e6:.2f}M parameters, attn={config.attn}, device={device}, "
          f"dtype={run_config['dtype']}, {tokens_per_iter(config):,} tokens per iteration{processes}")
    flop_per_iter = raw_model.flops_per_token() * tokens_per_iter(config)
    if device.type == "cpu" and flop_per_iter > CPU_FLOP_PER_ITER_WARNING:
        print(f"warning: this config is sized for a GPU ({flop_per_iter / 1e12:.1f} TFLOP per iteration) and runs "
              f"on the CPU, where each iteration and evaluation batch may take minutes; configs/tiny.py is sized "
              f"for a CPU (python train.py configs/tiny.py)", file=sys.stderr)


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM (`kill`, job schedulers) ask the loop to stop at the next
    iteration boundary, the one point where model, optimizer and random streams agree, so
    the checkpoint saved there resumes exactly; an evaluation in progress stops after its
    current batch. A second signal, of either kind, stops the process at once without
    saving (the last checkpoint on disk is intact either way), with exit status 128 + its
    number.

    Python runs a signal handler in the main thread between bytecodes, so two signals that
    arrive during one long torch call would run it once. Python's C-level handler also
    writes one byte per signal to the wakeup fd, whatever the main thread is doing; a
    thread counts those bytes and stops the process at the second, so no signal is lost
    and a stuck main thread does not delay the stop.

    Under torchrun, signal torchrun: it passes the signal on to every process (and kills any
    still running 30 s later), and the processes agree on the iteration to stop at."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, announce):
        self.received = None
        self.announce = announce  # rank 0 alone says what happens next, as it alone saves
        wakeup_read, wakeup_write = os.pipe()
        os.set_blocking(wakeup_write, False)  # the C handler must never block
        signal.set_wakeup_fd(wakeup_write)
        for signum in self.SIGNALS:
            signal.signal(signum, self._handle)
        threading.Thread(target=self._count, args=(wakeup_read,), daemon=True).start()

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signum
            if self.announce:
                # os.write, not print: print is not safe to re-enter from a signal handler.
                os.write(2, f"\n{signal.Signals(signum).name}: stopping after this iteration and saving a "
                            "checkpoint (send a second signal to stop at once, without saving)\n".encode())

    def _count(self, wakeup_read):
        count = 0
        while True:
            for signum in os.read(wakeup_read, 64):
                if signum not in self.SIGNALS:
                    continue
                count += 1
                if count >= 2:
                    os.write(2, f"\nsecond signal ({signal.Signals(signum).name}): stopped at once, without "
                                "saving; the last checkpoint on disk is intact\n".encode())
                    os._exit(exit_status_of_signal(signum))


@torch.no_grad()
def estimate_loss(model, batches, config, amp, stop, it):
    """Mean loss over eval_iters batches per split, or None when a signal stopped the
    evaluation (checked between batches). The batches come from a generator seeded afresh
    each time: every evaluation sees the same windows (comparable across iterations and
    backends), and the training sampler is left untouched. An evaluation that runs longer
    than EVAL_PROGRESS_SECONDS prints how far it has got, so a long one is not silent."""
    model.eval()
    losses = {}
    last_report = time.perf_counter()
    for split in ("train", "val"):
        generator = torch.Generator().manual_seed(config.seed)
        total = 0.0
        for batch in range(config.eval_iters):
            if stop.received:
                model.train()
                return None
            total += batch_loss(model, *batches.get(split, generator), config, amp)
            if time.perf_counter() - last_report > EVAL_PROGRESS_SECONDS:
                print(f"evaluating at iter {it}: {split} batch {batch + 1}/{config.eval_iters}")
                last_report = time.perf_counter()
        losses[split] = total / config.eval_iters
    model.train()
    return losses


@torch.no_grad()
def one_batch_loss(model, batches, config, amp):
    """The model's loss on one val batch (the first of every evaluation), drawn from a
    generator of its own so no random stream of training moves."""
    model.eval()
    loss = batch_loss(model, *batches.get("val", torch.Generator().manual_seed(config.seed)), config, amp)
    model.train()
    return loss


def batch_loss(model, x, y, config, amp):
    """The loss of one batch in evaluation, as a float."""
    if config.compile:
        torch.compiler.cudagraph_mark_step_begin()  # see train_step
    with amp:
        _, loss = model(x, y)
    return loss.item()


def forward_backward(training, batches):
    """Every micro-batch's forward and backward pass: leaves the step's gradients in the
    parameters' .grad (summed over the micro-batches, and averaged over the processes by DDP)
    and returns the sum of the micro-batches' losses as a tensor, unread. With cuda_graph=True
    this is what the CUDA graph holds (training/step_graph.py).

    DDP averages the gradients across processes during the backward pass; only the last
    micro-batch's backward does so, the ones before run under no_sync and add to the local
    gradients, so a step costs one all-reduce rather than one per micro-batch.
    """
    config, world, model = training.config, training.world, training.train_model
    # Set to None, so that the first micro-batch's backward writes the gradients instead of
    # adding them to zeros (a kernel per parameter less; docs/benchmarks.md, session 16). A
    # captured step (cuda_graph=True) zeroes them in place: its graph writes the gradients where
    # the previous step left them.
    training.optimizer.zero_grad(set_to_none=not config.cuda_graph)
    loss_sum = torch.zeros((), device=training.device)
    for micro_step, (x, y) in enumerate(batches):
        accumulate_only = world.distributed and micro_step < len(batches) - 1
        if config.compile:
            # Under CUDA graphs (compile_mode reduce-overhead, max-autotune) each replay reuses the
            # memory of the previous one's outputs: this says the previous micro-batch is done with
            # them (its loss was added up, its backward ran), so the replay may overwrite them.
            torch.compiler.cudagraph_mark_step_begin()
        with model.no_sync() if accumulate_only else contextlib.nullcontext():
            with training.amp:
                _, loss = model(x, y)
            loss_sum += loss.detach()
            training.scaler.scale(loss / len(batches)).backward()
    return loss_sum


def train_step(training, passes):
    """One optimizer step; returns the mean loss over the micro-batches of every process.
    passes: batches -> their summed loss, gradients in .grad (forward_backward bound to
    training, or its CUDA graph with cuda_graph=True).

    Each process runs gradient_accumulation_steps / world.size micro-batches. The loss is read
    on the host once per step (a device sync), so a NaN or inf is caught at the iteration it
    appears, before the optimizer applies it; a non-finite loss is returned without stepping.
    It is averaged over the processes first, so all of them see the same number and skip or
    stop together. Batches are drawn inside the step, not prefetched across steps, so the
    sampler's state at a step boundary is exactly what a checkpoint stores.
    """
    config, world, optimizer, scaler = training.config, training.world, training.optimizer, training.scaler
    micro_steps = config.gradient_accumulation_steps // world.size
    batches = [training.batches.get("train", training.sampler) for _ in range(micro_steps)]
    mean_loss = world.mean_(passes(batches)).item() / micro_steps
    with labelled(OPTIMIZER_RANGE):
        if math.isfinite(mean_loss):
            if config.grad_clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(training.train_model.parameters(), config.grad_clip)
            scaler.step(optimizer)
            scaler.update()
    return mean_loss


def log(training, record):
    """A record to out_dir/metrics.jsonl and, with wandb_log=True, to wandb."""
    append_metrics(training.config.out_dir, record)
    if training.wandb_run is not None:
        training.wandb_run.log({key: value for key, value in record.items() if key != "iter"}, step=record["iter"])


def save(training, state, rng):
    """A checkpoint of this iteration. rng: every process's random streams (world.gather)."""
    save_checkpoint({
        "model": training.raw_model.state_dict(),
        "optimizer": training.optimizer.state_dict(),
        "scaler": training.scaler.state_dict(),
        "model_args": asdict(training.model_args),
        "config": asdict(training.config),
        "iter": state.iter_num,
        "best_val_loss": state.best_val_loss,
        "rng": rng,
        "wandb_run_id": training.wandb_run.id if training.wandb_run is not None else None,
        "gpt2_ids": training.batches.gpt2_ids,  # the model's token ids -> GPT-2's, for sample.py to decode
    }, training.config.out_dir)
    state.last_saved_iter = state.iter_num


def non_finite_error(what, value, state, out_dir):
    """The error that stops a run whose loss is NaN or inf, saying which checkpoint is left."""
    kept = (f"{checkpoint_path(out_dir)} still holds iter {state.last_saved_iter}, the last good checkpoint"
            if state.last_saved_iter is not None else "no checkpoint was saved")
    return TrainingError(f"{what} is {value} at iter {state.iter_num}; stopped without saving ({kept}). "
                         "A lower learning_rate or a smaller grad_clip may help")


def evaluate(training, state, stop):
    """Every process hands rank 0 its random streams for the checkpoint; rank 0 evaluates,
    logs and saves while the others wait at the next iteration. An evaluation a signal cuts
    short logs and saves nothing: the loop saves this iteration's state and stops."""
    config, world = training.config, training.world
    rng = world.gather(rng_states(training.sampler, training.device))
    losses = (estimate_loss(training.model, training.batches, config, training.amp, stop, state.iter_num)
              if world.is_main else {})
    stopped = losses is None
    losses = losses or {}
    if losses:
        val_bpc = bits_per_char(losses["val"], training.batches.tokens_per_char["val"])
        print(f"iter {state.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f} "
              f"({val_bpc:.3f} bits/char)")
    non_finite = [split for split, loss in losses.items() if not math.isfinite(loss)]
    if world.max(len(non_finite)):  # all processes stop together, with rank 0's message
        if not world.is_main:
            raise TrainingError(f"rank 0's evaluation at iter {state.iter_num} was not finite")
        raise non_finite_error(f"{non_finite[0]} loss", losses[non_finite[0]], state, config.out_dir)
    if not world.is_main or stopped:
        return
    log(training, {"iter": state.iter_num, "train_loss": losses["train"], "val_loss": losses["val"],
                   "val_bpc": val_bpc})
    improved = losses["val"] < state.best_val_loss
    state.best_val_loss = min(state.best_val_loss, losses["val"])
    if state.iter_num > 0 and (improved or config.always_save_checkpoint):
        save(training, state, rng)


def save_at_signal(training, state, signum):
    """Rank 0 saves this iteration (unless its checkpoint is on disk already) and says how to
    continue; every process hands it its random streams first."""
    world, name = training.world, signal.Signals(signum).name
    rng = world.gather(rng_states(training.sampler, training.device))
    if not world.is_main:
        return
    if state.last_saved_iter != state.iter_num:
        # The last step's update has not been through a loss yet (a diverging step gives a
        # finite loss, then weights that do not): checked first, so that a signal never saves
        # them over the last good checkpoint.
        loss = one_batch_loss(training.model, training.batches, training.config, training.amp)
        if not math.isfinite(loss):
            raise non_finite_error(f"{name}: the loss of the weights to save", loss, state, training.config.out_dir)
        save(training, state, rng)
    print(f"stopped by {name} at iter {state.iter_num}; checkpoint saved in "
          f"{checkpoint_path(training.config.out_dir)}. To continue, run the same command with --init_from=resume")


def log_progress(training, iter_num, loss, lr, seconds_per_step, warmup):
    """Rank 0 prints and logs the last step's loss and learning rate, and the steps' mean time
    since the last record, with the throughput and memory that follow from it."""
    device = training.device
    step_ms = 1000 * seconds_per_step
    tokens_per_s = tokens_per_iter(training.config) / seconds_per_step
    card_peak = peak_flops(device)
    mfu = training.raw_model.flops_per_token() * tokens_per_s / (card_peak * training.world.size) if card_peak else None
    peak_mem = peak_memory_mb(device)
    print(f"iter {iter_num}: loss {loss:.4f}, lr {lr:.2e}, {step_ms:.1f} ms/iter, {tokens_per_s:,.0f} tok/s, "
          f"mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}, "
          f"peak mem {'n/a' if peak_mem is None else f'{peak_mem:,.0f} MB'}"
          f"{' (warm-up)' if warmup else ''}")
    log(training, {"iter": iter_num, "loss": loss, "lr": lr, "step_ms": step_ms, "tokens_per_s": tokens_per_s,
                   "mfu": mfu, "peak_mem_mb": peak_mem, "warmup": warmup})


def save_profile(training, result):
    """The profiler's category times, with the memory numbers torch can tell."""
    config = training.config
    x, y = training.batches.get("train", torch.Generator().manual_seed(config.seed))
    result.update(attn=config.attn, compile=config.compile, peak_mem_mb=peak_memory_mb(training.device),
                  attention_saved_mb=attention_saved_mb(training.raw_model, x, y, training.amp))
    write_profile(config.out_dir, result)
    print(f"profiled {result['steps']} steps: {result['step_ms']:.1f} ms/step, "
          + ", ".join(f"{category} {ms:.2f}" for category, ms in result["ms"].items())
          + f" (ms, {'GPU kernels' if result['device'] == 'cuda' else 'CPU ops'}); "
          f"{os.path.join(config.out_dir, PROFILE_NAME)}")


def finish(training, profiler, status):
    """Stop the profiler (warning when the run ended before its steps) and close the wandb
    run with the exit status."""
    if profiler is not None:
        profiler.stop()
        if not os.path.exists(os.path.join(training.config.out_dir, PROFILE_NAME)):
            print(f"warning: profile=True but the run stopped before its steps {TIMING_WARMUP_STEPS + 2}-"
                  f"{TIMING_WARMUP_STEPS + 1 + PROFILE_STEPS} were profiled: nothing written", file=sys.stderr)
    if training.wandb_run is not None:
        training.wandb_run.finish(exit_code=status)


def run(config, world):
    """Train; return the process exit status (0, or 128 + signal number when stopped)."""
    device, dtype, amp = start_device(config, world)
    # Each process seeds its own streams, so dropout and batches differ between processes
    # (DDP copies rank 0's initial weights to the others). A plain run is rank 0.
    seed = config.seed + world.rank
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    batches = load_data(config, device, world)
    model_args, model, optimizer, scaler = build_model(config, batches.vocab_size, device, dtype)
    sampler = torch.Generator().manual_seed(seed)
    state, wandb_run_id = TrainState(), None
    if config.init_from == "resume":
        state, wandb_run_id = resume(config, world, device, sampler, model_args, model, optimizer, scaler)

    raw_model = model
    if config.compile:
        model = compile_model(model, config.compile_mode)
    # Rank 0 evaluates `model` on its own; training goes through the DDP wrapper, which
    # averages gradients across the processes.
    train_model = model
    if world.distributed:
        train_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    run_config = {**asdict(config), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                  "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                  "world_size": world.size, "n_params": raw_model.num_params(),
                  "tokens_per_iter": tokens_per_iter(config)}
    # Before anything is written to out_dir, so a missing wandb login changes nothing there.
    wandb_run = start_wandb(config, run_config, wandb_run_id) if config.wandb_log and world.is_main else None
    if world.is_main:
        start_out_dir(config, state, run_config)
        print_run_summary(config, world, device, raw_model, run_config)
    training = Training(config=config, world=world, device=device, amp=amp, batches=batches, sampler=sampler,
                        model_args=model_args, raw_model=raw_model, model=model, train_model=train_model,
                        optimizer=optimizer, scaler=scaler, wandb_run=wandb_run)
    # Kept here, not in training: a Training that referred to itself through it would sit in a
    # reference cycle, and its DDP model, which holds the process group, would be freed by the
    # garbage collector at interpreter exit, after World.stop destroyed the group. Under
    # torchrun on the CPU that aborted a process now and then ("terminate called without an
    # active exception": 9 of 56 two-process runs; none of 40 without the cycle).
    passes = functools.partial(forward_backward, training)
    if config.cuda_graph:
        passes = StepGraph(passes)

    # Profiles the steady steps right after the timing warm-up, then lets training go on; those
    # few steps' logged times include the profiler's overhead.
    profiler = (step_profiler(config.out_dir, TIMING_WARMUP_STEPS, lambda result: save_profile(training, result))
                if config.profile and world.is_main else None)
    status = EXIT_ERROR  # what wandb records if an exception ends the run
    try:
        if profiler is not None:
            profiler.start()
        stop = StopSignals(announce=world.is_main)
        if config.init_from == "scratch":
            evaluate(training, state, stop)
        warmup_end = state.iter_num + TIMING_WARMUP_STEPS
        step_seconds, steps_timed = 0.0, 0
        while True:
            # All processes stop at the same iteration, whichever of them got the signal.
            signum = world.max(stop.received or 0)
            if signum:
                save_at_signal(training, state, signum)
                status = exit_status_of_signal(signum)
                return status
            if state.iter_num >= config.max_iters:
                status = 0
                return status

            lr = learning_rate_at(state.iter_num, config)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # The whole optimizer step, from the first batch to the weight update, between two
            # device synchronisations, so on a GPU it ends when the GPU has finished the step's
            # work, not when the host has issued it; logging, evaluation and checkpoints fall outside.
            synchronize(device)
            start = time.perf_counter()
            loss = train_step(training, passes)
            synchronize(device)
            step_seconds += time.perf_counter() - start
            steps_timed += 1
            state.iter_num += 1
            if profiler is not None:
                profiler.step()
            if not math.isfinite(loss):
                raise non_finite_error("training loss", loss, state, config.out_dir)

            # A record at the end of the warm-up too, so no record mixes warm-up and steady steps.
            if state.iter_num % config.log_interval == 0 or state.iter_num == warmup_end:
                if world.is_main:
                    log_progress(training, state.iter_num, loss, lr, step_seconds / steps_timed,
                                 warmup=state.iter_num <= warmup_end)
                step_seconds, steps_timed = 0.0, 0
            if state.iter_num % config.eval_interval == 0 or state.iter_num == config.max_iters:
                evaluate(training, state, stop)
    finally:
        finish(training, profiler, status)


def config_name(argv):
    """The config files' names (e.g. shakespeare_long), for the default wandb run name."""
    return "+".join(Path(path).stem for path in config_files(argv)) or DEFAULT_CONFIG_NAME


def is_out_of_memory(error):
    """The GPU's allocator raises torch.OutOfMemoryError; the host's raise a RuntimeError
    (torch's CPU allocator) or MemoryError (numpy, Python)."""
    return (isinstance(error, (torch.OutOfMemoryError, MemoryError))
            or "DefaultCPUAllocator: can't allocate memory" in str(error))


def out_of_memory_message(config, world):
    where = f" on rank {world.rank}" if world.distributed else ""
    cap = f" under max_memory_gb={config.max_memory_gb:g}" if config.max_memory_gb else ""
    hint = "; a FlashAttention backend never holds the block_size x block_size scores" if config.attn == "eager" else ""
    return (f"out of memory{where}{cap} with attn={config.attn}, block_size={config.block_size}, "
            f"batch_size={config.batch_size}. A smaller batch_size or block_size needs less{hint}")


def main(argv=None):
    sys.stdout.reconfigure(line_buffering=True)  # log lines show up at once, even through a pipe
    argv = sys.argv[1:] if argv is None else list(argv)
    world = World()
    config = parse_config(TrainConfig, argv, check=lambda config: (check_config(config, world.size),
                                                                     check_out_dir(config)), usage=__doc__)
    if not config.wandb_run_name:
        config = replace(config, wandb_run_name=f"{config.attn}-{config_name(argv)}")
    try:
        status = run(config, world)
    except (DataError, PrepareError, DeviceError, CheckpointError, TrainingError) as e:
        # These meet every process alike (the same files, the same averaged loss), so rank 0
        # speaks for all of them.
        if world.is_main:
            print(f"error: {e}", file=sys.stderr)
        status = EXIT_ERROR
    except ConfigError as e:  # one that shows only once the run starts: no wandb login
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
