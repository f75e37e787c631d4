"""A step captured as one CUDA graph: recorded once, then each replay launches all its kernels
at once, so the host no longer issues them one by one. The model's decoding (model.py's
StaticDecoder), the training step (training/devices.py's StepGraph) and bench.py's decode
timings capture through capture_graph; it lives here, the package every one of them imports."""
import torch


def capture_graph(step, warm_up=None):
    """(graph, output): a torch.cuda.CUDAGraph recorded from one call of step, and what that call
    returned (tensors each replay writes). The recorded call runs nothing: graph.replay() does.
    First warm_up() (by default, step once) runs on a side stream, as torch's docs ask: what a
    capture refuses happens there (torch.compile compiling, Triton tuning and loading kernels,
    the allocator growing its pools), and its work is done before the capture starts."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (warm_up or step)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step()
    return graph, output
