"""Draw where one forward program's tiles live: docs/figures/tiles_in_memory.png.

    python docs/figures/tiles_in_memory.py [--out PATH]

Top: one program of _attn_fwd (a query tile of one head, causal) and the memories its tiles
move between. Its Q tile is read from HBM once and stays in shared memory; the K and V tiles it
sees stream through a ring of pipeline stages, each read once; the scores, the running max and
sum and the output live in registers, and O and lse are written once. The N x N scores never
reach HBM. Bottom: the pipeline with num_stages = 3, cp.async keeping the next two tiles' loads
in flight while the tensor cores work on this one. Prints the bytes and FLOPs of the program
that sees the most keys, at the ladder's shape, and the shared memory its config takes.
"""
import argparse
import sys
from pathlib import Path

import triton
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `attention`
from attention.launch import SHARED_MEMORY_SLACK_BYTES, shared_memory_bytes  # noqa: E402
from attention.masks import UNBOUNDED, key_tile_bounds  # noqa: E402
from attention.triton_forward import forward_smem_rows  # noqa: E402

N, D, BYTES = 4096, 64, 2  # the ladder's sequence and head dim, bf16
CONFIG = triton.Config(dict(BLOCK_M=64, BLOCK_N=64, USE_TMA=False), num_warps=4, num_stages=3)
HBM, SMEM, REGS, DOT = "#d9e4f1", "#f6dcc0", "#d8ecd4", "#f0a340"
DRAWN = 8  # tiles drawn along each matrix; the program's query tile is the 6th


def box(ax, x, y, w, h, text, colour, size=9, **kwargs):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=colour, edgecolor="black", lw=1, **kwargs))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)


def arrow(ax, start, end, text, at):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, lw=1.3, color="#333333"))
    ax.text(*at, text, ha="center", fontsize=8, bbox=dict(facecolor="white", edgecolor="none", pad=1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".png")))
    out = Path(parser.parse_args(argv).out)
    bm, bn, stages = CONFIG.kwargs["BLOCK_M"], CONFIG.kwargs["BLOCK_N"], CONFIG.num_stages

    # The last query tile sees every key: the most traffic of any program.
    start, _, _, end = key_tile_bounds(N - bm, (N, N, UNBOUNDED, 0), bm, bn)
    key_tiles = -(-(end - start) // bn)
    read = (bm + 2 * key_tiles * bn) * D * BYTES
    written = bm * D * BYTES + bm * 4
    tile_flop = 4 * bm * bn * D  # S = Q K^T and P V
    smem = shared_memory_bytes(CONFIG, forward_smem_rows, D, BYTES, wgmma=False) - SHARED_MEMORY_SLACK_BYTES
    print(f"{bm} x {bn} tiles, D = {D}, bf16, {stages} stages: shared memory {smem:,} bytes (Q tile "
          f"{bm * D * BYTES:,} + {stages - 1} stages of K and V {2 * bn * D * BYTES:,} each)")
    print(f"the last query tile of N = {N:,}, causal: {key_tiles} key tiles; reads {read:,} bytes from HBM, "
          f"writes {written:,}; {key_tiles * tile_flop / 1e6:.0f} MFLOP, {key_tiles * tile_flop / read:.0f} FLOP a byte "
          f"(BLOCK_M = {bm}: each K and V element read serves {bm} query rows)")

    fig = Figure(figsize=(12, 8.5), layout="constrained")
    ax, timeline = fig.subplots(2, 1, height_ratios=[3, 1])
    ax.set(xlim=(0, 12), ylim=(0, 8.4), title=f"one program of the forward kernel: query tile 5 of one head, causal "
                                               f"({bm} x {bn} tiles, D = {D})")
    ax.axis("off")
    for x, w, name, colour, note in ((0, 4.6, "HBM (global memory, GBs)", HBM, "3.35 TB/s on an H100, 504 GB/s on "
                                      "an RTX 4070 Super"),
                                     (5.2, 3.0, "shared memory (one SM)", SMEM, f"{smem // 1024} KB of 99-227 KB"),
                                     (8.8, 3.1, "registers (one program)", REGS, "float32")):
        ax.add_patch(Rectangle((x, 0.1), w, 7.6, facecolor=colour, alpha=0.35, edgecolor="none"))
        ax.text(x + w / 2, 8.0, name, ha="center", fontsize=11, weight="bold")
        ax.text(x + w / 2, 7.75, note, ha="center", fontsize=8)
    h = 6.8 / DRAWN
    for col, name in enumerate(("Q", "K", "V", "O")):
        x = 0.25 + 1.1 * col
        for t in range(DRAWN):
            y = 7.2 - (t + 1) * h
            seen = name in ("Q", "O") and t == 5 or name in ("K", "V") and t <= 5
            ax.add_patch(Rectangle((x, y), 0.8, h, facecolor="white" if not seen else HBM if name in "KV" else DOT,
                                   edgecolor="black", lw=0.8, hatch="" if seen or name in "QO" else "//"))
        ax.text(x + 0.4, 7.3, name, ha="center", fontsize=10, weight="bold")
    ax.text(2.35, 0.25, "K and V tiles past the diagonal (hatched) are never read", ha="center", fontsize=8)
    box(ax, 5.5, 5.7, 2.4, 0.8, f"q_tile ({bm} x {D})\nloaded once", SMEM)
    for i in range(stages - 1):
        box(ax, 5.5, 4.2 - 1.1 * i, 2.4, 0.9, f"stage {i}: k_tile, v_tile\n({bn} x {D} each)", SMEM)
    ax.text(6.7, 0.6, f"num_stages = {stages}: {stages - 1} stages here; with mma.sync\n"
                      "the tile being multiplied sits in registers", ha="center", fontsize=8)
    box(ax, 9.1, 5.7, 2.5, 0.8, f"s, p = exp2(s - m)\n({bm} x {bn})", REGS)
    box(ax, 9.1, 4.2, 2.5, 0.9, f"acc ({bm} x {D})\n+= p @ v_tile", REGS)
    box(ax, 9.1, 2.9, 2.5, 0.8, "m_i, l_i (one per row)", REGS)
    q_y = 7.2 - 5.5 * h
    arrow(ax, (1.05, q_y), (5.5, 6.1), "Q tile: read once", at=(4.6, 5.85))
    arrow(ax, (3.55, 4.6), (5.5, 4.6), "each K, V tile it sees:\nread once, in turn", at=(4.55, 4.85))
    arrow(ax, (7.9, 6.1), (9.1, 6.1), "tl.dot", at=(8.5, 6.25))
    arrow(ax, (7.9, 4.6), (9.1, 4.6), "tl.dot", at=(8.5, 4.75))
    arrow(ax, (9.1, 3.1), (4.05, q_y), "O = acc / l_i and lse: written once", at=(6.7, 2.45))

    # The pipeline: with num_stages = 3, loads run two tiles ahead of the tile being computed.
    tiles = 6
    for j in range(tiles):
        timeline.barh(1, 0.9, left=j * 0.95, color=HBM, edgecolor="black")
        timeline.text(j * 0.95 + 0.45, 1, f"load K{j} V{j}", ha="center", va="center", fontsize=8)
        compute = (j + stages - 1) * 0.95 + 0.1
        timeline.barh(0, 0.85, left=compute, color=DOT, edgecolor="black")
        timeline.text(compute + 0.42, 0, f"tile {j}", ha="center", va="center", fontsize=8)
    timeline.set(yticks=[0, 1], yticklabels=["tensor cores\n+ softmax", "cp.async loads"], xticks=[],
                 xlim=(-0.1, (tiles + stages) * 0.95),
                 title=f"num_stages = {stages}: the loads run {stages - 1} tiles ahead of the tile being computed;\n"
                       "with one stage (the article's kernel) each tile waits for its own load")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
