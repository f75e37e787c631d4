"""Draw the tiles FlashAttention visits under a mask: docs/figures/causal_tiles.png.

    python docs/figures/causal_tiles.py [--out PATH]

An N_q x N_k score matrix in tile_m x tile_n tiles, causal (top) and with a sliding window of
WINDOW keys (bottom). Left, the forward and dQ: a program walks the key tiles along its query
tile's row; right, dK/dV: one walks the query tiles down its key tile's column. Each tile is
full, masked (it crosses the diagonal, the window's edge or the end) or skipped: a mask is a
bound on the loop. The kinds come from attention/masks.py, the bounds the kernels use;
each panel's count of full, masked and skipped tiles is printed too.
"""
import argparse
import sys
from collections import Counter
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `attention`
from attention.masks import UNBOUNDED, key_tile_bounds, query_tile_bounds  # noqa: E402

N_Q, N_K, TILE_M, TILE_N = 176, 176, 32, 16  # lengths that end mid-tile, tiles that are not square
WINDOW = 72
COLOURS = {"full": "#4c9f70", "masked": "#f0a340", "skipped": "#e6e6e6"}


def run(bounds, step):
    """{tile start: kind} for a run of tiles (start, full_start, full_end, end)."""
    start, full_start, full_end, end = bounds
    return {t: "full" if full_start <= t < full_end else "masked" for t in range(start, end, step)}


def draw(ax, kind_of, program, title):
    """kind_of(q_start, k_start) -> kind; program: (q_start, k_start, height, width) to outline.
    Prints how many tiles are of each kind."""
    kinds = Counter()
    for q_start in range(0, N_Q, TILE_M):
        for k_start in range(0, N_K, TILE_N):
            height, width = min(TILE_M, N_Q - q_start), min(TILE_N, N_K - k_start)
            kinds[kind_of(q_start, k_start)] += 1
            ax.add_patch(Rectangle((k_start, q_start), width, height, facecolor=COLOURS[kind_of(q_start, k_start)],
                                   edgecolor="white", linewidth=1))
    print(f"{title.splitlines()[0] + ':':<50}" + ", ".join(f"{kinds[kind]:3} {kind}" for kind in COLOURS))
    ax.add_patch(Rectangle(program[1::-1], program[3], program[2], fill=False, edgecolor="black", linewidth=2.5))
    ax.plot([0, min(N_Q, N_K)], [0, min(N_Q, N_K)], color="black", linewidth=1, linestyle="--")  # key j = query i
    ax.set(xlim=(0, N_K), ylim=(N_Q, 0), aspect="equal", title=title, xlabel="key j", ylabel="query i")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".png")))
    out = Path(parser.parse_args(argv).out)

    fig = Figure(figsize=(12, 12))
    q_program, k_program = 3 * TILE_M, 3 * TILE_N
    for (forward_ax, dkdv_ax), (left, mask) in zip(fig.subplots(2, 2), ((UNBOUNDED, "causal"),
                                                                       (WINDOW, f"window of {WINDOW} keys"))):
        draw(forward_ax, lambda q, k: run(key_tile_bounds(q, (N_Q, N_K, left, 0), TILE_M, TILE_N), TILE_N).get(k, "skipped"),
             (q_program, 0, TILE_M, N_K),
             f"{mask}; forward and dQ: a query tile\nwalks the key tiles (outlined: rows "
             f"{q_program}-{q_program + TILE_M - 1})")
        draw(dkdv_ax, lambda q, k: run(query_tile_bounds(k, (N_Q, N_K, left, 0), TILE_M, TILE_N), TILE_M).get(q, "skipped"),
             (0, k_program, N_Q, TILE_N),
             f"{mask}; dK/dV: a key tile\nwalks the query tiles (outlined: keys {k_program}-"
             f"{k_program + TILE_N - 1})")
    handles = [Rectangle((0, 0), 1, 1, facecolor=colour) for colour in COLOURS.values()]
    fig.legend(handles, list(COLOURS), loc="upper center", bbox_to_anchor=(0.5, 0.02), ncols=3,
               title=f"N_q = N_k = {N_Q}, tiles of tile_m = {TILE_M} queries x tile_n = {TILE_N} keys; "
                     "dashed: the diagonal j = i")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, bbox_inches="tight")  # takes in the titles and the legend below
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
