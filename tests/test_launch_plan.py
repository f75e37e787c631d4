"""The tuner's key: the sequence lengths bucketed (launch.length_bucket), so that a new prompt
length tunes only where it starts a new bucket, while the kernels get the exact lengths."""
import torch

from attention import triton_backward, triton_forward
from attention.triton_backward import flash_backward
from attention.triton_forward import flash_forward
from test_attention import TOLERANCE, assert_all_close, random_qkv, reference


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


def first_rows(n, seed=0):
    """q, k, v: the first n rows of float32 (1, 2, 128, 16) tensors, whose strides do not depend on n."""
    return [t[:, :, :n] for t in detached(*random_qkv((1, 2, 128, 16), 128, seed=seed))]


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
