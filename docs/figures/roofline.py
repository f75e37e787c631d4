"""Draw the forward's ladder on the rooflines of an H100 and an RTX 4070 Super: docs/figures/roofline.png.

    python docs/figures/roofline.py [--out PATH]

A roofline bounds a kernel's TFLOP/s by the card's tensor-core peak, or by its memory bandwidth
times the kernel's arithmetic intensity (FLOP per byte moved), whichever is lower. The peaks are
training/devices.py's CARDS, the one table train.py's MFU and bench.py read. The ladder's rungs
(docs/results/h100.json: `python bench.py --mode=ladder` on an H100 at 3a4cadb, and the consumer
card's path there, NANOFA2_ADA=1) sit at the intensity of their tiles, counted as if every
program read its Q tile, each K and V tile it sees and wrote its O tile from and to HBM with no
help from the L2: about BLOCK_M FLOP a byte in bf16, as each K and V element read serves
BLOCK_M query rows. The 4070 Super's panel has no measurement: it shows the roof at each rung's
intensity, what its tiles allow there if the L2 does not help. Prints every rung's numbers.
"""
import argparse
import json
import sys
from pathlib import Path

from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repo root, for `attention` and `training`
from attention.masks import UNBOUNDED, key_tile_bounds  # noqa: E402
from training.devices import CARDS  # noqa: E402

H100, ADA = "NVIDIA H100 80GB HBM3", "NVIDIA GeForce RTX 4070 SUPER"
SHORT = {"the article's tiles: 16x16, no pipelining": "16x16", "64x64 tiles": "64x64",
         "+ software pipelining (3 stages)": "64x64, 3 stages", "128x64 tiles, 8 warps": "128x64",
         "TMA descriptors instead of cp.async": "128x64, TMA", "64x128 tiles, TMA, 2 stages": "64x128, TMA"}
LINES = {"tuned Triton kernel (triton.autotune)": "tuned Triton", "warp-specialised Gluon kernel (Hopper)": "Gluon",
         "sdpa_flash": "torch FA2", "sdpa_cudnn": "cuDNN"}


def intensity(shape, block_m, block_n, bytes_per=2):
    """FLOP per HBM byte of the forward at shape with these tiles, counted without the L2."""
    n, d = shape["N"], shape["D"]
    flop = 4 * n * n * d / (2 if shape["causal"] else 1)
    mask = (n, n, UNBOUNDED, 0 if shape["causal"] else UNBOUNDED)
    moved = 0
    for q_start in range(0, n, block_m):
        start, _, _, end = key_tile_bounds(q_start, mask, block_m, block_n)
        moved += (2 * block_m + 2 * (end - start)) * d * bytes_per + 4 * block_m  # Q, O; K, V; lse
    return flop / moved


def roof(card, x):
    return min(card.tflops, x * card.gb_per_s / 1000)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".png")))
    out = Path(parser.parse_args(argv).out)
    results = json.loads((ROOT / "docs" / "results" / "h100.json").read_text())
    shape = results["ladder"]["shape"]
    consumer = {step["step"]: step["tflops"] for step in results["ladder_consumer_path"]["steps"]}
    h100, ada = CARDS[H100], CARDS[ADA]

    fig = Figure(figsize=(13, 6), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, card, name in zip(axes, (h100, ada), ("H100 SXM", "RTX 4070 Super")):
        ridge = card.tflops * 1000 / card.gb_per_s
        ax.plot([2, ridge, 4096], [roof(card, x) for x in (2, ridge, 4096)], color="black", lw=2)
        ax.annotate(f"{card.tflops:g} TFLOP/s, {card.gb_per_s:,} GB/s\nridge at {ridge:.0f} FLOP/byte",
                    (ridge, card.tflops), xytext=(0.55, 0.93), textcoords="axes fraction", fontsize=8,
                    arrowprops=dict(arrowstyle="-", color="grey"))
        ax.set(xscale="log", yscale="log", xlim=(4, 2048), ylim=(3, 2000), xlabel="FLOP per byte of HBM traffic "
               "(no L2 reuse)", title=f"{name}: roofline from CARDS")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel(f"TFLOP/s, forward, B={shape['B']} H={shape['H']} N={shape['N']:,} D={shape['D']} causal bf16")

    print(f"{'rung':<18} {'FLOP/B':>7} {'H100 roof':>10} {'H100':>7} {'consumer path':>14} {'4070S roof':>11}")
    lines, at = [], {}  # the kernels of no one tile size, as lines; the rungs by intensity
    for step in results["ladder"]["steps"]:
        if step["step"] in LINES:
            lines.append((step["tflops"], f"{LINES[step['step']]} {step['tflops']:.0f}"))
        elif step["tiles"] is not None:  # (sdpa's memory-efficient kernel is neither)
            x = intensity(shape, step["tiles"]["BLOCK_M"], step["tiles"]["BLOCK_N"])
            at.setdefault(round(x, 1), []).append(step)
    for tflops, text in sorted(lines):
        near = [t for t, _ in lines if t != tflops and abs(t / tflops - 1) < 0.02]
        if near and min(near) < tflops:  # drawn with its neighbour's label
            continue
        axes[0].axhline(tflops, color="grey", lw=0.8, linestyle="--")
        axes[0].text(2000, tflops, ", ".join(t for v, t in lines if abs(v / tflops - 1) < 0.02), ha="right",
                     va="bottom", fontsize=7, color="dimgrey")
    for x, steps in at.items():
        for i, step in enumerate(sorted(steps, key=lambda step: step["tflops"])):
            left = len(steps) > 2 and i % 2  # three close points: labels right, left, right
            label, first = SHORT[step["step"]], step["step"] == results["ladder"]["steps"][0]["step"]
            axes[0].plot(x, step["tflops"], "o", color="#4c72b0", label="H100, measured" if first else None)
            axes[0].annotate(label, (x, step["tflops"]), xytext=(-6 if left else 6, -3), textcoords="offset points",
                             fontsize=7, ha="right" if left else "left")
            if step["step"] in consumer:
                axes[0].plot(x, consumer[step["step"]], "o", mfc="none", color="#dd8452",
                             label="H100 on the consumer card's path (NANOFA2_ADA=1)" if first else None)
            print(f"{label:<18} {x:7.1f} {roof(h100, x):10.1f} {step['tflops']:7.1f} "
                  f"{consumer.get(step['step'], float('nan')):14.1f} {roof(ada, x):11.1f}")
        axes[1].plot(x, roof(ada, x), "s", mfc="none", color="#55a868",
                     label="the roof at these tiles' intensity, without the L2 (a model, no run)" if x < 20 else None)
        axes[1].annotate("\n".join(SHORT[step["step"]] for step in steps), (x, roof(ada, x)), xytext=(6, 0),
                         textcoords="offset points", fontsize=7, va="top")
    axes[0].text(5, 1000, "points above the slanted roof: the L2 serves the K and V tiles\nthat the query "
                          "tiles of one head share, so HBM moves less than counted", fontsize=7, va="top")
    for ax in axes:
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"The forward's ladder on the roofline ({results['run']['card']}, torch {results['run']['torch']}, "
                 f"Triton {results['run']['triton']}, commit {results['run']['commit']})", fontsize=10)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
