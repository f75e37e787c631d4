"""Draw the online softmax, tile by tile: docs/figures/online_softmax.png.

    python docs/figures/online_softmax.py [--out PATH]

One query row's scores against 32 keys in four tiles of 8, folded one tile at a time by the
repo's own update (attention.tiled.online_softmax_update), with a scalar value per key. Top: the
scores and the running max m_i. Middle: the running sum l_i, each tile's old sum rescaled by
alpha = exp(m_old - m_new) before the tile's own part is added. Bottom: the output estimate
acc / l_i after each tile, which reaches the exact softmax-weighted value at the last tile,
and what it would be without the rescale. Prints each tile's numbers.
"""
import argparse
import sys
from pathlib import Path

import torch
from matplotlib.figure import Figure

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `attention`
from attention.tiled import online_softmax_update  # noqa: E402

TILE, TILES = 8, 4
COLOURS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".png")))
    out = Path(parser.parse_args(argv).out)

    g = torch.Generator().manual_seed(3)
    s = torch.randn(TILES * TILE, generator=g, dtype=torch.float64)
    s[TILE + 2] = 2.5  # the max grows in tile 1 ...
    s[3 * TILE + 5] = 3.5  # ... and again in tile 3
    v = torch.randn(TILES * TILE, 1, generator=g, dtype=torch.float64)
    exact = (s.softmax(0) @ v).item()

    m_i, l_i, acc = torch.tensor([float("-inf")], dtype=torch.float64), torch.zeros(1, dtype=torch.float64), \
        torch.zeros(1, 1, dtype=torch.float64)
    naive_l, naive_acc = 0.0, 0.0  # the same sums, never rescaled: each tile against its own max
    steps = []
    for t in range(TILES):
        keys = slice(t * TILE, (t + 1) * TILE)
        m_old, l_old = m_i.item(), l_i.item()
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, s[None, keys], v[keys])
        alpha = torch.exp(torch.tensor(m_old) - m_i).item()
        p = (s[keys] - s[keys].max()).exp()
        naive_l, naive_acc = naive_l + p.sum().item(), naive_acc + (p @ v[keys]).item()
        steps.append(dict(m_old=m_old, m_new=m_i.item(), alpha=alpha, carried=alpha * l_old,
                          own=l_i.item() - alpha * l_old, o=(acc / l_i).item(), naive=naive_acc / naive_l))
        print(f"tile {t}: m {m_old:6.3f} -> {m_i.item():6.3f}, alpha {alpha:.3f}, l_i {alpha * l_old:.3f} "
              f"+ {l_i.item() - alpha * l_old:.3f} = {l_i.item():.3f}, O {steps[-1]['o']:+.4f}")
    print(f"exact softmax-weighted value {exact:+.4f}; after the last tile {steps[-1]['o']:+.4f} "
          f"(off by {abs(steps[-1]['o'] - exact):.1e}); never rescaled {steps[-1]['naive']:+.4f}")

    fig = Figure(figsize=(10, 9), layout="constrained")
    top, middle, bottom = fig.subplots(3, 1)
    for t in range(TILES):
        keys = range(t * TILE, (t + 1) * TILE)
        top.bar(keys, s[t * TILE:(t + 1) * TILE].tolist(), color=COLOURS[t], label=f"tile {t}")
        top.hlines(steps[t]["m_new"], t * TILE - 0.5, TILES * TILE - 0.5, color=COLOURS[t], linestyle="--", lw=1)
    top.set(title="scores of one query row, four key tiles; dashed: the running max m_i after each tile",
            xlabel="key j", ylabel="score")
    top.legend(ncols=4, fontsize=8)

    x = range(TILES)
    middle.bar(x, [st["carried"] for st in steps], color="#bbbbbb", label="alpha x l_i so far (rescaled)")
    middle.bar(x, [st["own"] for st in steps], bottom=[st["carried"] for st in steps], color=COLOURS,
               label="this tile: sum of exp(s - m_new)")
    for t, st in enumerate(steps):
        middle.annotate(f"alpha = {st['alpha']:.2f}" if t else "first tile", (t, st["carried"] + st["own"]),
                        ha="center", va="bottom", fontsize=8)
    middle.set(title="the running sum l_i: rescaled when the max grows, then this tile added",
               xticks=list(x), xticklabels=[f"after tile {t}" for t in x], ylabel="l_i",
               ylim=(0, 1.35 * max(st["carried"] + st["own"] for st in steps)))
    middle.legend(fontsize=8, loc="upper right", ncols=2)

    bottom.plot(x, [st["o"] for st in steps], marker="o", label="acc / l_i (online softmax)")
    bottom.plot(x, [st["naive"] for st in steps], marker="x", color="#c44e52", label="never rescaled: wrong")
    bottom.axhline(exact, color="black", linestyle=":", label="softmax(s) . v, all keys at once")
    bottom.set(title="the output: exact once every tile is in", xticks=list(x),
               xticklabels=[f"after tile {t}" for t in x], ylabel="O")
    bottom.legend(fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
