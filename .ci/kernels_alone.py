"""Forward+backward at the paper grid with and without the gradient gather: `.ci/gpu kernels_alone`.

    python .ci/kernels_alone.py

bench.py hands every provider q, k, v as strided views of one (B, N, 3, H, D) projection, as the
model does, so each backward also pays autograd gathering the three gradients into the
projection's: on the H200 0.6-0.7 ms at most of the paper grid's shapes, for every provider
alike, which narrows the gaps between them (docs/benchmarks.md, session 12). Here each shape is also timed with q, k, v as
three separate contiguous leaves, whose gradients need no gather: the kernels alone. bf16,
N = 1024, 4096, 16384, D = 64 and 128, causal and not, one process, do_bench medians.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench import flops, make_inputs, paper_grid, run_provider  # noqa: E402
import triton  # noqa: E402, I001  (after bench, which imports attention first)

PROVIDERS = ("triton", "sdpa_cudnn", "sdpa_flash")


def fwd_bwd_ms(name, q, k, v, causal, wrt, do):
    return triton.testing.do_bench(lambda: torch.autograd.grad(run_provider(name, q, k, v, causal), wrt, do),
                                   warmup=10, rep=40)


def main():
    print("shape                                 provider     views ms  leaves ms  views TF/s  leaves TF/s")
    for shape in paper_grid(quick=True):
        B, H, N, D, causal = (shape[key] for key in ("B", "H", "N", "D", "causal"))
        qkv, *views = make_inputs(shape, requires_grad=True)
        leaves = [view.detach().contiguous().requires_grad_() for view in views]  # the same values, no gather
        do = torch.randn_like(leaves[0])
        gflop = flops(shape, "fwd+bwd") / 1e9
        ms = {}
        for name in PROVIDERS:
            ms[name] = fwd_bwd_ms(name, *views, causal, qkv, do), fwd_bwd_ms(name, *leaves, causal, leaves, do)
            print(f"B={B:<3} H={H:<3} N={N:<6} D={D:<4} {'causal' if causal else 'full  '} {name:<12} "
                  f"{ms[name][0]:8.3f} {ms[name][1]:9.3f} {gflop / ms[name][0]:10.0f} {gflop / ms[name][1]:11.0f}",
                  flush=True)
        ours, cudnn = ms["triton"], ms["sdpa_cudnn"]
        print(f"   triton / cuDNN speed: views {cudnn[0] / ours[0]:.2f}x, leaves {cudnn[1] / ours[1]:.2f}x", flush=True)
        del qkv, views, leaves, do
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
