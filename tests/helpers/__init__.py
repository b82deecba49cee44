"""What the tests share, imported as ``helpers.<module>`` (``tests/`` is on pytest's path).

No test module imports another test module: what two of them need is here, and fixtures
several modules use are in a ``conftest.py`` (``end_to_end/conftest.py``: ``run_dir``).

The oracle, independent single-process models the library is tested against:
``oracle`` (the 1-bit exchanges over n workers), ``oracle_onebit`` (1-bit LAMB and 1-bit
Adam), ``oracle_zero_one_adam`` (0/1 Adam).

The problems and inputs several test modules share: ``onebit_problem`` (1-bit LAMB and
1-bit Adam on four tensors), ``zero_one_adam_problem`` (0/1 Adam and its schedule),
``simulation`` (the model of the many-worker simulation's tests), ``simulated_exchange``
(the library's simulated exchange driven call by call), ``per_tensor_inputs`` (the tensors
of the per-tensor exchange's tests), ``gradients`` (parameters with a gradient of a given
norm), ``jobs`` (the tiny job of the end-to-end tests and its inputs).

And: ``traffic_probe`` (the bytes counted at torch.distributed's process group),
``emulated_cluster`` (whether the emulated cluster can run here), ``paths`` (fixtures, docs
and scripts).
"""
