"""What the tests share, imported as ``helpers.<module>`` (``tests/`` is on pytest's path).

The oracle (``oracle``, ``oracle_onebit``, ``oracle_zero_one_adam``): independent
single-process models the library is tested against; ``traffic_probe``: the bytes counted at
torch.distributed's process group; the problems several test modules share
(``onebit_problem``: 1-bit LAMB and 1-bit Adam on four tensors; ``jobs``: the tiny job of
the end-to-end tests and its inputs). No test module imports another test module: what two of
them need goes here, and fixtures several modules use go to a ``conftest.py``.
"""
