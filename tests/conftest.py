"""Test-session setup shared by every test module."""

import os

import torch

if not torch.cuda.is_available():
    # Without a GPU the triton backend runs in Triton's interpreter. triton.jit reads this
    # when it decorates a kernel, so it is set before onebit.kernels._triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One thread, as each rank of a run on this machine's cores has: numba then compiles only its
# serial build (its parallel build, which compiles slower, is checked against it in
# tests/unit/test_kernels.py), and in-process tests do not compete with the spawned ranks.
torch.set_num_threads(1)
