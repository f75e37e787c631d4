"""A slow warm-up, for tests: with this folder on PYTHONPATH, the process's first forward (its
first evaluation batch) and its first optimizer step each take SLOW_WARM_UP_SECONDS longer, as
they do on a GPU where they compile and tune."""
import os
import time

from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

_handles = {}


def _sleep_once(name):
    def sleep(*args):
        time.sleep(float(os.environ["SLOW_WARM_UP_SECONDS"]))
        _handles.pop(name).remove()
    return sleep


_handles["forward"] = register_module_forward_pre_hook(_sleep_once("forward"))
_handles["step"] = register_optimizer_step_post_hook(_sleep_once("step"))
