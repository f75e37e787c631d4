"""Draw the backward's two jobs: docs/figures/backward_jobs.png.

    python docs/figures/backward_jobs.py [--out PATH]

The causal score matrix in tiles, and one program of each job of _attn_bwd (triton_backward.py):
left, a dK/dV program holds a key tile and walks down the query tiles that see it; right, a dQ
program holds a query tile and walks along the key tiles it sees, as the forward does. The tile
kinds come from attention/masks.py, the bounds the kernels use. Beside each, what one tile pair
costs it. Prints the matrix multiplies of both jobs against FlashAttention-2's Algorithm 2.
"""
import argparse
import sys
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `attention`
from attention.masks import UNBOUNDED, key_tile_bounds, query_tile_bounds  # noqa: E402

N, TILE = 512, 64  # 8 x 8 tiles
MASK = (N, N, UNBOUNDED, 0)  # causal
KEY_TILE, QUERY_TILE = 2, 5  # the two programs drawn
COLOURS = {"full": "#4c9f70", "masked": "#f0a340", "skipped": "#e6e6e6"}
JOBS = {
    "dK/dV": ("holds K_j, V_j; accumulates dK_j, dV_j\n"
              "per query tile i: loads Q_i, dO_i, lse_i, delta_i\n"
              "  S^T = K_j Q_i^T         P^T = exp2(S^T - lse_i)\n"
              "  dV_j += P^T dO_i\n"
              "  dP^T = V_j dO_i^T       dS^T = P^T (dP^T - delta_i)\n"
              "  dK_j += dS^T Q_i\n"
              "4 multiplies a tile pair; writes dK_j, dV_j once"),
    "dQ": ("holds Q_i, dO_i, lse_i, delta_i; accumulates dQ_i\n"
           "per key tile j: loads K_j, V_j\n"
           "  S = Q_i K_j^T            P = exp2(S - lse_i)\n"
           "  dP = dO_i V_j^T          dS = P (dP - delta_i)\n"
           "  dQ_i += dS K_j\n"
           "3 multiplies a tile pair (S and dP again); writes dQ_i once"),
}


def kind(q_start, k_start, bounds, start):
    first, full_start, full_end, end = bounds
    if not first <= start < end:
        return "skipped"
    return "full" if full_start <= start < full_end else "masked"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".png")))
    out = Path(parser.parse_args(argv).out)

    pairs = sum(kind(q, 0, key_tile_bounds(q, MASK, TILE, TILE), k) != "skipped"
                for q in range(0, N, TILE) for k in range(0, N, TILE))
    print(f"causal, {N // TILE} x {N // TILE} tiles: {pairs} tile pairs seen; this backward {7 * pairs} tile "
          f"multiplies (4 dK/dV + 3 dQ a pair), FlashAttention-2's Algorithm 2 {5 * pairs} (dQ added by atomics)")

    fig = Figure(figsize=(13, 8), layout="constrained")
    axes = fig.subplots(2, 2, height_ratios=[3, 1])
    for ax, text_ax, job in zip(axes[0], axes[1], JOBS):
        counts = {name: 0 for name in COLOURS}
        for q in range(0, N, TILE):
            for k in range(0, N, TILE):
                if job == "dK/dV":
                    tile_kind = kind(q, k, query_tile_bounds(k, MASK, TILE, TILE), q)
                    mine = k == KEY_TILE * TILE and tile_kind != "skipped"
                else:
                    tile_kind = kind(q, k, key_tile_bounds(q, MASK, TILE, TILE), k)
                    mine = q == QUERY_TILE * TILE and tile_kind != "skipped"
                counts[tile_kind] += mine
                ax.add_patch(Rectangle((k, q), TILE, TILE, facecolor=COLOURS[tile_kind], edgecolor="white",
                                       alpha=1.0 if mine else 0.3, lw=1))
        where = (KEY_TILE * TILE, 0, TILE, N) if job == "dK/dV" else (0, QUERY_TILE * TILE, N, TILE)
        ax.add_patch(Rectangle(where[:2], where[2], where[3], fill=False, edgecolor="black", lw=2.5))
        walk = "down the query tiles" if job == "dK/dV" else "along the key tiles, as the forward does"
        ax.set(xlim=(0, N), ylim=(N, 0), aspect="equal", xlabel="key j", ylabel="query i",
               title=f"{job} job: one program walks {walk}\n({counts['full']} full and {counts['masked']} masked "
                     f"tiles for this one)")
        text_ax.axis("off")
        text_ax.text(0.05, 1, JOBS[job], va="top", fontsize=9, family="monospace")
        print(f"{job} program: {counts['full']} full, {counts['masked']} masked tiles")
    handles = [Rectangle((0, 0), 1, 1, facecolor=colour) for colour in COLOURS.values()]
    fig.legend(handles, list(COLOURS), loc="outside lower center", ncols=3,
               title="Given delta = rowsum(dO O), the two jobs are independent: one launch runs both, and each "
                     "program owns what it writes (no atomics)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
