"""attention.cuda_graph.capture_graph and the training step's StepGraph on the CPU, with torch's
CUDA stream and graph calls replaced by recorders: the warm-up runs on a side stream before the
capture, the captured call's output comes back, and StepGraph's first call is its warm-up (it
returns that call's loss, then captures on copies of its batches) while later calls copy their
batches in and replay. The GPU tests (tests/test_compile_gpu.py, tests/test_decode.py) run the
real captures."""
import contextlib

import pytest
import torch

from attention import cuda_graph
from training.devices import StepGraph


class Recorder:
    """torch.cuda's stream and graph calls, each appended to events."""

    def __init__(self):
        self.events = []
        events = self.events

        class Stream:
            def __init__(self, name="side"):
                self.name = name

            def wait_stream(self, other):
                events.append(f"{self.name} waits for {other.name}")

        class CUDAGraph:
            def replay(self):
                events.append("replay")

        self.Stream, self.CUDAGraph = Stream, CUDAGraph

    def current_stream(self):
        return self.Stream("current")

    @contextlib.contextmanager
    def stream(self, stream):
        self.events.append(f"on {stream.name}")
        yield
        self.events.append(f"off {stream.name}")

    @contextlib.contextmanager
    def graph(self, graph):
        self.events.append("capture")
        yield
        self.events.append("end capture")


@pytest.fixture
def cuda(monkeypatch):
    recorder = Recorder()
    for name in ("Stream", "current_stream", "stream", "graph", "CUDAGraph"):
        monkeypatch.setattr(torch.cuda, name, getattr(recorder, name))
    return recorder


def test_the_warm_up_runs_on_a_side_stream_before_the_capture(cuda):
    step = lambda: cuda.events.append("step") or "output"
    graph, output = cuda_graph.capture_graph(step, warm_up=lambda: cuda.events.append("warm up"))
    assert output == "output" and isinstance(graph, cuda.CUDAGraph)
    assert cuda.events == ["side waits for current", "on side", "warm up", "off side", "current waits for side",
                           "capture", "step", "end capture"]


def test_step_graph_returns_its_warm_up_then_replays_on_copies_of_the_batches(cuda):
    seen = []

    def forward_backward(batches):
        seen.append([x.clone() for x, _ in batches])
        return torch.tensor(float(len(seen)))

    graphed = StepGraph(forward_backward)
    first, second = [(torch.full((2,), 1.0), torch.zeros(2))], [(torch.full((2,), 2.0), torch.zeros(2))]
    assert graphed(first).item() == 1.0  # the warm-up's own loss: the step ran uncaptured
    assert "replay" not in cuda.events and len(seen) == 2  # warmed up, then captured on the copies
    static = graphed.static_batches[0][0]
    assert static is not first[0][0] and torch.equal(static, first[0][0])
    assert graphed(second) is graphed.static_loss_sum and cuda.events[-1] == "replay"
    assert torch.equal(static, second[0][0]) and len(seen) == 2  # copied in and replayed, not run again
