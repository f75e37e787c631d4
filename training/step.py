"""The training step: train.py takes it, bench.py --mode=step times it. Every micro-batch's
forward and backward, the mean loss read once, then, where it is finite, the gradients
unscaled, clipped and applied through the GradScaler."""
import contextlib
import math

import torch

from model import labelled
from training.devices import StepGraph
from training.profiling import OPTIMIZER_RANGE


def make_train_step(model, optimizer, scaler, amp, world, grad_clip, compiled, cuda_graph):
    """step(batches, lr) -> the mean loss, batches being one (x, y) per micro-batch. model is what
    trains (the DDP wrapper under torchrun), amp the autocast context, world a devices.World;
    compiled says model is torch.compile's, cuda_graph replays the forward and backward from one
    CUDA graph (devices.StepGraph). Closures rather than an object holding its own bound method:
    no reference cycle, so the model is freed as soon as the step is (bench.py builds many)."""

    def forward_backward(batches):
        """Every micro-batch's forward and backward: leaves the gradients in .grad and returns the
        losses' sum, unread. Under DDP only the last micro-batch all-reduces (no_sync before it)."""
        # None: the first backward writes the gradients rather than adding them to zeros; a
        # captured step zeroes them in place, where its graph writes.
        optimizer.zero_grad(set_to_none=not cuda_graph)
        loss_sum = torch.zeros((), device=batches[0][0].device)
        for micro_step, (x, y) in enumerate(batches):
            accumulate_only = world.distributed and micro_step < len(batches) - 1
            if compiled:
                # Under compile's own CUDA graphs a replay reuses the previous one's outputs: done with them.
                torch.compiler.cudagraph_mark_step_begin()
            with model.no_sync() if accumulate_only else contextlib.nullcontext():
                with amp:
                    _, loss = model(x, y)
                loss_sum += loss.detach()
                scaler.scale(loss / len(batches)).backward()
        return loss_sum

    passes = StepGraph(forward_backward) if cuda_graph else forward_backward

    def step(batches, lr):
        """One optimizer step; the mean loss is read once a step, so that a NaN stops the run
        before the optimizer applies it."""
        for group in optimizer.param_groups:
            group["lr"] = lr
        mean_loss = world.mean_(passes(batches)).item() / len(batches)
        with labelled(OPTIMIZER_RANGE):
            if math.isfinite(mean_loss):
                if grad_clip > 0:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
                scaler.step(optimizer)
                scaler.update()
        return mean_loss

    return step
