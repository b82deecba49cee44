"""Where one process sits in the job, and failing together: a step every rank must pass."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


@dataclasses.dataclass
class Rank:
    """Where this process sits in the job."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def collective_ok(error: str | None, what: str) -> None:
    """Raise on every rank if any rank failed ``what`` (the first error message is shown)."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        rank, message = failed[0]
        raise RuntimeError(f"{what} failed on rank {rank}: {message}")
