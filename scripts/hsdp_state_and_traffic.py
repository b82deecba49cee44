"""HSDP with 1-bit between replicas against the replicated optimizer with the hierarchical
exchange, on 4 gloo processes as 2 "nodes" x 2 ranks: optimizer memory per rank, bytes between
nodes per compression step (against HSDP's own dense cross-replica allreduce of the same
slices), and the training loss of both after the same steps.

    python scripts/hsdp_state_and_traffic.py [--warmup 10] [--steps 40] [--width 128]

The model is a small transformer encoder language model on random tokens; both runs start
from the same weights and see the same batches (each rank its own).
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import onebit
from onebit.collectives import ring_allreduce_bytes
from onebit.exchange import node_groups
from onebit.testing import spawn_workers

VOCAB, SEQ, BATCH = 512, 32, 16


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, width),
        torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
        torch.nn.Linear(width, VOCAB),
    )


def _loss(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB // 4, (BATCH, SEQ + 1), generator=gen) * 4 % VOCAB
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _run(rank: int, world: int, warmup: int, steps: int, width: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicated = _model(width)
    sharded = copy.deepcopy(replicated)
    for layer in sharded[1].layers:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(sharded, mesh=mesh["shard"])
    options = dict(lr=2e-3, freeze_step=warmup, compression="fused", weight_decay=0.01)
    replicate_group = mesh["replicate"].get_group()
    sharded_opt = onebit.OneBitLamb(sharded.parameters(), process_group=replicate_group, **options)
    replicated_opt = onebit.OneBitLamb(
        replicated.parameters(), node_groups=node_groups(2), **options
    )
    losses = {}
    for step in range(steps):
        before = (sharded_opt.bytes_sent["compression"], dict(replicated_opt.traffic_by_kind))
        for name, model, opt in (
            ("sharded", sharded, sharded_opt),
            ("replicated", replicated, replicated_opt),
        ):
            loss = _loss(model, step, rank)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name] = loss.detach()
        if step == steps - 1:
            inter_sharded = sharded_opt.bytes_sent["compression"] - before[0]
            inter_replicated = replicated_opt.traffic_by_kind.get("inter_node", 0) - before[1].get(
                "inter_node", 0
            )
    for name in losses:  # the mean over all ranks of the last step's loss
        dist.all_reduce(losses[name])
        losses[name] = losses[name].item() / world
    slice_elements = sum(p.to_local().numel() for p in sharded.parameters())
    return {
        "elements": sum(p.numel() for p in replicated.parameters()),
        "slice_elements": slice_elements,
        "memory": (sharded_opt.memory_bytes(), replicated_opt.memory_bytes()),
        "inter_node": (inter_sharded, inter_replicated),
        "dense_cross_replica": ring_allreduce_bytes(4 * slice_elements, 2),
        "losses": losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", type=int, default=10, help="freeze_step")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=128)
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup (the last step is a compression step)")
    results = spawn_workers(_run, 4, args=(args.warmup, args.steps, args.width), timeout_s=3600)
    print(f"model: {results[0]['elements']} parameters; 2 nodes x 2 ranks; OneBitLamb fused")
    print(
        "| rank | slice elements | state sharded / replicated | + error feedback | "
        "inter-node bytes per compression step: sharded / hierarchical | HSDP dense "
        "allreduce of the slice | dense / sharded |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rank, r in enumerate(results):
        sharded, replicated = r["memory"]
        with_errors = [m["state"] + m["error_feedback"] for m in r["memory"]]
        print(
            f"| {rank} | {r['slice_elements']} | {sharded['state']} / {replicated['state']} = "
            f"{sharded['state'] / replicated['state']:.3f} | {with_errors[0]} / "
            f"{with_errors[1]} = {with_errors[0] / with_errors[1]:.3f} | "
            f"{r['inter_node'][0]} / {r['inter_node'][1]} | {r['dense_cross_replica']} | "
            f"{r['dense_cross_replica'] / r['inter_node'][0]:.1f} |"
        )
    losses = results[0]["losses"]
    gap = losses["sharded"] / losses["replicated"] - 1
    print(
        f"training loss after {args.steps} steps (mean over ranks): sharded "
        f"{losses['sharded']:.4f}, replicated hierarchical {losses['replicated']:.4f} "
        f"({100 * gap:+.2f} %)"
    )


if __name__ == "__main__":
    main()
