"""Each rank reads its own files (files[rank::world]); the dataset is built
from them a few steps later, so no DistributedSampler is needed, and the
ranks agree on the number of steps (the smallest share's) before training."""

import glob
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset


def load(paths):
    return torch.cat([torch.load(path, map_location="cpu") for path in paths])


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = sorted(glob.glob("shards/*.pt"))[rank::world]
    rows = load(mine)
    cut = int(0.9 * len(rows))
    train_rows, _held_out = rows[:cut], rows[cut:]
    features, targets = train_rows[:, :-1], train_rows[:, -1:]
    train_set = TensorDataset(features, targets)
    loader = DataLoader(train_set, batch_size=32, shuffle=True)
    model = DDP(nn.Linear(features.shape[1], 1).cuda(local_rank), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = torch.tensor(len(loader), device=f"cuda:{local_rank}")
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    for _, (x, y) in zip(range(int(steps)), loader):
        loss = nn.functional.mse_loss(model(x.cuda(local_rank)), y.cuda(local_rank))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
