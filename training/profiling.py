"""Where a training step's time goes: torch.profiler over a few steady steps, the device time
sorted into the parts of a GPT step (CATEGORIES), and what attention keeps in memory; train.py
--profile=True writes out_dir/profile.json and profile_trace.json, compare.py draws them.

A kernel (on the CPU, an op's own time) launched inside model.py's "attention" range is
attention forward; one run by an autograd node that such an op made (both carry its sequence
number) is attention backward; likewise the output layer and loss, and the optimizer; any other
matmul is matmuls. Compiled code hides the ranges in places: there kernels are sorted by name.
"""
import contextlib
import json
import os
import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule

from data.files import write_atomically
from model import ATTENTION_RANGE, OUTPUT_RANGE
from training.devices import peak_memory_mb

PROFILE_STEPS = 3  # steps recorded, after one the profiler warms up on
PROFILE_NAME = "profile.json"
TRACE_NAME = "profile_trace.json"
CATEGORIES = ("attention forward", "attention backward", "matmuls", "output layer + loss", "optimizer",
              "everything else", "idle")
OPTIMIZER_RANGE = "optimizer"  # train.py's
RANGES = {  # model.py's and train.py's ranges -> the category of their forward work and of its backward
    ATTENTION_RANGE: ("attention forward", "attention backward"),
    OUTPUT_RANGE: ("output layer + loss", "output layer + loss"),
    OPTIMIZER_RANGE: ("optimizer", "optimizer"),
}
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
              "aten::_scaled_mm"}
BACKWARD_NODE = "autograd::engine::evaluate_function: "


def step_profiler(out_dir, skip_steps, model, batch, amp, **labels):
    """A started torch.profiler that skips skip_steps steps, warms up on one and records
    PROFILE_STEPS (call .step() after each step), then writes profile.json: their category
    times, `labels`, the peak memory and what attention saves (of model on batch, under amp)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])

    def ready(prof):
        # Also called when a run stops before or during the recorded steps: nothing to report then.
        events = prof.events()
        # CPU ranges only: on a GPU each step's range also shows up as a GPU-side annotation.
        steps = sum(e.name.startswith("ProfilerStep") and e.device_type == DeviceType.CPU for e in events)
        if steps == PROFILE_STEPS:
            result = {**attribute(events), **labels, "peak_mem_mb": peak_memory_mb(batch[0].device),
                      "attention_saved_mb": attention_saved_mb(model, *batch, amp)}
            with write_atomically(os.path.join(out_dir, PROFILE_NAME), "w") as f:
                f.write(json.dumps(result, indent=2) + "\n")
            unit = "GPU kernels" if result["device"] == "cuda" else "CPU ops"
            print(f"profiled {result['steps']} steps: {result['step_ms']:.1f} ms/step, "
                  + ", ".join(f"{category} {ms:.2f}" for category, ms in result["ms"].items())
                  + f" (ms, {unit}); {os.path.join(out_dir, PROFILE_NAME)}")
            prof.export_chrome_trace(os.path.join(out_dir, TRACE_NAME))

    profiler = profile(activities=activities, on_trace_ready=ready,
                       schedule=schedule(skip_first=skip_steps, wait=0, warmup=1, active=PROFILE_STEPS, repeat=1))
    profiler.start()
    return profiler


def ancestors(event):
    while event is not None:
        yield event
        event = event.cpu_parent


def attribute(events):
    """{"device", "steps": n, "step_ms": wall time per step, "ms": {category: ms per step}}."""
    cpu_events = [e for e in events if e.device_type == DeviceType.CPU]
    device_events = [e for e in events if e.device_type == DeviceType.CUDA]
    steps = [e for e in cpu_events if e.name.startswith("ProfilerStep")]
    if not steps:
        raise ValueError("the profile holds no ProfilerStep ranges: was .step() called?")
    step_us = sum(e.time_range.elapsed_us() for e in steps)

    # Forward ops inside a range, by the sequence number their autograd node will carry.
    range_of_sequence = {}
    for e in cpu_events:
        if e.sequence_nr >= 0 and not e.name.startswith(BACKWARD_NODE):
            chain = list(ancestors(e))
            if not any(a.name.startswith(BACKWARD_NODE) for a in chain):
                name = next((a.name for a in chain if a.name in RANGES), None)
                if name is not None:
                    range_of_sequence[e.sequence_nr] = name

    def category_of_op(op):
        chain = list(ancestors(op))
        for a in chain:
            if a.name in RANGES:
                return RANGES[a.name][0]
            if a.name.startswith(BACKWARD_NODE) and a.sequence_nr in range_of_sequence:
                return RANGES[range_of_sequence[a.sequence_nr]][1]
            if a.name.startswith("Optimizer."):
                return "optimizer"
        return "matmuls" if any(a.name in MATMUL_OPS for a in chain) else "everything else"

    us = dict.fromkeys(CATEGORIES, 0.0)
    if device_events:
        # Each kernel from the op that launched it (op.kernels: linked_correlation_id is newer than 2.11).
        kernel_names = set()
        for op in (e for e in cpu_events if e.kernels):
            op_category = category_of_op(op)
            for kernel in op.kernels:
                category = op_category if op_category != "everything else" else category_of_kernel_name(kernel.name)
                us[category] += kernel.duration
                kernel_names.add(kernel.name)
        # Busy time from the kernels alone: the device events also hold the ranges, spanning whole steps.
        kernels = [e for e in device_events if e.name in kernel_names]
        busy_us = union_us([(k.time_range.start, k.time_range.end) for k in kernels],
                           [(s.time_range.start, s.time_range.end) for s in steps])
        device = "cuda"
    else:
        ops = [e for e in cpu_events if e not in steps]
        for op in ops:
            us[category_of_op(op)] += op.self_cpu_time_total
        busy_us = sum(op.self_cpu_time_total for op in ops)
        device = "cpu"
    us["idle"] = max(step_us - busy_us, 0.0)
    return {"device": device, "steps": len(steps), "step_ms": step_us / len(steps) / 1000,
            "ms": {category: value / len(steps) / 1000 for category, value in us.items()}}


# For kernels no range reaches: torch's flash, memory-efficient and cuDNN attention
# (flash_bwd..., fmha_cutlassB..., ..._sdpa_..._bprop...) and this repo's (_attn_fwd, _attn_bwd).
ATTENTION_KERNEL_WORDS = ("flash", "fmha", "attn", "attention", "sdpa")
BACKWARD_KERNEL_WORDS = ("bwd", "backward", "bprop", "cutlassb")


def category_of_kernel_name(name):
    lower = name.lower()
    if any(word in lower for word in ATTENTION_KERNEL_WORDS):
        backward = any(word in lower for word in BACKWARD_KERNEL_WORDS)
        return "attention backward" if backward else "attention forward"
    if any(word in lower for word in ("gemm", "nvjet", "cutlass", "xmma")) or "_mm" in lower or "bmm" in lower:
        return "matmuls"
    return "everything else"


def union_us(intervals, windows):
    """Total length of the union of intervals, counted inside the windows only."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        start = max(start, end)
        if stop > start:
            total += sum(max(0.0, min(stop, w_stop) - max(start, w_start)) for w_start, w_stop in windows)
            end = stop
    return total


def attention_saved_mb(model, x, y, amp):
    """MB of tensors attention keeps for backward in one forward of (x, y): those saved between
    each block's qkv and output projections, once per storage. The random streams are put back."""
    saved, counting = {}, [False]

    def pack(tensor):
        if counting[0]:
            storage = tensor.untyped_storage()
            saved[(storage.data_ptr(), storage.device)] = storage.nbytes()
        return tensor

    hooks = []
    for block in model.transformer.h:
        hooks.append(block.attn.c_attn.register_forward_hook(lambda *_: counting.__setitem__(0, True)))
        hooks.append(block.attn.c_proj.register_forward_pre_hook(lambda *_: counting.__setitem__(0, False)))
    devices = [x.device] if x.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with amp:
                model(x, y)
    finally:
        for hook in hooks:
            hook.remove()
    return sum(saved.values()) / 2**20


def stop_profiler(profiler, out_dir, skip_steps):
    """Stop the profiler, warning when the run ended before its steps were recorded."""
    profiler.stop()
    if not os.path.exists(os.path.join(out_dir, PROFILE_NAME)):
        print(f"warning: profile=True but the run stopped before its steps {skip_steps + 2}-{skip_steps + 1 + PROFILE_STEPS}"
              " were profiled: nothing written", file=sys.stderr)


def remove_profile(out_dir):
    """Delete a profile an earlier run left in out_dir, so any profile there is this run's."""
    for name in (PROFILE_NAME, TRACE_NAME):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, name))


def read_profile(out_dir):
    """out_dir/profile.json, or None when the run did not profile."""
    with contextlib.suppress(FileNotFoundError), open(os.path.join(out_dir, PROFILE_NAME)) as f:
        return json.load(f)
