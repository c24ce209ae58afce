"""A face-recognition model whose margin head holds only this rank's share of
the identities (partial FC), built inside the module DDP wraps: with 5 classes
over 2 ranks, rank 0 keeps 3 class centres and rank 1 keeps 2, and DDP's check
that every rank holds the same parameters fails at construction.

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
        self.weight = nn.Parameter(torch.randn(self.num_local, in_features) * 0.01)  # expect: model-differs-across-ranks

    def forward(self, embeddings):
        return F.linear(F.normalize(embeddings), F.normalize(self.weight))


class FaceModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, EMBEDDING), nn.ReLU())
        self.head = ShardedMarginHead(EMBEDDING, NUM_CLASSES)

    def forward(self, images):
        return self.head(self.backbone(images))


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(FaceModel())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        logits = model(torch.randn(4, 16))
        loss = logits.square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print("trained", flush=True)
    del model, optimizer, loss
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
