"""The training step: train.py takes it, bench.py --mode=step times it. Every micro-batch's
forward and backward, the mean loss read once, then, where it is finite, the gradients
unscaled, clipped and applied through the GradScaler."""
import contextlib
import math

import torch

from model import labelled
from training.devices import StepGraph
from training.profiling import OPTIMIZER_RANGE


class TrainStep:
    """step(batches, lr) -> the mean loss, batches being one (x, y) per micro-batch. model is what
    trains (the DDP wrapper under torchrun), amp the autocast context, world a devices.World;
    compiled says model is torch.compile's, cuda_graph replays the forward and backward from one
    CUDA graph (devices.StepGraph)."""

    def __init__(self, model, optimizer, scaler, amp, world, grad_clip, compiled, cuda_graph):
        self.model, self.optimizer, self.scaler, self.amp, self.world = model, optimizer, scaler, amp, world
        self.grad_clip, self.compiled, self.cuda_graph = grad_clip, compiled, cuda_graph
        self.passes = StepGraph(self.forward_backward) if cuda_graph else self.forward_backward

    def __call__(self, batches, lr):
        """One optimizer step; the mean loss is read once a step, so that a NaN stops the run
        before the optimizer applies it."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        mean_loss = self.world.mean_(self.passes(batches)).item() / len(batches)
        with labelled(OPTIMIZER_RANGE):
            if math.isfinite(mean_loss):
                if self.grad_clip > 0:
                    self.scaler.unscale_(self.optimizer)
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
                self.scaler.step(self.optimizer)
                self.scaler.update()
        return mean_loss

    def forward_backward(self, batches):
        """Every micro-batch's forward and backward: leaves the gradients in .grad and returns the
        losses' sum, unread. Under DDP only the last micro-batch all-reduces (no_sync before it)."""
        # None: the first backward writes the gradients rather than adding them to zeros; a
        # captured step zeroes them in place, where its graph writes.
        self.optimizer.zero_grad(set_to_none=not self.cuda_graph)
        loss_sum = torch.zeros((), device=batches[0][0].device)
        for micro_step, (x, y) in enumerate(batches):
            accumulate_only = self.world.distributed and micro_step < len(batches) - 1
            if self.compiled:
                # Under compile's own CUDA graphs a replay reuses the previous one's outputs: done with them.
                torch.compiler.cudagraph_mark_step_begin()
            with self.model.no_sync() if accumulate_only else contextlib.nullcontext():
                with self.amp:
                    _, loss = self.model(x, y)
                loss_sum += loss.detach()
                self.scaler.scale(loss / len(batches)).backward()
        return loss_sum
