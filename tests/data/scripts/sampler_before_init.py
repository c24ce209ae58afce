import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_loader():
    data = TensorDataset(torch.randn(100, 4), torch.randn(100, 1))
    sampler = DistributedSampler(data)  # expect: process-group-not-initialized
    return DataLoader(data, batch_size=10, sampler=sampler)


def main():
    loader = make_loader()
    rank = dist.get_rank()  # expect: process-group-not-initialized
    dist.init_process_group("gloo")
    model = DDP(nn.Linear(4, 1))
    for x, y in loader:
        nn.functional.mse_loss(model(x), y).backward()
    print(f"rank {rank} done")


if __name__ == "__main__":
    main()
