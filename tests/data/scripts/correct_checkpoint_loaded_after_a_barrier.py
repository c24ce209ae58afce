"""The trainer of checkpoint_loaded_before_rank_zero_finished.py with the fix:
every rank waits in a barrier until rank 0 has written the best checkpoint,
then loads it."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    best, best_path = float("inf"), "best.pt"
    for _epoch in range(5):
        loss = model(torch.randn(32, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and loss.item() < best:
            best = loss.item()
            torch.save(model.module.state_dict(), best_path)
    dist.barrier()
    state = torch.load(best_path, map_location="cpu")
    model.module.load_state_dict(state)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
