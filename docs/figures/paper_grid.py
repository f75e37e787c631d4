"""Draw the kernels' TFLOP/s on the FlashAttention-2 paper's grid: docs/figures/paper_grid.png.

    python docs/figures/paper_grid.py [--out PATH]

From docs/results/h100.json (an H100 at 3a4cadb): forward and forward+backward TFLOP/s against N
for each head dim and mask, our Triton backend beside torch's cuDNN and FlashAttention-2 (FA2)
kernels, and, dashed, our kernels down the consumer card's path (NANOFA2_ADA=1, on the same H100)
beside FA2 on that run. Prints the range of our forward over cuDNN.
"""
import argparse
import json
from pathlib import Path

from matplotlib.figure import Figure

RESULTS = Path(__file__).resolve().parents[1] / "results" / "h100.json"
LINES = {"triton": dict(label="triton (ours)", lw=2.5, color="#4c72b0"),
         "sdpa_cudnn": dict(label="cuDNN", lw=1.2, color="#55a868"),
         "sdpa_flash": dict(label="FA2", lw=1.2, color="#dd8452"),
         "triton_ada": dict(label="triton, consumer path", lw=1.5, color="#4c72b0", linestyle="--"),
         "sdpa_flash_ada": dict(label="FA2, that run", lw=1, color="#dd8452", linestyle="--")}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".png")))
    out = Path(parser.parse_args(argv).out)
    results = json.loads(RESULTS.read_text())
    run = results["run"]
    rows = results["paper_grid"]["rows"] + [
        {**r, "provider": r["provider"] + ("" if r["provider"] == "triton_ada" else "_ada")}
        for r in results["paper_grid_consumer_path"]["rows"] if r["provider"] in ("triton_ada", "sdpa_flash")]
    panels = sorted({(r["D"], r["causal"]) for r in results["paper_grid"]["rows"]})
    fig = Figure(figsize=(15, 7), layout="constrained")
    axes = fig.subplots(2, len(panels), squeeze=False)
    for col, (d, causal) in enumerate(panels):
        for row, mode in enumerate(("fwd", "fwd_bwd")):
            ax = axes[row][col]
            for provider, style in LINES.items():
                points = sorted((r["N"], r[mode]) for r in rows if (r["D"], r["causal"], r["provider"]) ==
                                (d, causal, provider) and r.get("B", 16384 // r["N"]) * r["N"] == 16384)
                if points:
                    ax.plot(*zip(*points), marker="o", ms=3, **style)
            ax.set(title=f"{'forward' if mode == 'fwd' else 'forward+backward'}, D={d}, "
                         f"{'causal' if causal else 'full'}", xlabel="N", ylabel="TFLOP/s", xscale="log")
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"The FlashAttention-2 paper's grid (16k tokens a batch, hidden 2048, bf16): {run['card']}, "
                 f"torch {run['torch']}, Triton {run['triton']}, commit {run['commit']}", fontsize=10)
    ours = {(r["D"], r["causal"], r["N"]): r for r in rows if r["provider"] == "triton"}
    ratios = sorted((ours[k]["fwd"] / r["fwd"], k) for r in rows if r["provider"] == "sdpa_cudnn"
                    for k in [(r["D"], r["causal"], r["N"])])
    print(f"forward over cuDNN: {ratios[0][0]:.2f} (D, causal, N = {ratios[0][1]}) to {ratios[-1][0]:.2f}; "
          f"next lowest {ratios[1][0]:.2f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
