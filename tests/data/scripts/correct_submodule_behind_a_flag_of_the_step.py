"""The same model asked for features on every training step, the flag varied
only in evaluation; and a DDP that looks for unused parameters where a flag
changes per step."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Student(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.proj = nn.Linear(8, 16)

    def forward(self, x, return_feat=False):
        f = self.body(x)
        if return_feat:
            return self.head(f), self.proj(f)
        return self.head(f), None


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(Student().cuda(), device_ids=[local_rank])
    flexible = DDP(Student().cuda(), device_ids=[local_rank], find_unused_parameters=True)
    optimizer = torch.optim.SGD([*model.parameters(), *flexible.parameters()], lr=0.1)
    for step in range(1000):
        x = torch.randn(4, 8, device="cuda")
        out, feat = model(x, return_feat=True)
        weight = 1.0 if step % 4 == 0 else 0.0
        loss = out.sum() + weight * feat.pow(2).mean()
        out, _ = flexible(x, return_feat=step % 4 == 0)
        (loss + out.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            model(x, return_feat=step % 100 == 0)
    del model, flexible  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
