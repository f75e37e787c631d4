"""The Triton kernels under torch.compile and CUDA graphs, on the GPU (run by `.ci/gpu tests`).
The CPU versions of these checks are in test_attention.py, test_model.py and test_train.py."""
import pytest
import torch

from attention import attention, packed_attention, triton_launch
from attention.inputs import unpack_heads
from model import GPT, GPTConfig, compile_model
from attention.triton_forward import _attn_fwd_tuned
from test_attention import GPU_TOLERANCE, random_qkv
from test_train import read_metrics, step_losses
from conftest import run_script

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("suffix", ["", "_traced"])
def test_gpu_custom_ops_pass_opcheck(suffix):
    """The opaque operators, and their torch.library.triton_op twins that torch.compile takes on a GPU."""
    ops = torch.ops.nanofa2
    qkv = torch.randn(2, 300, 3, 2, 64, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.detach().requires_grad_() for t in unpack_heads(qkv))
    for name in ("triton_attention", "triton_fwd_attention"):
        torch.library.opcheck(getattr(ops, name + suffix), (q, k, v, True))
    o, lse = (t.detach() for t in ops.triton_attention(q, k, v, True))  # the backward ops' own inputs
    for op in (getattr(ops, "triton_attention_backward" + suffix), ops.recompute_attention_backward):
        torch.library.opcheck(op, (q.detach(), k.detach(), v.detach(), o, torch.randn_like(o), lse, True))
    torch.library.opcheck(getattr(ops, "triton_packed_attention" + suffix), (qkv.requires_grad_(), True))
    o, lse = ops.triton_packed_attention(qkv.detach(), True)
    torch.library.opcheck(getattr(ops, "triton_packed_attention_backward" + suffix),
                          (qkv.detach(), o, torch.randn_like(o), lse, True))


def test_gpu_inductor_launches_the_kernels_itself():
    """Compiled on a GPU, the graph holds the Triton kernels (through the triton_op twins), not a
    call to an opaque operator: Inductor's generated code launches _attn_fwd, _attn_bwd_delta and
    _attn_bwd."""
    from torch._inductor.utils import run_and_get_code

    qkv = torch.randn(2, 300, 3, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    step = torch.compile(lambda x: packed_attention(x, True, "triton").float().square().sum(), fullgraph=True)

    def forward_and_backward(x):
        step(x).backward()
        return x.grad
    grad, code = run_and_get_code(forward_and_backward, qkv)
    code = "\n".join(code)
    for kernel in ("_attn_fwd", "_attn_bwd_delta", "_attn_bwd"):
        assert kernel in code
    assert "triton_packed_attention.default(" not in code  # no call to the opaque operator
    x = qkv.detach().requires_grad_()
    packed_attention(x, True, "triton").float().square().sum().backward()
    torch.testing.assert_close(grad, x.grad)


@pytest.mark.parametrize("attn", ["triton", "triton_fwd"])
def test_gpu_fullgraph_inductor_matches_the_plain_model(attn):
    idx = torch.randint(0, 50257, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        gpt = GPT(GPTConfig(block_size=128, n_layer=2, n_head=4, n_embd=256, dropout=0.0, attn=attn)).cuda()
        run = torch.compile(gpt, fullgraph=True) if compiled else gpt
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = run(idx, targets=idx.roll(-1, 1))
        loss.backward()
        results.append((loss.detach().float(), {n: p.grad.float() for n, p in gpt.named_parameters()}))
    (loss, grads), (loss_compiled, grads_compiled) = results
    torch.testing.assert_close(loss_compiled, loss, rtol=2e-3, atol=2e-3)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_compiled[name], grad, rtol=5e-2, atol=5e-3, msg=name)


def test_gpu_reduce_overhead_accumulates_gradients_like_the_plain_model():
    """Two micro-batches through CUDA graphs: the accumulated gradient is the sum of both (the
    replay of the second must not overwrite the first's gradient, which autograd keeps)."""
    batches = [torch.randint(0, 50257, (4, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(s))
               for s in range(2)]
    grads = []
    for mode in (None, "reduce-overhead"):
        torch.manual_seed(0)
        gpt = GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64, dropout=0.0, attn="triton")).cuda()
        run = compile_model(gpt, mode) if mode else gpt
        for _ in range(3):  # CUDA graph trees record on the second call and replay from the third
            gpt.zero_grad(set_to_none=True)
            for x in batches:
                torch.compiler.cudagraph_mark_step_begin()
                _, loss = run(x, targets=x.roll(-1, 1))
                loss.backward()
        grads.append({n: p.grad.clone() for n, p in gpt.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-2, atol=1e-4, msg=name)


@pytest.mark.parametrize("attn", ["eager", "sdpa", "triton", "triton_fwd", "tiled"])
def test_gpu_reduce_overhead_trains_every_backend(attn, tiny_args, tmp_path):
    """train.py --compile_mode=reduce-overhead with accumulation and evaluation: the losses of
    the uncompiled run."""
    args = [*tiny_args, "--device=cuda", "--dtype=float32", f"--attn={attn}", "--gradient_accumulation_steps=2",
            "--max_iters=4", "--eval_interval=2", "--log_interval=1"]
    losses = []
    for name, extra in (("plain", []), ("compiled", ["--compile=True", "--compile_mode=reduce-overhead"])):
        result = run_script("train.py", *args, f"--out_dir={tmp_path / name}", *extra, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        losses.append(step_losses(read_metrics(tmp_path / name)))
    for it in (1, 2, 3, 4):
        assert losses[1][it] == pytest.approx(losses[0][it], rel=2e-3), it


def test_gpu_a_new_shape_inside_a_cuda_graph_capture_is_not_timed(tmp_path, monkeypatch):
    """The first call at a shape, inside a capture, with no saved choice: no timing (it would
    sync, and record the timing launches), and the replayed graph computes the right O."""
    monkeypatch.setenv(triton_launch.TUNING_CACHE_ENV, str(tmp_path))
    q, k, v = (t.detach() for t in random_qkv((1, 2, 1500, 32), 1500, dtype=torch.float16, device="cuda", seed=3))
    tunings = _attn_fwd_tuned.tunings
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = attention(q, k, v, True, "triton")
    assert _attn_fwd_tuned.tunings == tunings
    o.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(o, attention(q, k, v, True, "sdpa"), rtol=0, atol=GPU_TOLERANCE[torch.float16])


@pytest.mark.parametrize("attn, extra", [
    *[(attn, []) for attn in ("eager", "sdpa", "triton", "triton_fwd", "tiled")],
    ("triton", ["--compile=True"]),
    ("sdpa", ["--dtype=float16"]),  # the gradient scaler's scale, read by the graph, changes between replays
    ("sdpa", ["--dropout=0.2"]),  # each replay draws new dropout masks, as the plain run does
])
def test_gpu_cuda_graph_trains_like_the_plain_run(attn, extra, tiny_args, tmp_path):
    """train.py --cuda_graph=True with accumulation and evaluation: step 1 runs uncaptured, step
    2 is captured and replayed, the rest replay; every step's loss is the plain run's."""
    args = [*tiny_args, "--device=cuda", "--dtype=float32", f"--attn={attn}", "--gradient_accumulation_steps=2",
            "--max_iters=6", "--eval_interval=3", "--log_interval=1", *extra]
    losses, val_losses = [], []
    for name, graph in (("plain", []), ("graph", ["--cuda_graph=True"])):
        result = run_script("train.py", *args, f"--out_dir={tmp_path / name}", *graph, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        records = read_metrics(tmp_path / name)
        losses.append(step_losses(records))
        val_losses.append({r["iter"]: r["val_loss"] for r in records if "val_loss" in r})
    assert losses[1].keys() == set(range(1, 7)) and val_losses[1].keys() == {0, 3, 6}
    for it in range(1, 7):
        assert losses[1][it] == pytest.approx(losses[0][it], rel=2e-3), it
    for it in (3, 6):  # evaluated between replays, on the weights the replays trained
        assert val_losses[1][it] == pytest.approx(val_losses[0][it], rel=2e-3), it
