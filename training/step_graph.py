"""A training step's forward and backward passes as one CUDA graph: train.py --cuda_graph=True.

Why: each micro-batch of the default model is several hundred small kernels (8 layers, forward
and backward), and PyTorch issues each one from Python. On a slow or busy host that takes
longer than the GPU takes to run them, so the wall clock measures the host and hides what the
attention backend saves (docs/benchmarks.md, session 14). A CUDA graph records the kernels once;
every later step launches them all with one call, and the GPU sets the pace.

The graph holds: zeroing the gradients, then every micro-batch's forward and backward pass,
adding up their losses. The optimizer stays outside it, so train.py still reads the loss
before stepping and skips a step whose loss is not finite, as it does without a graph.

Capture asks for fixed addresses and no host work inside the step:
- the batches are copied into buffers that the graph reads;
- the gradients stay allocated from step to step (the graph zeroes and fills them in place;
  nothing may set them to None), and the loss sum is a buffer that the graph writes;
- nothing may sync or tune during capture. So the first step runs uncaptured on a side stream,
  as torch's CUDA-graph docs ask: it compiles, tunes the Triton kernels for these shapes and
  sets up cuBLAS. The second step is captured and then replayed, like every step after it.
Dropout draws new numbers on every replay: capture registers torch's CUDA generator, and each
replay moves its offset on.
"""
import torch


class StepGraph:
    """Calls forward_backward(batches) -> loss-sum tensor (it also leaves the step's gradients
    in the parameters' .grad). The first call runs it uncaptured; the second captures and replays
    it; the later ones copy their batches into the captured ones and replay. Every call's batches
    must have the shapes and dtypes of the first call's."""

    def __init__(self, forward_backward):
        self.forward_backward = forward_backward
        self.warmed_up = False
        self.graph = None
        self.static_batches = None
        self.static_loss_sum = None

    def __call__(self, batches):
        if not self.warmed_up:
            side_stream = torch.cuda.Stream()
            side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side_stream):
                loss_sum = self.forward_backward(batches)
            torch.cuda.current_stream().wait_stream(side_stream)
            self.warmed_up = True
            return loss_sum
        if self.graph is None:
            self.static_batches = [tuple(t.clone() for t in batch) for batch in batches]
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.static_loss_sum = self.forward_backward(self.static_batches)
        else:
            for static_batch, batch in zip(self.static_batches, batches, strict=True):
                for static, new in zip(static_batch, batch, strict=True):
                    static.copy_(new)
        self.graph.replay()
        return self.static_loss_sum
