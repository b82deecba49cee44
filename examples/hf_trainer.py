"""1-bit LAMB under the Hugging Face Trainer, on CPU or GPU.

    torchrun --nproc-per-node 2 examples/hf_trainer.py

Trains a tiny BERT classifier (built from a config: nothing is downloaded) on synthetic
token sequences for 40 steps, the first 10 uncompressed. ``OneBitCallback`` puts onebit's
hook on the DistributedDataParallel model the Trainer builds, so DDP averages gradients only
during the warm-up; without it DDP would keep sending every gradient densely.
"""

import tempfile

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

import onebit
from onebit.integrations.hf import OneBitCallback

STEPS, FREEZE = 40, 10


class FirstToken(torch.utils.data.Dataset):
    """Sequences of 16 tokens; the label says whether the first one is below 32."""

    def __init__(self, size: int = 2048) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(5, 64, (size, 16), generator=generator)
        self.labels = (self.tokens[:, 0] < 32).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.labels[i]}


def main() -> None:
    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=2,
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    optimizer = onebit.OneBitLamb(
        model.parameters(), lr=2e-2, freeze_step=FREEZE, weight_decay=0.01
    )
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=STEPS,
            per_device_train_batch_size=16,
            lr_scheduler_type="constant",
            logging_steps=10,
            save_strategy="no",
            report_to="none",
            use_cpu=not torch.cuda.is_available(),
        )
        trainer = Trainer(model, args, train_dataset=FirstToken(), optimizers=(optimizer, None))
        trainer.add_callback(OneBitCallback(trainer))
        trainer.train()
    if trainer.is_world_process_zero():
        print(f"stage: {optimizer.stage}; bytes this rank sent: {optimizer.bytes_sent}")


if __name__ == "__main__":
    main()
