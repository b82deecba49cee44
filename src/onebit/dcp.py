"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), the standard for FSDP2: models,
onebit optimizers with their error feedback, and whatever else DCP takes, in one call.

    onebit.dcp.save({"model": model, "optimizer": optimizer, "step": step}, checkpoint_id=path)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    onebit.dcp.load(state, checkpoint_id=path)          # now state["step"] is the saved step

Every rank calls both (they are collectives). What is stored under an entry's key ``K``:

* a module (``nn.Module``): its ``state_dict()``, DTensors where FSDP2 shards it, which DCP
  reshards onto the mesh it is loaded on;
* a onebit optimizer (``Lamb``, ``OneBitLamb``, ``OneBitAdam``):

  - ``K.state.<i>.<name>``: parameter i's state (``optimizer.state_dict()``'s numbering);
    per-element tensors of a sharded parameter as DTensors placed like the parameter (DCP
    reshards them too), other tensors as they are (the same on every replica: saved once);
  - ``K.onebit``: hyper-parameters, step counters, stage (the same on every rank);
  - ``K.rank<r>``: rank r's traffic counters and the layout of its error buffers
    (exchange, topology, buckets, the elements of each of its tensors), and
    ``K.error_feedback.rank<r>.{worker_error,server_error}``: its error buffers. A load
    takes a rank's buffers back only where that layout is unchanged, and otherwise restarts
    them from zero with a warning that says what changed, as another world size does;

* anything else (tensors, plain values, ``Stateful`` objects): handed to DCP as it is.

``ZeroOneAdam`` is refused: its replicas differ between synchronisations, which DCP would
save as one (save each rank's ``state_dict()`` with ``torch.save``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from onebit.optim import (
    PER_ELEMENT_STATE,
    Lamb,
    OneBitOptimizer,
    ZeroOneAdam,
    local_tensor,
    params_in_order,
)

__all__ = ["load", "save"]

_ERRORS = ("worker_error", "server_error")


@dataclasses.dataclass
class _Saved:
    """A non-tensor value DCP stores whole (a mapping would be split into its leaves)."""

    value: Any


def save(
    state: Mapping[str, Any],
    checkpoint_id: str | None = None,
    *,
    storage_writer: dcp.StorageWriter | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Save ``state`` (modules, onebit optimizers, anything DCP takes) with ``dcp.save``."""
    payload: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            payload[key] = value.state_dict()
        elif _is_optimizer(key, value):
            payload.update(_optimizer_entries(key, value))
        else:
            payload[key] = value
    dcp.save(
        payload,
        checkpoint_id=checkpoint_id,
        storage_writer=storage_writer,
        process_group=process_group,
    )


def load(
    state: MutableMapping[str, Any],
    checkpoint_id: str | None = None,
    *,
    storage_reader: dcp.StorageReader | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Load what :func:`save` stored into ``state``: modules and optimizers in place, other
    values as ``dcp.load`` does (tensors in place, plain values replaced in ``state``).

    Raises ``ValueError`` naming the entry, with nothing changed, where the checkpoint does
    not hold what ``state`` asks for (another optimizer, other parameter groups, another
    compression, a parameter of another shape). Modules are loaded in place, as
    ``model.state_dict()`` is by ``dcp.load``."""
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError("give checkpoint_id or storage_reader")
        storage_reader = dcp.FileSystemReader(checkpoint_id)
    metadata = storage_reader.read_metadata()
    optimizers = {key: value for key, value in state.items() if _is_optimizer(key, value)}
    _check_optimizers(optimizers, metadata, storage_reader, process_group)
    template: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            template[key] = value.state_dict()  # loaded in place
        elif key in optimizers:
            template.update(_optimizer_template(key, value, metadata))
        else:
            template[key] = value
    dcp.load(
        template,
        checkpoint_id=checkpoint_id,
        storage_reader=storage_reader,
        process_group=process_group,
    )
    for key, value in state.items():
        if isinstance(value, nn.Module):
            value.load_state_dict(template[key])
        elif key in optimizers:
            _load_optimizer(key, value, template)
        else:
            state[key] = template[key]


# --------------------------------------------------------------------- optimizers
def _is_optimizer(key: str, value: Any) -> bool:
    """Whether ``value`` is an optimizer this module saves; refuses those it cannot."""
    if isinstance(value, ZeroOneAdam):
        raise ValueError(
            f"{key!r}: ZeroOneAdam's replicas hold different weights and momenta between "
            "synchronisations, which DCP would save once for all; save each rank's "
            "optimizer.state_dict() with torch.save"
        )
    if isinstance(value, Lamb | OneBitOptimizer):
        return True
    if isinstance(value, torch.optim.Optimizer):
        raise ValueError(
            f"{key!r}: {type(value).__name__} is not a onebit optimizer; save it through "
            "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict"
        )
    return False


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _error_layout(optimizer: OneBitOptimizer) -> dict[str, Any]:
    """What fixes where this rank's error values belong: the optimizer's layout of them, and
    the number of processes."""
    processes = dist.get_world_size() if dist.is_initialized() else 1
    return {**optimizer.error_feedback_layout(), "processes": processes}


def _optimizer_entries(key: str, optimizer: Lamb | OneBitOptimizer) -> dict[str, Any]:
    """The flat DCP entries of ``optimizer`` (see the module's docstring)."""
    state_dict = optimizer.state_dict()
    params = params_in_order(optimizer.param_groups)
    entries: dict[str, Any] = {}
    for index, state in state_dict["state"].items():
        param = params[index]
        for name, value in state.items():
            if name in PER_ELEMENT_STATE and isinstance(param, DTensor):
                value = DTensor.from_local(
                    value,
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
            entries[f"{key}.state.{index}.{name}"] = value
    extra = dict(state_dict.get("onebit") or {})
    errors = {name: extra.pop(name, None) for name in _ERRORS}
    bytes_sent = extra.pop("bytes_sent", None)
    has_errors = errors["worker_error"] is not None
    entries[f"{key}.onebit"] = _Saved(
        {
            "optimizer": type(optimizer).__name__,
            "param_groups": state_dict["param_groups"],
            "extra": extra or None,
            "error_feedback": has_errors,
        }
    )
    rank = _rank()
    layout = None
    if has_errors and isinstance(optimizer, OneBitOptimizer):
        layout = _error_layout(optimizer)
    entries[f"{key}.rank{rank}"] = _Saved({"bytes_sent": bytes_sent, "error_layout": layout})
    if has_errors:
        for name, value in errors.items():
            entries[f"{key}.error_feedback.rank{rank}.{name}"] = value
    return entries


def _check_optimizers(
    optimizers: Mapping[str, Lamb | OneBitOptimizer],
    metadata: Metadata,
    storage_reader: dcp.StorageReader,
    process_group: dist.ProcessGroup | None,
) -> None:
    """Raise ``ValueError`` naming what does not fit, before anything is loaded: a missing
    entry, another optimizer, other parameter groups or another compression (shapes are
    checked by :func:`_optimizer_template`)."""
    for key in optimizers:
        if f"{key}.onebit" not in metadata.state_dict_metadata:
            raise ValueError(f"the checkpoint holds no onebit optimizer under {key!r}")
    shared: dict[str, Any] = {f"{key}.onebit": None for key in optimizers}
    if shared:
        dcp.load(shared, storage_reader=storage_reader, process_group=process_group)
    for key, optimizer in optimizers.items():
        saved = shared[f"{key}.onebit"].value
        if saved["optimizer"] != type(optimizer).__name__:
            raise ValueError(
                f"{key!r} was saved from {saved['optimizer']}, not from {type(optimizer).__name__}"
            )
        optimizer.check_checkpoint(
            {"param_groups": saved["param_groups"]}
            | ({} if saved["extra"] is None else {"onebit": saved["extra"]})
        )


def _optimizer_template(
    key: str, optimizer: Lamb | OneBitOptimizer, metadata: Metadata
) -> dict[str, Any]:
    """Entries for ``dcp.load`` to fill: what the checkpoint holds of ``optimizer`` and of
    this rank, shaped as it was saved; sharded state placed like its parameter here."""
    saved = metadata.state_dict_metadata
    params = params_in_order(optimizer.param_groups)
    rank = _rank()
    own = (f"{key}.rank{rank}", f"{key}.error_feedback.rank{rank}.")
    template: dict[str, Any] = {}
    for fqn, md in saved.items():
        if fqn == f"{key}.onebit" or fqn == own[0]:
            template[fqn] = None
        elif fqn.startswith(own[1]) and isinstance(md, TensorStorageMetadata):
            template[fqn] = torch.zeros(md.size, dtype=md.properties.dtype)
        elif fqn.startswith(f"{key}.state."):
            template[fqn] = _state_template(fqn, md, params)
    return template


def _state_template(fqn: str, md: Any, params: list[Tensor]) -> Any:
    index, name = fqn.rsplit(".", 2)[-2:]
    if not isinstance(md, TensorStorageMetadata):
        return None
    if int(index) >= len(params):
        raise ValueError(f"{fqn}: the optimizer has only {len(params)} parameters")
    param = params[int(index)]
    if name not in PER_ELEMENT_STATE:
        return torch.zeros(md.size, dtype=md.properties.dtype)
    if tuple(md.size) != tuple(param.shape):
        raise ValueError(
            f"{fqn} was saved for a parameter of shape {tuple(md.size)}; parameter {index} "
            f"has shape {tuple(param.shape)}"
        )
    local = torch.zeros(local_tensor(param).shape, dtype=md.properties.dtype)
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local.to(param.device),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def _load_optimizer(key: str, optimizer: Lamb | OneBitOptimizer, loaded: Mapping[str, Any]) -> None:
    """Give ``optimizer`` the state :func:`_optimizer_template`'s entries were loaded with;
    its own ``load_state_dict`` checks everything before it changes anything."""
    shared = loaded[f"{key}.onebit"].value
    prefix = f"{key}.state."
    state: dict[int, dict[str, Any]] = {}
    for fqn, value in loaded.items():
        if fqn.startswith(prefix):
            index, name = fqn[len(prefix) :].split(".")
            state.setdefault(int(index), {})[name] = local_tensor(value)
    state_dict: dict[str, Any] = {"state": state, "param_groups": shared["param_groups"]}
    extra = shared["extra"]
    if extra is not None and isinstance(optimizer, OneBitOptimizer):  # the 1-bit ones' entry
        own = loaded.get(f"{key}.rank{_rank()}")
        part = _rank_part(key, optimizer, own, loaded, shared["error_feedback"])
        state_dict["onebit"] = {**extra, **part}
    optimizer.load_state_dict(state_dict)


def _rank_part(
    key: str,
    optimizer: OneBitOptimizer,
    own: _Saved | None,
    loaded: Mapping[str, Any],
    error_feedback: bool,
) -> dict[str, Any]:
    """This rank's traffic counters and error buffers for ``load_state_dict``: the buffers
    only where their layout is this rank's now (else ``None``, with a warning where the
    checkpoint had error feedback)."""
    rank = _rank()
    part = {} if own is None else own.value
    bytes_sent = part.get("bytes_sent") or {stage: 0 for stage in optimizer.bytes_sent}
    saved_layout, layout = part.get("error_layout"), _error_layout(optimizer)
    errors = {name: loaded.get(f"{key}.error_feedback.rank{rank}.{name}") for name in _ERRORS}
    if saved_layout != layout:
        if error_feedback:
            warnings.warn(
                f"{key!r}: rank {rank}'s error-feedback buffers were "
                f"{_what_changed(saved_layout, layout, own is None)}: they are reset to zero",
                UserWarning,
                stacklevel=3,
            )
        errors = dict.fromkeys(_ERRORS)
    topology = {"world_size": layout["world_size"], "ranks_per_node": layout["ranks_per_node"]}
    if layout["buckets"] is not None:
        topology["buckets"] = layout["buckets"]
    return {"bytes_sent": bytes_sent, **topology, **errors}


def _what_changed(saved: dict[str, Any] | None, now: dict[str, Any], missing: bool) -> str:
    if missing or saved is None:
        return "not saved for this rank (the checkpoint has fewer processes)"
    for name, meaning in (
        ("processes", "processes"),
        ("exchange", "exchange"),
        ("world_size", "data-parallel world size"),
        ("ranks_per_node", "ranks per node"),
        ("buckets", "buckets"),
    ):
        if saved[name] != now[name]:
            return f"saved with {meaning} {saved[name]}, now {now[name]}"
    return (
        f"saved for {sum(saved['numels'])} elements of this rank's {len(saved['numels'])} "
        f"tensors, now {sum(now['numels'])} of {len(now['numels'])} (another sharding)"
    )
