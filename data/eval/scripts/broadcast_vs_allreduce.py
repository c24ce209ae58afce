"""Rank 0 broadcasts the new learning rate while the others already all_reduce the loss."""

from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    rank = dist.get_rank()
    loss = torch.tensor([0.5 + rank])
    if rank == 0:
        lr = torch.tensor([1e-3])
        dist.broadcast(lr, src=0)
    dist.all_reduce(loss)
    print(rank, loss.item())


if __name__ == "__main__":
    main()
