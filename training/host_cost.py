"""What one call costs the host: bench.py --mode=host's method, on any machine.

A call's host time is the CPU time of the calling thread while it runs (time.thread_time). On a
GPU the kernels it launches run asynchronously, so that is the time the host spends issuing
them; the GPU is synchronised between calls, outside the timed part, so that no call waits on a
full launch queue. The cases take turns (least_host_us), and each keeps its least mean over the
rounds: other processes and the host's drift fall on all alike, and the least is the call's own.

Without a GPU, stand_in_for_the_gpu() lets the Triton backends do their host work as on a GPU:
Triton compiles for a GPU (no interpreter) and its real launch path runs (JITFunction.run, the
autotuner, CompiledKernel[grid], the launcher's Python), with only the CUDA driver replaced:
compiling gives a CompiledKernel with no binary, and the C launch (parsing the arguments,
cuLaunchKernelEx: a few µs on a GPU) is a Python stand-in that reads each tensor's pointer, as
the C launcher does. No kernel runs. The tuner times nothing (its first candidate wins). One more
stand-in, for torch's CUDA caching allocator, which hands a freed block back at once: glibc's
malloc maps and unmaps every block over 128 KB instead, several µs a tensor, so blocks stay in
its heap (mallopt). Torch's own kernels still run on the CPU: the rows that run them take tiny
tensors, where the math costs next to nothing and what is left is the dispatch, on one thread (a
thread pool's spinning would count as the caller's time). Written against
Triton's internals as of 3.9: if an update breaks it, fix the stand-in, not the numbers.
"""
import ctypes
import os
import sys
import time
import types

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def least_host_us(cases, rounds=15, calls=50, synchronize=lambda: None):
    """{name: µs}: the least, over rounds, of each case's mean host time a call. cases: {name:
    call}; each is called a few times first (warm-up: tuning, compiling, the plans)."""
    for call in cases.values():
        for _ in range(5):
            call()
        synchronize()
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for name, call in cases.items():
            spent = 0.0
            for _ in range(calls):
                start = time.thread_time()
                call()
                spent += time.thread_time() - start
                synchronize()
            best[name] = min(best[name], spent / calls * 1e6)
    return best


def stand_in_for_the_gpu():
    """Install the stand-in CUDA driver (the module's docstring); before attention or anything
    else imports triton, as Triton reads TRITON_INTERPRET as it loads."""
    if "triton" in sys.modules:
        raise RuntimeError("stand_in_for_the_gpu() must run before anything imports triton")
    os.environ.pop("TRITON_INTERPRET", None)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    torch.set_num_threads(1)

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia import driver as nvidia
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class Utils:
        def launch(self, grid_x, grid_y, grid_z, stream, function, cooperative, pdl, kernel_metadata,
                   launch_metadata, enter_hook, exit_hook, global_scratch, profile_scratch, annotations, signature,
                   args):
            assert len(args) == len(annotations), (len(args), len(annotations))
            for arg in args:  # the C launcher's getPointer: data_ptr() of each tensor
                if hasattr(arg, "data_ptr"):
                    arg.data_ptr()

        def build_signature_metadata(self, signature):
            return tuple(signature)

        def is_stream_capturing(self, stream):
            return False

    class Driver:
        utils = Utils()
        launcher_cls = nvidia.CudaLauncher

        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def allocate_default_profile_scratch(self, *args):
            return None

    def compile_nothing(self, key, signature, device, constexprs, options, attrs, warmup):
        """JITFunction._do_compile: a CompiledKernel with no binary, and the real launcher's Python."""
        source = types.SimpleNamespace(constants=constexprs, signature=signature, fn=self)
        metadata = types.SimpleNamespace(num_ctas=1, global_scratch_size=0, global_scratch_align=1,
                                         profile_scratch_size=0, profile_scratch_align=1,
                                         launch_cooperative_grid=False, launch_pdl=False, tensordesc_meta=None)
        kernel = CompiledKernel.__new__(CompiledKernel)
        kernel.module, kernel._module_pid, kernel.function, kernel.packed_metadata = object(), None, 0, ()
        kernel.name, kernel.src, kernel._run = self.__name__, source, nvidia.CudaLauncher(source, metadata)
        self.device_caches[device][0][key] = kernel
        return kernel

    driver.set_active(Driver())
    # What the C utilities module (not built without a GPU) gives the launcher.
    nvidia.PyKernelArg = lambda nested_tuple, type: (nested_tuple, type)
    nvidia.ARG_CONSTEXPR, nvidia.ARG_KERNEL, nvidia.ARG_TUPLE = 0, 1, 2
    JITFunction._do_compile = compile_nothing
    torch.cuda.is_current_stream_capturing = lambda: False

    from attention import launch, triton_backward, triton_forward
    assert not launch.INTERPRETING
    triton_forward.check_kernel_device = lambda t: None  # the CPU tensors are the GPU's here
    for kernel in (triton_forward._attn_fwd, triton_backward._attn_bwd):
        kernel.do_bench = lambda call, quantiles: (call(), [0.0] * len(quantiles))[1]
        kernel.cache_results = False
