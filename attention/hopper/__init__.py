"""Kernels for Hopper (sm_90) alone, in Gluon: FlashAttention-3's warp specialisation written out.

    forward.py   the forward, warp-specialised and persistent: a TMA load warp, two softmax warpgroups
    backward.py  the backward, warp-specialised: dQ summed by TMA's reduce-add
    common.py    what they share: when they serve, TMA descriptors, the load ring (their tile rules: masks.py)

triton_forward.flash_forward and triton_backward.flash_backward ask serves() first and send a call
here only where these kernels measured faster than the plain Triton kernels on the H200: 16-bit,
head dims 64 and 128, long enough sequences; any mask (causal, a window, none) and grouped-query
heads. A consumer card (and NANOFA2_ADA=1) never comes here. docs/hopper.md explains the terms.
"""
