"""Every figure the docs show is drawn by a script in docs/figures/, each script runs on the CPU
and prints the numbers its figure shows, and every figure is shown in a doc."""
import importlib.util
import re

import pytest

from conftest import REPO

FIGURES = REPO / "docs" / "figures"
SCRIPTS = sorted(FIGURES.glob("*.py"))
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# What each script must print: the numbers its figure stands on.
PRINTS = {
    "online_softmax": [r"after the last tile ([+-][0-9.]+) \(off by 0\.0e\+00\); never rescaled (?!\1)"],
    "tiles_in_memory": [r"shared memory 40,960 bytes", r"64 key tiles; reads 1,056,768 bytes", r" 64 FLOP a byte"],
    "backward_jobs": [r"36 tile pairs seen; this backward 252 tile multiplies .* Algorithm 2 180",
                      r"dK/dV program: 5 full, 1 masked", r"dQ program: 5 full, 1 masked"],
    "roofline": [r"16x16 +15\.8 +52\.9 +38\.0 +38\.0 +8\.0", r"128x64 +116\.9 +391\.6 +286\.8 +211\.9 +58\.9"],
    "loss_curves": [r"triton: best val loss 4\.6259 at iteration 1600", r"sdpa: best val loss 4\.6255 at iteration 1600"],
    "paper_grid": [r"forward over cuDNN: 0\.49 \(D, causal, N = \(128, True, 1024\)\) to 1\.11; next lowest 0\.92"],
    "sweep": [r"peak GPU memory \(MB\), eager: 256: 6441\.0, .* 4096: OOM"],
    "causal_tiles": [r"causal; forward and dQ: .* 25 skipped", r"window of 72 keys; forward and dQ: .* 34 skipped"],
}


def test_every_figure_has_its_script_and_its_checks():
    assert {p.stem for p in SCRIPTS} == {p.stem for p in FIGURES.glob("*.png")} == set(PRINTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_the_figure_script_draws_and_prints_its_numbers(script, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(f"figure_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--out", str(tmp_path / "figure.png")])
    printed = capsys.readouterr().out
    assert (tmp_path / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = [pattern for pattern in PRINTS[script.stem] if not re.search(pattern, printed)]
    assert not missing, f"{script.name} printed no line matching {missing}:\n{printed}"


@pytest.mark.parametrize("figure", sorted(FIGURES.glob("*.png")), ids=lambda p: p.stem)
def test_every_figure_is_shown_in_a_doc(figure):
    shown = [doc.name for doc in DOCS if re.search(rf"!\[[^\]]*\]\((docs/)?figures/{figure.name}\)", doc.read_text())]
    assert shown, f"no doc shows {figure.relative_to(REPO)}"
