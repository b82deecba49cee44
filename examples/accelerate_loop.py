"""1-bit Adam in a plain Accelerate loop, on CPU or GPU.

    torchrun --nproc-per-node 2 examples/accelerate_loop.py

Prepare model, optimizer and data as usual, then register onebit's hook on the prepared
model: DDP averages the gradients of the first 10 steps, and the optimizer exchanges its
momentum at 1 bit per element after them.
"""

import torch
from accelerate import Accelerator

import onebit
from onebit.integrations.hf import register_comm_hook

STEPS, FREEZE = 60, 10


def main() -> None:
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=generator)
    y = x @ torch.randn(32, 1, generator=generator)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    onebit_adam = onebit.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE)
    model, optimizer, loader = accelerator.prepare(model, onebit_adam, loader)
    register_comm_hook(model, optimizer)

    for step, (inputs, targets) in zip(range(1, STEPS + 1), loader, strict=False):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 10 == 0:
            accelerator.print(f"step {step}: loss {loss.item():.4f} ({onebit_adam.stage})")
    accelerator.print(f"bytes this rank sent: {onebit_adam.bytes_sent}")


if __name__ == "__main__":
    main()
