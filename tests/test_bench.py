"""bench.py on the CPU, its GPU work replaced by recorders: each rung of the ladder launches its
own tile config (a closure reading the loop variable late would time the last one at every
rung), every TFLOP/s figure is printed beside the fraction of the card's peak it reached, each
row of the host mode runs the backend it names, the host mode runs without a GPU, and the masks
grid runs each shape at the window and kv heads it names."""
import json
import re
import sys
from unittest import mock

import pytest
import torch

from attention import BACKENDS
from conftest import run_script


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


def test_grid_names_the_tuners_choice_beside_the_ratios(bench, monkeypatch, capsys):
    """After each shape, triton's ratios to FA2 and cuDNN (their time over triton's) and the
    configs the tuner chose, read off the kernels' best_config (the Gluon kernel where Hopper's
    serves the shape); the tables name the config of their kernel."""
    from attention.triton_backward import atomic
    from attention.triton_forward import tiles
    times = {"triton": 1.0, "sdpa_flash": 1.2, "sdpa_cudnn": 0.9}
    inputs = torch.empty(1)
    monkeypatch.setattr(bench, "this_card", lambda: None)
    monkeypatch.setattr(bench, "time_mode", lambda name, shape, mode: (times[name], (times[name], times[name]), times[name]))
    monkeypatch.setattr(bench, "make_inputs", lambda shape, requires_grad: (None, inputs, inputs, inputs))
    monkeypatch.setattr(bench.hopper_forward, "serves", lambda *args: False)
    monkeypatch.setattr(bench.hopper_backward, "serves", lambda *args: True)
    monkeypatch.setattr(bench._attn_fwd, "best_config", tiles(128, 64, warps=4, stages=3), raising=False)
    monkeypatch.setattr(bench._attn_bwd, "best_config", atomic(64, 128, warps=8, stages=2), raising=False)
    shape = dict(B=4, H=32, N=4096, D=64, causal=True, dtype="bfloat16")
    rows = bench.bench_grid("paper", [shape], list(times))
    summary = capsys.readouterr().out.splitlines()[-1]
    assert summary == ("  4x32x4096x64 causal: triton vs FA2 fwd 1.20 bwd 1.20 fwd+bwd 1.20 | vs cuDNN fwd 0.90 "
                       "bwd 0.90 fwd+bwd 0.90 | tuner: fwd 128x64 w4 s3, bwd Gluon (Hopper)")
    monkeypatch.setattr(bench.hopper_backward, "serves", lambda *args: False)
    assert bench.tuner_choice(shape) == dict(fwd="128x64 w4 s3", bwd="atomic 64x128 w8 s2")
    table = bench.grid_tables(rows, list(times))
    assert "| 1.20 | 0.90 | 128x64 w4 s3 |" in table and "| 1.20 | 0.90 | Gluon (Hopper) |" in table


def test_the_decode_table_gives_the_fraction_of_the_cards_bandwidth(bench, monkeypatch):
    monkeypatch.setattr(bench, "this_card", lambda: bench.CARDS["NVIDIA GeForce RTX 4070 SUPER"])
    rows = [dict(shape="8 x 16/4 x 4,096 x 64", bytes=33_554_432, splits=7,
                 steps={"triton": dict(us=133.2, gb_per_s=252.0), "sdpa": dict(us=266.3, gb_per_s=126.0)})]
    assert "| 8 x 16/4 x 4,096 x 64 | 34 MB | 7 | 133 | 50% | 266 | 25% |" in bench.decode_table(rows)
    monkeypatch.setattr(bench, "this_card", lambda: None)
    assert "| 133 | ? | 266 | ? |" in bench.decode_table(rows)


@pytest.mark.parametrize("args, message", [
    (["--compile_modes=none,fast"], "compile_modes='none,fast': unknown ['fast']; each is none or a torch.compile "
                                    "mode (default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs), +graph "
                                    "for the step's CUDA graph"),
    (["--compile_modes=reduce-overhead+graph"], "compile_modes='reduce-overhead+graph': reduce-overhead captures "
                                                "CUDA graphs of its own (+graph goes with none, default or "
                                                "max-autotune-no-cudagraphs)"),
    (["--max_memory_gb=-1"], "max_memory_gb=-1.0: expected a finite float >= 0 (0: no cap)"),
    (["--rep_ms=0"], "rep_ms=0: expected an int >= 1"),
    (["--out=FILE"], "out='FILE' is a file; expected a folder (made if missing)"),
], ids=["compile mode", "graph twice", "memory cap", "rep_ms", "out a file"])
def test_bench_refuses_a_bad_setting_before_torch_loads(args, message, tmp_path):
    # On a GPU each died with a traceback, after loading torch and building the first model.
    from test_config import exit_before_torch

    (tmp_path / "FILE").write_text("not a folder")
    args = [arg.replace("FILE", str(tmp_path / "FILE")) for arg in args]
    status, stderr, torch_loaded = exit_before_torch("bench.py", "--mode=step", *args)
    assert (status, torch_loaded) == (2, False)
    assert stderr == f"config error: {message.replace('FILE', str(tmp_path / 'FILE'))}\n"



class Spy(torch.autograd.Function):
    """The identity on q, recording which backend's forward and backward ran."""

    @staticmethod
    def forward(ctx, q, k, v, name, ran):
        ctx.name, ctx.ran = name, ran
        ran.append(("forward", name))
        return q.clone()

    @staticmethod
    def backward(ctx, do):
        ctx.ran.append(("backward", ctx.name))
        return do, torch.zeros_like(do), torch.zeros_like(do), None, None


def test_each_host_row_runs_the_backend_it_names(bench, monkeypatch):
    """Every backend's function, and torch's sdpa, replaced by a spy: each row of the host mode
    runs its own forward, and with fwd+bwd its own backward, and nothing else."""
    import attention
    ran = []
    for name, (_, decode) in attention._FUNCTIONS.items():
        monkeypatch.setitem(attention._FUNCTIONS, name,
                            (lambda q, k, v, is_causal, window, name=name: Spy.apply(q, k, v, name, ran), decode))
    monkeypatch.setattr(bench.F, "scaled_dot_product_attention",
                        lambda q, k, v, is_causal: Spy.apply(q, k, v, bench.TORCH_SDPA, ran))
    tiny = bench.HOST_TINY_SHAPE
    cases = bench.host_cases(tiny, tiny, "cpu", stand_in=True)
    assert sorted(cases) == sorted((name, mode) for name in (*bench.BACKENDS, bench.TORCH_SDPA)
                                   for mode in ("fwd", "fwd+bwd"))
    for (name, mode), (_, call) in cases.items():
        ran.clear()
        call()
        assert ran == [("forward", name)] + ([("backward", name)] if mode == "fwd+bwd" else []), (name, mode)


def test_without_a_gpu_only_the_triton_kernels_launches_run_at_the_models_shape(bench):
    """With the stand-in driver the Triton kernels cost nothing, torch's kernels their CPU math:
    those rows take tiny tensors (triton_fwd's backward is torch's)."""
    cases = bench.host_cases(bench.HOST_SHAPE, bench.HOST_TINY_SHAPE, "cpu", stand_in=True)
    at_the_models_shape = {key for key, (shape, _) in cases.items() if shape is bench.HOST_SHAPE}
    assert at_the_models_shape == {("triton", "fwd"), ("triton", "fwd+bwd"), ("triton_fwd", "fwd")}
    on_a_gpu = bench.host_cases(bench.HOST_SHAPE, bench.HOST_TINY_SHAPE, "cpu", stand_in=False)
    assert all(shape is bench.HOST_SHAPE for shape, _ in on_a_gpu.values())


def test_the_host_mode_runs_without_a_gpu(tmp_path):
    """bench.py --mode=host on the CPU: Triton's launch path with the stand-in driver
    (training/host_cost.py), every row timed and written."""
    result = run_script("bench.py", "--mode=host", "--host_rounds=1", f"--out={tmp_path}", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "host.json").read_text())["results"]["rows"]
    assert {(r["backend"], r["mode"]) for r in rows} == {
        (name, mode) for name in (*BACKENDS, "F.scaled_dot_product_attention") for mode in ("fwd", "fwd+bwd")}
    assert all(r["us"] > 0 for r in rows) and "stand-in CUDA driver" in (tmp_path / "host.md").read_text()


def test_the_step_summary_gives_each_mode_a_column_and_each_wall_time_as_a_multiple_of_sdpas(bench):
    """bench.py --mode=step's summary: the wall ms a step of each backend in each compile mode,
    beside its multiple of sdpa's in the same mode (what the step's targets are stated in)."""
    results = {f"{backend} {mode} T=512": dict(wall_ms=wall, gpu_ms=gpu, wall_ms_iqr=(wall, wall), peak_mb=1.0)
               for backend, walls, gpu in (("sdpa", (29.4, 19.6, 5.43), 5.0), ("triton", (32.0, 21.0, 4.96), 4.0))
               for mode, wall in zip(("none", "default", "default+graph"), walls)}
    results["eager none T=512"] = dict(status="out of memory")
    summary = bench.step_summary(results)
    assert "| backend | uncompiled | compiled (default) | compiled (default) + CUDA graph |" in summary
    assert ("| triton | 32.00 (1.09x sdpa), GPU 4.00 | 21.00 (1.07x sdpa), GPU 4.00 | 4.96 (0.91x sdpa), GPU 4.00 |"
            in summary)
    assert "| eager | out of memory | not run | not run |" in summary


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
    monkeypatch.setattr(bench, "run_provider", lambda name, q, k, v, causal, window: Recorded.calls.append(name)
                        or Recorded.apply(q, k, v))
    monkeypatch.setattr(bench.triton.testing, "do_bench", timer("wall", wall_ms, timed))
    graphed = timer("gpu", 0.2, timed)
    monkeypatch.setattr(bench, "replayed_ms", lambda fn, stream, rep_ms: (graphed(fn), (0.19, 0.21)))
    monkeypatch.setattr(bench.torch.cuda, "Stream", lambda: None)  # torch.cuda.stream(None) changes nothing
    monkeypatch.setattr(bench, "this_card", lambda: bench.CARDS["NVIDIA H100 80GB HBM3"])
    shape = dict(B=4, H=16, N=4096, D=64, causal=True, dtype="float32")
    row, = bench.bench_grid("paper", [shape], ["sdpa_cudnn"])
    ran = {"fwd": ("sdpa_cudnn", "forward"), "bwd": ("backward",), "fwd+bwd": ("sdpa_cudnn", "forward", "backward")}
    assert timed == [(kind, ran[mode]) for mode in bench.MODES for kind in ("wall", "gpu")]
    for mode in bench.MODES:
        assert row[mode] == dict(ms=0.2, spread_ms=(0.19, 0.21), tflops=bench.flops(shape, mode) / 0.2 / 1e9,
                                 wall_ms=wall_ms, host_bound=host_bound)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("N="))
    assert line.startswith("N=4096   D=64   causal sdpa_cudnn      fwd  687.2 ( 69% of peak)")  # 0.2 ms, not wall_ms
    assert line.count(f"[host-bound: wall {wall_ms:.3f} ms, GPU 0.200]") == (3 if host_bound else 0), line


@pytest.mark.parametrize("n, window", [(1, 0), (9, 0), (9, 3), (9, 8), (9, 40), (100, 31)])
def test_a_windows_flops_count_the_pairs_its_mask_leaves(bench, n, window):
    from attention.masks import visible_keys
    assert bench.visible_pairs(n, True, window) == visible_keys((n, n, window, 0)).sum().item()


def test_the_masks_grid_runs_each_provider_at_the_window_and_kv_heads_it_names(bench, monkeypatch):
    """Each masks-grid shape goes to attention() with its window and its kv heads (q, k, v on the
    CPU here, the call recorded, not run); sdpa's kernels refuse a window, which the grid reports
    as unsupported."""
    calls = []
    monkeypatch.setattr(bench, "attention", lambda q, k, v, is_causal, backend, window_size:
                        calls.append((backend, q.shape[1], k.shape[1], is_causal, window_size)))
    expected = []
    for shape in bench.masks_grid(quick=False):
        H, H_kv = shape["H"], shape.get("H_kv", shape["H"])
        q, k, v = torch.zeros(1, H, 4, 8), torch.zeros(1, H_kv, 4, 8), torch.zeros(1, H_kv, 4, 8)
        bench.run_provider("triton", q, k, v, shape["causal"], window=shape.get("window", -1))
        expected.append(("triton", H, H_kv, True, (shape.get("window", -1), 0)))
        if shape.get("window", -1) >= 0:
            with pytest.raises(RuntimeError, match="takes no sliding window"):
                bench.run_provider("sdpa_flash", q, k, v, True, window=shape["window"])
    assert calls == expected
    assert {(s["D"], s.get("window", -1)) for s in bench.masks_grid(False) if s["N"] == 16384} == \
        {(64, -1), (64, 1024), (128, -1), (128, 1024)}
    assert {s.get("H_kv") for s in bench.masks_grid(False) if s["N"] == 4096} == {16, 4}


def test_the_masks_table_gives_what_each_mask_saves(bench):
    def row(provider, fwd, both, **shape):
        return dict(shape, provider=provider, status="ok", causal=True,
                    **{m: dict(ms=ms, spread_ms=(ms, ms)) for m, ms in (("fwd", fwd), ("fwd+bwd", both))})
    rows = [row("triton", 4.0, 12.0, B=1, H=32, N=16384, D=64, window=-1),
            row("triton", 0.5, 2.0, B=1, H=32, N=16384, D=64, window=1024),
            row("triton", 0.3, 1.0, B=4, H=16, H_kv=16, N=4096, D=64),
            row("triton", 0.4, 1.0, B=4, H=16, H_kv=4, N=4096, D=64),
            dict(provider="sdpa_flash", status="unsupported: sdpa_flash takes no sliding window", B=1, H=32, N=16384,
                 D=64, causal=True, window=1024)]
    table = bench.masks_table(rows)
    assert "| 1x32x16384x64 causal window 1024 | triton | 0.500 (0.500-0.500) | 2.000 (2.000-2.000) |" in table
    assert "| 1x32x16384x64 causal window 1024 | sdpa_flash | unsupported: sdpa_flash takes no sliding window |" in table
    assert ("- triton fwd: window 1k at N 16k, D 64: 8.0x faster than causal; 16 over 4 kv heads: 0.75x the speed "
            "of 16 over 16") in table
    assert "- triton fwd+bwd: window 1k at N 16k, D 64: 6.0x faster than causal; 16 over 4 kv heads: 1.00x" in table
