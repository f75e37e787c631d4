"""A signal that lands at a known moment, for tests: with this folder on PYTHONPATH, the
process sends itself SIGTERM right after its SIGNAL_AFTER_STEPS-th optimizer step, so the
loop sees the signal at the boundary just after that step."""
import os
import signal

from torch.optim.optimizer import register_optimizer_step_post_hook

_steps_left = int(os.environ["SIGNAL_AFTER_STEPS"])


def _signal_after_the_step(optimizer, args, kwargs):
    global _steps_left
    _steps_left -= 1
    if _steps_left == 0:
        os.kill(os.getpid(), signal.SIGTERM)


register_optimizer_step_post_hook(_signal_after_the_step)
