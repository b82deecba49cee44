"""1-bit LAMB with PyTorch Lightning, on CPU or GPU.

    torchrun --nproc-per-node 2 examples/lightning_ddp.py

``configure_optimizers`` returns one onebit optimizer and the Trainer runs
``OneBitDDPStrategy``, which registers onebit's hook on the DDP model following it.
"""

import os

import lightning.pytorch as pl
import torch

import onebit
from onebit.integrations.lightning import OneBitDDPStrategy

STEPS, FREEZE = 60, 10


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
        )

    def training_step(self, batch, batch_index):
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.net(inputs), targets)
        if batch_index % 10 == 9:
            self.print(f"step {batch_index + 1}: loss {loss.item():.4f}")
        return loss

    def configure_optimizers(self):
        return onebit.OneBitLamb(
            self.parameters(), lr=2e-2, freeze_step=FREEZE, weight_decay=0.01, max_coeff=0.3
        )

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 32, generator=generator)
        y = x @ torch.randn(32, 1, generator=generator)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)

    def on_train_end(self) -> None:
        optimizer = self.optimizers().optimizer
        self.print(f"stage: {optimizer.stage}; bytes this rank sent: {optimizer.bytes_sent}")


def main() -> None:
    torch.manual_seed(0)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=local,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // local,
        strategy=OneBitDDPStrategy(),
        max_steps=STEPS,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(Regression())


if __name__ == "__main__":
    main()
