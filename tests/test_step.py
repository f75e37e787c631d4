"""training/step.py, the step train.py takes and bench.py --mode=step times: the micro-batches'
gradients averaged, clipped, applied only after a finite loss."""
import contextlib
import copy
import gc
import importlib
import math
import sys
import weakref

import pytest
import torch

from model import GPT, GPTConfig
from training.devices import StepGraph, World
from training import step as step_module

TINY = GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16, dropout=0.0, attn="eager")


def tiny_step(model, grad_clip):
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return step_module.make_train_step(model, optimizer, scaler, contextlib.nullcontext(), World(), grad_clip,
                                       compiled=False, cuda_graph=False), optimizer


def micro_batches(n, generator):
    tokens = [torch.randint(0, TINY.vocab_size, (3, TINY.block_size + 1), generator=generator) for _ in range(n)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def test_the_step_averages_the_micro_batches_and_clips_the_mean_gradient():
    torch.manual_seed(0)
    model = GPT(TINY)
    reference = copy.deepcopy(model)
    batches = micro_batches(2, torch.Generator().manual_seed(1))
    step, _ = tiny_step(model, grad_clip=1e-3)  # far below the gradient's norm: clipping acts
    mean_loss = step(batches, lr=1e-3)

    losses = [reference(x, y)[1] for x, y in batches]
    (sum(losses) / len(losses)).backward()
    grads = [p.grad for p in reference.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert norm > 1e-2
    assert mean_loss == pytest.approx(torch.stack(losses).mean().item(), rel=1e-6)
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g * (1e-3 / norm), rtol=1e-4, atol=1e-9)


def test_a_non_finite_loss_leaves_the_weights_as_they_were():
    torch.manual_seed(0)
    model = GPT(TINY)
    with torch.no_grad():
        model.transformer.wte.weight[0, 0] = math.nan
    before = copy.deepcopy(model.state_dict())
    step, optimizer = tiny_step(model, grad_clip=1.0)
    batches = micro_batches(2, torch.Generator().manual_seed(1))
    batches[0][0][0, 0] = 0  # a token whose embedding holds the NaN
    assert math.isnan(step(batches, lr=1e-3))
    assert not optimizer.state  # AdamW never stepped
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], equal_nan=True)


def test_the_model_is_freed_with_its_step():
    # bench.py builds a step per backend and mode: a reference cycle would keep each model on the GPU.
    gc.disable()
    try:
        model = GPT(TINY)
        freed = weakref.ref(model)
        step, optimizer = tiny_step(model, grad_clip=1.0)
        step(micro_batches(1, torch.Generator().manual_seed(1)), lr=1e-3)
        del model, step, optimizer
        assert freed() is None
    finally:
        gc.enable()


def test_bench_step_mode_times_the_step_train_py_takes(monkeypatch):
    """bench.py --mode=step builds training/step.py's step, with train.py's gradient clipping,
    and each timed step is one call of it (a GPU mode; run here on the CPU, the model shrunk)."""
    monkeypatch.setattr(sys, "argv", ["bench.py", "--mode=step"])
    bench = importlib.import_module("bench")
    monkeypatch.setattr(bench, "GPTConfig", lambda: TINY)
    built, calls = [], []

    def recording_make_train_step(*args, **kwargs):
        built.append((args, kwargs))
        step = step_module.make_train_step(*args, **kwargs)
        return lambda batches, lr: calls.append(lr) or step(batches, lr)

    monkeypatch.setattr(bench, "make_train_step", recording_make_train_step)
    timed = bench.build_step("eager", "none", TINY.block_size, device="cpu")
    assert len(built) == 1 and len(calls) == 5  # the warm-up
    timed()
    assert len(built) == 1 and len(calls) == 6
    grad_clip = built[0][0][5]
    assert grad_clip == bench.TrainConfig.grad_clip > 0


def mock_cuda_graph(monkeypatch, owner, name, output=None):
    """CUDA graph capture and replay on the CPU, for the calls of owner.<name> (a method or a
    function attribute): inside torch.cuda.graph(g) a call is recorded, not run (a capture records
    kernels without running them) and returns output() (None without one), a placeholder; each
    g.replay() runs the recorded calls and writes their results into the placeholders, as a replay
    writes the captured outputs' memory. Streams are the CPU's own. Returns the (captured,
    replayed) call counts."""
    counts = {"captured": 0, "replayed": 0}
    recorded = []
    capturing = []
    real = getattr(owner, name)

    def call(*args, **kwargs):
        # owner.<name> is this for the whole test, so a caller that took the function before the
        # capture began (attention.cuda_graph.capture_graph takes it as an argument) records too.
        if not capturing:
            return real(*args, **kwargs)
        counts["captured"] += 1
        placeholder = output() if output else None
        recorded.append((args, kwargs, placeholder))
        return placeholder

    class Graph:
        def replay(self):
            counts["replayed"] += 1
            for args, kwargs, placeholder in recorded:
                result = real(*args, **kwargs)
                if placeholder is not None:
                    placeholder.copy_(result)

    @contextlib.contextmanager
    def graph(cuda_graph, *args, **kwargs):
        capturing.append(True)
        try:
            yield
        finally:
            capturing.pop()

    monkeypatch.setattr(owner, name, call)
    stream = type("Stream", (), {"wait_stream": lambda self, other: None})
    monkeypatch.setattr(torch.cuda, "Stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    return counts


def test_a_step_replayed_from_a_cuda_graph_trains_like_the_plain_step(monkeypatch):
    """The CPU twin of test_compile_gpu.py's test_gpu_cuda_graph_trains_like_the_plain_run, the
    capture mocked (mock_cuda_graph): the first step runs uncaptured, the second captures copies
    of its batches and replays, the later ones copy their batches into those and replay; every
    step's loss and the weights after are the plain step's (a replay that read the captured
    batches again, or a gradient not zeroed in place, would differ)."""
    generator = torch.Generator().manual_seed(1)
    steps = [micro_batches(2, generator) for _ in range(4)]
    graphs = []
    monkeypatch.setattr(step_module, "StepGraph", lambda passes: graphs.append(StepGraph(passes)) or graphs[-1])
    results = []
    for cuda_graph in (False, True):
        torch.manual_seed(0)
        model = GPT(TINY)
        optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.99), "cpu")
        step = step_module.make_train_step(model, optimizer, torch.amp.GradScaler("cpu", enabled=False),
                                           contextlib.nullcontext(), World(), 1.0, compiled=False,
                                           cuda_graph=cuda_graph)
        if cuda_graph:
            counts = mock_cuda_graph(monkeypatch, graphs[0], "forward_backward", output=lambda: torch.zeros(()))
        results.append(([step(batches, lr=1e-2) for batches in steps], model.state_dict()))
    (losses, weights), (graphed_losses, graphed_weights) = results
    assert counts == {"captured": 1, "replayed": 3} and len(set(losses)) == 4
    assert graphed_losses == pytest.approx(losses, rel=1e-6)
    for name, value in weights.items():
        torch.testing.assert_close(graphed_weights[name], value, msg=name)
