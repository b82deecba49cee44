"""compressed_allreduce's arithmetic in one process: the padded size and the bytes counted."""

from __future__ import annotations

import pytest
import torch

from onebit.collectives import compressed_allreduce_bytes, padded_size


def test_traffic_of_float64_buffers_counts_float64_scales():
    assert compressed_allreduce_bytes(64, 2, torch.float64) == 2 * 4 + 3 * 8
    assert compressed_allreduce_bytes(64, 2, torch.float32) == 2 * 4 + 3 * 4
    assert compressed_allreduce_bytes(64, 1, torch.float32) == 0


def test_padded_size():
    assert padded_size(0, 1) == 8
    assert padded_size(1, 4) == 32
    assert padded_size(64, 4) == 64
    assert padded_size(65, 3) == 72
    with pytest.raises(ValueError, match="world_size"):
        padded_size(10, 0)
