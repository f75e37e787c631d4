"""Which Triton runs the kernels, chosen where a program starts: attention/__init__.py imports
this module first, before any module of the package imports triton.

- Without a CUDA GPU, Triton's interpreter (TRITON_INTERPRET=1), so that `from attention import
  attention` gives working Triton backends on any machine. Triton reads that switch as it
  defines each @triton.jit function, its own helpers in triton.language (tl.max, tl.cdiv, ...)
  included, which it defines when triton is imported. So the choice is made here only while
  triton is not loaded yet; a program that imports triton first (torch.compile's machinery
  does) and wants the interpreter sets TRITON_INTERPRET=1 itself, before that import. If it
  does not, the Triton backends refuse CPU tensors with one line saying so
  (launch.check_kernel_device), and the other backends run as ever.
- NANOFA2_ADA=1: the consumer-card path (launch.py), whose Ampere-class mma.sync Triton reads as
  it compiles a kernel (DISABLE_MMA_V3=1).
An explicit TRITON_INTERPRET is left as it is.
"""
import os
import sys

import torch

if "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
if os.environ.get("NANOFA2_ADA") == "1":
    os.environ["DISABLE_MMA_V3"] = "1"  # Ampere-class mma.sync, as an sm_89 card runs, not Hopper's wgmma
