"""Each epoch every rank saves the same checkpoint file, and resumes from it.

torchrun --nproc_per_node=2 checkpoint_saved_by_every_rank.py
Two processes write last.pt at once; a run that resumes can read a truncated
archive ("PytorchStreamReader failed reading zip archive").
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def save_checkpoint(model, epoch, path):
    state = {"model": model.module.state_dict(), "epoch": epoch}
    torch.save(state, path)  # expect: checkpoint-written-by-every-rank


def main():
    dist.init_process_group("gloo")
    model = DDP(nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if os.path.exists("last.pt"):
        model.module.load_state_dict(torch.load("last.pt", map_location="cpu")["model"])
    for epoch in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        save_checkpoint(model, epoch, "last.pt")
    torch.save(model.module.state_dict(), "final.pt")  # expect: checkpoint-written-by-every-rank
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
