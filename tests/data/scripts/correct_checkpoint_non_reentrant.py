"""Activation checkpointing that DDP with find_unused_parameters=True can
follow: the non-reentrant variant, for torch and for a Hugging Face model
(no finding expected). Lint only: it needs a model from the Hub and GPUs."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from transformers import AutoModel


class Fusion(nn.Module):
    def __init__(self):
        super().__init__()
        self.text = AutoModel.from_pretrained("distilbert-base-uncased")
        self.text.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
        self.blocks = nn.ModuleList(nn.Linear(768, 768) for _ in range(3))
        self.aux_head = nn.Linear(768, 2)
        self.head = nn.Linear(768, 2)

    def forward(self, input_ids, use_aux):
        x = self.text(input_ids=input_ids).last_hidden_state[:, 0]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.aux_head(x) if use_aux else self.head(x)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(Fusion().cuda(), device_ids=[local_rank], find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    for step in range(4):
        logits = model(torch.randint(0, 1000, (4, 32)).cuda(), use_aux=step % 2 == 1)
        loss = logits.logsumexp(1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
