"""training/profiling.py: where a step's time goes, sorted into categories; train.py --profile=True
and compare.py --profile=True on the CPU (CPU op time stands in for GPU kernel time)."""
import contextlib
import json
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import Interval, Kernel

from conftest import run_script
from model import ATTENTION_RANGE, GPT, GPTConfig, labelled
from training.profiling import CATEGORIES, attribute, union_us
from test_compare import table_rows


def test_union_counts_overlaps_once_and_only_inside_the_steps():
    intervals = [(0, 10), (5, 15), (20, 30), (40, 50)]
    assert union_us(intervals, [(0, 100)]) == 35
    assert union_us(intervals, [(8, 25), (45, 46)]) == 7 + 5 + 1


def test_ranges_exist_only_while_a_profiler_records():
    assert isinstance(labelled(ATTENTION_RANGE), contextlib.nullcontext)
    with torch.profiler.profile():
        assert isinstance(labelled(ATTENTION_RANGE), torch.profiler.record_function)


def test_ranges_do_not_break_a_compiled_graph():
    import torch._dynamo

    gpt = GPT(GPTConfig(block_size=16, vocab_size=100, n_layer=1, n_head=2, n_embd=32, attn="sdpa"))
    idx = torch.randint(0, 100, (2, 16))
    explanation = torch._dynamo.explain(gpt)(idx, idx)
    assert explanation.graph_break_count == 0


def test_attention_backward_is_found_through_autograd_sequence_numbers():
    # eager's attention is plain matmuls and a softmax: only the ranges and autograd's
    # sequence numbers tell its backward from the MLP's.
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=32, attn="eager"))
    idx = torch.randint(0, 64, (4, 32))
    results = []
    with torch.profiler.profile(schedule=torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1),
                                on_trace_ready=lambda prof: results.append(attribute(prof.events()))) as prof:
        for _ in range(3):
            _, loss = gpt(idx, idx)
            loss.backward()
            prof.step()
    result, = results
    assert result["device"] == "cpu" and result["steps"] == 2
    assert set(result["ms"]) == set(CATEGORIES)
    for category in ("attention forward", "attention backward", "matmuls", "output layer + loss", "everything else"):
        assert result["ms"][category] > 0, category
    assert result["ms"]["optimizer"] == 0  # no optimizer in this loop
    assert sum(result["ms"].values()) == pytest.approx(result["step_ms"], rel=1e-6)


def gpu_profile_events():
    """What torch.profiler's events look like on a GPU, for one 1000 us step: ops on the CPU
    with the kernels they launched in .kernels, the kernels again as CUDA events, and the
    step's range copied to the GPU as an annotation spanning the whole step."""
    def event(name, device, start, end, parent=None, kernels=()):
        return SimpleNamespace(name=name, device_type=device, time_range=Interval(start, end), cpu_parent=parent,
                               sequence_nr=-1, kernels=list(kernels))
    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    step = event("ProfilerStep#1", cpu, 0, 1000)
    attention_range = event(ATTENTION_RANGE, cpu, 10, 40, parent=step)
    ops = [event("aten::mm", cpu, 0, 10, parent=step, kernels=[Kernel("sm90_xmma_gemm", 0, 100)]),
           event("nanofa2::triton_attention", cpu, 10, 40, parent=attention_range, kernels=[Kernel("_attn_fwd", 0, 50)])]
    device = [event("sm90_xmma_gemm", cuda, 100, 200), event("_attn_fwd", cuda, 300, 350),
              event("ProfilerStep#1", cuda, 0, 1000)]
    return [step, attention_range, *ops, *device]


def test_gpu_kernels_are_sorted_by_the_op_that_launched_them_and_annotations_are_not_busy():
    result = attribute(gpu_profile_events())
    assert result["device"] == "cuda" and result["steps"] == 1 and result["step_ms"] == pytest.approx(1.0)
    ms = result["ms"]
    assert ms["matmuls"] == pytest.approx(0.1) and ms["attention forward"] == pytest.approx(0.05)
    # Busy is the two kernels' 150 us; the step's GPU-side annotation is no kernel.
    assert ms["idle"] == pytest.approx(0.85)


def test_compare_profiles_every_backend(data_dir, tmp_path):
    result = run_script("compare.py", "configs/tiny.py", f"--data_dir={data_dir}", "--backends=eager,sdpa",
                        "--block_size=32", "--batch_size=4", "--max_iters=8", "--eval_interval=8", "--eval_iters=1",
                        "--profile=True", f"--out={tmp_path}", timeout=900)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "profile.png").read_bytes().startswith(b"\x89PNG")
    profiles = {b: json.loads((tmp_path / "runs" / b / "profile.json").read_text()) for b in ("eager", "sdpa")}
    for backend, profile in profiles.items():
        assert profile["attn"] == backend and profile["steps"] == 3 and profile["peak_mem_mb"] is None
        assert profile["ms"]["attention forward"] > 0 and profile["ms"]["optimizer"] > 0
        assert (tmp_path / "runs" / backend / "profile_trace.json").exists()
    # eager keeps each layer's attention probabilities for backward; sdpa keeps q, k, v, the output and the logsumexp
    assert profiles["eager"]["attention_saved_mb"] > profiles["sdpa"]["attention_saved_mb"] > 0
    markdown = (tmp_path / "compare.md").read_text()
    rows = table_rows(markdown.split("## Where the step goes")[1])
    for backend, profile in profiles.items():
        cells = rows[backend]
        assert [float(cells[1 + i]) for i in range(len(CATEGORIES))] == pytest.approx(
            [profile["ms"][c] for c in CATEGORIES], abs=0.01)
        assert cells[-1] == f"{profile['attention_saved_mb']:,.1f}"
    # train.py's own runs were not disturbed by profiling: the same losses as an unprofiled run
    plain = run_script("train.py", "configs/tiny.py", f"--data_dir={data_dir}", "--attn=eager", "--block_size=32",
                       "--batch_size=4", "--max_iters=8", "--eval_interval=8", "--eval_iters=1", "--log_interval=1",
                       f"--out_dir={tmp_path / 'plain'}")
    assert plain.returncode == 0, plain.stderr
    losses = lambda d: [json.loads(line).get("loss") for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert losses(tmp_path / "plain") == losses(tmp_path / "runs" / "eager")


@pytest.mark.parametrize("args, message", [
    (["--profile=True", "--from_runs=out-a"], "profile and compile_both apply to the comparison"),
    (["--compile_both=True", "--compile=True"], "--compile: compile_both=True trains every backend both ways"),
], ids=["from_runs", "compile"])
def test_bad_profile_arguments_stop_before_any_run(args, message, tmp_path):
    result = run_script("compare.py", "configs/tiny.py", f"--out={tmp_path / 'out'}", *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_a_run_too_short_to_profile_says_so_and_leaves_no_stale_profile(tiny_args, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "profile.json").write_text("{}")  # an earlier run's
    result = run_script("train.py", *tiny_args, "--block_size=32", "--max_iters=4", "--eval_interval=4",
                        "--profile=True")
    assert result.returncode == 0, result.stderr
    assert "warning: profile=True but the run stopped before its steps 5-7 were profiled" in result.stderr
    assert not (tmp_path / "out" / "profile.json").exists()


@pytest.mark.parametrize("name, category", [
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>(Flash_fwd_params)", "attention forward"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>(Flash_bwd_params)", "attention backward"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80", "attention backward"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3", "attention backward"),
    ("_attn_fwd", "attention forward"),
    ("_attn_bwd", "attention backward"),
    ("_attn_bwd_delta", "attention backward"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmuls"),
    ("triton_tem_fused_mm_0", "matmuls"),
    ("triton_poi_fused_add_native_layer_norm_3", "everything else"),
], ids=lambda value: value[:24])
def test_kernels_no_range_reaches_are_sorted_by_name(name, category):
    from training.profiling import category_of_kernel_name

    assert category_of_kernel_name(name) == category
