"""Draw a full default run's loss curves per backend: docs/figures/loss_curves.png.

    python docs/figures/loss_curves.py [--out PATH]

`python train.py --attn=triton --max_memory_gb=12` and the same with --attn=sdpa, on an H100 at
3a4cadb (docs/results/h100.json, copied from the run's logs): the training loss every 10
iterations and the validation loss every 100, then their differences. Our kernels and torch's
train the same model to the same losses; what differs is bf16 rounding. Prints the best
validation loss of each and the largest gaps.
"""
import argparse
import json
from pathlib import Path

from matplotlib.figure import Figure

RESULTS = Path(__file__).resolve().parents[1] / "results" / "h100.json"
COLOURS = {"triton": "#4c72b0", "sdpa": "#dd8452"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".png")))
    out = Path(parser.parse_args(argv).out)
    results = json.loads(RESULTS.read_text())
    run, training = results["run"], results["training"]

    fig = Figure(figsize=(11, 7), layout="constrained")
    curves, gaps = fig.subplots(2, 1, height_ratios=[2, 1], sharex=True)
    for backend in ("triton", "sdpa"):
        loss, evals = training[backend]["loss"], training[backend]["eval"]
        curves.plot(*zip(*loss), color=COLOURS[backend], alpha=0.35, lw=1, label=f"{backend}: training loss")
        curves.plot([e[0] for e in evals], [e[2] for e in evals], "o-", color=COLOURS[backend], ms=3,
                    label=f"{backend}: validation loss")
        best = min(evals, key=lambda e: e[2])
        print(f"{backend}: best val loss {best[2]:.4f} at iteration {best[0]}, last {evals[-1][2]:.4f}")
    curves.set(ylabel="loss (nats a token)", ylim=(3, 10), title=f"the default run, per backend "
               f"({run['card']}, torch {run['torch']}, Triton {run['triton']}, commit {run['commit']})")
    curves.legend(fontsize=8)
    curves.grid(alpha=0.3)

    train = {b: dict(map(tuple, training[b]["loss"])) for b in COLOURS}
    val = {b: {e[0]: e[2] for e in training[b]["eval"]} for b in COLOURS}
    iters = sorted(set(train["triton"]) & set(train["sdpa"]))
    evals = sorted(set(val["triton"]) & set(val["sdpa"]))
    train_gap = [train["triton"][i] - train["sdpa"][i] for i in iters]
    val_gap = [val["triton"][i] - val["sdpa"][i] for i in evals]
    gaps.plot(iters, train_gap, color="grey", lw=1, label="training loss")
    gaps.plot(evals, val_gap, "o-", color="black", ms=3, label="validation loss")
    gaps.axhline(0, color="black", lw=0.5)
    gaps.set(xlabel="iteration", ylabel="triton - sdpa", title="the difference: bf16 rounding, which training carries forward, and no trend")
    gaps.legend(fontsize=8)
    gaps.grid(alpha=0.3)
    print(f"largest gap, triton - sdpa: training loss {max(map(abs, train_gap)):.4f}, validation loss "
          f"{max(map(abs, val_gap)):.4f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
