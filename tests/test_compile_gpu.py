"""The Triton kernels under torch.compile and CUDA graphs, on the GPU (run by `.ci/gpu tests`).
The CPU versions of these checks are in test_attention.py (the operators' opcheck, one list of
calls for both), test_model.py, test_decode.py, test_step.py (the step's CUDA graph, the capture
mocked) and test_train.py."""
import pytest
import torch

from attention import FlashAttentionTriton, attention  # first: it picks Triton's interpreter where there is no GPU
from conftest import run_script
from model import GPT, GPTConfig, compile_model
from test_attention import custom_op_calls
from test_train import read_metrics, step_losses
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402 (imports triton)

pytestmark = pytest.mark.gpu

# The model's two attention shapes: multi-head, and grouped-query heads (two query heads per kv
# head) with a window shorter than the sequence.
CONFIGS = {"multi-head": dict(n_head=4), "gqa+window": dict(n_head=4, n_kv_head=2, window=31)}


def projection_views(B, N, H, H_kv, D, dtype=torch.bfloat16, seed=0):
    """q (B, H, N, D), k and v (B, H_kv, N, D): views of one fused projection, as the model hands them."""
    g = torch.Generator("cuda").manual_seed(seed)
    qkv = torch.randn(B, N, H + 2 * H_kv, D, device="cuda", dtype=dtype, generator=g)
    return qkv.transpose(1, 2).split([H, H_kv, H_kv], dim=1)


def test_gpu_custom_ops_pass_opcheck():
    """test_attention.py's opcheck of every operator, on the card in bfloat16 at the model's
    sizes: the operators' fake implementations give the real outputs' shapes and strides there too."""
    for op, args in custom_op_calls("cuda", torch.bfloat16, n=300, head_dim=64, cache_rows=37):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("heads", CONFIGS)
@pytest.mark.parametrize("attn", ["triton", "triton_fwd"])
def test_gpu_fullgraph_inductor_is_one_graph_and_matches_the_plain_model(attn, heads):
    idx = torch.randint(0, 50257, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = []
    counter = CompileCounterWithBackend("inductor")
    for compiled in (False, True):
        torch.manual_seed(0)
        gpt = GPT(GPTConfig(block_size=128, vocab_size=50257, n_layer=2, n_embd=256, dropout=0.0, attn=attn,
                            **CONFIGS[heads])).cuda()
        run = torch.compile(gpt, backend=counter, fullgraph=True) if compiled else gpt
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = run(idx, targets=idx.roll(-1, 1))
        loss.backward()
        results.append((loss.detach().float(), {n: p.grad.float() for n, p in gpt.named_parameters()}))
    assert counter.frame_count == 1  # one graph: the kernels are opaque operators, no break around them
    (loss, grads), (loss_compiled, grads_compiled) = results
    torch.testing.assert_close(loss_compiled, loss, rtol=2e-3, atol=2e-3)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_compiled[name], grad, rtol=5e-2, atol=5e-3, msg=name)


@pytest.mark.parametrize("heads", CONFIGS)
def test_gpu_reduce_overhead_accumulates_gradients_like_the_plain_model(heads):
    """Two micro-batches through CUDA graphs: the accumulated gradient is the sum of both (the
    replay of the second must not overwrite the first's gradient, which autograd keeps)."""
    batches = [torch.randint(0, 50257, (4, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(s))
               for s in range(2)]
    grads = []
    for mode in (None, "reduce-overhead"):
        torch.manual_seed(0)
        gpt = GPT(GPTConfig(block_size=64, vocab_size=50257, n_layer=2, n_embd=64, dropout=0.0, attn="triton",
                            **CONFIGS[heads])).cuda()
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


@pytest.mark.parametrize("window_size", [(-1, 0), (200, 0)])
def test_gpu_attention_captured_at_a_new_shape_replays_the_right_output(window_size):
    """The first call at a shape, inside a CUDA graph capture: the tuner times nothing there (a
    timing would sync, and record its launches), and the replayed graph computes the O of an
    uncaptured call."""
    q, k, v = (t.detach() for t in projection_views(1, 1500, 4, 2, 40, dtype=torch.float16, seed=3))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = FlashAttentionTriton.apply(q, k, v, True, window_size)
    o.zero_()
    graph.replay()
    torch.cuda.synchronize()
    expected = attention(q.float(), k.float(), v.float(), True, "eager", window_size)
    assert o.abs().sum() > 0
    torch.testing.assert_close(o.float(), expected, rtol=0, atol=1e-2)


@pytest.mark.parametrize("attn, extra", [
    *[(attn, []) for attn in ("eager", "sdpa", "triton", "triton_fwd", "tiled")],
    ("triton", ["--compile=True"]),
    ("sdpa", ["--dtype=float16"]),  # the gradient scaler's scale, read by the graph, changes between replays
    ("sdpa", ["--dropout=0.2"]),  # each replay draws new dropout masks, as the plain run does
])
def test_gpu_cuda_graph_trains_like_the_plain_run(attn, extra, tiny_args, tmp_path):
    """train.py --cuda_graph=True with accumulation and evaluation: step 1 runs uncaptured (the
    capture's warm-up) and the graph is captured after it, the rest replay; every step's loss is
    the plain run's."""
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
