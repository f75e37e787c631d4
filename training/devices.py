"""Where a script runs: its device, precision and CPU threads, the processes torchrun starts,
the signals that stop a run, and the training step as one CUDA graph.

`device=auto` and `dtype=auto` mean the same in every script: the GPU when there is one, bf16
autocast where it supports it, else fp16, and fp32 on the CPU. A setting this machine cannot
run is a ConfigError (exit 2), like any other bad setting.
"""
import contextlib
import gc
import os
import signal
import threading
from collections import namedtuple

import torch
import torch.distributed as dist

from attention.cuda_graph import capture_graph
from training.config import ConfigError

# Each card's dense (no sparsity) 16-bit tensor-core peak with float32 accumulation, as the
# kernels and the model's matmuls accumulate, and its memory bandwidth, keyed by the name
# torch.cuda.get_device_name gives: the one table of peaks, which train.py's MFU, bench.py's
# fractions of peak and the roofline figure (docs/figures/roofline.py) divide by.
Card = namedtuple("Card", "tflops gb_per_s source")
CARDS = {
    # GeForce cards run fp16/bf16 MMA with fp32 accumulation at half the fp16-accumulate rate:
    # 512 FLOP a clock per SM (NVIDIA Ada GPU architecture whitepaper, appendix: RTX 4090, 165.2
    # TFLOP/s from 128 SMs at 2,520 MHz) x 56 SMs x 2,475 MHz boost = 71.0 TFLOP/s; 21 Gbps GDDR6X
    # on a 192-bit bus = 504 GB/s (NVIDIA's RTX 4070 family specifications).
    "NVIDIA GeForce RTX 4070 SUPER": Card(71.0, 504, "Ada whitepaper's per-SM rate x 56 SMs x 2,475 MHz"),
    "NVIDIA GeForce RTX 4090": Card(165.2, 1008, "Ada whitepaper, appendix; 21 Gbps on a 384-bit bus"),
    "NVIDIA A100-SXM4-80GB": Card(312.0, 2039, "NVIDIA A100 datasheet, SXM 80GB"),
    "NVIDIA H100 PCIe": Card(756.0, 2000, "NVIDIA H100 datasheet, PCIe"),
    # 989.4 dense BF16/FP16 TFLOP/s (the datasheet's 1,979 is with 2:4 sparsity), 3.35 TB/s HBM3:
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (torch names the SXM5 card so).
    "NVIDIA H100 80GB HBM3": Card(989.4, 3350, "NVIDIA H100 datasheet, SXM"),
    # The same tensor cores and clocks as the H100 SXM, 4.8 TB/s HBM3e: NVIDIA H200 datasheet, SXM.
    "NVIDIA H200": Card(989.4, 4800, "NVIDIA H200 datasheet, SXM"),
}

# Below this many FLOP a call (a micro-batch's forward and backward, a decoded token) is too
# small to share among cores: on 2 cores configs/tiny.py's step (2.7 GFLOP) took 55 ms with 2
# threads and 65-95 ms with 1, but 350-1,400 ms with 2 while another process kept a core busy.
ONE_THREAD_FLOP = 1e10


def pick_device(name):
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but torch sees no CUDA GPU (use device=cpu or device=auto)")
    return torch.device(name)


def pick_dtype(name, device):
    """'auto' | 'float32' | 'bfloat16' | 'float16' -> the torch dtype autocast runs in."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name == "float16" and device.type != "cuda":
        raise ConfigError("dtype='float16' needs a CUDA device; on the CPU use float32 or bfloat16")
    if name == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("dtype='bfloat16' is not supported by this GPU; use float16 or auto")
    return getattr(torch, name)


def choose_cpu_threads(flop_per_call, processes=1):
    """Set torch's CPU threads for calls of flop_per_call FLOP, unless OMP_NUM_THREADS chose;
    returns the line that says what was chosen and why."""
    cores = len(os.sched_getaffinity(0))
    if "OMP_NUM_THREADS" in os.environ:
        return f"CPU threads: {torch.get_num_threads()} of {cores} cores (OMP_NUM_THREADS)"
    if flop_per_call < ONE_THREAD_FLOP:
        torch.set_num_threads(1)
        return (f"CPU threads: 1 of {cores} cores: a call of {flop_per_call / 1e9:.2g} GFLOP is too small to share "
                "(OMP_NUM_THREADS=n sets another count)")
    threads = max(1, cores // processes)
    torch.set_num_threads(threads)
    return f"CPU threads: {threads} of {cores} cores (OMP_NUM_THREADS=n sets another count)"


def autocast(device, dtype):
    """Mixed precision for the forward pass; weights and optimizer state stay fp32."""
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)


def generation_precision(model, device, dtype):
    """Put model (fp32, on device) in the precision it generates in; returns the context to generate under.
    bf16 casts the weights once (autocast would cast them at every token: the decoder's CUDA graph
    cannot keep its cache); fp16 overflows past 65504, so its weights stay fp32 under autocast."""
    if dtype == torch.bfloat16:
        model.to(dtype)
        return contextlib.nullcontext()
    return autocast(device, dtype)


def synchronize(device):
    """Wait for queued GPU work, so that a wall-clock reading covers the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_flops(device):
    """The card's dense 16-bit peak in FLOP/s (CARDS), or None when the device is not in the table."""
    card = CARDS.get(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return card and card.tflops * 1e12


def peak_memory_mb(device):
    """Most GPU memory torch has held since the start (None on the CPU)."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def cap_memory(device, max_gb, announce):
    """Let torch's CUDA allocator hold at most max_gb GiB on `device`, so that a big card runs out
    of memory where a smaller one would (the CUDA context is not counted)."""
    if device.type != "cuda":
        raise ConfigError(f"max_memory_gb={max_gb:g} caps CUDA memory, but the device is {device.type}; "
                          "leave max_memory_gb at 0 there")
    index = device.index if device.index is not None else torch.cuda.current_device()  # torch wants an index here
    total_gb = torch.cuda.get_device_properties(index).total_memory / 2**30
    # A cap above the card's size would be an error to torch; the card itself is the cap then.
    torch.cuda.set_per_process_memory_fraction(min(max_gb / total_gb, 1.0), index)
    if announce:
        print(f"CUDA memory capped at {max_gb:g} GiB (the card has {total_gb:.1f} GiB)")


def is_out_of_memory(error):
    """torch.OutOfMemoryError on the GPU; a RuntimeError (torch's CPU allocator) or MemoryError on the host."""
    return (isinstance(error, (torch.OutOfMemoryError, MemoryError))
            or "DefaultCPUAllocator: can't allocate memory" in str(error))


def out_of_memory_message(config, world):
    """What ran out of memory and what would need less, for the one-line error (exit 3)."""
    where = f" on rank {world.rank}" if world.distributed else ""
    cap = f" under max_memory_gb={config.max_memory_gb:g}" if config.max_memory_gb else ""
    hint = "; a FlashAttention backend never holds the block_size x block_size scores" if config.attn == "eager" else ""
    return (f"out of memory{where}{cap} with attn={config.attn}, block_size={config.block_size}, "
            f"batch_size={config.batch_size}. A smaller batch_size or block_size needs less{hint}")


class World:
    """This process's place among the processes torchrun starts (one per GPU, or several on the
    CPU) and what they do together. Without torchrun it is rank 0 of 1, and every method does
    nothing or returns its own value, so train.py has one code path."""

    def __init__(self):
        self.distributed = "RANK" in os.environ
        self.rank = int(os.environ.get("RANK", 0))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.size = int(os.environ.get("WORLD_SIZE", 1))
        self.is_main = self.rank == 0  # the one process that logs, evaluates and saves
        self.device = None

    def start(self, device):
        """Join the other processes; returns the device this process trains on (its own GPU)."""
        if not self.distributed:
            return device
        if device.type == "cuda":
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
            dist.init_process_group(backend="nccl", device_id=device)  # GPU to GPU, over NVLink where there is one
        else:
            dist.init_process_group(backend="gloo")  # PyTorch's CPU backend
        self.device = device
        return device

    def stop(self):
        """Free what holds the process group (the DDP model) before destroying the group: a
        reference cycle can keep it alive past the run (torch 2.13's AdamW keeps its caller's
        frame, and with it the trainer), and freed after the group, a torchrun process aborts at
        exit ("terminate called without an active exception")."""
        if self.distributed and dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()

    def barrier(self):
        if self.distributed:
            dist.barrier()

    def mean_(self, tensor):
        """Average `tensor` over the processes, in place (gloo has SUM but no AVG)."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor /= self.size
        return tensor

    def max(self, value):
        """The largest of the ints the processes hold; every process gets it."""
        if not self.distributed:
            return value
        tensor = torch.tensor(value, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def gather(self, obj):
        """Every process's `obj` (picklable), as a list in rank order; every process gets it."""
        if not self.distributed:
            return [obj]
        objs = [None] * self.size
        dist.all_gather_object(objs, obj)
        return objs


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP ask train.py to stop at the next iteration boundary, where the
    checkpoint resumes exactly; a second stops the process at once without saving (exit 128 +
    its number). Two signals during one long torch call would run Python's handler once, so a
    thread counts the bytes the C handler writes to the wakeup fd. Under torchrun, signal torchrun."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, announce):
        self.received = None
        self.announce = announce  # rank 0 alone says what happens next, as it alone saves
        wakeup_read, wakeup_write = os.pipe()
        os.set_blocking(wakeup_write, False)  # the C handler must never block
        signal.set_wakeup_fd(wakeup_write)
        for signum in self.SIGNALS:
            signal.signal(signum, self._handle)
        threading.Thread(target=self._count, args=(wakeup_read,), daemon=True).start()

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signum
            if self.announce:  # os.write, not print: print is not safe to re-enter from a signal handler
                os.write(2, f"\n{signal.Signals(signum).name}: stopping after this iteration and saving a "
                            "checkpoint (send a second signal to stop at once, without saving)\n".encode())

    def _count(self, wakeup_read):
        count = 0
        while True:
            for signum in os.read(wakeup_read, 64):
                count += signum in self.SIGNALS
                if count >= 2:
                    os.write(2, f"\nsecond signal ({signal.Signals(signum).name}): stopped at once, without "
                                "saving; the checkpoints on disk are intact\n".encode())
                    os._exit(128 + signum)


class StepGraph:
    """A step's forward and backward as one CUDA graph (train.py's cuda_graph), so that the host
    issuing hundreds of small kernels one by one no longer sets the pace. forward_backward(batches)
    returns the loss sum and leaves the gradients in .grad (zeroed in place); the optimizer stays
    outside. The first call is the warm-up of attention.cuda_graph.capture_graph (it compiles and
    tunes), uncaptured, and returns its own result; the graph is recorded after it, on copies of
    its batches. Later calls copy their batches into those and replay."""

    def __init__(self, forward_backward):
        self.forward_backward = forward_backward
        self.graph, self.static_batches, self.static_loss_sum = None, None, None

    def __call__(self, batches):
        if self.graph is None:
            self.static_batches = [tuple(t.clone() for t in batch) for batch in batches]
            warm_up_loss_sum = []
            self.graph, self.static_loss_sum = capture_graph(
                lambda: self.forward_backward(self.static_batches),
                warm_up=lambda: warm_up_loss_sum.append(self.forward_backward(batches)))
            return warm_up_loss_sum[0]
        for static_batch, batch in zip(self.static_batches, batches, strict=True):
            for static, new in zip(static_batch, batch, strict=True):
                static.copy_(new)
        self.graph.replay()
        return self.static_loss_sum
