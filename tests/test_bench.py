"""bench.py on the CPU, its GPU work replaced by recorders: each rung of the ladder launches its
own tile config (a closure reading the loop variable late would time the last one at every
rung), and every TFLOP/s figure is printed beside the fraction of the card's peak it reached."""
import re
import sys
from unittest import mock

import pytest
import torch


@pytest.fixture(scope="module")
def bench():
    with mock.patch.object(sys, "argv", ["bench.py"]):  # bench.py reads its settings as it loads
        import bench
    return bench


# The ladder's shape, B=4, H=16, N=4,096, D=64, causal: 4 * B * H * N^2 * D / 2 FLOP a forward;
# in 0.25 ms that is 549.8 TFLOP/s, 56% of an H100's 989.4 and 774% of an RTX 4070 Super's 71.
LADDER_FLOP = 4 * 4 * 16 * 4096 ** 2 * 64 / 2


@pytest.fixture
def recorded_ladder(bench, monkeypatch, capsys):
    """bench.ladder()'s result, the kernel calls it made (each timed at 0.25 ms) and its printed
    lines, on a pretend H100."""
    launched = []
    inputs = torch.empty(1)
    monkeypatch.setattr(bench, "make_inputs", lambda shape, requires_grad: (None, inputs, inputs, inputs))
    monkeypatch.setattr(bench.launch, "has_tma", lambda device: True)
    monkeypatch.setattr(bench.hopper_forward, "serves", lambda *args: False)
    monkeypatch.setattr(bench, "flash_forward", lambda q, k, v, causal, config=None: launched.append(config))
    monkeypatch.setattr(bench, "run_provider", lambda name, q, k, v, causal: launched.append(name))
    monkeypatch.setattr(bench.triton.testing, "do_bench", lambda fn, **kwargs: fn() or 0.25)
    monkeypatch.setattr(bench, "this_card", lambda: bench.CARDS["NVIDIA H100 80GB HBM3"])
    return bench.ladder(), launched, capsys.readouterr().out.splitlines()


def test_each_ladder_rung_launches_its_own_config(bench, recorded_ladder):
    result, launched, _ = recorded_ladder
    rungs = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, c.kwargs["USE_TMA"])
             for c in launched[:len(bench.LADDER)]]
    assert rungs == [tiles for _, tiles in bench.LADDER]
    assert launched[len(bench.LADDER):] == [None, *bench.SDPA_BACKENDS]  # the tuner's pick, then sdpa's
    assert [row["config"] for row in result["steps"][:len(bench.LADDER)]] == list(map(str, launched[:len(bench.LADDER)]))


def test_ladder_prints_the_fraction_of_the_cards_peak(recorded_ladder):
    result, _, lines = recorded_ladder
    assert len(lines) == len(result["steps"]) and LADDER_FLOP / 0.25e-3 / 1e12 == pytest.approx(549.8, 1e-4)
    assert all(re.search(r" 0\.250 ms +549\.8 TFLOP/s +56% of peak$", line) for line in lines), lines


def test_grid_tables_and_lines_give_the_fraction_of_the_cards_peak(bench, monkeypatch):
    monkeypatch.setattr(bench, "this_card", lambda: bench.CARDS["NVIDIA GeForce RTX 4070 SUPER"])
    assert bench.tflops_of_peak(35.5) == "50%" and bench.bandwidth_of_peak(252) == "50%"
    rows = [dict(grid="paper", provider=p, N=4096, D=64, causal=True, status="ok",
                 **{m: dict(tflops=tf) for m in bench.MODES}) for p, tf in (("triton", 56.8), ("sdpa_flash", 35.5))]
    table = bench.grid_tables(rows, ["triton", "sdpa_flash"])
    assert "| 4096 | 57 (80%) | 36 (50%) | 1.60 | – |" in table and "% of the card's dense 16-bit peak" in table
    monkeypatch.setattr(bench, "this_card", lambda: None)  # a card not in CARDS: no fraction, never a wrong one
    assert bench.tflops_of_peak(35.5) == "?"


def test_the_decode_table_gives_the_fraction_of_the_cards_bandwidth(bench, monkeypatch):
    monkeypatch.setattr(bench, "this_card", lambda: bench.CARDS["NVIDIA GeForce RTX 4070 SUPER"])
    rows = [dict(shape="8 x 16/4 x 4,096 x 64", bytes=33_554_432, splits=7,
                 steps={"triton": dict(us=133.2, gb_per_s=252.0), "sdpa": dict(us=266.3, gb_per_s=126.0)})]
    assert "| 8 x 16/4 x 4,096 x 64 | 34 MB | 7 | 133 | 50% | 266 | 25% |" in bench.decode_table(rows)
    monkeypatch.setattr(bench, "this_card", lambda: None)
    assert "| 133 | ? | 266 | ? |" in bench.decode_table(rows)


class Recorded(torch.autograd.Function):
    """A provider's attention on the CPU that says when its forward and its backward run."""
    calls = []

    @staticmethod
    def forward(ctx, q, k, v):
        Recorded.calls.append("forward")
        return q * k + v

    @staticmethod
    def backward(ctx, do):
        Recorded.calls.append("backward")
        return do, do, do


def timer(kind, ms, timed):
    """Stands in for one of do_bench (kind "wall") and replayed_ms ("gpu"): runs the call once,
    records what it ran, and reports ms."""
    def time(fn, **kwargs):
        Recorded.calls.clear()
        fn()
        timed.append((kind, tuple(Recorded.calls)))
        return ms
    return time


@pytest.mark.parametrize("wall_ms, host_bound", [(0.5, True), (0.21, False)])
def test_the_grid_reports_gpu_time_and_flags_a_host_bound_row(bench, monkeypatch, capsys, wall_ms, host_bound):
    """Every grid TFLOP/s is of the GPU time (replayed from a CUDA graph), never of the wall time;
    a cell whose wall time is HOST_BOUND times its GPU time or more is flagged host-bound, in its
    row and its printed line; and each timer times the mode its label says: the forward alone,
    the backward alone (on a kept graph), or both, of the provider named."""
    def inputs(shape, requires_grad):
        qkv = torch.randn(1, 8, 3, 4, requires_grad=requires_grad)
        return qkv, *qkv.transpose(1, 2).split([1, 1, 1], dim=1)
    timed = []
    monkeypatch.setattr(bench, "make_inputs", inputs)
    monkeypatch.setattr(bench, "run_provider", lambda name, q, k, v, causal: Recorded.calls.append(name)
                        or Recorded.apply(q, k, v))
    monkeypatch.setattr(bench.triton.testing, "do_bench", timer("wall", wall_ms, timed))
    graphed = timer("gpu", 0.2, timed)
    monkeypatch.setattr(bench, "replayed_ms", lambda fn, stream, rep_ms: graphed(fn))
    monkeypatch.setattr(bench.torch.cuda, "Stream", lambda: None)  # torch.cuda.stream(None) changes nothing
    monkeypatch.setattr(bench, "this_card", lambda: bench.CARDS["NVIDIA H100 80GB HBM3"])
    shape = dict(B=4, H=16, N=4096, D=64, causal=True, dtype="float32")
    row, = bench.bench_grid("paper", [shape], ["sdpa_cudnn"])
    ran = {"fwd": ("sdpa_cudnn", "forward"), "bwd": ("backward",), "fwd+bwd": ("sdpa_cudnn", "forward", "backward")}
    assert timed == [(kind, ran[mode]) for mode in bench.MODES for kind in ("wall", "gpu")]
    for mode in bench.MODES:
        assert row[mode] == dict(ms=0.2, tflops=bench.flops(shape, mode) / 0.2 / 1e9, wall_ms=wall_ms,
                                 host_bound=host_bound)
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("N=4096   D=64   causal sdpa_cudnn      fwd  687.2 ( 69% of peak)")  # 0.2 ms, not wall_ms
    assert line.count(f"[host-bound: wall {wall_ms:.3f} ms, GPU 0.200]") == (3 if host_bound else 0), line
