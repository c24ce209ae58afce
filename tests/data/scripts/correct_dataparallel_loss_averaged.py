"""The gathered per-GPU losses averaged before backward; a model that returns
its outputs, with the loss computed outside; the same scalar-loss model
under one process per GPU (DDP gathers nothing)."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(16, 1)

    def forward(self, x, target=None):
        pred = self.net(x)
        if target is None:
            return pred
        return F.mse_loss(pred, target)


def main():
    model = nn.DataParallel(Regressor().cuda())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(100):
        x = torch.randn(64, 16, device="cuda")
        y = torch.randn(64, 1, device="cuda")
        loss = model(x, y)
        loss = loss.mean()
        loss.backward()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    if "LOCAL_RANK" in os.environ:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        ddp = DDP(Regressor().cuda(), device_ids=[local_rank])
        ddp(torch.randn(8, 16, device="cuda"), torch.randn(8, 1, device="cuda")).backward()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
