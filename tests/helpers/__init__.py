"""What the tests share, imported as ``helpers.<module>`` (``tests/`` is on pytest's path).

The oracle (``oracle``, ``oracle_onebit``, ``oracle_zero_one_adam``): independent
single-process models the library is tested against; ``traffic_probe``: the bytes counted at
torch.distributed's process group. No test module imports another test module: what two of
them need goes here, and fixtures several modules use go to a ``conftest.py``.
"""
