"""Launch plans (attention/launch_plan.py), the tuner's key and the eager route around the
custom operators, on the CPU. Triton's interpreter compiles nothing, so here each kernel's
launch is made to hand back a stand-in compiled kernel, as Triton's launch does on a GPU. It
remembers what Triton would have compiled it for (each tensor's dtype and 16-byte alignment,
each integer's being 1 or a multiple of 16, every other argument's value, the device) and,
launched from a plan, fails unless the arguments are the same; then it runs the kernel in the
interpreter. Each test changes one thing a plan's key must see: a stale plan would fail the
stand-in's check or the float64 reference. The tuner keys the lengths on power-of-two buckets,
so a new prompt length tunes only where it starts a bucket; the kernels get the exact lengths."""
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from attention import attention, launch_plan, triton_backward, triton_forward, triton_ops
from attention.triton_backward import flash_backward
from attention.triton_forward import flash_forward
from test_attention import TOLERANCE, assert_all_close, random_qkv, reference


def specialisation(args):
    """What Triton compiles a kernel for, of its arguments (stricter on integers it does not specialise)."""
    return [(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
            else (a == 1, a % 16 == 0) if type(a) is int else a for a in args]


class StandInCompiledKernel:
    """What a kernel's launch returns on a GPU, for the arguments args (all of them, in order) on device."""

    def __init__(self, interpreted, run, args, device, launches):
        self.interpreted, self.run, self.launches = interpreted, run, launches
        self.specialisation, self.device = specialisation(args), device

    def __getitem__(self, grid):
        def launch(*args):
            assert launch_plan.current_device() == self.device, "a plan ran on another device than its kernel's"
            assert specialisation(args) == self.specialisation, "a plan ran a kernel compiled for other arguments"
            self.launches.append(("plan", self.interpreted.fn.__name__))
            self.run(*args, grid=grid, warmup=False)
        return launch


class Launches(list):
    """[(how, kernel name), ...] of every launch, how being "triton" (Triton's own launch, after
    which a plan is made) or "plan"; and device, the device Triton launches on."""
    device = 0


@pytest.fixture
def launches(monkeypatch):
    """Launches, every kernel's launch handing back a stand-in compiled kernel; no plan yet."""
    record = Launches()
    monkeypatch.setattr(launch_plan, "current_device", lambda: record.device)
    for interpreted in (triton_forward._attn_fwd.fn, triton_backward._attn_bwd.fn, triton_backward._attn_bwd_delta):
        def run(*args, grid, warmup, interpreted=interpreted, original=interpreted.run, **kwargs):
            record.append(("triton", interpreted.fn.__name__))
            original(*args, grid=grid, warmup=warmup, **kwargs)
            named = dict(zip(interpreted.arg_names, args)) | kwargs
            every_argument = [named[name] for name in interpreted.arg_names]
            return StandInCompiledKernel(interpreted, original, every_argument, record.device, record)
        monkeypatch.setattr(interpreted, "run", run)
    monkeypatch.setattr(triton_forward, "PLANS", {})
    monkeypatch.setattr(triton_backward, "PLANS", {})
    return record


def check_forward_and_backward(q, k, v, is_causal=True):
    """flash_forward and flash_backward on q, k, v against the float64 reference."""
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    o, lse = flash_forward(q, k, v, is_causal)
    dq, dk, dv = flash_backward(q, k, v, o, do, lse, is_causal)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = reference(q, k, v, is_causal, do)
    assert_all_close([("O", o, o_ref), ("lse", lse, lse_ref), ("dQ", dq, dq_ref), ("dK", dk, dk_ref),
                      ("dV", dv, dv_ref)], TOLERANCE[q.dtype])


def detached(*tensors):
    return [t.detach() for t in tensors]


def test_a_layout_seen_before_launches_from_its_plan(launches):
    q, k, v = first_rows(40)
    check_forward_and_backward(q, k, v)
    assert [how for how, _ in launches] == ["triton"] * 3
    check_forward_and_backward(q, k, v)
    assert launches[3:] == [("plan", "_attn_fwd"), ("plan", "_attn_bwd_delta"), ("plan", "_attn_bwd")]


def unaligned_copy(t):
    """t's values in a tensor of t's shape and strides whose data starts 4 bytes past 16-byte alignment."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    flat = torch.empty(extent + 8, dtype=t.dtype)
    offset = next(i for i in range(1, 8) if (flat.data_ptr() + i * t.element_size()) % 16)
    return flat[offset:].as_strided(t.shape, t.stride()).copy_(t)


def first_rows(n, seed=0):
    """q, k, v: the first n rows of float32 (1, 2, 128, 16) tensors, whose strides do not depend on n."""
    return [t[:, :, :n] for t in detached(*random_qkv((1, 2, 128, 16), 128, seed=seed))]


# Each a change to the second call that a plan's key must see: q, k, v of the second call, and
# the device it runs on, from the first call's first_rows(40) on device 0.
def a_new_dtype(q, k, v):
    return [torch.empty_strided(t.shape, t.stride(), dtype=torch.float16).copy_(t) for t in (q, k, v)], 0


def an_unaligned_view(q, k, v):
    return [unaligned_copy(t) for t in (q, k, v)], 0


def a_new_length_bucket(q, k, v):
    return first_rows(100, seed=1), 0


def a_new_length_in_the_bucket(q, k, v):
    return first_rows(33, seed=1), 0


def other_strides(q, k, v):
    return [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)], 0


def another_device(q, k, v):
    return (q, k, v), 1


@pytest.mark.parametrize("change", [a_new_dtype, an_unaligned_view, a_new_length_bucket, a_new_length_in_the_bucket,
                                    other_strides, another_device])
def test_a_change_the_plan_did_not_see_takes_tritons_own_launch(change, launches):
    q, k, v = first_rows(40)
    check_forward_and_backward(q, k, v)
    (q, k, v), launches.device = change(q, k, v)
    del launches[:]
    check_forward_and_backward(q, k, v)
    assert [how for how, _ in launches] == ["triton"] * 3


def test_the_unaligned_copy_differs_in_its_alignment_alone():
    q, _, _ = first_rows(40)
    copy = unaligned_copy(q)
    assert copy.data_ptr() % 16 and copy.stride() == q.stride() and torch.equal(copy, q)


def test_a_new_length_tunes_only_where_it_starts_a_new_bucket(monkeypatch):
    """The tuner keys the lengths on launch.length_bucket: of 40, 50, 64, 65 and 100 query rows
    (and as many keys) only 40 and 65 start a bucket, in the forward and the backward alike."""
    tuned = []
    for kernel in (triton_forward._attn_fwd, triton_backward._attn_bwd):
        def prune(configs, named_args, original=kernel.early_config_prune, name=kernel.fn.fn.__name__, **kwargs):
            tuned.append((name, named_args["N_Q"]))
            return original(configs, named_args, **kwargs)
        monkeypatch.setattr(kernel, "early_config_prune", prune)
        monkeypatch.setattr(kernel, "cache", {})
    for n in (40, 50, 64, 65, 100):
        check_forward_and_backward(*first_rows(n))
    assert tuned == [("_attn_fwd", 40), ("_attn_bwd", 40), ("_attn_fwd", 65), ("_attn_bwd", 65)]


class DispatchWatcher(TorchDispatchMode):
    """Records the operators it sees, as a FLOP counter or fake tensors would see them."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


class FunctionWatcher(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def triton_operators_called(monkeypatch):
    """Records, by name, each call of FlashAttentionTriton's two custom operators."""
    called = []
    for name in ("flash_forward_op", "flash_backward_op"):
        op = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name, lambda *args, op=op, name=name: called.append(name) or op(*args))
    return called


def test_plain_eager_calls_run_the_kernels_without_the_operators(monkeypatch):
    called = triton_operators_called(monkeypatch)
    q, k, v = random_qkv((1, 2, 20, 16), 20)
    attention(q, k, v, True, "triton").sum().backward()
    assert called == [] and q.grad.abs().sum() > 0


# A torch function mode sees nothing the autograd engine runs: the backward's operator is not its.
@pytest.mark.parametrize("watcher,operators", [(DispatchWatcher, ["flash_forward", "flash_backward"]),
                                               (FunctionWatcher, ["flash_forward"])])
def test_a_mode_sees_the_operators(watcher, operators, monkeypatch):
    """A dispatch mode (a FLOP counter, fake tensors) or a torch function mode must see the
    operators, not the kernels' launches: under one, calls take the operators."""
    called = triton_operators_called(monkeypatch)
    q, k, v = random_qkv((1, 2, 20, 16), 20)
    with watcher() as watching:
        attention(q, k, v, True, "triton").sum().backward()
    assert called == [f"{name}_op" for name in operators]
    assert {getattr(torch.ops.nanofa2, name).default for name in operators} <= set(watching.seen)
