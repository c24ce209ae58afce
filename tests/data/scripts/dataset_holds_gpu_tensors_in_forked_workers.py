"""The dataset puts its samples on the GPU once, in __init__, and the
DataLoader's forked workers index them: a forked child cannot use CUDA,
and the first worker dies with "CUDA error: initialization error"."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Embeddings(Dataset):
    def __init__(self, path, device):
        rows = torch.load(path, map_location="cpu")
        self.features = rows[:, :-1].to(device)  # expect: cuda-init-before-fork
        self.targets = rows[:, -1:]

    def __len__(self):
        return len(self.features)

    def __getitem__(self, i):
        return self.features[i], self.targets[i]


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    data = Embeddings("embeddings.pt", device)
    loader = DataLoader(data, batch_size=256, sampler=DistributedSampler(data), num_workers=4)
    model = DDP(nn.Linear(768, 1).to(device), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
