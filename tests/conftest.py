"""Test-session setup shared by every test module."""

import os

import torch

if not torch.cuda.is_available():
    # Without a GPU the triton backend runs in Triton's interpreter. triton.jit reads this
    # when it decorates a kernel, so it is set before onebit.kernels._triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
