"""Forked DataLoader workers that move each sample to the GPU in __getitem__."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


class MovingDataset(Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        return torch.randn(32).cuda(), torch.randn(1).cuda()


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    # CUDA is up in this process before the DataLoader forks its workers
    model = DDP(torch.nn.Linear(32, 1).cuda(), device_ids=[local_rank])
    loader = DataLoader(MovingDataset(), batch_size=32, num_workers=2)
    for x, y in loader:
        torch.nn.functional.mse_loss(model(x), y).backward()
    print(f"rank {dist.get_rank()}: done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
