"""A torch.compile'd model under DDP whose best checkpoint is saved from the wrapper's
`.module` (the compiled module) and loaded back into a fresh model that is not
compiled, for the final test:

    torchrun --nproc_per_node=2 train.py

Compiled with backend="eager" so that it runs on CPU ranks without a C++
compiler; the saved keys are the same under inductor. Runs under torchrun
(gloo): every key of the checkpoint carries the compiled module's prefix, and
the strict load fails on both ranks with Missing and Unexpected key(s).
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    model = torch.compile(model, backend="eager")
    model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    best_path = os.path.join(os.getcwd(), "best.pt")
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    if rank == 0:
        torch.save(model.module.state_dict(), best_path)
    dist.barrier()
    final = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    final.load_state_dict(torch.load(best_path, map_location="cpu"))  # expect: torch-compile-ddp
    print(f"rank {rank} loaded the best weights", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
