"""Checkpoints whose keys fit the model they are loaded into (no finding
expected): the inner model saved through `.module` and loaded into a plain
model, and a checkpoint saved from the wrapper loaded back into the wrapper."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def build():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def evaluate(path):
    plain = build()
    plain.load_state_dict(torch.load(path, map_location="cpu"))
    print(plain(torch.randn(2, 8)))


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo")
    model = DDP(build())
    if os.path.exists("wrapped.pt"):
        model.load_state_dict(torch.load("wrapped.pt", map_location="cpu")["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    if local_rank == 0:
        torch.save(model.module.state_dict(), "plain.pt")
        torch.save({"model": model.state_dict()}, "wrapped.pt")
    dist.barrier()
    if local_rank == 0:
        evaluate("plain.pt")
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
