"""A click-through model whose categorical features are hashed into embedding
buckets with Python's built-in hash(): string hashes are salted per process, so
every rank puts the same feature value in another bucket and the ranks train
different feature-to-row mappings under one synchronised model."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

BUCKETS = 100_000
COLUMNS = ("site", "app", "device")


def bucket_ids(row):
    return [hash(f"{c}={row[c]}") % BUCKETS for c in COLUMNS]  # expect: rank-divergent-data-split


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(nn.EmbeddingBag(BUCKETS, 16, mode="sum").cuda(), device_ids=[local_rank])
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.01)
    rows = [{"site": "a1", "app": "news", "device": "ios"}] * 256
    for row in rows:
        ids = torch.tensor([bucket_ids(row)], device="cuda")
        loss = model(ids).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
