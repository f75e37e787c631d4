"""Benchmarks: the attention kernels and the training step, every provider side by side in one
process on one CUDA card (the host mode on any machine).

    python bench.py                      # the paper grid: forward, backward, forward+backward -> bench-out/
    python bench.py --grid=long          # one sequence, causal, 128 to 65,536 tokens; the model's own shapes
    python bench.py --grid=masks --providers=triton,flex,sdpa_flash   # a 1k window vs causal, 16 vs 4 kv heads
    python bench.py --quick=True         # three lengths of each grid
    python bench.py --mode=ladder        # the forward, one optimisation at a time (docs/optimisation.md)
    python bench.py --mode=configs       # every tile config of each Triton kernel that fits the card, timed
    python bench.py --mode=step          # the default model's training step per backend and mode: wall ms, GPU ms
    python bench.py --mode=step --block_sizes=256,512,1024,4096 --max_memory_gb=12   # ... and memory, per context
    python bench.py --mode=decode        # one decoding step against a full KV cache: bytes read, share of the bandwidth
    python bench.py --mode=host          # what one attention call costs the host, per backend (a GPU or not)
    NANOFA2_ADA=1 python bench.py ...    # the path an RTX 4070 Super takes (attention/launch.py says what)
    python bench.py --impl=mine          # your functions (mine/) beside ours and FA2; on a CPU, in the interpreter

The grids are the FlashAttention-2 paper's (16k tokens a batch, hidden 2048, N from 512 to 16k,
head dims 64 and 128, causal and not) and a long-context one, q, k, v being views of one fused
projection as in the model. Each cell is timed twice: its GPU time, replayed from a CUDA graph
(replayed_ms: the host's launches out of it), which every ms and TFLOP/s is of, with its spread
(the 20th and 80th percentiles of the replays), and its wall time called eagerly (do_bench); a
row whose wall time exceeds its GPU time by HOST_BOUND is marked host-bound, the host and not
the kernels setting its speed. After each shape a line gives triton's ratios to FA2 and cuDNN
(their time over triton's) and the configs the tuner chose (launch.config_name), which the
tables name too. TFLOP/s count
4 * B * H * N^2 * D for the forward (half when causal), 2.5 times that for the backward, each
printed beside the fraction of the card's dense 16-bit tensor-core peak it reached (CARDS). The
step mode times train.py's step (training/step.py), the backends in turns, as the host drifts over
minutes: GPU time judges the kernels, wall time the host. At each block size the batch keeps
the default run's tokens per micro-batch; a backend out of memory is not run at longer ones.
The decode mode times decode_attention alone, one new token against a full cache (triton, sdpa,
and sdpa over the whole cache with no mask, exact there; triton at other split counts too),
replayed from a CUDA graph as sample.py runs it, each after an L2 flush that leaves only clean
lines (clean_l2_us), and divides the K and V bytes read by the time and by the card's memory
bandwidth. The host mode times the CPU time one attention call takes, at the default model's
shape, forward and forward+backward, per backend and for torch's scaled_dot_product_attention
itself; without a GPU through a stand-in CUDA driver (training/host_cost.py says how). Writes
JSON and markdown (and a plot of each grid) to --out. Whole-model decoding: sample.py
--benchmark=True. --impl=mine (bench_mine) prints a table of its own and writes nothing.
"""
import functools
import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, replace
from unittest import mock

from training.config import (BACKENDS, COMPILE_MODES, CUDA_GRAPH_COMPILE_MODES, TRITON_BACKENDS, ConfigError,
                             TrainConfig, check_folder, choice, first_broken, parse_config)

# The backends (attention/backends.py), sdpa split into the kernels torch chooses among.
SDPA_KERNELS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
PROVIDERS = tuple(provider for name in BACKENDS for provider in (SDPA_KERNELS if name == "sdpa" else (name,))) + ("flex",)
MODES = ("fwd", "bwd", "fwd+bwd")


@dataclass
class BenchConfig:
    mode: str = choice("grid", ("grid", "ladder", "configs", "step", "decode", "host"))  # what to measure
    grid: str = choice("paper", ("paper", "long", "masks", "all"))  # mode=grid: which grid of shapes (masks: windows and grouped heads)
    quick: bool = False  # mode=grid: three lengths of each grid
    providers: str = "triton,sdpa_flash,sdpa_cudnn"  # mode=grid: comma-separated, of the backends but sdpa, and sdpa's kernels: sdpa_flash (FlashAttention-2), sdpa_cudnn, sdpa_efficient
    backends: str = "eager,sdpa,triton"  # mode=step: the attention backends to train with
    compile_modes: str = "none,default,default+graph"  # mode=step: none (uncompiled) or a torch.compile mode; +graph: the step's CUDA graph
    block_sizes: str = "512"  # mode=step: comma-separated contexts, e.g. 256,512,4096; 2,048 tokens a micro-batch
    max_memory_gb: float = 0.0  # mode=step: cap torch's CUDA memory at this many GiB (12: a 12 GB card); 0: no cap
    rep_ms: int = 100  # do_bench's timing window per measurement, ms
    host_rounds: int = 15  # mode=host: rounds of 50 calls of each case, each case keeping its least mean
    out: str = "bench-out"  # folder for the results
    impl: str = choice("ours", ("ours", "mine"))  # mine: time your functions (mine/) beside ours at one shape, on a CPU too


def check(config):
    unknown = set(config.providers.split(",")) - set(PROVIDERS)
    if unknown:
        raise ConfigError(f"providers={config.providers!r}: unknown {sorted(unknown)}; choose from {', '.join(PROVIDERS)}")
    unknown = set(config.backends.split(",")) - set(BACKENDS)
    if unknown:
        raise ConfigError(f"backends={config.backends!r}: unknown {sorted(unknown)}; choose from {', '.join(BACKENDS)}")
    if config.host_rounds < 1:
        raise ConfigError(f"host_rounds={config.host_rounds}: expected an int >= 1")
    if not all(size.isdigit() and int(size) >= 1 for size in config.block_sizes.split(",")):
        raise ConfigError(f"block_sizes={config.block_sizes!r}: expected ints >= 1, comma-separated, e.g. 256,512")
    if config.impl == "mine" and config.mode != "grid":
        raise ConfigError(f"impl=mine times your functions at a shape of its own: it takes no mode (got {config.mode!r})")
    modes = [mode.removesuffix("+graph") for mode in config.compile_modes.split(",")]
    unknown = [mode for mode in modes if mode not in ("none", *COMPILE_MODES)]
    if unknown:
        raise ConfigError(f"compile_modes={config.compile_modes!r}: unknown {unknown}; each is none or a torch.compile "
                          f"mode ({', '.join(COMPILE_MODES)}), +graph for the step's CUDA graph")
    graphed_twice = [mode for mode in config.compile_modes.split(",")
                     if mode.endswith("+graph") and mode.removesuffix("+graph") in CUDA_GRAPH_COMPILE_MODES]
    if graphed_twice:
        raise ConfigError(f"compile_modes={config.compile_modes!r}: {graphed_twice[0].removesuffix('+graph')} captures "
                          "CUDA graphs of its own (+graph goes with none, default or max-autotune-no-cudagraphs)")
    first_broken(config, [("max_memory_gb", 0.0 <= config.max_memory_gb < math.inf, "a finite float >= 0 (0: no cap)"),
                          ("rep_ms", config.rep_ms >= 1, "an int >= 1")])
    check_folder("out", config.out, writable=True)


config = parse_config(BenchConfig, check=check, usage=__doc__)  # before torch loads: --help answers at once

import torch  # noqa: E402

if config.mode == "host" and not torch.cuda.is_available():
    from training.host_cost import stand_in_for_the_gpu  # noqa: E402
    stand_in_for_the_gpu()  # before attention loads, and with it Triton
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from attention import attention, decode_attention, launch, store_in_cache, triton_decode  # noqa: E402
from attention.cuda_graph import capture_graph  # noqa: E402
from attention.masks import UNBOUNDED, window_bounds  # noqa: E402
from attention.hopper import backward as hopper_backward  # noqa: E402
from attention.hopper import forward as hopper_forward  # noqa: E402
from attention.launch import fitting_configs  # noqa: E402
from attention.triton_backward import BACKWARD_CONFIGS, _attn_bwd, backward_smem_rows, flash_backward  # noqa: E402
from attention.triton_forward import FORWARD_CONFIGS, _attn_fwd, flash_forward, forward_smem_rows  # noqa: E402
from attention import tiled, triton_backward, triton_forward  # noqa: E402
from model import GPT, GPTConfig, compile_model  # noqa: E402
from training.devices import CARDS, World, autocast, cap_memory, synchronize  # noqa: E402
from training.host_cost import least_host_us  # noqa: E402
from training.step import make_train_step  # noqa: E402

import triton  # noqa: E402, I001  (after attention, which decides whether Triton interprets)


def this_card(name=None):
    """The CARDS entry (training/devices.py) of the card named (by default the one bench.py runs
    on), or None for a card not in the table. NANOFA2_ADA=1 changes the code path, not the card:
    on an H100 its fractions are of the H100's peak, not an RTX 4070 Super's."""
    return CARDS.get(name or torch.cuda.get_device_name())


def of_peak(value, peak):
    """value as a percentage of peak, for the printed lines and tables: "37%", or "?" without a peak."""
    return f"{value / peak:.0%}" if peak else "?"


def tflops_of_peak(tflops):
    card = this_card()
    return of_peak(tflops, card and card.tflops)


def bandwidth_of_peak(gb_per_s):
    card = this_card()
    return of_peak(gb_per_s, card and card.gb_per_s)


SDPA_BACKENDS = dict(zip(SDPA_KERNELS, (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                         SDPBackend.EFFICIENT_ATTENTION)))
TILED_MAX_N = 2048  # the Python-loop teaching version takes seconds a call beyond this


def paper_grid(quick):
    lengths = (1024, 4096, 16384) if quick else (512, 1024, 2048, 4096, 8192, 16384)
    return [dict(B=16384 // n, H=2048 // d, N=n, D=d, causal=c, dtype="bfloat16")
            for d in (64, 128) for c in (False, True) for n in lengths]


def long_grid(quick):
    """One sequence of 128 to 65,536 tokens, causal, and the model's own calls (D 32, causal): the
    default run's (TrainConfig's batch of 512-token sequences) and the long-context run's
    (configs/shakespeare_long.py: 2 sequences of 4,096)."""
    lengths = (1024, 16384, 65536) if quick else tuple(2 ** p for p in range(7, 17))
    head_dim = TrainConfig.n_embd // TrainConfig.n_head
    model = [dict(B=TrainConfig.batch_size, H=TrainConfig.n_head, N=TrainConfig.block_size, D=head_dim, causal=True,
                  dtype="bfloat16"),
             dict(B=2, H=TrainConfig.n_head, N=4096, D=head_dim, causal=True, dtype="bfloat16")]
    return [dict(B=1, H=16, N=n, D=d, causal=True, dtype="bfloat16") for d in (64, 128) for n in lengths] + model


def masks_grid(quick):
    """What a mask saves: causal against a 1,024-key window (window, its left side) at 16k tokens,
    and 16 query heads over 16 kv heads against over 4 (H_kv) at 4k. The model's training masks."""
    windows = [dict(B=1, H=2048 // d, N=16384, D=d, causal=True, dtype="bfloat16", window=w)
               for d in (64, 128) for w in (-1, 1024)]
    grouped = [dict(B=4, H=16, H_kv=h_kv, N=4096, D=64, causal=True, dtype="bfloat16") for h_kv in (16, 4)]
    return windows + grouped


def make_inputs(shape, requires_grad):
    """q, k, v as (B, H, N, D) and (B, H_kv, N, D) views of one (B, N, H + 2 * H_kv, D) projection,
    and that projection."""
    B, H, N, D = shape["B"], shape["H"], shape["N"], shape["D"]
    H_kv = shape.get("H_kv", H)
    qkv = torch.randn(B, N, H + 2 * H_kv, D, device="cuda", dtype=getattr(torch, shape["dtype"]),
                      requires_grad=requires_grad)
    return qkv, *qkv.transpose(1, 2).split([H, H_kv, H_kv], dim=1)


@functools.cache
def flex_block_mask(n, causal, window):
    """FlexAttention's block mask of a causal or windowed mask over n tokens, made once a shape."""
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b, h, q_idx, kv_idx):
        seen = (kv_idx <= q_idx) if causal else (kv_idx >= 0)
        return seen & (q_idx - kv_idx <= window) if window >= 0 else seen
    return create_block_mask(visible, None, None, n, n, device="cuda")


@functools.cache
def compiled_flex():
    """FlexAttention compiled for each shape (dynamic=False): after a second shape torch.compile
    would otherwise make the lengths dynamic, whose kernels copy sizes from the host, which a CUDA
    graph capture refuses. Its backward donates the forward's buffers by default, which refuses
    the bwd mode's second backward over one forward (retain_graph): off."""
    from torch.nn.attention.flex_attention import flex_attention
    torch._functorch.config.donated_buffer = False
    return torch.compile(flex_attention, dynamic=False)


def run_provider(name, q, k, v, causal, window=-1):
    """One call of a provider; window: the left side of a sliding window (-1: none). sdpa's kernels
    take no window (the sdpa backend's bool mask would time the mask, not the kernel): a
    RuntimeError, which bench_grid reports as unsupported."""
    grouped = q.shape[1] != k.shape[1]
    if name in SDPA_BACKENDS:
        if window >= 0:
            raise RuntimeError(f"{name} takes no sliding window")
        with sdpa_kernel(SDPA_BACKENDS[name]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=grouped)
    if name == "flex":
        return compiled_flex()(q, k, v, block_mask=flex_block_mask(q.shape[2], causal, window), enable_gqa=grouped)
    return attention(q, k, v, is_causal=causal, backend=name, window_size=(window, 0 if causal else -1))


def visible_pairs(n, causal, window):
    """The (query, key) pairs a mask over n tokens leaves, as the FlashAttention-2 paper counts
    them: n^2, half of it causal; with a window of left side w (causal), each query i sees
    min(i, w) + 1 keys, counted exactly."""
    if window < 0:
        return n * n / (2 if causal else 1)
    m = min(window, n - 1)
    return (m + 1) * (m + 2) / 2 + (n - 1 - m) * (window + 1)


def flops(shape, mode):
    fwd = 4 * shape["B"] * shape["H"] * shape["D"] * visible_pairs(shape["N"], shape["causal"], shape.get("window", -1))
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}[mode]


# A grid cell whose wall time is this many times its GPU time or more is host-bound: the host's
# work for a call (checks, dispatch, autograd) outlasts the kernels it launches.
HOST_BOUND = 1.25


def replayed_ms(fn, stream, rep_ms):
    """GPU ms of a call of fn: triton.testing.do_bench_cudagraph's method (the calls of about
    rep_ms captured back to back in one CUDA graph, so that no host work lies between them; the
    median over 10 replays of a replay's time over its calls, and their 20th and 80th
    percentiles), captured on `stream`, the one the
    caller made its inputs on: autograd runs a backward's kernels on its forward's stream, which
    must be the capturing one."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        fn()
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        calls = max(1, int(rep_ms / max(start.elapsed_time(end) / 5, 1e-3)))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
        times = []
        for _ in range(10):
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / calls)
    quintiles = statistics.quantiles(times, n=5)
    return statistics.median(times), (quintiles[0], quintiles[-1])


def time_mode(name, shape, mode):
    """Median ms of one mode, (GPU, its spread, wall): replayed from a CUDA graph (replayed_ms), and called
    eagerly (do_bench, which clears the L2 before each call); raises where the provider does not
    take the shape. Inputs, the kept forward of the bwd mode and both timings are on one side
    stream, the capture's (the legacy default stream cannot be captured). The eager timing runs
    first: it also warms up (compiles, tunes) before the capture."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        qkv, q, k, v = make_inputs(shape, requires_grad=mode != "fwd")
        call = functools.partial(run_provider, name, q, k, v, shape["causal"], window=shape.get("window", -1))
        if mode == "fwd":
            fn = call
        else:
            do = torch.randn(q.shape, device=q.device, dtype=q.dtype)
            o = call()
            fn = (lambda: torch.autograd.grad(o, qkv, do, retain_graph=True)) if mode == "bwd" else \
                 (lambda: torch.autograd.grad(call(), qkv, do))
        wall = triton.testing.do_bench(fn, warmup=max(config.rep_ms // 4, 5), rep=config.rep_ms,
                                       return_mode="median")
    return (*replayed_ms(fn, stream, config.rep_ms), wall)


def tuner_choice(shape):
    """What the triton backend ran at shape, forward and backward, as launch.config_name names it:
    the Hopper Gluon kernel where it serves the shape, else the config the tuner chose (the
    kernel's best_config, its last call's, which was at this shape)."""
    _, q, k, _ = make_inputs(shape, requires_grad=False)
    left, right = window_bounds(shape["causal"], (shape.get("window", -1), -1))
    return dict(fwd="Gluon (Hopper)" if hopper_forward.serves(q, k, left, right) else
                launch.config_name(_attn_fwd.best_config),
                bwd="Gluon (Hopper)" if hopper_backward.serves(q, k, left, right) else
                launch.config_name(_attn_bwd.best_config))


def shape_label(shape):
    """B x H x N x D and the mask, with the kv heads and the window where the shape has them."""
    label = f"{shape['B']}x{shape['H']}x{shape['N']}x{shape['D']} {'causal' if shape['causal'] else 'full'}"
    label += f" kv heads {shape['H_kv']}" if "H_kv" in shape else ""
    return label + (f" window {shape['window']}" if shape.get("window", -1) >= 0 else "")


def shape_summary(shape, rows):
    """One line per shape: triton's time ratios against FA2 and cuDNN (their time over triton's:
    above 1, triton is faster) per mode, and what the tuner chose."""
    ms = {r["provider"]: {m: r[m]["ms"] for m in MODES} for r in rows if r["status"] == "ok"}
    ratios = lambda peer: " ".join(f"{m} {ms[peer][m] / ms['triton'][m]:.2f}" for m in MODES) \
        if "triton" in ms and peer in ms else "–"
    triton_row = next((r for r in rows if r["provider"] == "triton" and "tuner" in r), None)
    chosen = f"fwd {triton_row['tuner']['fwd']}, bwd {triton_row['tuner']['bwd']}" if triton_row else "–"
    return (f"  {shape_label(shape)}: "
            f"triton vs FA2 {ratios('sdpa_flash')} | vs cuDNN {ratios('sdpa_cudnn')} | tuner: {chosen}")


def bench_grid(grid, shapes, providers):
    rows = []
    for shape in shapes:
        shape_rows = []
        for name in providers:
            if name == "tiled" and shape["N"] > TILED_MAX_N:
                continue
            row = dict(grid=grid, provider=name, **shape)
            try:
                for mode in MODES:
                    ms, spread, wall_ms = time_mode(name, shape, mode)
                    row[mode] = dict(ms=ms, spread_ms=spread, tflops=flops(shape, mode) / ms / 1e9, wall_ms=wall_ms,
                                     host_bound=wall_ms >= HOST_BOUND * ms)
                if name == "triton":
                    row["tuner"] = tuner_choice(shape)
                row["status"] = "ok"
            except torch.cuda.OutOfMemoryError:
                row["status"] = "out of memory"
            except RuntimeError as e:  # an sdpa kernel that does not take this shape
                row["status"] = "unsupported: " + str(e).splitlines()[0][:80]
            torch.cuda.empty_cache()
            shape_rows.append(row)
            host_bound = lambda m: (f" [host-bound: wall {row[m]['wall_ms']:.3f} ms, GPU {row[m]['ms']:.3f}]"
                                    if row[m]["host_bound"] else "")
            perf = "  ".join(f"{m} {row[m]['tflops']:6.1f} ({tflops_of_peak(row[m]['tflops']):>4} of peak)"
                             + host_bound(m) for m in MODES) if row["status"] == "ok" else row["status"]
            extra = (f" kv {shape['H_kv']}" if "H_kv" in shape else "") + \
                (f" window {shape['window']}" if shape.get("window", -1) >= 0 else "")
            print(f"N={shape['N']:<6} D={shape['D']:<4} {'causal' if shape['causal'] else 'full  '}{extra} {name:<15} {perf}",
                  flush=True)
        print(shape_summary(shape, shape_rows), flush=True)
        rows += shape_rows
    return rows


def grid_tables(rows, providers):
    """Markdown: per grid, mode, head dim and mask, TFLOP/s by N (and the fraction of the card's
    peak), and triton over FA2 and cuDNN."""
    lines = []
    for grid in sorted({r["grid"] for r in rows}):
        for mode in MODES:
            for D, causal in sorted({(r["D"], r["causal"]) for r in rows if r["grid"] == grid}):
                sel = [r for r in rows if (r["grid"], r["D"], r["causal"]) == (grid, D, causal) and r["status"] == "ok"]
                kernel = "fwd" if mode == "fwd" else "bwd"
                lines += [f"**{grid} grid, {mode}, D={D}, {'causal' if causal else 'full'}** (TFLOP/s, and % of "
                          "the card's dense 16-bit peak)", "",
                          "| N | " + " | ".join(providers) + f" | triton / FA2 | triton / cuDNN | triton's {kernel} |",
                          "|---" * (len(providers) + 4) + "|"]
                for n in sorted({r["N"] for r in sel}):
                    tf = {r["provider"]: r[mode]["tflops"] for r in sel if r["N"] == n}
                    ratio = lambda peer: f"{tf['triton'] / tf[peer]:.2f}" if "triton" in tf and peer in tf else "–"
                    chosen = next((r["tuner"][kernel] for r in sel if r["N"] == n and "tuner" in r), "–")
                    lines.append(f"| {n} | " + " | ".join(f"{tf[p]:.0f} ({tflops_of_peak(tf[p])})" if p in tf else "–"
                                                        for p in providers)
                                 + f" | {ratio('sdpa_flash')} | {ratio('sdpa_cudnn')} | {chosen} |")
                lines.append("")
    return "\n".join(lines)


def masks_table(rows):
    """Markdown: each provider's GPU ms (and spread) per mask, forward and forward+backward, then
    what the masks save: causal's time over the 1,024-key window's, 16 kv heads' over 4's."""
    ok = [r for r in rows if r["status"] == "ok"]
    lines = ["| shape | provider | fwd ms | fwd+bwd ms |", "|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[m]['ms']:.3f} ({r[m]['spread_ms'][0]:.3f}-{r[m]['spread_ms'][1]:.3f})" for m in ("fwd", "fwd+bwd")] \
            if r["status"] == "ok" else [r["status"], ""]
        lines.append(f"| {shape_label(r)} | {r['provider']} | {cells[0]} | {cells[1]} |")
    ms = lambda provider, mode, **shape: next((r[mode]["ms"] for r in ok if r["provider"] == provider and all(
        r.get(key, -1 if key == "window" else r["H"]) == value for key, value in shape.items())), None)
    lines.append("")
    for provider in dict.fromkeys(r["provider"] for r in ok):
        for mode in ("fwd", "fwd+bwd"):
            saved = []
            for D in (64, 128):
                causal, window = ms(provider, mode, D=D, N=16384, window=-1), ms(provider, mode, D=D, N=16384, window=1024)
                if causal and window:
                    saved.append(f"window 1k at N 16k, D {D}: {causal / window:.1f}x faster than causal")
            mha, gqa = ms(provider, mode, N=4096, H_kv=16), ms(provider, mode, N=4096, H_kv=4)
            if mha and gqa:
                saved.append(f"16 over 4 kv heads: {mha / gqa:.2f}x the speed of 16 over 16")
            if saved:
                lines.append(f"- {provider} {mode}: " + "; ".join(saved))
    return "\n".join(lines)


def plot_grid(rows, grid, path):
    from matplotlib.figure import Figure
    rows = [r for r in rows if r["grid"] == grid and r["status"] == "ok"]
    panels = sorted({(r["D"], r["causal"]) for r in rows})
    fig = Figure(figsize=(4 * len(panels), 3.2 * len(MODES)), layout="constrained")
    axes = fig.subplots(len(MODES), len(panels), squeeze=False)
    for col, (D, causal) in enumerate(panels):
        for row_i, mode in enumerate(MODES):
            ax = axes[row_i][col]
            for p in PROVIDERS:
                points = sorted((r["N"], r[mode]["tflops"]) for r in rows if r["provider"] == p and
                                (r["D"], r["causal"]) == (D, causal))
                if points:
                    ax.plot(*zip(*points), marker="o", ms=3, label=p, lw=2.5 if p == "triton" else 1.2)
            ax.set(title=f"{mode}, D={D}, {'causal' if causal else 'full'}", xlabel="N", ylabel="TFLOP/s")
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.savefig(path, dpi=110)


# The ladder's rungs: (label, (BLOCK_M, BLOCK_N, num_warps, num_stages, USE_TMA)) of _attn_fwd.
# With one stage Triton issues plain loads; from two it pipelines them with cp.async.
LADDER = [("the article's tiles: 16x16, no pipelining", (16, 16, 4, 1, False)),
          ("64x64 tiles", (64, 64, 4, 1, False)),
          ("+ software pipelining (3 stages)", (64, 64, 4, 3, False)),
          ("128x64 tiles, 8 warps", (128, 64, 8, 3, False)),
          ("TMA descriptors instead of cp.async", (128, 64, 8, 3, True)),
          ("64x128 tiles, TMA, 2 stages", (64, 128, 4, 2, True))]


def ladder():
    """The forward at one shape (B=4, H=16, N=4096, D=64, causal, bf16), one knob at a time from
    the article's 16x16 tiles to the tuned kernel (LADDER), then (on Hopper) the Gluon kernel,
    then sdpa's."""
    shape = dict(B=4, H=16, N=4096, D=64, causal=True, dtype="bfloat16")
    _, q, k, v = make_inputs(shape, requires_grad=False)
    # Each rung's call is bound to its config as the rung is built (functools.partial): a lambda
    # would read the loop variable when do_bench calls it, after the loop, and time the last config
    # at every rung.
    timed = []
    for label, (bm, bn, warps, stages, tma) in LADDER:
        if tma and not launch.has_tma(q.device):
            continue
        tiles = triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, USE_TMA=tma), num_warps=warps, num_stages=stages)
        timed.append((label, str(tiles), functools.partial(flash_forward, q, k, v, True, config=tiles)))
    timed.append(("tuned Triton kernel (triton.autotune)", "", functools.partial(flash_forward, q, k, v, True)))
    with mock.patch.object(hopper_forward, "serves", lambda *args: False):  # the Triton kernels alone
        rows = [dict(step=label, config=tiles, ms=triton.testing.do_bench(fn, rep=config.rep_ms, return_mode="median"))
                for label, tiles, fn in timed]
    if hopper_forward.serves(q, k, UNBOUNDED, 0):
        rows.append(dict(step="warp-specialised Gluon kernel (Hopper)", config="", ms=triton.testing.do_bench(
            functools.partial(flash_forward, q, k, v, True), rep=config.rep_ms, return_mode="median")))
    for name in SDPA_BACKENDS:
        rows.append(dict(step=name, config="", ms=triton.testing.do_bench(
            functools.partial(run_provider, name, q, k, v, True), rep=config.rep_ms, return_mode="median")))
    for row in rows:
        row["tflops"] = flops(shape, "fwd") / row["ms"] / 1e9
        print(f"{row['step']:<45} {row['ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s {tflops_of_peak(row['tflops']):>4} of peak")
    return dict(shape=shape, steps=rows)


def sweep_configs():
    """Every config of each Triton kernel's list for this card's path (launch.candidates) that fits
    this card, at N=4096 of the paper grid, both masks and head dims, fastest first."""
    results = []
    for D in (64, 128):
        for causal in (False, True):
            shape = dict(B=4, H=2048 // D, N=4096, D=D, causal=causal, dtype="bfloat16")
            _, q, k, v = make_inputs(shape, requires_grad=False)
            o, lse = flash_forward(q, k, v, causal)
            do = torch.randn_like(o)
            for kernel, configs, smem_rows, fn in (
                    ("fwd", FORWARD_CONFIGS, forward_smem_rows, functools.partial(flash_forward, q, k, v, causal)),
                    ("bwd", BACKWARD_CONFIGS, backward_smem_rows,
                     functools.partial(flash_backward, q, k, v, o, do, lse, causal))):
                for c in fitting_configs(launch.candidates(configs, q.device, D), smem_rows, q, D, 4096, 4096):
                    ms = triton.testing.do_bench(functools.partial(fn, config=c), rep=config.rep_ms, return_mode="median")
                    results.append(dict(kernel=kernel, D=D, causal=causal, config=launch.config_name(c), ms=ms))
                ranked = sorted((r for r in results if (r["kernel"], r["D"], r["causal"]) == (kernel, D, causal)),
                                key=lambda r: r["ms"])
                print(f"{kernel} D={D} causal={causal}: " + "; ".join(f"{r['config']} {r['ms']:.3f} ms"
                                                                        for r in ranked[:4]), flush=True)
    return results


# (B, H, H_kv, S, D): batch, query heads, kv heads, cache length, head dim.
DECODE_SHAPES = [(8, 16, 16, 4096, 64), (8, 16, 4, 4096, 64), (8, 16, 16, 4096, 128), (8, 16, 4, 4096, 128),
                 (1, 16, 4, 32768, 128), (1, 16, 16, 32768, 128)]
def decode_steps(q, k, v, k_cache, v_cache, pos):
    """{label: one decoding step}, each storing the token at pos and attending over the cache."""
    def sdpa_no_mask():
        store_in_cache(k, v, k_cache, v_cache, pos)
        return F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=q.shape[1] != k_cache.shape[1])
    return {"triton": lambda: decode_attention(q, k, v, k_cache, v_cache, pos, backend="triton"),
            "sdpa": lambda: decode_attention(q, k, v, k_cache, v_cache, pos, backend="sdpa"),
            "sdpa, no mask": sdpa_no_mask}


def split_steps(q, k, v, k_cache, v_cache, pos):
    """{n_splits: the triton step with that many splits}: one, the host's plan, twice and four
    times as many (at most MAX_SPLITS, and a tile a split), to see what the plan leaves."""
    plan, block_n = triton_decode.split_plan(k_cache)
    most = min(triton_decode.MAX_SPLITS, -(-k_cache.shape[2] // block_n))
    step = lambda n: lambda: triton_decode.split_kv_decode(q, k, v, k_cache, v_cache, pos, UNBOUNDED, n, block_n)
    return {n: step(n) for n in sorted({1, plan, min(2 * plan, most), min(4 * plan, most)})}


def graphed(step):
    """step captured in a CUDA graph (attention.cuda_graph.capture_graph, after one warm-up call
    that compiles the kernels), as sample.py runs a decoding step: a replay times the GPU's work,
    not the host's (decode_attention's checks, pos's among them, which reads pos and so waits for
    the GPU outside a capture). do_bench still clears the L2 before each replay."""
    graph, _ = capture_graph(step)
    return graph.replay


def clean_l2_us(replay, flush, reps=100):
    """Median µs of replay, each run after reading flush (twice the L2's size), so that the L2
    holds only clean lines, none of the step's data, as after the projections before a decoding
    step. do_bench clears the L2 by writing zeros: the dirty lines that leaves are written back
    while the step reads, up to the L2's size of HBM traffic (50 MB on an H100, about 15 µs)
    that no decoding step meets."""
    replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.sum()
        start.record()
        replay()
        end.record()
    torch.cuda.synchronize()
    return 1000 * statistics.median(start.elapsed_time(end) for start, end in events)


def decode_times():
    """Each of DECODE_SHAPES in bf16, one new token at the cache's last row (every row is read):
    median µs of each of decode_steps and split_steps, replayed from a CUDA graph after an L2
    flush that leaves it clean (clean_l2_us), and the K and V bytes read over that, GB/s and as a
    share of the card's bandwidth (bandwidth_of_peak). The triton step is also timed by do_bench,
    whose flush leaves the L2 dirty, as the figures before clean_l2_us were."""
    flush = torch.ones(2 * torch.cuda.get_device_properties(0).L2_cache_size // 4, dtype=torch.int32, device="cuda")
    time_us = lambda step: clean_l2_us(graphed(step), flush)
    rows = []
    for B, H, H_kv, S, D in DECODE_SHAPES:
        qkv = torch.randn(B, 1, H + 2 * H_kv, D, device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv.transpose(1, 2).split([H, H_kv, H_kv], dim=1)  # views of the fused projection, as in the model
        k_cache, v_cache = (torch.randn(B, H_kv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        inputs = (q, k, v, k_cache, v_cache, torch.tensor([S - 1], device="cuda"))
        row = dict(shape=f"{B} x {H}/{H_kv} x {S:,} x {D}", bytes=2 * k_cache.numel() * k_cache.element_size(),
                   splits=triton_decode.split_plan(k_cache)[0], steps={})
        with torch.no_grad():
            for label, step in decode_steps(*inputs).items():
                us = time_us(step)
                row["steps"][label] = dict(us=us, gb_per_s=row["bytes"] / (us * 1e3))
            row["triton_us_by_splits"] = {n: time_us(step) for n, step in split_steps(*inputs).items()}
            row["triton_us_dirty_l2"] = 1000 * triton.testing.do_bench(graphed(decode_steps(*inputs)["triton"]),
                                                                       rep=config.rep_ms, return_mode="median")
        rows.append(row)
        print(f"{row['shape']:<24} {row['bytes'] / 1e6:6.0f} MB  " + "  ".join(
            f"{label} {r['us']:8.1f} us ({bandwidth_of_peak(r['gb_per_s'])})"
            for label, r in row["steps"].items()) + f"  (triton after do_bench's dirty flush: "
            f"{row['triton_us_dirty_l2']:.1f} us)", flush=True)
        print(f"{'':<24} triton by splits (the plan: {row['splits']}): " + ", ".join(
            f"{n}: {us:.1f} us" for n, us in row["triton_us_by_splits"].items()), flush=True)
    write("decode", rows, decode_table(rows))


def decode_table(rows):
    """Markdown: a row per shape, each step's µs and share of the bandwidth ("?": a card not in CARDS)."""
    labels = list(rows[0]["steps"])
    lines = ["Bandwidth: K and V bytes read over the step's time, against the card's (CARDS).", "",
             "| batch x heads/kv heads x cache x D | K+V bytes | triton splits | "
             + " | ".join(f"{label} µs | of bandwidth" for label in labels) + " |",
             "|---" * (3 + 2 * len(labels)) + "|"]
    for row in rows:
        lines.append(f"| {row['shape']} | {row['bytes'] / 1e6:,.0f} MB | {row['splits']} | "
                     + " | ".join(f"{r['us']:,.0f} | {bandwidth_of_peak(r['gb_per_s'])}" for r in row["steps"].values())
                     + " |")
    return "\n".join(lines)


def build_step(backend, compile_mode, block_size, device="cuda"):
    """train.py's step (training/step.py: the micro-batch loop, gradient clipping, the scaler) on
    the default model (GPTConfig(), dropout 0, bf16 autocast, fused AdamW, random tokens) at
    block_size, warmed up (5 steps, which compile). batch_size keeps the default run's tokens per
    micro-batch (at least one sequence)."""
    torch.manual_seed(0)
    device = torch.device(device)
    defaults = GPTConfig()
    batch_size = max(1, TrainConfig.batch_size * TrainConfig.block_size // block_size)
    model = GPT(replace(defaults, block_size=block_size, dropout=0.0, attn=backend)).to(device)
    optimizer = model.configure_optimizers(TrainConfig.weight_decay, TrainConfig.learning_rate,
                                           (TrainConfig.beta1, TrainConfig.beta2), device.type)
    compile_mode, graphed = compile_mode.removesuffix("+graph"), compile_mode.endswith("+graph")
    run = model if compile_mode == "none" else compile_model(model, compile_mode)
    train_step = make_train_step(run, optimizer, torch.amp.GradScaler(device.type, enabled=False),
                                 autocast(device, torch.bfloat16), World(), TrainConfig.grad_clip,
                                 compiled=compile_mode != "none", cuda_graph=graphed)
    tokens = [torch.randint(0, defaults.vocab_size, (batch_size, block_size), device=device) for _ in range(2)]
    batches = [(x, x.roll(-1, dims=1)) for x in tokens]  # (x, y) pairs, as StepGraph copies them

    def step():
        train_step(batches, TrainConfig.learning_rate)
    for _ in range(5):
        step()
    synchronize(device)
    return step


def step_times(rounds=6, steps=5):
    """{"<backend> <mode> T=<block size>": wall ms of each step, GPU ms a step, peak MB}: the
    backends of a mode take turns, the order reversed every other round, so the host's drift
    falls on all alike. Peak memory is what building and warming a step adds to what is held."""
    if config.max_memory_gb:
        cap_memory(torch.device("cuda"), config.max_memory_gb, announce=True)
    results, out_of_memory = {}, set()
    for block_size in sorted(map(int, config.block_sizes.split(","))):
        for mode in config.compile_modes.split(","):
            built = {}
            for backend in config.backends.split(","):
                name = f"{backend} {mode} T={block_size}"
                if (backend, mode) in out_of_memory:
                    results[name] = dict(status="not run (out of memory at a shorter context)")
                    continue
                held = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                try:
                    built[backend] = build_step(backend, mode, block_size)
                    results[name] = dict(peak_mb=(torch.cuda.max_memory_allocated() - held) / 2**20)
                except torch.cuda.OutOfMemoryError:
                    out_of_memory.add((backend, mode))
                    results[name] = dict(status="out of memory")
                    print(f"{name:<28} out of memory", flush=True)
                torch.cuda.empty_cache()
            walls = {backend: [] for backend in built}
            for r in range(rounds):
                for backend in (list(built) if r % 2 == 0 else reversed(list(built))):
                    for _ in range(steps):
                        start = time.perf_counter()
                        built[backend]()
                        torch.cuda.synchronize()
                        walls[backend].append(1000 * (time.perf_counter() - start))
            for backend, step in built.items():
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(steps):
                        step()
                    torch.cuda.synchronize()
                gpu_ms = sum(e.device_time_total for e in prof.key_averages()
                             if e.device_type == torch.autograd.DeviceType.CUDA) / 1000 / steps
                quartiles = statistics.quantiles(walls[backend], n=4)
                name = f"{backend} {mode} T={block_size}"
                result = results[name]
                result.update(wall_ms=statistics.median(walls[backend]), wall_ms_iqr=(quartiles[0], quartiles[2]),
                              gpu_ms=gpu_ms)
                print(f"{name:<28} wall {result['wall_ms']:7.2f} ms (quartiles "
                      f"{quartiles[0]:.2f}-{quartiles[2]:.2f}), GPU {gpu_ms:6.2f} ms, peak {result['peak_mb']:,.0f} MB",
                      flush=True)
            built = step = None  # frees the models before the next ones are built
            torch._dynamo.reset()
        write("step", results, step_summary(results) + "\n\n" + step_table(results))  # a cut run keeps each block size
    print(step_summary(results))
    return results


def mode_heading(compile_mode):
    """"none" -> "uncompiled", "default+graph" -> "compiled (default) + CUDA graph"."""
    if compile_mode == "none":
        return "uncompiled"
    graph = " + CUDA graph" if compile_mode.endswith("+graph") else ""
    return f"compiled ({compile_mode.removesuffix('+graph')}){graph}"


def step_summary(results):
    """Markdown: per block size, a row per backend and a column per compile mode, each cell the
    median wall ms a step, its multiple of sdpa's in the same mode, and the GPU ms."""
    runs = {}
    for name, result in results.items():
        backend, mode, block = name.split(" ")
        runs[block, backend, mode] = result
    modes = list(dict.fromkeys(mode for _, _, mode in runs))
    lines = []
    for block in dict.fromkeys(block for block, _, _ in runs):
        lines += [f"Wall ms a step at {block} (median), its multiple of sdpa's in the same mode, and GPU ms:", "",
                  "| backend | " + " | ".join(map(mode_heading, modes)) + " |", "|---" * (len(modes) + 1) + "|"]
        for backend in dict.fromkeys(backend for b, backend, _ in runs if b == block):
            cells = []
            for mode in modes:
                result, sdpa = runs.get((block, backend, mode), {}), runs.get((block, "sdpa", mode), {})
                if "wall_ms" not in result:
                    cells.append(result.get("status", "not run"))
                    continue
                of_sdpa = f" ({result['wall_ms'] / sdpa['wall_ms']:.2f}x sdpa)" if "wall_ms" in sdpa else ""
                cells.append(f"{result['wall_ms']:.2f}{of_sdpa}, GPU {result['gpu_ms']:.2f}")
            lines.append(f"| {backend} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip()


def step_table(results):
    """Markdown: a row per backend, mode and block size."""
    lines = ["| backend mode T=block size | wall ms (median) | wall ms (quartiles) | GPU ms | peak memory (MB) |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | " + (f"{r['wall_ms']:.2f} | {r['wall_ms_iqr'][0]:.2f}-{r['wall_ms_iqr'][1]:.2f} | "
                                        f"{r['gpu_ms']:.2f} | {r['peak_mb']:,.0f} |" if "wall_ms" in r else
                                        f"{r['status']} | | | |"))
    return "\n".join(lines)


def median_ms(fn):
    """do_bench's median on a GPU; on a CPU, where the interpreter's time says nothing of a GPU's,
    one call (after the caller's first, which compiles)."""
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, rep=config.rep_ms, return_mode="median")
    start = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - start)


def bench_mine():
    """Your functions (mine/) beside ours: the tiled forward (PyTorch), then the Triton forward and
    forward+backward, both tuned, the Hopper kernels off (as for the ladder's tuned rung), beside
    torch's FA2. The ladder's shape on a GPU; on a CPU a small one, through the interpreter. Yours
    run in copies of our modules (mine.with_mine); each row gives its time and how far its outputs
    are from ours: yours should be ours to rounding."""
    import mine
    cuda = torch.cuda.is_available()
    shape = dict(B=4, H=16, N=4096, D=64, causal=True, dtype="bfloat16") if cuda else \
        dict(B=1, H=2, N=200, D=16, causal=True, dtype="float32")  # two key tiles a row: rescaling matters
    print(f"B={shape['B']} H={shape['H']} N={shape['N']} D={shape['D']} causal {shape['dtype']} on "
          + (torch.cuda.get_device_name() if cuda else "the CPU, through Triton's interpreter"))
    print("yours: " + (", ".join(f"{name} ({step.file.replace('.', '/')}.py)" for step, name in mine.written())
                       or "none written yet, so every row runs ours"))
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(shape["B"], shape["H"], shape["N"], shape["D"], generator=g).to(
        "cuda" if cuda else "cpu", getattr(torch, shape["dtype"])) for _ in range(4))
    causal = shape["causal"]

    def forward_backward(fwd, bwd):
        def run():
            o, lse = fwd(q, k, v, causal)
            return (o, *bwd(q, k, v, o, do, lse, causal))
        return run

    def fa2_forward_backward():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o = run_provider("sdpa_flash", *leaves, causal)
        return (o, *torch.autograd.grad(o, leaves, do))

    yours_tiled, yours_fwd, yours_bwd = (mine.with_mine(m) for m in ("attention.tiled", "attention.triton_forward",
                                                                     "attention.triton_backward"))
    rows = {"tiled forward": {"yours": lambda: yours_tiled.tiled_forward(q, k, v, causal)[:1],
                              "ours": lambda: tiled.tiled_forward(q, k, v, causal)[:1]},
            "Triton forward": {"yours": lambda: yours_fwd.flash_forward(q, k, v, causal)[:1],
                               "ours": lambda: triton_forward.flash_forward(q, k, v, causal)[:1]},
            "Triton forward+backward": {
                "yours": forward_backward(yours_fwd.flash_forward, yours_bwd.flash_backward),
                "ours": forward_backward(triton_forward.flash_forward, triton_backward.flash_backward)}}
    if cuda:
        rows["Triton forward"]["FA2"] = lambda: (run_provider("sdpa_flash", q, k, v, causal),)
        rows["Triton forward+backward"]["FA2"] = fa2_forward_backward
    names = ("O", "dQ", "dK", "dV")
    with mock.patch.object(hopper_forward, "serves", lambda *args: False), \
            mock.patch.object(hopper_backward, "serves", lambda *args: False):
        for label, runs in rows.items():
            ours = runs["ours"]()
            for who, run in runs.items():
                diff = ", ".join(f"{name} {(a.float() - b.float()).abs().max().item():.1e}"
                                 for name, a, b in zip(names, run(), ours))
                ms = median_ms(run)
                tflops = flops(shape, "fwd+bwd" if "backward" in label else "fwd") / ms / 1e9
                speed = f"{tflops:6.1f} TFLOP/s ({tflops_of_peak(tflops):>4} of peak)  " if cuda else ""
                print(f"{label:<24} {who:<6} {ms:9.3f} ms  {speed}from ours: {diff}", flush=True)


# The default model's attention: 8 sequences, 12 heads, 512 tokens, head dim 32, bf16, causal.
HOST_SHAPE = dict(B=8, H=12, N=512, D=32, causal=True, dtype="bfloat16")
# Without a GPU, the rows whose work runs as torch ops on the CPU: tiny, so their math is next to nothing.
HOST_TINY_SHAPE = dict(HOST_SHAPE, B=1, H=1, N=16)
TORCH_SDPA = "F.scaled_dot_product_attention"  # torch's own call, without attention()'s checks


def host_inputs(shape, device, requires_grad):
    """q, k, v: the model's (B, H, N, D) views of one fused projection, as leaves (so that a
    backward stops at them), and dO."""
    B, H, N, D = shape["B"], shape["H"], shape["N"], shape["D"]
    qkv = torch.randn(B, N, 3 * H, D, device=device, dtype=getattr(torch, shape["dtype"])).transpose(1, 2)
    q, k, v = (t.requires_grad_(requires_grad) for t in qkv.split([H, H, H], dim=1))
    return q, k, v, torch.randn_like(q)


def host_cases(shape, tiny_shape, device, stand_in):
    """{(backend, pass): (shape, call)}: one call of each backend and of torch's sdpa itself,
    forward alone (no gradient asked for) and forward+backward. With the stand-in driver only the
    Triton kernels' launches cost nothing, so the rows that run torch's kernels on the CPU take
    tiny_shape: eager, tiled and sdpa, and triton_fwd's PyTorch backward."""
    cases = {}
    for name in (*BACKENDS, TORCH_SDPA):
        for mode in ("fwd", "fwd+bwd"):
            runs_torch_kernels = name not in TRITON_BACKENDS or (name == "triton_fwd" and mode == "fwd+bwd")
            at = tiny_shape if stand_in and runs_torch_kernels else shape
            q, k, v, do = host_inputs(at, device, requires_grad=mode == "fwd+bwd")
            call = (functools.partial(F.scaled_dot_product_attention, is_causal=at["causal"]) if name == TORCH_SDPA
                    else functools.partial(attention, is_causal=at["causal"], backend=name))
            if mode == "fwd":
                cases[name, mode] = at, functools.partial(call, q, k, v)
            else:
                cases[name, mode] = at, functools.partial(
                    lambda call, q, k, v, do: torch.autograd.grad(call(q, k, v), (q, k, v), do), call, q, k, v, do)
    return cases


def host_times():
    """µs of host time a call (training/host_cost.py), each row beside torch's sdpa's."""
    on_gpu = torch.cuda.is_available()
    cases = host_cases(HOST_SHAPE, HOST_TINY_SHAPE, "cuda" if on_gpu else "cpu", stand_in=not on_gpu)
    us = least_host_us({key: call for key, (_, call) in cases.items()}, rounds=config.host_rounds,
                       synchronize=torch.cuda.synchronize if on_gpu else lambda: None)
    rows = [dict(backend=name, mode=mode, shape="x".join(str(at[d]) for d in "BHND"), us=us[name, mode],
                 of_torch_sdpa=us[name, mode] / us[TORCH_SDPA, mode]) for (name, mode), (at, _) in cases.items()]
    for row in rows:
        print(f"{row['backend']:<32} {row['mode']:<8} {row['shape']:<12} {row['us']:8.1f} us  "
              f"{row['of_torch_sdpa']:5.2f}x torch's sdpa", flush=True)
    stand_in = "" if on_gpu else ("; no GPU: Triton's launch path with a stand-in CUDA driver, no kernel runs, and "
                                  "the rows that run torch's kernels on the CPU at 1x1x16x32")
    method = (f"CPU time of the calling thread, the GPU synchronised between calls, least mean of {config.host_rounds} "
              f"rounds of 50 calls (training/host_cost.py){stand_in}")
    write("host", dict(method=method, rows=rows), host_table(rows, method))
    return rows


def host_table(rows, method):
    """Markdown: a row per backend, forward and forward+backward, µs and the multiple of torch's sdpa."""
    lines = [f"Host µs a call, {HOST_SHAPE['B']}x{HOST_SHAPE['H']}x{HOST_SHAPE['N']}x{HOST_SHAPE['D']} bf16 "
             f"causal unless the shape says otherwise: {method}.", "",
             "| backend | shape fwd | fwd µs | x torch sdpa | shape fwd+bwd | fwd+bwd µs | x torch sdpa |",
             "|---|---|---|---|---|---|---|"]
    by = {(r["backend"], r["mode"]): r for r in rows}
    for name in dict.fromkeys(r["backend"] for r in rows):
        fwd, both = by[name, "fwd"], by[name, "fwd+bwd"]
        lines.append(f"| {name} | {fwd['shape']} | {fwd['us']:.1f} | {fwd['of_torch_sdpa']:.2f} | {both['shape']} | "
                     f"{both['us']:.1f} | {both['of_torch_sdpa']:.2f} |")
    return "\n".join(lines)


def environment():
    if not torch.cuda.is_available():  # the host mode's stand-in (training/host_cost.py)
        return dict(card=f"no GPU: {platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores, "
                         "a stand-in CUDA driver", sm="-", path="native", torch=torch.__version__,
                    triton=triton.__version__, cuda="-", cudnn="-", python=platform.python_version(),
                    date=time.strftime("%Y-%m-%d"), settings=asdict(config))
    props = torch.cuda.get_device_properties(0)
    card = this_card()
    return dict(card=props.name, sm=f"{props.major}{props.minor}", path="consumer card (NANOFA2_ADA=1)"
                if launch.ADA_PATH else "native", peak_tflops=card and card.tflops, peak_gb_per_s=card and card.gb_per_s,
                torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), python=platform.python_version(),
                date=time.strftime("%Y-%m-%d"), settings=asdict(config))


def write(name, results, markdown=None):
    """results (with the environment) to out/name.json; markdown, headed by the environment, to out/name.md."""
    env = environment()
    with open(os.path.join(config.out, f"{name}.json"), "w") as f:
        json.dump(dict(env=env, results=results), f, indent=1)
    if markdown is not None:
        with open(os.path.join(config.out, f"{name}.md"), "w") as f:
            f.write(f"{env['card']} (sm_{env['sm']}, {env['path']}); torch {env['torch']}, Triton {env['triton']}, "
                    f"CUDA {env['cuda']}, cuDNN {env['cudnn']}; {env['date']}.\n\n{markdown}\n")


def main():
    if config.impl == "mine":
        return bench_mine()
    os.makedirs(config.out, exist_ok=True)
    if config.mode == "host":  # on any machine
        print(" ".join(f"{key}={value}" for key, value in environment().items() if key != "settings"))
        host_times()
        print(f"wrote {config.out}/")
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench.py times GPU kernels: it needs a CUDA GPU (--mode=host runs without one)")
    print(" ".join(f"{key}={value}" for key, value in environment().items() if key != "settings"))
    card = this_card()
    print(f"fractions of peak are of {card.tflops} TFLOP/s and {card.gb_per_s:,} GB/s ({card.source})" if card else
          f"{torch.cuda.get_device_name()} is not in bench.py's CARDS: no fraction of its peak is shown")
    if launch.ADA_PATH:
        print("NANOFA2_ADA=1 takes the consumer card's code path on this card: the fractions are of this card's peak")
    if config.mode == "ladder":
        write("ladder", ladder())
    elif config.mode == "configs":
        write("configs", sweep_configs())
    elif config.mode == "step":
        step_times()
    elif config.mode == "decode":
        decode_times()
    else:
        providers = config.providers.split(",")
        rows = []
        for grid, shapes in (("paper", paper_grid(config.quick)), ("long", long_grid(config.quick))):
            if config.grid in (grid, "all"):
                rows += bench_grid(grid, shapes, providers)
                write("attention", rows, grid_tables(rows, providers))  # after each grid: a cut run keeps it
                plot_grid(rows, grid, os.path.join(config.out, f"attention_{grid}.png"))
        if config.grid in ("masks", "all"):
            masks = bench_grid("masks", masks_grid(config.quick), providers)
            print(masks_table(masks))
            write("masks", masks, masks_table(masks))
    print(f"wrote {config.out}/")


if __name__ == "__main__":
    main()
