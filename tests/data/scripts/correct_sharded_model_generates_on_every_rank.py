"""Every rank runs the sharded model's generate() and rank 0 prints it; a DDP
model (not sharded) may generate on rank 0 alone through `.module`."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.head = nn.Linear(32, 100)

    def forward(self, ids):
        return self.head(self.embed(ids))

    def generate(self, ids, steps=8):
        for _ in range(steps):
            ids = torch.cat([ids, self(ids)[:, -1:].argmax(-1)], dim=1)
        return ids


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    model = TinyLM().cuda()
    fully_shard(model)
    small = DDP(TinyLM().cuda(), device_ids=[local_rank])
    prompt = torch.zeros(1, 4, dtype=torch.long, device="cuda")
    for step in range(100):
        ids = torch.randint(0, 100, (8, 16), device="cuda")
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss = loss + nn.functional.cross_entropy(small(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        if step % 50 == 0:
            with torch.no_grad():
                sample = model.generate(prompt)
            if rank == 0:
                print(sample)
                with torch.no_grad():
                    print(small.module.generate(prompt))
    del small  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
