"""A dataset that holds its samples as CUDA tensors, read by forked DataLoader workers."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


class GpuDataset(Dataset):
    def __init__(self, device):
        self.x = torch.randn(256, 32, device=device)  # made in the parent, on the GPU
        self.y = torch.randn(256, 1, device=device)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] * 2, self.y[i]


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    loader = DataLoader(GpuDataset(device), batch_size=32, num_workers=2)
    model = DDP(torch.nn.Linear(32, 1).to(device), device_ids=[local_rank])
    for x, y in loader:
        torch.nn.functional.mse_loss(model(x), y).backward()
    print(f"rank {dist.get_rank()}: done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
