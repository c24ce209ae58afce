"""Hogwild: processes share one model on one GPU, with no process group.

torch.multiprocessing workers update a model kept in shared memory. There is
no init_process_group and no DDP, so "cuda" (the current device, GPU 0) is the
one GPU they are meant to share. Lint only.
"""

import torch
import torch.multiprocessing as mp
from torch import nn


def train(model, device):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 16, device=device)).sum().backward()
        optimizer.step()


def main():
    device = torch.device("cuda")
    model = nn.Linear(16, 4).to(device)
    model.share_memory()
    workers = [mp.Process(target=train, args=(model, device)) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


if __name__ == "__main__":
    main()
