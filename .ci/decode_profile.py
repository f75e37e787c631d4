"""Where a decode token's GPU time goes, kernel by kernel: `.ci/gpu decode_profile`.

    python .ci/decode_profile.py [--backends=triton,sdpa] [--batches=1,32] [--replays=50] [--top=25]

For each batch and backend, bench.py --decode's model (the default's shape, untrained, bf16
weights cast once) with its decode step compiled generates as bench.py --decode times it
(tokens/s of the second of two greedy runs). Then the decoder's CUDA graph, one token (the
step and the sampling), is replayed --replays times under torch.profiler, queued behind a GPU
sleep so that the GPU runs the replays back to back, and the kernels are summed per token:
the replays' GPU span, the time inside kernels, the kernel count and the top kernels by GPU
time. Needs a CUDA GPU.
"""
import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench import DECODE_NEW_TOKENS, decode_model, decode_tokens_per_s  # noqa: E402
from data.shakespeare.prepare import SHAKESPEARE_VOCAB_SIZE  # noqa: E402
from model import GPT  # noqa: E402
from training.train_config import TrainConfig  # noqa: E402


def profile_replays(decoder, replays):
    """Kernel events (name, start us, end us) of `replays` replays of the decoder's graph, from
    position block_size / 4 on."""
    decoder.pos.fill_(decoder.cache.block_size // 4)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(100_000_000)  # about 50 ms of GPU clock: time to queue every replay behind it
        for _ in range(replays):
            decoder.graph.replay()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == DeviceType.CUDA and "spin_kernel" not in e.name]  # spin_kernel: the sleep


def report(kernels, replays, top):
    """Prints the per-token summary and the top kernels; returns (span us, busy us, kernels) a token."""
    span_us = (max(end for _, _, end in kernels) - min(start for _, start, _ in kernels)) / replays
    busy_us = sum(end - start for _, start, end in kernels) / replays
    print(f"  per token on the GPU: {span_us:,.1f} us span, {busy_us:,.1f} us in kernels, "
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
    parser.add_argument("--backends", default="triton,sdpa", help="comma-separated attention backends")
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes, run in this order")
    parser.add_argument("--replays", type=int, default=50, help="tokens profiled")
    parser.add_argument("--top", type=int, default=25, help="kernels listed")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_profile.py needs a CUDA GPU")
    config = TrainConfig().model_config(SHAKESPEARE_VOCAB_SIZE)
    if config.block_size // 4 + args.replays > config.block_size:
        parser.error(f"--replays must fit in block_size={config.block_size} from position block_size / 4")
    torch.manual_seed(0)
    state = GPT(config).state_dict()
    print(f"decode profile: {torch.cuda.get_device_name()}, torch {torch.__version__}, {config}", flush=True)
    rows, began = [], time.perf_counter()
    for batch in (int(b) for b in args.batches.split(",")):
        for backend in args.backends.split(","):
            model, precision = decode_model(config, state, backend, compiled=True)
            rate, first_s = decode_tokens_per_s(model, batch, "KV cache, compiled", precision)
            print(f"\n{backend}, batch {batch}: {rate:,.0f} tokens/s ({DECODE_NEW_TOKENS} tokens; first run "
                  f"{first_s:.1f} s; {time.perf_counter() - began:.0f} s in)", flush=True)
            kernels = profile_replays(model.generate_decoder, args.replays)
            rows.append((backend, batch, rate, *report(kernels, args.replays, args.top)))
            del model
            torch.cuda.empty_cache()
    print(f"\n{'backend':<8} {'batch':>5} {'tokens/s':>10} {'GPU us/token':>13} {'busy us':>8} {'kernels':>8}")
    for backend, batch, rate, span_us, busy_us, count in rows:
        print(f"{backend:<8} {batch:>5} {rate:>10,.0f} {span_us:>13,.1f} {busy_us:>8,.1f} {count:>8.1f}")


if __name__ == "__main__":
    main()
