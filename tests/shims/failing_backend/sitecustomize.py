"""A training run that fails midway, for tests: with this folder on PYTHONPATH, a process
started with --attn=$FAILING_BACKEND raises a RuntimeError at its first optimizer step,
as a kernel bug would; runs of other backends are untouched."""
import os
import sys

from torch.optim.optimizer import register_optimizer_step_pre_hook

if f"--attn={os.environ['FAILING_BACKEND']}" in sys.argv:
    def _fail(optimizer, args, kwargs):
        raise RuntimeError("fake kernel failure in the first step")

    register_optimizer_step_pre_hook(_fail)
