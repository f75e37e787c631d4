"""Attention benchmark: every provider side by side, in one process, on one card. Needs a
CUDA GPU (it times GPU kernels); without one it stops at once.

    python bench.py                  # paper grid + long-context grid -> bench-out/
    python bench.py --quick          # a few shapes of each grid
    python bench.py --configs        # time every candidate tile config of each Triton kernel
    python bench.py --ladder         # the forward, one optimisation at a time (docs/optimisation.md)
    python bench.py --launch         # CPU time to issue vs GPU time to run, at the model's shape
    python bench.py --decode         # generation tokens/s: KV cache or not, compiled or not, batch 1 and 32

Times forward, backward and forward+backward with triton.testing.do_bench (median of
repeated runs after warm-up, on fresh random inputs per shape). q, k, v are strided views of
one fused (B, N, 3, H, D) projection, as the model makes them. TFLOP/s count 4*B*H*N^2*D for
the forward (half when causal) and 2.5x that for the backward. Writes attention.json,
attention.md (tables), attention.png (paper grid) and attention_long.png.
"""
import argparse
import json
import os
import platform
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context
from unittest import mock

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention import BACKENDS, attention, gluon_forward, packed_attention
from attention.triton_backward import backward_smem_rows, flash_backward
from attention.triton_launch import shared_memory_bytes, shared_memory_limit
from attention.triton_forward import FORWARD_CONFIGS, flash_forward, forward_smem_rows
from data.shakespeare.prepare import SHAKESPEARE_VOCAB_SIZE
from model import GPT
from training.devices import generation_precision
from training.train_config import TrainConfig

import triton  # noqa: E402, I001  (after attention, which decides whether Triton interprets)

SDPA_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                 "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
PROVIDERS = ("eager", "tiled", "triton", "triton_fwd", *SDPA_BACKENDS)
MODES = ("fwd", "bwd", "fwd+bwd")
TILED_MAX_N = 2048  # the Python-loop teaching version takes seconds per call beyond this


def paper_grid(quick):
    """FlashAttention-2 paper: 16k tokens per batch, hidden size 2048."""
    lengths = (1024, 4096, 16384) if quick else (512, 1024, 2048, 4096, 8192, 16384)
    return [dict(B=16384 // n, H=2048 // d, N=n, D=d, causal=c, dtype="bfloat16")
            for d in (64, 128) for c in (False, True) for n in lengths]


def long_grid(quick):
    """One sequence, causal, up to 64k tokens; 16 heads."""
    lengths = (1024, 16384, 65536) if quick else tuple(2 ** p for p in range(7, 17))
    dims = (64, 128) if quick else (16, 32, 64, 128)
    return [dict(B=1, H=16, N=n, D=d, causal=True, dtype=dt)
            for dt in ("bfloat16", "float32") for d in dims for n in lengths]


def make_inputs(shape, requires_grad):
    B, H, N, D = shape["B"], shape["H"], shape["N"], shape["D"]
    qkv = torch.randn(B, N, 3, H, D, device="cuda", dtype=getattr(torch, shape["dtype"]), requires_grad=requires_grad)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    return qkv, q, k, v


def run_provider(name, q, k, v, causal):
    if name in SDPA_BACKENDS:
        with sdpa_kernel(SDPA_BACKENDS[name]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return attention(q, k, v, is_causal=causal, backend=name)


def flops(shape, mode):
    fwd = 4 * shape["B"] * shape["H"] * shape["N"] ** 2 * shape["D"] / (2 if shape["causal"] else 1)
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}[mode]


def time_mode(name, shape, mode, rep_ms):
    """Median ms of one mode, or raises (unsupported shape, out of memory)."""
    causal = shape["causal"]
    if mode == "fwd":
        _, q, k, v = make_inputs(shape, requires_grad=False)
        fn = lambda: run_provider(name, q, k, v, causal)
    else:
        qkv, q, k, v = make_inputs(shape, requires_grad=True)
        do = torch.randn(q.shape, device=q.device, dtype=q.dtype)
        if mode == "bwd":
            o = run_provider(name, q, k, v, causal)
            fn = lambda: torch.autograd.grad(o, qkv, do, retain_graph=True)
        else:
            fn = lambda: torch.autograd.grad(run_provider(name, q, k, v, causal), qkv, do)
    return triton.testing.do_bench(fn, warmup=max(rep_ms // 4, 5), rep=rep_ms, return_mode="median")


def peak_memory_mb(name, shape):
    """Peak memory of one forward+backward beyond the inputs."""
    qkv, q, k, v = make_inputs(shape, requires_grad=True)
    do = torch.randn(q.shape, device=q.device, dtype=q.dtype)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.autograd.grad(run_provider(name, q, k, v, shape["causal"]), qkv, do)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def bench_shape(grid, shape, providers, rep_ms):
    rows = []
    for name in providers:
        if name == "tiled" and shape["N"] > TILED_MAX_N:
            continue
        row = dict(grid=grid, provider=name, **shape)
        try:
            row["peak_mem_mb"] = round(peak_memory_mb(name, shape), 1)
            for mode in MODES:
                ms = time_mode(name, shape, mode, rep_ms)
                row[mode] = dict(ms=ms, tflops=flops(shape, mode) / ms / 1e9)
            row["status"] = "ok"
        except torch.cuda.OutOfMemoryError:
            row["status"] = "out of memory"
        except RuntimeError as e:  # e.g. an SDPA backend that does not take this shape or dtype
            row["status"] = "unsupported: " + str(e).splitlines()[0][:80]
        torch.cuda.empty_cache()
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def format_row(row):
    shape = f"B={row['B']:<3} H={row['H']:<3} N={row['N']:<6} D={row['D']:<4} {'causal' if row['causal'] else 'full  '} {row['dtype']:<9}"
    if row["status"] != "ok":
        return f"{shape} {row['provider']:<15} {row['status']}"
    perf = "  ".join(f"{m} {row[m]['tflops']:6.1f}" for m in MODES)
    return f"{shape} {row['provider']:<15} {perf}  TFLOP/s   peak {row['peak_mem_mb']:9.1f} MB"


def environment():
    props = torch.cuda.get_device_properties(0)
    return dict(card=props.name, sm=f"{props.major}.{props.minor}", torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), python=platform.python_version(),
                date=time.strftime("%Y-%m-%d"))


# ------------------------------------------------------------------ reports

def markdown(rows, env):
    lines = [f"Card: {env['card']} (sm_{env['sm'].replace('.', '')}); torch {env['torch']}, Triton {env['triton']}, "
             f"CUDA {env['cuda']}, cuDNN {env['cudnn']}; {env['date']}.", ""]
    for grid in ("paper", "long"):
        grid_rows = [r for r in rows if r["grid"] == grid]
        keys = sorted({(r["D"], r["causal"], r["dtype"]) for r in grid_rows})
        for mode in MODES:
            for D, causal, dtype in keys:
                sel = [r for r in grid_rows if (r["D"], r["causal"], r["dtype"]) == (D, causal, dtype)]
                providers = [p for p in PROVIDERS if any(r["provider"] == p for r in sel)]
                lines += [f"**{grid} grid, {mode}, D={D}, {'causal' if causal else 'not causal'}, {dtype}** "
                          "(TFLOP/s; x = triton over sdpa_flash / sdpa_cudnn)", "",
                          "| N | " + " | ".join(providers) + " | x flash | x cuDNN |",
                          "|---" * (len(providers) + 3) + "|"]
                for n in sorted({r["N"] for r in sel}):
                    cell = {r["provider"]: r for r in sel if r["N"] == n}
                    tf = {p: cell[p][mode]["tflops"] for p in providers if p in cell and cell[p]["status"] == "ok"}
                    values = [f"{tf[p]:.0f}" if p in tf else ("OOM" if p in cell and "memory" in cell[p]["status"] else "–")
                              for p in providers]
                    ratio = lambda peer: f"{tf['triton'] / tf[peer]:.2f}" if "triton" in tf and peer in tf else "–"
                    lines.append(f"| {n} | " + " | ".join(values) + f" | {ratio('sdpa_flash')} | {ratio('sdpa_cudnn')} |")
                lines.append("")
        mem_keys = sorted({(r["D"], r["causal"], r["dtype"]) for r in grid_rows})
        for D, causal, dtype in mem_keys[:1] if grid == "paper" else mem_keys:
            sel = [r for r in grid_rows if (r["D"], r["causal"], r["dtype"]) == (D, causal, dtype)]
            providers = [p for p in PROVIDERS if any(r["provider"] == p for r in sel)]
            lines += [f"**{grid} grid, peak memory of forward+backward beyond the inputs (MB), D={D}, "
                      f"{'causal' if causal else 'not causal'}, {dtype}**", "",
                      "| N | " + " | ".join(providers) + " |", "|---" * (len(providers) + 1) + "|"]
            for n in sorted({r["N"] for r in sel}):
                cell = {r["provider"]: r for r in sel if r["N"] == n}
                lines.append(f"| {n} | " + " | ".join(
                    (f"{cell[p]['peak_mem_mb']:.0f}" if cell[p]["status"] == "ok" else "OOM" if "memory" in cell[p]["status"] else "–")
                    if p in cell else "–" for p in providers) + " |")
            lines.append("")
    return "\n".join(lines)


def plot(rows, grid, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["grid"] == grid and r["status"] == "ok"]
    panels = sorted({(r["D"], r["causal"], r["dtype"]) for r in rows})
    fig, axes = plt.subplots(len(MODES), len(panels), figsize=(4 * len(panels), 3.2 * len(MODES)), squeeze=False)
    for col, (D, causal, dtype) in enumerate(panels):
        for row_i, mode in enumerate(MODES):
            ax = axes[row_i][col]
            for p in PROVIDERS:
                pts = sorted((r["N"], r[mode]["tflops"]) for r in rows
                             if r["provider"] == p and (r["D"], r["causal"], r["dtype"]) == (D, causal, dtype))
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=3, label=p, lw=2.5 if p == "triton" else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode}, D={D}, {'causal' if causal else 'full'}, {dtype}", fontsize=9)
            ax.set_xlabel("sequence length N")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------ tile-config sweep

def sweep_configs(out):
    """Time each kernel with every candidate config (a superset of the autotuner's lists) at
    one paper-grid shape per head dim, on both load paths, and print them fastest first."""
    wide = [(a, b, w, s) for a in (64, 128) for b in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
    bwd = [(a, b, c, w, s) for a in (64, 128) for b in (32, 64, 128) for c in (32, 64) for w in (4, 8) for s in (2, 3)]
    jobs = [("fwd", dict(BLOCK_M=a, BLOCK_N=b), w, s) for a, b, w, s in wide]
    jobs += [("bwd", dict(BLOCK_M=a, BLOCK_N=b, DKDV_BLOCK_M=c), w, s) for a, b, c, w, s in bwd]
    cases = [(D, causal, tma) for D in (64, 128) for causal in (False, True) for tma in (True, False)]
    work = [(kernel, tiles, w, s, D, causal, tma) for D, causal, tma in cases for kernel, tiles, w, s in jobs]
    # Compiling is the slow part and needs no GPU time: compile every config in parallel first.
    with ProcessPoolExecutor(max_workers=min(16, os.cpu_count()), mp_context=get_context("spawn")) as pool:
        list(pool.map(_run_config, work, [1] * len(work)))
    results = [dict(kernel=kernel, tiles=tiles, num_warps=w, num_stages=s, D=D, causal=causal, tma=tma,
                    ms=_run_config((kernel, tiles, w, s, D, causal, tma), 0))
               for kernel, tiles, w, s, D, causal, tma in work]
    with open(os.path.join(out, "configs.json"), "w") as f:
        json.dump(dict(env=environment(), results=results), f, indent=1)
    for D, causal, tma in cases:
        for kernel in ("fwd", "bwd"):
            sel = sorted((r for r in results if (r["kernel"], r["D"], r["causal"], r["tma"]) == (kernel, D, causal, tma)
                          and r["ms"] is not None), key=lambda r: r["ms"])
            print(f"{kernel} D={D} causal={causal} tma={tma}: " + ", ".join(
                f"{tuple(r['tiles'].values())}w{r['num_warps']}s{r['num_stages']} {r['ms']:.3f}" for r in sel[:6]))


def optimisation_ladder(out):
    """The forward at docs/optimisation.md's fixed shape (B=4, H=16, N=4096, D=64, causal, bf16),
    one knob at a time from the seed's 16x16 tiles to the autotuned kernel, then (on Hopper) the
    warp-specialised Gluon kernel that flash_forward runs there."""
    shape = dict(B=4, H=16, N=4096, D=64, causal=True, dtype="bfloat16")
    _, q, k, v = make_inputs(shape, requires_grad=False)
    steps = [("seed's tiles: 16x16, no pipelining, cp.async path", (16, 16, 4, 1, False)),
             ("64x64 tiles", (64, 64, 4, 1, False)),
             ("+ software pipelining (3 stages)", (64, 64, 4, 3, False)),
             ("128x64 tiles, 8 warps", (128, 64, 8, 3, False)),
             ("TMA descriptors instead of cp.async", (128, 64, 8, 3, True)),
             ("64x128 tiles, TMA, 2 stages", (64, 128, 4, 2, True))]
    rows = []
    for label, (bm, bn, w, s, tma) in steps:
        config = triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, USE_TMA=tma), num_warps=w, num_stages=s)
        ms = triton.testing.do_bench(lambda: flash_forward(q, k, v, True, config=config), rep=100, return_mode="median")
        rows.append(dict(step=label, config=str(config), ms=ms, tflops=flops(shape, "fwd") / ms / 1e9))
    with mock.patch.object(gluon_forward, "serves", lambda *args: False):  # triton_forward.py's kernel, tuned
        ms = triton.testing.do_bench(lambda: flash_forward(q, k, v, True), rep=100, return_mode="median")
    rows.append(dict(step="autotuned Triton kernel", config="", ms=ms, tflops=flops(shape, "fwd") / ms / 1e9))
    if gluon_forward.serves(q, k, True):
        ms = triton.testing.do_bench(lambda: flash_forward(q, k, v, True), rep=100, return_mode="median")
        rows.append(dict(step="warp-specialised Gluon kernel (Hopper)", config=str(gluon_forward.TILES[64, True]),
                         ms=ms, tflops=flops(shape, "fwd") / ms / 1e9))
    for name in SDPA_BACKENDS:
        ms = triton.testing.do_bench(lambda: run_provider(name, q, k, v, True), rep=100, return_mode="median")
        rows.append(dict(step=name, config="", ms=ms, tflops=flops(shape, "fwd") / ms / 1e9))
    with open(os.path.join(out, "ladder.json"), "w") as f:
        json.dump(dict(env=environment(), shape=shape, steps=rows), f, indent=1)
    for r in rows:
        print(f"{r['step']:<55} {r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s")


# ------------------------------------------------------------------ launch overhead

_MODEL = TrainConfig()  # train.py's defaults, which are configs/shakespeare.py
MODEL_SHAPE = dict(B=_MODEL.batch_size, H=_MODEL.n_head, N=_MODEL.block_size, D=_MODEL.n_embd // _MODEL.n_head,
                   causal=True, dtype="bfloat16")  # one attention call of that model's training step
SLEEP_CYCLES = 10 ** 9  # about half a second of GPU clock: longer than queuing the timed calls takes


def launch_overhead(out):
    """Each training backend's forward+backward at the model's shape, called as the model calls
    it (packed_attention on the fused projection): the CPU time to issue it and the GPU time to
    run it. Where issuing takes longer, the GPU waits on Python, and a faster kernel cannot make
    training faster (docs/benchmarks.md, training section)."""
    rows = []
    for name in BACKENDS:
        qkv, q, _, _ = make_inputs(MODEL_SHAPE, requires_grad=True)
        do = torch.randn(q.transpose(1, 2).shape, device=q.device, dtype=q.dtype)
        step = lambda: torch.autograd.grad(packed_attention(qkv, MODEL_SHAPE["causal"], name), qkv, do)
        for _ in range(10):  # compile, tune, warm the allocator
            step()
        issue_s = []
        for _ in range(50):
            torch.cuda.synchronize()  # an idle GPU: issuing never waits for room in the launch queue
            start = time.perf_counter()
            step()
            issue_s.append(time.perf_counter() - start)
        # GPU time alone: a sleep kernel holds the GPU while the calls queue up behind it; the
        # events around them then time the GPU's work back to back, without Python's gaps.
        calls = 20
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(calls):
            step()
        end.record()
        gpu_idled = begin.query()  # the sleep ended before the last call was queued: gaps were timed too
        torch.cuda.synchronize()
        rows.append(dict(backend=name, issue_us=1e6 * statistics.median(issue_s),
                         gpu_us=1e3 * begin.elapsed_time(end) / calls, gpu_idled=gpu_idled))
    shape = ", ".join(f"{key}={value}" for key, value in MODEL_SHAPE.items())
    lines = [f"Forward+backward of packed_attention at the model's attention shape ({shape}).", "",
             "| backend | CPU time to issue (us) | GPU time to run (us) |", "|---|---|---|"]
    lines += [f"| {r['backend']} | {r['issue_us']:.0f} | {r['gpu_us']:.0f}{' (GPU idled: an upper bound)' if r['gpu_idled'] else ''} |"
              for r in rows]
    with open(os.path.join(out, "launch.json"), "w") as f:
        json.dump(dict(env=environment(), shape=MODEL_SHAPE, results=rows), f, indent=1)
    with open(os.path.join(out, "launch.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


# ------------------------------------------------------------------ decoding

DECODE_BATCHES = (1, 32)
DECODE_NEW_TOKENS = 255  # after a 1-token prompt: the 256-token context exactly, never sliding
DECODE_RUNS = ("no cache", "KV cache", "KV cache, compiled")


def decode_model(config, state, backend, compiled):
    """The model decode_throughput times: config with the given attention backend and weights,
    on the GPU in eval mode, its weights cast to bf16 once (as sample.py generates in bf16), its
    decode step compiled when asked. Returns it and the context to generate under."""
    model = GPT(replace(config, attn=backend))
    model.load_state_dict(state)
    model.eval().cuda()
    precision = generation_precision(model, torch.device("cuda"), torch.bfloat16)
    if compiled:
        # Every model compiles the same code object, GPT.decode_step: without a reset, Dynamo
        # counts each one against that code's recompile limit.
        torch._dynamo.reset()
        model.compile_decode_step()
    return model, precision


def decode_tokens_per_s(model, batch, run, precision):
    """model.generate's tokens/s from a 1-token prompt, and the seconds of a first, untimed run,
    which compiles, tunes and captures; the second run is timed, between synchronisations. Both
    cached runs replay one CUDA graph per token (GPT.generate's StaticDecoder: the decode step,
    the sampling and the feeding back of the drawn token), the compiled one with the step
    compiled by Inductor inside it. The prefill and the no-cache loop stay eager: the no-cache
    loop meets a new context length, so a new shape, at every token. precision: the context to
    generate under, generation_precision's."""
    prompt = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    seconds = []
    for _ in range(2):
        torch.manual_seed(0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with precision:
            model.generate(prompt, DECODE_NEW_TOKENS, top_k=1, kv_cache=run != "no cache")
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return batch * DECODE_NEW_TOKENS / seconds[-1], seconds[0]


def graph_gpu_us_per_step(decoder, steps=64):
    """GPU microseconds of one replay of the decoder's CUDA graph (a whole token: the step and
    the sampling), from positions block_size/4 on: the replays are queued behind a GPU sleep
    (torch.cuda._sleep, as PyTorch's own tests use) long enough for the host to queue them all,
    so the GPU runs them back to back and the events time the GPU alone. Against the wall time
    of a step it says what the host costs."""
    decoder.pos.fill_(decoder.cache.block_size // 4)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # clock cycles: about 25 ms, time to queue the replays
    start.record()
    for _ in range(steps):
        decoder.graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / steps


def decode_throughput(out, backends):
    """Greedy generation with an untrained model of configs/shakespeare.py's shape, its weights
    cast to bf16 (as sample.py generates in bf16), every
    backend: tokens/s with and without the KV cache, the cached step compiled or not, side by
    side in one process. Writes decode.json and decode.md."""
    config = _MODEL.model_config(SHAKESPEARE_VOCAB_SIZE)
    torch.manual_seed(0)
    state = GPT(config).state_dict()
    rows = []
    for name in backends:
        for batch in DECODE_BATCHES:
            row = dict(backend=name, batch=batch)
            for run in DECODE_RUNS:
                model, precision = decode_model(config, state, name, compiled=run.endswith("compiled"))
                row[run], row[run + " first run s"] = decode_tokens_per_s(model, batch, run, precision)
                if run != "no cache":
                    row[run + " GPU us/step"] = graph_gpu_us_per_step(model.generate_decoder)
                    row[run + " wall us/step"] = 1e6 * batch / row[run]
            rows.append(row)
            print(f"{name:<11} batch {batch:>2}  " + "  ".join(f"{run} {row[run]:9,.0f}" for run in DECODE_RUNS)
                  + "  tok/s  (first runs " + ", ".join(f"{row[run + ' first run s']:.1f}" for run in DECODE_RUNS)
                  + " s; GPU / wall us a step " + ", ".join(f"{row[run + ' GPU us/step']:,.0f} / "
                                                         f"{row[run + ' wall us/step']:,.0f}" for run in DECODE_RUNS[1:])
                  + ")", flush=True)
    lines = [f"Greedy decoding tokens/s: an untrained configs/shakespeare.py model (block_size {config.block_size}), "
             f"bf16 weights, a 1-token prompt and {DECODE_NEW_TOKENS} new tokens; the second of two runs. Both cached "
             "columns replay one CUDA graph per token (the decode step and the sampling); the compiled one compiles "
             "the step first (Inductor). First "
             "runs: the seconds of the untimed first run (compiling, tuning, capturing). GPU / wall: microseconds a "
             "step (one token per sequence) of the graph's replay alone on the GPU (graph_gpu_us_per_step) and of "
             "the timed run's wall clock; the difference is the host's.", "",
             "| backend | batch | " + " | ".join(DECODE_RUNS) + " | cache / no cache | compiled cache / no cache "
             "| first runs (s) | GPU / wall us a step, cache | GPU / wall us a step, compiled |",
             "|---" * (len(DECODE_RUNS) + 7) + "|"]
    for r in rows:
        lines.append(f"| {r['backend']} | {r['batch']} | " + " | ".join(f"{r[run]:,.0f}" for run in DECODE_RUNS)
                     + f" | {r['KV cache'] / r['no cache']:.2f}x | {r['KV cache, compiled'] / r['no cache']:.2f}x | "
                     + " / ".join(f"{r[run + ' first run s']:.1f}" for run in DECODE_RUNS) + " | "
                     + " | ".join(f"{r[run + ' GPU us/step']:,.0f} / {r[run + ' wall us/step']:,.0f}"
                                  for run in DECODE_RUNS[1:]) + " |")
    with open(os.path.join(out, "decode.json"), "w") as f:
        json.dump(dict(env=environment(), model=config.__dict__, new_tokens=DECODE_NEW_TOKENS, results=rows), f,
                  indent=1, default=str)
    with open(os.path.join(out, "decode.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def _run_config(job, warm_only):
    """Run once (warm_only=1: compiles it) or time one kernel config on the paper-grid shape
    N=4096, bf16. None if it does not fit the card."""
    kernel, tiles, num_warps, num_stages, D, causal, tma = job
    shape = dict(B=4, H=2048 // D, N=4096, D=D, causal=causal, dtype="bfloat16")
    _, q, k, v = make_inputs(shape, requires_grad=False)
    config = triton.Config(dict(tiles, USE_TMA=tma), num_warps=num_warps, num_stages=num_stages)
    smem_rows = dict(fwd=forward_smem_rows, bwd=backward_smem_rows)[kernel]
    if shared_memory_bytes(config, smem_rows, D, q.element_size()) > shared_memory_limit(q.device):
        return None
    if kernel == "fwd":
        fn = lambda: flash_forward(q, k, v, causal, config=config)
    else:
        o, lse = flash_forward(q, k, v, causal, config=FORWARD_CONFIGS[0])
        do = torch.randn_like(o)
        fn = lambda: flash_backward(q, k, v, o, do, lse, causal, config=config)
    try:
        if warm_only:
            fn()
            return None
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    except triton.runtime.errors.OutOfResources:
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-out", help="folder for attention.json/.md/.png")
    parser.add_argument("--quick", action="store_true", help="a few shapes of each grid")
    parser.add_argument("--grid", choices=("paper", "long", "all"), default="all")
    parser.add_argument("--providers", default=",".join(PROVIDERS), help="comma-separated subset of: " + ", ".join(PROVIDERS))
    parser.add_argument("--rep_ms", type=int, default=100, help="do_bench's timing window per measurement")
    parser.add_argument("--configs", action="store_true", help="sweep the Triton kernels' tile configs instead")
    parser.add_argument("--ladder", action="store_true", help="docs/optimisation.md's forward ladder instead")
    parser.add_argument("--launch", action="store_true", help="CPU issue time vs GPU run time at the model's shape instead")
    parser.add_argument("--decode", action="store_true", help="generation tokens/s per backend instead (--backends)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="--decode: comma-separated subset of "
                        + ",".join(BACKENDS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.py needs a CUDA GPU")
    providers = [provider.strip() for provider in args.providers.split(",")]
    unknown = sorted(set(providers) - set(PROVIDERS))
    if unknown:
        raise SystemExit(f"--providers: unknown {unknown}; choose from {','.join(PROVIDERS)}")
    os.makedirs(args.out, exist_ok=True)
    if args.configs:
        return sweep_configs(args.out)
    if args.ladder:
        return optimisation_ladder(args.out)
    if args.launch:
        return launch_overhead(args.out)
    if args.decode:
        backends = args.backends.split(",")
        unknown = sorted(set(backends) - set(BACKENDS))
        if unknown:
            raise SystemExit(f"--backends: unknown {unknown}; choose from {','.join(BACKENDS)}")
        return decode_throughput(args.out, backends)

    env = environment()
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    grids = {"paper": paper_grid(args.quick), "long": long_grid(args.quick)}
    rows = []
    for grid, shapes in grids.items():
        if args.grid in (grid, "all"):
            for shape in shapes:
                rows += bench_shape(grid, shape, providers, args.rep_ms)
                save(rows, env, args.out)  # after every shape, so a run cut short keeps what it measured
            plot(rows, grid, os.path.join(args.out, "attention.png" if grid == "paper" else "attention_long.png"))
    print(f"wrote {args.out}/attention.json, attention.md and plots")


def save(rows, env, out):
    with open(os.path.join(out, "attention.json"), "w") as f:
        json.dump(dict(env=env, sdpa_backends={k: str(v) for k, v in SDPA_BACKENDS.items()}, results=rows), f, indent=1)
    with open(os.path.join(out, "attention.md"), "w") as f:
        f.write(markdown(rows, env))


if __name__ == "__main__":
    main()
