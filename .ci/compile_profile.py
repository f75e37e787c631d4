"""Where a first compile of the default step spends its time: `.ci/gpu compile_profile`.

    python .ci/compile_profile.py sdpa|triton

Builds the compiled default step (compile_steps.build: torch.compile default mode, the
default's context and micro-batch, 5 warm-up steps) under cProfile and prints torch.compile's
own phase timings (torch._dynamo.utils.compile_times), then the profile's top functions by
cumulative and by own time. Run it in a fresh process with empty caches (the stage sets TRITON_CACHE_DIR,
TORCHINDUCTOR_CACHE_DIR and NANOFA2_TUNING_CACHE to new folders), once per backend, and compare
the two. cProfile slows Python-heavy phases, so compare the phases, not the totals with
compile_tuning's; it sees only the main thread (the tuner compiles its candidates on others).
"""
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from compile_steps import DEFAULT, TOKENS_PER_MICRO_BATCH, build  # noqa: E402


def main():
    backend = sys.argv[1]
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    _, seconds = build(backend, "default", DEFAULT.block_size, TOKENS_PER_MICRO_BATCH)
    profiler.disable()
    print(f"{backend}: build + 5 warm-up steps {seconds:.1f} s under cProfile "
          f"(with the model's setup {time.perf_counter() - start:.1f} s)")
    print(torch._dynamo.utils.compile_times(repr="str"))
    for order, lines in (("cumulative", 60), ("tottime", 25)):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(lines)
        print(text.getvalue())


if __name__ == "__main__":
    main()
