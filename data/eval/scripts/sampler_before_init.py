"""Builds the data pipeline (with a DistributedSampler) before init_process_group."""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Squares(Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor([float(i * i)])


def build_loader():
    ds = Squares()
    return DataLoader(ds, batch_size=50, sampler=DistributedSampler(ds, shuffle=True))


def main():
    loader = build_loader()
    dist.init_process_group("gloo")
    for x, _ in loader:
        pass
    print(dist.get_rank(), x.shape)


if __name__ == "__main__":
    main()
