"""The main job with FSDP2 (``onebit train --fsdp``): parameters, gradients and optimizer state
sharded over the ``--node-size`` workers of each node, replicated across nodes (HSDP).

* onebit-lamb and onebit-adam: each encoder layer and the whole model ``fully_shard``-ed over
  the node (``mesh["shard"]`` of an M x L mesh); the optimizer's data-parallel group is
  ``mesh["replicate"]``, so the warm-up averages each slice densely between nodes and the
  compression stage exchanges each slice's momentum between nodes at 1 bit (ALGORITHM.md,
  "Sharded parameters (FSDP2 and HSDP)");
* lamb: FSDP's own HSDP on the 2-D mesh, which all-reduces every slice's gradient between
  nodes densely (what the 1-bit exchange replaces).

The bytes a worker sends between nodes are counted (the optimizer's, or LAMB's allreduce of its
slices); FSDP's all-gathers and reduce-scatters inside the node are not. Checkpoints hold the
sharded model and optimizer state through ``torch.distributed.checkpoint`` (:mod:`onebit.dcp`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from onebit import dcp
from onebit.collectives import TrafficCounter, ring_allreduce_bytes
from onebit.optim import local_tensor
from onebit.train import checkpoint
from onebit.train.gradients import build_optimizer
from onebit.train.trainer import EVAL_BATCH, Trainer


class ShardedTrainer(Trainer):
    """:class:`~onebit.train.trainer.Trainer` with the model sharded by FSDP2 within nodes."""

    def _parallelize(self) -> None:
        config = self.config
        self.nodes = self.workers // config.node_size
        self.mesh = init_device_mesh(
            self.rank.device.type,
            (self.nodes, config.node_size),
            mesh_dim_names=("replicate", "shard"),
        )
        # The 1-bit optimizers own the traffic between nodes; LAMB leaves it to FSDP's HSDP.
        shard_mesh = self.mesh["shard"] if config.uses_onebit else self.mesh
        for layer in self.model.base_model.encoder.layer:
            fully_shard(layer, mesh=shard_mesh)
        fully_shard(self.model, mesh=shard_mesh)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(
            config,
            self.params,
            max_grad_norm=config.grad_clip,
            process_group=self.mesh["replicate"].get_group(),
        )
        self.dense_traffic = TrafficCounter()  # LAMB's allreduce of its slices between nodes
        self.slice_bytes = 4 * sum(local_tensor(p).numel() for p in self.params)
        self.forward = self.model

    def _launch(self) -> dict[str, Any]:
        return {**super()._launch(), "fsdp_shard_group": self.config.node_size}

    def _report_extra(self) -> dict[str, Any]:
        return {
            "fsdp": {
                "nodes": self.nodes,
                "shard_group": self.config.node_size,
                "bytes_counted": "between nodes (FSDP's traffic inside a node is not)",
            }
        }

    def _averages_gradients(self) -> bool:
        return False  # FSDP averages within the node; HSDP or the optimizer between nodes

    def _gradient_step(
        self, step: int, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[float, int]:
        result = super()._gradient_step(step, inputs, labels)
        if not self.config.uses_onebit:  # HSDP's allreduce of this rank's slices
            bytes_sent = ring_allreduce_bytes(self.slice_bytes, self.nodes)
            self.dense_traffic.record("allreduce", bytes_sent)
        return result

    def _eval_batches(self, mine: torch.Tensor, sequences: int) -> tuple[torch.Tensor, ...]:
        """As many batches on every rank (each runs FSDP's collectives), of at most
        :data:`EVAL_BATCH` sequences."""
        largest_share = math.ceil(sequences / self.rank.world)
        return mine.tensor_split(max(1, math.ceil(largest_share / EVAL_BATCH)))

    # ----------------------------------------------------------------- checkpoints
    def _weights_checkpoint(self) -> dict[str, Any]:
        return {}  # in the shared folder

    def _optimizer_checkpoint(self) -> dict[str, Any]:
        return {}

    def _write_shared_checkpoint(self, folder: Path) -> None:
        dcp.save({"model": self.model, "optimizer": self.optimizer}, checkpoint_id=folder)

    def _restore_state(self, resumed: checkpoint.Checkpoint) -> None:
        """The sharded weights and the optimizer's state from the checkpoint's DCP folder."""
        state = {"model": self.model, "optimizer": self.optimizer}
        dcp.load(state, checkpoint_id=resumed.path / checkpoint.SHARED_DIR)
