"""The comparisons of a run on nodes of ``L > 1`` workers (wire bytes are per node: what
crosses its one shaped link):

* the hierarchical exchange against the flat one (``onebit-lamb-ddp``, else ``onebit-lamb``):
  compression-stage step and ``optimizer.step()`` time ratios, and the ratio of wire bytes per
  node per compression step (ideally ``1/L``);
* 1-bit LAMB on FSDP2 sharded within the node (``hsdp-onebit-lamb``) against LAMB on FSDP's
  own HSDP (``hsdp-lamb``), whose dense allreduce of each slice between nodes the 1-bit
  exchange replaces: wire bytes per node per compression step (ideally 32x fewer) and step
  time.
"""

from __future__ import annotations

from typing import Any

from onebit.bench.settings import FLAT_ONEBIT_LAMB_METHODS, HIERARCHICAL_METHOD, HSDP_BASELINE

__all__ = ["compare_nodes", "node_targets", "target"]

#: Targets of the hierarchical exchange on nodes of L workers: at most this many times 1/L of
#: the flat exchange's wire bytes per node, and a compression stage at least this much faster.
HIERARCHICAL_BYTES_SLACK = 1.05
HIERARCHICAL_SPEEDUP = 1.5
#: The 1-bit HSDP method, and the least reduction of its bytes between nodes against HSDP's
#: dense allreduce (32x less headers and scales, as the flat exchange's target).
HSDP_ONEBIT = "hsdp-onebit-lamb"
HSDP_BYTES_REDUCTION = 30.0


def target(met: bool | None, detail: str) -> dict[str, Any]:
    return {"met": met, "detail": detail}


def compare_nodes(summary: dict[str, Any]) -> None:
    """Add ``vs_flat`` to the hierarchical method's summary and ``vs_hsdp`` to the 1-bit
    HSDP method's, where both sides ran."""
    _compare_hierarchical(summary)
    ours, theirs = summary.get(HSDP_ONEBIT), summary.get(HSDP_BASELINE)
    if ours is None or theirs is None:
        return
    ours["vs_hsdp"] = {"compression_stage_speedup": theirs["t_comp"] / ours["t_comp"]}
    if ours["wire_comp"] and theirs["wire_comp"]:
        ours["vs_hsdp"]["wire_bytes_reduction"] = theirs["wire_comp"] / ours["wire_comp"]


def _compare_hierarchical(summary: dict[str, Any]) -> None:
    """Add ``vs_flat`` to the hierarchical method's summary: how it compares with the flat
    1-bit LAMB of the same run in the compression stage."""
    hier = summary.get(HIERARCHICAL_METHOD)
    flat_name = next((m for m in FLAT_ONEBIT_LAMB_METHODS if m in summary), None)
    if hier is None or flat_name is None:
        return
    flat = summary[flat_name]
    ours, theirs = hier["stages"]["compression"], flat["stages"]["compression"]
    vs_flat: dict[str, Any] = {
        "method": flat_name,
        "compression_stage_speedup": flat["t_comp"] / hier["t_comp"],
    }
    if "rank0_optimizer_step_seconds" in ours and "rank0_optimizer_step_seconds" in theirs:
        vs_flat["optimizer_step_speedup"] = (
            theirs["rank0_optimizer_step_seconds"] / ours["rank0_optimizer_step_seconds"]
        )
    if hier["wire_comp"] and flat["wire_comp"]:
        vs_flat["wire_bytes_ratio"] = hier["wire_comp"] / flat["wire_comp"]
    hier["vs_flat"] = vs_flat


def node_targets(raw: dict[str, Any]) -> dict[str, Any]:
    """The targets of the hierarchical exchange and of 1-bit HSDP, on nodes of several
    workers."""
    return {**_hierarchical_targets(raw), **_hsdp_targets(raw["summary"])}


def _hsdp_targets(summary: dict[str, Any]) -> dict[str, Any]:
    versus = summary.get(HSDP_ONEBIT, {}).get("vs_hsdp", {})
    reduction = versus.get("wire_bytes_reduction")
    if reduction is None:
        return {}
    ours, theirs = summary[HSDP_ONEBIT]["wire_comp"], summary[HSDP_BASELINE]["wire_comp"]
    return {
        "hsdp_inter_node_bytes_30x": target(
            reduction >= HSDP_BYTES_REDUCTION,
            f"wire bytes per node per compression step, {HSDP_BASELINE} / {HSDP_ONEBIT}: "
            f"{theirs / 1e6:.3f} MB / {ours / 1e6:.3f} MB = {reduction:.1f}x (target >= "
            f"{HSDP_BYTES_REDUCTION:g}x: 32x less headers and scales)",
        )
    }


def _hierarchical_targets(raw: dict[str, Any]) -> dict[str, Any]:
    """The hierarchical exchange's targets, on nodes of several workers."""
    settings, summary = raw["settings"], raw["summary"]
    per_node = settings.get("workers_per_node", 1)
    hier = summary.get(HIERARCHICAL_METHOD, {})
    vs_flat = hier.get("vs_flat")
    if per_node < 2 or vs_flat is None:
        return {}
    flat = vs_flat["method"]
    targets: dict[str, Any] = {}
    ratio = vs_flat.get("wire_bytes_ratio")
    if ratio is not None:
        limit = HIERARCHICAL_BYTES_SLACK / per_node
        targets["hierarchical_inter_node_bytes"] = target(
            ratio <= limit,
            f"wire bytes per node per compression step, {HIERARCHICAL_METHOD} / {flat}: "
            f"{hier['wire_comp'] / 1e6:.3f} MB / {summary[flat]['wire_comp'] / 1e6:.3f} MB = "
            f"{ratio:.3f} (target <= {HIERARCHICAL_BYTES_SLACK:g}/L = {limit:.3f}, L = {per_node})",
        )
    speedup = vs_flat["compression_stage_speedup"]
    step = vs_flat.get("optimizer_step_speedup")
    detail = f"compression-stage step time, {flat} / {HIERARCHICAL_METHOD}: {speedup:.2f}x" + (
        "" if step is None else f" (optimizer.step() alone, rank 0: {step:.2f}x)"
    )
    if settings["bandwidth"] is None:
        detail = f"not applicable: unshaped links; {detail}"
    targets["hierarchical_compression_stage_1.5x"] = target(
        speedup >= HIERARCHICAL_SPEEDUP if settings["bandwidth"] else None, detail
    )
    return targets
