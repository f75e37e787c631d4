"""Data-parallel training over the processes torchrun starts: one per GPU, or several on the CPU.

    torchrun --standalone --nproc_per_node=2 train.py --attn=triton

torchrun gives each process RANK (0 .. WORLD_SIZE-1), LOCAL_RANK (its index on this machine,
which picks its GPU) and WORLD_SIZE. A process started without torchrun is rank 0 of 1, and
every method below does nothing or returns its own value, so train.py has one code path.
"""
import os

import torch
import torch.distributed as dist


class World:
    """This process's place among the training processes, and what they do together."""

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
            # NCCL moves gradients GPU to GPU (NVLink where there is one).
            dist.init_process_group(backend="nccl", device_id=device)
        else:
            dist.init_process_group(backend="gloo")  # PyTorch's CPU backend
        self.device = device
        return device

    def stop(self):
        if self.distributed and dist.is_initialized():
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
