"""The hierarchical exchange in one process: its inter-node bytes against the flat
exchange's, and error buffers of another dtype named before anything is sent."""

from __future__ import annotations

import pytest
import torch

import onebit
from onebit.collectives import padded_size
from onebit.exchange.hierarchical import hierarchical_bytes


def test_inter_node_bytes_are_one_over_l_of_the_flat_exchange():
    """Per node and step: L ranks x their inter-node bytes, against the flat exchange's share
    that leaves the node (8 nodes of 8 ranks, 100M elements)."""
    numel, local, nodes = padded_size(10**8, 64), 8, 8
    hierarchical = local * hierarchical_bytes(numel, local, nodes, torch.float32)["inter_node"]
    flat_per_rank = onebit.collectives.compressed_allreduce_bytes(numel, 64, torch.float32)
    leaving_node = local * flat_per_rank * (64 - local) / (64 - 1)
    assert hierarchical <= 1.05 * leaving_node / local


def test_error_buffers_of_another_dtype_are_named_before_anything_is_sent():
    buffer = torch.zeros(16)
    with pytest.raises(ValueError, match="worker_error is torch.float64 on cpu"):
        onebit.hierarchical_compressed_allreduce(
            buffer, torch.zeros(16, dtype=torch.float64), torch.zeros(16), None, None
        )
    with pytest.raises(ValueError, match="server_error must be contiguous"):
        onebit.hierarchical_compressed_allreduce(
            buffer, torch.zeros(16), torch.zeros(16, 2)[:, 0], None, None
        )
