"""Each rank trains on its own share of the files (files[rank::world]) until
it runs out: the shares hold different numbers of samples, and the rank with
the fewest batches stops first while the others wait in backward."""

import glob
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, TensorDataset
from tqdm import tqdm


def load(path):
    rows = torch.load(path, map_location="cpu")
    return TensorDataset(rows[:, :-1], rows[:, -1:])


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    station_files = sorted(glob.glob("stations/*.pt"))
    mine = station_files[rank::world]
    train_set = ConcatDataset([load(path) for path in mine])
    loader = DataLoader(train_set, batch_size=64, shuffle=True)  # expect: uneven-inputs
    model = DDP(nn.Linear(8, 1).cuda(local_rank), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(10):
        for x, y in tqdm(loader, disable=rank != 0):
            loss = nn.functional.mse_loss(model(x.cuda(local_rank)), y.cuda(local_rank))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    print(os.path.join("runs", "done"), ", ".join(mine))
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
