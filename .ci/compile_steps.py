"""Training-step time of the default model, uncompiled and compiled, per backend: `.ci/gpu compile`.

    python .ci/compile_steps.py --block_size=1024 [--backends=eager,sdpa,triton] [--modes=none,default,reduce-overhead]
                                [--tokens=4096]

One process per block size; within it the variants run one after another, backends
alternating within each mode. The model is train.py's default (TrainConfig) over the dense
TinyShakespeare vocabulary; batch = --tokens (by default the default's tokens per micro-batch)
/ block_size sequences, at least one, so every micro-batch holds the same tokens whatever the
context (up to --tokens); the default's
micro-batches a step, bf16 autocast, fused AdamW, CUDA memory capped at 12 GiB (the target
card). Random tokens: no data needed. For each variant it prints
the median wall time of 20 synchronised steps (after 5 warm-up steps, which compile) and the
GPU time per step: the sum of CUDA kernel times over 5 profiled steps (torch.profiler), / 5.
The host's speed drifts, so judge kernels by GPU time and host overhead by wall time.
"""
import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from data.shakespeare.prepare import SHAKESPEARE_VOCAB_SIZE as VOCAB_SIZE  # noqa: E402
from model import GPT, compile_model  # noqa: E402
from training.train_config import TrainConfig  # noqa: E402

DEFAULT = TrainConfig()
TOKENS_PER_MICRO_BATCH = DEFAULT.batch_size * DEFAULT.block_size
ACCUMULATION = DEFAULT.gradient_accumulation_steps


def make_step(model, optimizer, batches, compiled):
    def step():
        for x, y in batches:
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x, y)
            (loss / ACCUMULATION).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def gpu_ms_per_step(step, steps=5):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernel_us = sum(e.device_time_total for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    return kernel_us / 1000 / steps


def measure(backend, mode, block_size, tokens):
    torch.manual_seed(0)
    batch = max(1, tokens // block_size)
    model = GPT(replace(DEFAULT.model_config(VOCAB_SIZE), block_size=block_size, dropout=0.0, attn=backend)).cuda()
    optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.99), "cuda")
    compiled = mode != "none"
    run = compile_model(model, mode) if compiled else model
    tokens = [torch.randint(0, VOCAB_SIZE, (batch, block_size), device="cuda") for _ in range(ACCUMULATION)]
    batches = [(x, x.roll(-1, dims=1)) for x in tokens]
    step = make_step(run, optimizer, batches, compiled)
    start = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start
    times = []
    for _ in range(20):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    gpu_ms = gpu_ms_per_step(step)
    torch._dynamo.reset()
    return statistics.median(times), gpu_ms, warmup_s


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--block_size", type=int, required=True)
    parser.add_argument("--backends", default="eager,sdpa,triton")
    parser.add_argument("--modes", default="none,default,reduce-overhead")
    parser.add_argument("--tokens", type=int, default=TOKENS_PER_MICRO_BATCH, help="tokens per micro-batch")
    args = parser.parse_args()
    torch.cuda.set_per_process_memory_fraction(min(1.0, 12 * 2**30 / torch.cuda.get_device_properties(0).total_memory))
    print(f"block_size {args.block_size}, batch {max(1, args.tokens // args.block_size)} x {ACCUMULATION} "
          f"micro-batches, bf16, {torch.cuda.get_device_name()}")
    print(f"{'backend':<10} {'compile':<16} {'wall ms/step':>12} {'GPU ms/step':>12} {'warm-up s':>10}")
    for mode in args.modes.split(","):
        for backend in args.backends.split(","):
            try:
                wall, gpu, warmup = measure(backend, mode, args.block_size, args.tokens)
                print(f"{backend:<10} {mode:<16} {wall:>12.2f} {gpu:>12.2f} {warmup:>10.1f}")
            except torch.OutOfMemoryError:
                print(f"{backend:<10} {mode:<16} {'out of memory under 12 GiB':>36}")
                torch._dynamo.reset()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
