"""Atomic, verified, per-rank checkpoints of a training run.

A checkpoint is a folder ``checkpoints/step-<K>/`` holding

* ``model.pt`` (written by rank 0): the model weights and BERT config, the step, and the size
  of ``metrics.jsonl`` at that step;
* ``rank-<R>.pt`` (one per rank): that rank's optimizer state (for the 1-bit optimizers, its
  own error-feedback buffers), its LR-scheduler state and the bytes it has sent so far;
* with ``--fsdp``, ``dcp/``: the sharded model and optimizer state, written by every rank
  through ``torch.distributed.checkpoint`` (:mod:`onebit.dcp`); ``model.pt`` and
  ``rank-<R>.pt`` then hold the rest;
* ``manifest.json`` (rank 0, written last): the step, the world size and the SHA-256 digest of
  every file. A checkpoint without a manifest is incomplete and never loaded.

Every file is written atomically (:mod:`onebit.atomic`). Older checkpoints are deleted
only after the new manifest exists, and the newest ``keep`` complete ones are kept, so a
checkpoint that turns out to be truncated or corrupt (its digest or ``torch.load`` fails) is
reported and the previous one is used. Everything loads with ``torch.load(weights_only=True)``.
The data order and the per-step random seeds are functions of the step alone, so the step is
the whole data position.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from onebit.atomic import atomic_path, write_bytes_atomic

logger = logging.getLogger(__name__)

MODEL_FILE = "model.pt"
MANIFEST_FILE = "manifest.json"
#: The folder of the state every rank writes a part of (``torch.distributed.checkpoint``).
SHARED_DIR = "dcp"
_STEP_DIR_RE = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated or corrupt."""


@dataclass
class Checkpoint:
    """What one rank loaded: the shared part (``model``, rank 0 only) and its own part."""

    step: int
    path: Path
    model: dict[str, Any] | None
    rank_state: dict[str, Any]


def step_dir(checkpoint_root: Path, step: int) -> Path:
    return checkpoint_root / f"step-{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _write(path: Path, payload: bytes) -> str:
    """Write ``payload`` to ``path`` atomically; return its SHA-256."""
    write_bytes_atomic(path, payload)
    return hashlib.sha256(payload).hexdigest()


def _save(path: Path, obj: Any) -> str:
    """``torch.save`` ``obj`` to ``path`` atomically, straight to the file (no copy of the
    state in memory: a simulation's error buffers can be gigabytes); return its SHA-256."""
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
    return _file_digest(path)


def _file_digest(path: Path, chunk: int = 1 << 24) -> str:
    """SHA-256 of the file at ``path``, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def complete_steps(checkpoint_root: Path) -> list[int]:
    """Steps of the checkpoints that have a manifest, newest first."""
    if not checkpoint_root.is_dir():
        return []
    steps = []
    for entry in checkpoint_root.iterdir():
        match = _STEP_DIR_RE.match(entry.name)
        if match and (entry / MANIFEST_FILE).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps, reverse=True)


def save(
    checkpoint_root: Path,
    step: int,
    model_state: dict[str, Any] | None,
    rank_state: dict[str, Any],
    keep: int,
    write_shared: Callable[[Path], None] | None = None,
) -> None:
    """Collective: every rank writes its part (and, with ``write_shared``, its part of the
    shared folder, which that call writes collectively); rank 0 (which passes
    ``model_state``) writes the manifest once all parts are on disk, then old checkpoints
    beyond ``keep`` are removed."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    folder = step_dir(checkpoint_root, step)
    folder.mkdir(parents=True, exist_ok=True)
    digests = {rank_file(rank): _save(folder / rank_file(rank), rank_state)}
    if rank == 0:
        if model_state is None:
            raise ValueError("rank 0 must pass the model state")
        digests[MODEL_FILE] = _save(folder / MODEL_FILE, model_state)
    if write_shared is not None:
        write_shared(folder / SHARED_DIR)
    gathered: list[dict[str, str] | None] = [None] * world
    dist.all_gather_object(gathered, digests)
    if rank == 0:
        files = {name: digest for part in gathered for name, digest in part.items()}
        if write_shared is not None:
            for path in sorted((folder / SHARED_DIR).iterdir()):
                files[f"{SHARED_DIR}/{path.name}"] = _file_digest(path)
        manifest = {"step": step, "world_size": world, "files": files}
        _write(folder / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
    dist.barrier()
    outdated = complete_steps(checkpoint_root)[keep:]
    for old in outdated:
        (step_dir(checkpoint_root, old) / rank_file(rank)).unlink(missing_ok=True)
    dist.barrier()
    if rank == 0:
        for old in outdated:
            shutil.rmtree(step_dir(checkpoint_root, old), ignore_errors=True)


def _load_verified(folder: Path, name: str, manifest: dict[str, Any]) -> dict[str, Any]:
    path = _verify(folder, name, manifest)
    try:  # mapped, not read into memory: a simulation's error buffers can be gigabytes
        return torch.load(path, weights_only=True, map_location="cpu", mmap=True)
    except Exception as exc:  # torch.load raises many types on a damaged archive
        raise CheckpointError(f"cannot load {path}: {exc}") from exc


def _verify(folder: Path, name: str, manifest: dict[str, Any]) -> Path:
    """The path of file ``name`` once its digest is the manifest's."""
    path = folder / name
    expected = manifest["files"].get(name)
    if expected is None:
        raise CheckpointError(f"{folder / MANIFEST_FILE} does not list {name}")
    try:
        actual, size = _file_digest(path), path.stat().st_size
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if actual != expected:
        raise CheckpointError(
            f"{path} is truncated or corrupt: {size} bytes with SHA-256 {actual[:12]}..., "
            f"the manifest recorded {expected[:12]}..."
        )
    return path


def _try_load(folder: Path, rank: int, world: int) -> Checkpoint:
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
        step = int(manifest["step"])
        saved_world = int(manifest["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"unreadable manifest in {folder}: {exc}") from exc
    if saved_world != world:
        raise CheckpointError(
            f"{folder} was written by {saved_world} workers, this job has {world}: each "
            "worker's 1-bit error-feedback state is its own; resume with the same --workers"
        )
    model = _load_verified(folder, MODEL_FILE, manifest) if rank == 0 else None
    rank_state = _load_verified(folder, rank_file(rank), manifest)
    shared = sorted(name for name in manifest["files"] if name.startswith(f"{SHARED_DIR}/"))
    for name in shared[rank::world]:  # each rank checks its share of the shared files
        _verify(folder, name, manifest)
    return Checkpoint(step=step, path=folder, model=model, rank_state=rank_state)


def load_latest(checkpoint_root: Path) -> Checkpoint | None:
    """Collective: the newest checkpoint that every rank can load, or None if there is none.

    Rank 0's list of complete checkpoints is used by all. A checkpoint that fails on any rank
    is reported (by that rank, with the reason) and the next older one is tried.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    candidates = [complete_steps(checkpoint_root) if rank == 0 else None]
    dist.broadcast_object_list(candidates, src=0)
    for step in candidates[0]:
        folder = step_dir(checkpoint_root, step)
        try:
            loaded: Checkpoint | None = _try_load(folder, rank, world)
            problem = ""
        except CheckpointError as exc:
            loaded, problem = None, str(exc)
            logger.error("rank %d: checkpoint at step %d is unusable: %s", rank, step, problem)
        ok = torch.tensor([0 if loaded is None else 1])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if int(ok):
            return loaded
        if rank == 0:
            logger.error("Skipping the checkpoint at step %d; trying the previous one", step)
    if candidates[0] and rank == 0:
        logger.error("No usable checkpoint in %s; starting from step 0", checkpoint_root)
    return None


def latest_model_state(checkpoint_root: Path) -> tuple[int, dict[str, Any]]:
    """Single process: the step and ``model.pt`` contents of the newest checkpoint that loads."""
    for step in complete_steps(checkpoint_root):
        folder = step_dir(checkpoint_root, step)
        try:
            manifest = json.loads((folder / MANIFEST_FILE).read_text())
            return step, _load_verified(folder, MODEL_FILE, manifest)
        except (CheckpointError, OSError, ValueError) as exc:
            logger.error(
                "Checkpoint at step %d is unusable (%s); trying the previous one", step, exc
            )
    raise FileNotFoundError(f"no usable checkpoint in {checkpoint_root}")
