"""The same sharded margin head kept out of DDP, as partial-FC trainers keep it:
DDP wraps the backbone (the same on every rank); each rank trains its own share
of the class centres with its own optimizer, nothing to average.

Runs under torchrun on CPU ranks (gloo)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

NUM_CLASSES = 5
EMBEDDING = 8


class ShardedMarginHead(nn.Module):
    def __init__(self, in_features, num_classes):
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        base, extra = divmod(num_classes, world)
        self.num_local = base + (1 if rank < extra else 0)
        self.class_start = base * rank + min(rank, extra)
        self.weight = nn.Parameter(torch.randn(self.num_local, in_features) * 0.01)

    def forward(self, embeddings):
        return F.linear(F.normalize(embeddings), F.normalize(self.weight))


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    backbone = DDP(nn.Sequential(nn.Linear(16, EMBEDDING), nn.ReLU()))
    head = ShardedMarginHead(EMBEDDING, NUM_CLASSES)
    optimizer = torch.optim.SGD([*backbone.parameters(), *head.parameters()], lr=0.1)
    for _ in range(3):
        logits = head(backbone(torch.randn(4, 16)))
        loss = logits.square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print("trained", flush=True)
    del backbone, head, optimizer, loss
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
