"""A DataLoader worker is killed by SIGKILL while it loads a large sample."""

import os
import signal

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class BigImages(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        if index == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.zeros(3, 64, 64)


def main():
    dist.init_process_group("gloo")
    ds = BigImages()
    loader = DataLoader(
        ds, batch_size=4, sampler=DistributedSampler(ds, shuffle=False), num_workers=2
    )
    for batch in loader:
        batch.mean()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
