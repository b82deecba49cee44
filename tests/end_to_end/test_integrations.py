"""onebit under HF Trainer, Accelerate and Lightning, each on 2 gloo processes.

One spawn runs every installed framework in turn; the tests check, per framework, that
onebit's hook is on the DDP model, that the traffic handed to ``torch.distributed`` in the
compression stage is 1/32 of the warm-up's dense traffic, that ranks end bit-identical, and
(Trainer) that the run follows the plain DDP loop on the same batches bit for bit; with the
delayed exchange (Trainer, Lightning), that the last update lands when training ends and that
Lightning validates the weights every rank shares.

Traffic is counted below onebit: every collective issued from Python goes through a method
of ``torch.distributed.ProcessGroup``, patched here to record what each call is handed;
DDP's reducer issues none itself once a comm hook is registered (the hook does). A call's
bytes are those this rank sends in a bandwidth-optimal implementation: an allreduce of S
bytes sends 2 (n-1)/n S, an all-gather of S local bytes (n-1) S, an all-to-all of S bytes
(n-1)/n S.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from helpers.traffic_probe import TrafficProbe
from torch.nn.parallel import DistributedDataParallel

import onebit
from onebit.collectives import (
    allreduce_bytes,
    compressed_allreduce_bytes,
    compressed_allreduce_per_tensor_bytes,
    padded_size,
    ring_allreduce_bytes,
)
from onebit.testing import spawn_workers

FREEZE, STEPS, BATCH, WORLD = 3, 8, 8, 2
OPTIMIZER = dict(lr=1e-2, freeze_step=FREEZE, weight_decay=0.01, max_coeff=0.3)
_HF = all(importlib.util.find_spec(m) for m in ("transformers", "accelerate"))  # onebit[hf]
INSTALLED = {
    "trainer": _HF,
    "accelerate": _HF,
    "lightning": importlib.util.find_spec("lightning") is not None,
}
# The collectives of each stage's gradient traffic; anything else is the framework's own.
GRADIENT_TRAFFIC = {
    "warmup": {"allreduce"},  # DDP's averaging, through onebit's hook
    # the 1-bit exchange's messages (point to point over gloo), the gradient check's all-gather
    "compression": {"send", "all_gather_single"},
}
CONTROL_BYTES = 64  # what a framework may add per step (flags, counters), at most


class Net(torch.nn.Module):
    """A small classifier (9610 parameters) with a Hugging Face style forward."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():  # the same initial weights on every rank and run
            torch.manual_seed(0)
            self.body = torch.nn.Sequential(
                torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10)
            )
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x, labels):
        self.seen.append((x.clone(), labels.clone()))
        logits = self.body(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


NUMELS = [64 * 128, 128, 128 * 10, 10]  # Net's tensors


class Samples(torch.utils.data.Dataset):
    """Synthetic, learnable: labels are the argmax of a fixed projection of x."""

    def __init__(self, n: int = WORLD * BATCH * STEPS) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 64, generator=gen)
        self.labels = (self.x @ torch.randn(64, 10, generator=gen)).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.labels[i]}


def _hooked(model: DistributedDataParallel) -> bool:
    return any(hook is onebit.ddp.onebit_hook for hook, _ in model._comm_hooks)


def _params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def _result(probe, optimizer, module, hooked, **extra):
    return dict(
        records=probe.records,
        bytes_sent=optimizer.bytes_sent,
        compression=optimizer.compression,
        params=_params(module),
        hooked=hooked,
        **extra,
    )


def _run_trainer(rank, delayed=False):
    from transformers import Trainer, TrainingArguments

    from onebit.integrations.hf import OneBitCallback

    options = dict(OPTIMIZER, delayed_exchange=delayed)
    with TrafficProbe() as probe, tempfile.TemporaryDirectory() as out:
        net = Net()
        optimizer = probe.optimizer = onebit.OneBitLamb(net.parameters(), **options)
        args = TrainingArguments(
            output_dir=out,
            max_steps=STEPS,
            per_device_train_batch_size=BATCH,
            lr_scheduler_type="constant",
            max_grad_norm=1.0,
            logging_strategy="no",
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(net, args, train_dataset=Samples(), optimizers=(optimizer, None))
        trainer.add_callback(OneBitCallback(trainer))
        trainer.train()
        hooked = _hooked(trainer.model_wrapped)
    # The plain DDP path (README) on the batches this rank saw, clipped as the Trainer does.
    replay = Net()
    model = DistributedDataParallel(replay)
    replay_optimizer = onebit.OneBitLamb(replay.parameters(), **options)
    onebit.ddp.register_comm_hook(model, replay_optimizer)
    for x, labels in net.seen:
        replay_optimizer.zero_grad()
        model(x, labels)["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        replay_optimizer.step()
    replay_optimizer.finish_exchange()
    same = torch.equal(_params(net), _params(replay))
    return _result(probe, optimizer, net, hooked, same_as_plain_ddp=same)


def _run_accelerate(rank):
    from accelerate import Accelerator

    from onebit.integrations.hf import register_comm_hook

    with TrafficProbe() as probe:
        accelerator = Accelerator(cpu=True)
        net = Net()
        optimizer = probe.optimizer = onebit.OneBitAdam(  # the fused exchange's bytes below
            net.parameters(), lr=1e-3, freeze_step=3, compression="fused"
        )
        loader = torch.utils.data.DataLoader(Samples(), batch_size=BATCH)
        model, prepared, loader = accelerator.prepare(net, optimizer, loader)
        register_comm_hook(model, prepared)
        for _, batch in zip(range(STEPS), loader, strict=False):
            prepared.zero_grad()
            accelerator.backward(model(**batch)["loss"])
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            prepared.step()
        return _result(probe, optimizer, net, _hooked(model))


def _run_lightning(rank, delayed=False):
    import lightning.pytorch as pl

    from onebit.integrations.lightning import OneBitDDPStrategy

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch, batch_index):
            return self.net(**batch)["loss"]

        def validation_step(self, batch, batch_index):
            self.validated.append(_params(self))  # the weights validated, on every rank
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            probe.optimizer = onebit.OneBitLamb(
                self.parameters(), delayed_exchange=delayed, **OPTIMIZER
            )
            return probe.optimizer

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Samples(), batch_size=BATCH)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(Samples(WORLD * BATCH), batch_size=BATCH)

        def on_train_start(self) -> None:
            self.hooked = _hooked(self.trainer.strategy.model)

    with TrafficProbe() as probe:
        module = Classifier()
        module.validated = []
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=OneBitDDPStrategy(),
            max_steps=STEPS,
            gradient_clip_val=1.0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            val_check_interval=FREEZE + 2,  # in the compression stage
            num_sanity_val_steps=0,
        )
        trainer.fit(module)
        return _result(probe, probe.optimizer, module, module.hooked, validated=module.validated)


def _frameworks_worker(rank, world_size, frameworks):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    runs = {
        "trainer": _run_trainer,
        "accelerate": _run_accelerate,
        "lightning": _run_lightning,
        "trainer-delayed": lambda rank: _run_trainer(rank, delayed=True),
        "lightning-delayed": lambda rank: _run_lightning(rank, delayed=True),
    }
    return {name: runs[name](rank) for name in frameworks}


@pytest.fixture(scope="module")
def results():
    # the Trainer's runs first: after Lightning's, accelerate cannot find the process group
    order = ["trainer", "trainer-delayed", "accelerate", "lightning", "lightning-delayed"]
    frameworks = [name for name in order if INSTALLED[name.removesuffix("-delayed")]]
    if not frameworks:
        pytest.skip("none of transformers+accelerate, lightning is installed")
    ranks = spawn_workers(_frameworks_worker, WORLD, (frameworks,), timeout_s=180)
    return {name: [rank[name] for rank in ranks] for name in frameworks}


def _check(results, framework):
    """Per step, the gradient traffic is exactly DDP's dense averaging (warm-up) or the 1-bit
    exchange (compression), and the framework adds at most a few control bytes."""
    if framework not in results:
        pytest.skip(f"{framework} is not installed")
    ranks = results[framework]
    dense = allreduce_bytes(torch.empty(sum(NUMELS)), WORLD)  # the warm-up's fp32 gradients
    wire = 0  # the most a compression step handed to torch.distributed, on any rank
    for rank in ranks:
        if rank["compression"] == "per_tensor":  # OneBitLamb's default
            compressed = compressed_allreduce_per_tensor_bytes(NUMELS, WORLD, torch.float32)
        else:
            compressed = compressed_allreduce_bytes(
                padded_size(sum(NUMELS), WORLD), WORLD, torch.float32
            )
        assert rank["hooked"], "onebit's hook is not on the DDP model"
        gradient, other = defaultdict(int), defaultdict(int)
        for step, kind, sent in rank["records"]:
            stage = "warmup" if step < FREEZE else "compression"
            (gradient if kind in GRADIENT_TRAFFIC[stage] else other)[step] += sent
        # From the second step on (the first also checks the replicas), STEPS steps in all;
        # the first compression step also sends the 8-byte gradient check.
        assert all(gradient[k] == dense for k in range(1, FREEZE))
        assert all(gradient[k] == compressed + 8 * (k == FREEZE) for k in range(FREEZE, STEPS))
        assert all(other[k] <= CONTROL_BYTES for k in range(1, STEPS)), dict(other)
        # bytes_sent also counts the byte per tensor that says whether a rank had its gradient
        flags = (STEPS - FREEZE) * ring_allreduce_bytes(len(NUMELS), WORLD)
        compression = sum(gradient[k] for k in range(FREEZE, STEPS)) + flags
        assert compression == rank["bytes_sent"]["compression"]
        wire = max(wire, *(gradient[k] + other[k] for k in range(FREEZE + 1, STEPS)))
    assert dense / wire > 30  # 1/32 but for padding, scales and the framework's own bytes
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    print(
        f"\n{framework}: warm-up {dense} B/step (DDP averaging through onebit's hook); "
        f"compression {compressed} B/step of 1-bit exchange + {wire - compressed} B of the "
        f"framework's own, handed to torch.distributed: 1/{dense / wire:.1f} of dense"
    )


@pytest.mark.slow  # a run of each framework
def test_trainer(results):
    _check(results, "trainer")
    assert all(rank["same_as_plain_ddp"] for rank in results["trainer"])


@pytest.mark.slow  # a run of each framework
def test_accelerate(results):
    _check(results, "accelerate")


@pytest.mark.slow  # a run of each framework
def test_lightning(results):
    _check(results, "lightning")


def _check_delayed(results, framework):
    """``delayed_exchange=True``: the last update applied when training ends, so the ranks
    end bit-identical."""
    if framework not in results:
        pytest.skip(f"{framework} is not installed")
    ranks = results[framework]
    assert all(rank["hooked"] for rank in ranks)
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])


@pytest.mark.slow  # a run of each framework
def test_trainer_finishes_a_delayed_exchange(results):
    _check_delayed(results, "trainer-delayed")
    assert all(rank["same_as_plain_ddp"] for rank in results["trainer-delayed"])


@pytest.mark.slow  # a run of each framework
def test_lightning_validates_the_shared_weights_and_finishes_a_delayed_exchange(results):
    _check_delayed(results, "lightning-delayed")
    ranks = results["lightning-delayed"]
    validated = [rank["validated"] for rank in ranks]
    assert len(validated[0]) > 0
    for first, second in zip(*validated, strict=True):  # the shared weights, not predictions
        assert torch.equal(first, second)
