"""Redraw step time and memory against context length: docs/figures/sweep.png.

    python docs/figures/sweep.py [--out PATH]

From the tables of docs/results/sweep.md (compare.py's sweep on an H200 at 6b4bd23, an older
default model: 6 layers, 6 heads of 64, 8,192 tokens a micro-batch): the median step time and
the peak GPU memory of each backend at 256 to 4,096 tokens of context. Eager's memory grows
with the context until it runs out of the 12 GB cap; FlashAttention's stays flat. Prints the
numbers it read.
"""
import argparse
import re
import textwrap
from pathlib import Path

from matplotlib.figure import Figure

RESULTS = Path(__file__).resolve().parents[1] / "results" / "sweep.md"


def table(text, heading):
    """{backend: {context: value or None (out of memory)}} from the markdown table under heading."""
    rows = re.search(rf"## {re.escape(heading)}\n\n(.*?)(?:\n\n|\Z)", text, re.S)[1].splitlines()
    contexts = [int(c) for c in re.findall(r"T=(\d+)", rows[0])]
    values = {}
    for row in rows[2:]:
        backend, *cells = [c.strip() for c in row.strip("|").split("|")]
        values[backend] = {t: None if "OOM" in c else float(c.replace(",", "")) for t, c in zip(contexts, cells)}
    return values


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".png")))
    out = Path(parser.parse_args(argv).out)
    text = RESULTS.read_text()
    setup = re.search(r"^\d+ layers.*$", text, re.M)[0]

    fig = Figure(figsize=(12, 5.5), layout="constrained")
    fig.suptitle("\n".join(textwrap.wrap(f"Step time and memory against context length: {setup}", 120)), fontsize=10)
    for ax, heading, unit in zip(fig.subplots(1, 2), ("median step time (ms), steady state", "peak GPU memory (MB)"),
                                 ("ms", "MB")):
        for backend, by_context in table(text, heading).items():
            ran = {t: v for t, v in by_context.items() if v is not None}
            ax.plot(list(ran), list(ran.values()), "o-", label=backend + (" (out of memory beyond)" if len(ran) <
                                                                          len(by_context) else ""))
            print(f"{heading}, {backend}: " + ", ".join(f"{t}: {v if v is not None else 'OOM'}"
                                                        for t, v in by_context.items()))
        ax.set(xscale="log", xlabel="context length (block_size)", ylabel=unit, title=heading)
        ax.minorticks_off()
        ax.set_xticks(list(by_context), [str(t) for t in by_context])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
