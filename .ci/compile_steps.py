"""Training-step time of the default model, uncompiled and compiled, per backend: `.ci/gpu compile`.

    python .ci/compile_steps.py --block_size=1024 [--backends=eager,sdpa,triton] [--tokens=4096] [--rounds=6]
                                [--modes=none,default,reduce-overhead,none+graph,default+graph]

One process per block size. The model is train.py's default (TrainConfig) over the dense
TinyShakespeare vocabulary, but with dropout 0, and the step does not clip the gradient
(train.py --profile=True measures the default run itself, with both). Batch = --tokens (by
default the default's tokens per micro-batch) / block_size sequences, at least one, so every
micro-batch holds the same tokens whatever the context (up to --tokens); the default's
micro-batches a step, bf16 autocast, fused AdamW, CUDA memory capped at 12 GiB (the target
card). Random tokens: no data needed. A mode is "none" (uncompiled) or a torch.compile mode;
"+graph" captures the forward and backward passes in one CUDA graph as train.py
--cuda_graph=True does (training/step_graph.py).

Per mode, every backend's model is built and warmed up (5 steps, which compile), then the
backends take turns: --rounds rounds of 5 synchronised steps each, the order reversed every other
round, because the host's speed drifts by tens of percent over minutes and alternating spreads
the drift over every backend alike. For each it prints the median wall time of those steps with
the spread of the rounds' medians, and the GPU time per step: the sum of CUDA kernel times over
5 profiled steps (torch.profiler), / 5. Judge kernels by GPU time, host overhead by wall time.
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
from training.step_graph import StepGraph  # noqa: E402
from training.train_config import TrainConfig  # noqa: E402

DEFAULT = TrainConfig()
TOKENS_PER_MICRO_BATCH = DEFAULT.batch_size * DEFAULT.block_size
ACCUMULATION = DEFAULT.gradient_accumulation_steps


def make_step(model, optimizer, batches, compiled, graphed):
    """train.py's step without its clipping and loss read: forward_backward (as one CUDA graph
    with graphed, training/step_graph.py), then the optimizer."""
    def forward_backward(batches):
        optimizer.zero_grad(set_to_none=not graphed)
        loss_sum = torch.zeros((), device="cuda")
        for x, y in batches:
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x, y)
            loss_sum += loss.detach()
            (loss / ACCUMULATION).backward()
        return loss_sum
    run = StepGraph(forward_backward) if graphed else forward_backward

    def step():
        run(batches)
        optimizer.step()
    return step


def gpu_ms_per_step(step, steps=5):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernel_us = sum(e.device_time_total for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    return kernel_us / 1000 / steps


def build(backend, mode, block_size, tokens):
    """The step function of one backend's model, warmed up; and the warm-up's seconds. mode:
    "none" (uncompiled) or a torch.compile mode, "+graph" for train.py's --cuda_graph=True."""
    torch.manual_seed(0)
    batch = max(1, tokens // block_size)
    model = GPT(replace(DEFAULT.model_config(VOCAB_SIZE), block_size=block_size, dropout=0.0, attn=backend)).cuda()
    optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.99), "cuda")
    compile_mode, graphed = mode.removesuffix("+graph"), mode.endswith("+graph")
    compiled = compile_mode != "none"
    run = compile_model(model, compile_mode) if compiled else model
    tokens = [torch.randint(0, VOCAB_SIZE, (batch, block_size), device="cuda") for _ in range(ACCUMULATION)]
    step = make_step(run, optimizer, [(x, x.roll(-1, dims=1)) for x in tokens], compiled, graphed)
    start = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    return step, time.perf_counter() - start


def timed_steps(step, steps=5):
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return times


def measure_mode(backends, mode, block_size, tokens, rounds):
    """{backend: (median wall ms, (lowest, highest) round median, GPU ms, warm-up s)}, None for a
    backend that does not fit 12 GiB."""
    steps, results = {}, {}
    for backend in backends:
        try:
            steps[backend] = build(backend, mode, block_size, tokens)
        except torch.OutOfMemoryError:
            results[backend] = None
            torch.cuda.empty_cache()
    walls = {backend: [] for backend in steps}
    round_medians = {backend: [] for backend in steps}
    for r in range(rounds):
        for backend in (list(steps) if r % 2 == 0 else reversed(list(steps))):
            times = timed_steps(steps[backend][0])
            walls[backend] += times
            round_medians[backend].append(statistics.median(times))
    for backend, (step, warmup_s) in steps.items():
        results[backend] = (statistics.median(walls[backend]), (min(round_medians[backend]),
                            max(round_medians[backend])), gpu_ms_per_step(step), warmup_s)
    torch._dynamo.reset()
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--block_size", type=int, required=True)
    parser.add_argument("--backends", default="eager,sdpa,triton")
    parser.add_argument("--modes", default="none,default,reduce-overhead,none+graph,default+graph")
    parser.add_argument("--tokens", type=int, default=TOKENS_PER_MICRO_BATCH, help="tokens per micro-batch")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of 5 steps per backend, taken in turn")
    args = parser.parse_args()
    torch.cuda.set_per_process_memory_fraction(min(1.0, 12 * 2**30 / torch.cuda.get_device_properties(0).total_memory))
    print(f"block_size {args.block_size}, batch {max(1, args.tokens // args.block_size)} x {ACCUMULATION} "
          f"micro-batches, bf16, {torch.cuda.get_device_name()}")
    print(f"{'backend':<10} {'mode':<16} {'wall ms/step':>12} {'round medians':>16} {'GPU ms/step':>12} "
          f"{'warm-up s':>10}")
    backends = args.backends.split(",")
    for mode in args.modes.split(","):
        for backend, result in measure_mode(backends, mode, args.block_size, args.tokens, args.rounds).items():
            if result is None:
                print(f"{backend:<10} {mode:<16} {'out of memory under 12 GiB':>36}")
                continue
            wall, (low, high), gpu, warmup = result
            print(f"{backend:<10} {mode:<16} {wall:>12.2f} {f'{low:.1f}-{high:.1f}':>16} {gpu:>12.2f} {warmup:>10.1f}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
