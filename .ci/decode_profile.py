"""Where a decode token's GPU time goes, before and after casting the weights to bf16.

    python .ci/decode_profile.py                 # H200: triton and sdpa, batch 1 then 32
    python .ci/decode_profile.py --device=cpu    # smoke test: a tiny model, no CUDA graph

For each batch, backend and setup, an untrained model of the default shape (TrainConfig, the
dense TinyShakespeare vocabulary, as bench.py --decode builds it), its decode step compiled
(GPT.compile_decode_step), generates as bench.py --decode times it: a 1-token prompt, 255 new
tokens, greedy, the second of two runs (tokens/s). Then the decoder's CUDA graph (one token: the
step and the sampling) is replayed --replays times under torch.profiler, queued behind a GPU
sleep so that the GPU runs the replays back to back, and the kernels are summed per token:
  old  fp32 weights under bf16 autocast: the graph casts every weight at every token
       (StaticDecoder.capture cannot keep autocast's cache of cast weights)
  new  bf16 weights, cast once (training/devices.py, generation_precision), no autocast
Printed per run: tokens/s; GPU us per token (the replays' span on the GPU, and the kernels' busy
time); kernels per token; the top kernels by GPU time. On the CPU the step runs uncaptured and
the "kernels" are the profiler's leaf CPU ops (a check that the script runs, not a measurement).
"""
import argparse
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from data.shakespeare.prepare import SHAKESPEARE_VOCAB_SIZE  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from training.devices import generation_precision  # noqa: E402
from training.train_config import TrainConfig  # noqa: E402

SETUPS = ("old", "new")
SETUP_NAMES = {"old": "fp32 weights + bf16 autocast", "new": "bf16 weights, no autocast"}
DEFAULT_CONFIG = TrainConfig().model_config(SHAKESPEARE_VOCAB_SIZE)
SMOKE_CONFIG = GPTConfig(block_size=32, vocab_size=200, n_layer=2, n_head=2, n_embd=64, bias=False)


def build(config, state, attn, setup, device, compile_mode):
    """The model of `setup` on device, its decode step compiled, and the context to generate under."""
    model = GPT(replace(config, attn=attn))
    model.load_state_dict(state)
    model.eval().to(device)
    if setup == "new":
        precision = generation_precision(model, device, torch.bfloat16)
    else:
        precision = torch.autocast(device.type, dtype=torch.bfloat16)
    torch._dynamo.reset()  # every model compiles GPT.decode_step's code: keep clear of the recompile limit
    if device.type == "cpu":
        model.compile_decode_step(backend="aot_eager")  # quick, and runs the Triton interpreter as is
    elif compile_mode == "default":
        model.compile_decode_step()
    else:  # an experiment: another Inductor mode, without its own CUDA graphs (the decoder captures one)
        model.decode_step = torch.compile(model.decode_step, mode=compile_mode, fullgraph=True, dynamic=False)
    return model, precision


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def tokens_per_s(model, precision, batch, new_tokens, device):
    """bench.py's decode_tokens_per_s: the second of two greedy runs from a 1-token prompt;
    and the seconds of the first (compile, tuning, capture)."""
    prompt = torch.zeros(batch, 1, dtype=torch.long, device=device)
    seconds = []
    for _ in range(2):
        torch.manual_seed(0)
        synchronize(device)
        start = time.perf_counter()
        with precision:
            model.generate(prompt, new_tokens, top_k=1)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return batch * new_tokens / seconds[-1], seconds[0]


def profile_tokens(decoder, precision, replays, device, captured):
    """Kernel events (name, start us, end us) of `replays` tokens from position block_size / 4:
    CUDA graph replays (captured), else the same step run op by op (on the CPU, always)."""
    decoder.pos.fill_(decoder.cache.block_size // 4)
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    synchronize(device)
    with profile(activities=[activity]) as prof, torch.no_grad(), precision:
        if device.type == "cuda":
            torch.cuda._sleep(100_000_000)  # about 50 ms of GPU clock: time to queue every token behind it
        for _ in range(replays):
            if captured:
                decoder.graph.replay()
            else:
                decoder.step()
        synchronize(device)
    events = prof.events()
    if device.type == "cuda":  # torch.cuda._sleep's kernel is spin_kernel
        kernels = [e for e in events if e.device_type == DeviceType.CUDA and "spin_kernel" not in e.name]
    else:  # leaf CPU ops: those that call no other op
        kernels = [e for e in events if e.device_type == DeviceType.CPU and not e.cpu_children]
    return [(e.name, e.time_range.start, e.time_range.end) for e in kernels]


def report(kernels, replays, top):
    """Prints the per-token summary and the top kernels; returns (span us, busy us, kernels) a token."""
    if not kernels:
        print("  no kernel events recorded (the profiler saw nothing of the graph's kernels)")
        return float("nan"), float("nan"), 0
    span_us = (max(end for _, _, end in kernels) - min(start for _, start, _ in kernels)) / replays
    busy_us = sum(end - start for _, start, end in kernels) / replays
    print(f"  per token on the device: {span_us:,.1f} us span, {busy_us:,.1f} us in kernels, "
          f"{len(kernels) / replays:.1f} kernels")
    by_name = defaultdict(lambda: [0, 0.0])
    for name, start, end in kernels:
        by_name[name][0] += 1
        by_name[name][1] += end - start
    print(f"  {'kernel':<90} {'per token':>9} {'us/token':>9}")
    for name, (count, total_us) in sorted(by_name.items(), key=lambda item: -item[1][1])[:top]:
        print(f"  {name[:90]:<90} {count / replays:>9.2f} {total_us / replays:>9.2f}")
    return span_us, busy_us, len(kernels) / replays


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--backends", default="triton,sdpa", help="comma-separated attention backends")
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes, run in this order")
    parser.add_argument("--setups", default="old,new", help="old (fp32 weights + autocast), new (bf16 weights)")
    parser.add_argument("--new_tokens", type=int, default=255, help="tokens of the timed run")
    parser.add_argument("--replays", type=int, default=50, help="tokens profiled")
    parser.add_argument("--top", type=int, default=25, help="kernels listed")
    parser.add_argument("--compile_mode", default="default",
                        help="Inductor mode of the step, e.g. max-autotune-no-cudagraphs (slow to compile)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device=cuda but torch sees no GPU (use --device=cpu for a smoke test)")
    setups = args.setups.split(",")
    if not set(setups) <= set(SETUPS):
        parser.error(f"--setups={args.setups!r}: expected a comma-separated subset of {SETUPS}")
    config = DEFAULT_CONFIG if device.type == "cuda" else SMOKE_CONFIG
    new_tokens, replays = args.new_tokens, args.replays
    if device.type == "cpu":
        new_tokens, replays = min(new_tokens, config.block_size - 2), min(replays, 3)
    if new_tokens + 1 > config.block_size or config.block_size // 4 + replays > config.block_size:
        parser.error(f"--new_tokens and --replays must fit block_size={config.block_size}")
    torch.manual_seed(0)
    state = GPT(config).state_dict()
    print(f"decode profile: {device}" + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else "")
          + f", torch {torch.__version__}, {config}, compile mode {args.compile_mode}", flush=True)
    rows, began = [], time.perf_counter()
    for batch in (int(b) for b in args.batches.split(",")):
        for attn in args.backends.split(","):
            for setup in setups:
                model, precision = build(config, state, attn, setup, device, args.compile_mode)
                rate, first_s = tokens_per_s(model, precision, batch, new_tokens, device)
                print(f"\n{attn}, batch {batch}, {SETUP_NAMES[setup]}: {rate:,.0f} tokens/s "
                      f"({new_tokens} tokens; first run {first_s:.1f} s; {time.perf_counter() - began:.0f} s in)",
                      flush=True)
                kernels = profile_tokens(model.generate_decoder, precision, replays, device, device.type == "cuda")
                if device.type == "cuda" and not kernels:
                    print("  the profiler saw no kernel of the graph's replays: profiling the same step uncaptured "
                          "instead (its span then includes the host's launch gaps)")
                    kernels = profile_tokens(model.generate_decoder, precision, replays, device, False)
                span_us, busy_us, count = report(kernels, replays, args.top)
                rows.append((attn, batch, setup, rate, span_us, busy_us, count))
                del model
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print(f"\n{'backend':<8} {'batch':>5} {'setup':<30} {'tokens/s':>10} {'GPU us/token':>13} "
          f"{'busy us':>8} {'kernels':>8}")
    for attn, batch, setup, rate, span_us, busy_us, count in rows:
        print(f"{attn:<8} {batch:>5} {SETUP_NAMES[setup]:<30} {rate:>10,.0f} {span_us:>13,.1f} {busy_us:>8,.1f} "
              f"{count:>8.1f}")


if __name__ == "__main__":
    main()
