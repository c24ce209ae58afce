"""Rank 0 keeps the best checkpoint in the job's working folder, on the file system
every node mounts, and after training every rank loads it back for the test
evaluation, in a job of two nodes:

    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=1
    srun torchrun --nnodes=2 --nproc_per_node=1 \\
        --rdzv-backend=c10d --rdzv-endpoint=$head:29400 train.py

Runs as two torchrun agents, one per node, each with its own $SLURM_TMPDIR and
one shared working folder: both ranks load the checkpoint rank 0 saved.
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
    model = DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    work_dir = os.path.join("checkpoints", "run")
    best_path = os.path.join(work_dir, "best.pt")
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    if rank == 0:
        os.makedirs(work_dir, exist_ok=True)
        torch.save({"model": model.module.state_dict(), "step": 1}, best_path)
    dist.barrier()
    state = torch.load(best_path, map_location="cpu")
    model.module.load_state_dict(state["model"])
    print(f"rank {rank} loaded step {state['step']}", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
