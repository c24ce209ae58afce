"""Samples printed from a sharded model on rank 0 only: FSDP2's fully_shard and
FSDP1's wrapper all-gather each layer's parameters in every forward, so rank 0
waits for ranks that never run it."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.head = nn.Linear(32, 100)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def generate(self, ids, steps=8):
        for _ in range(steps):
            ids = torch.cat([ids, self(ids)[:, -1:].argmax(-1)], dim=1)
        return ids


@torch.no_grad()
def print_samples(model, prompt):
    print(model.generate(prompt))  # expect: zero3-partitioned-parameters


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    model = TinyLM().cuda()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    teacher = FSDP(TinyLM().cuda())
    optimizer = torch.optim.AdamW(model.parameters())
    prompt = torch.zeros(1, 4, dtype=torch.long, device="cuda")
    for step in range(100):
        ids = torch.randint(0, 100, (8, 16), device="cuda")
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0 and rank == 0:
            print_samples(model, prompt)
            print(teacher(prompt).shape)  # expect: zero3-partitioned-parameters
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
