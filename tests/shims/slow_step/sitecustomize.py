"""A slow step, for tests: with this folder on PYTHONPATH, the process's first optimizer step
takes SLOW_STEP_SECONDS longer, as a step of a model sized for a GPU does on a CPU."""
import os
import time

from torch.optim.optimizer import register_optimizer_step_post_hook

_handle = None


def _sleep_once(optimizer, args, kwargs):
    time.sleep(float(os.environ["SLOW_STEP_SECONDS"]))
    _handle.remove()


_handle = register_optimizer_step_post_hook(_sleep_once)
