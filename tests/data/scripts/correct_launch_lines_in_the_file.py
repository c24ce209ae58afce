"""The fix of launch_lines_in_the_file_contradict.py (no finding expected):
the launch notes start one process per visible GPU, and under Slurm either
one torchrun per node or srun's own tasks without torchrun.

CUDA_VISIBLE_DEVICES=0,1,2 torchrun --standalone --nproc_per_node=3 correct_launch_lines_in_the_file.py
CUDA_VISIBLE_DEVICES=0,1,2,3 python -m torch.distributed.run --nproc_per_node 4 \
    correct_launch_lines_in_the_file.py

sbatch, one torchrun agent per node:
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=1
    #SBATCH --gpus-per-node=4
    srun torchrun --nnodes=2 --nproc_per_node=4 correct_launch_lines_in_the_file.py

or one task per GPU, started by srun itself (the script reads Slurm's variables):
    srun --ntasks-per-node=4 python correct_launch_lines_in_the_file.py
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    if "SLURM_PROCID" in os.environ and "LOCAL_RANK" not in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ["LOCAL_RANK"] = os.environ["SLURM_LOCALID"]
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(nn.Linear(8, 1).cuda(local_rank), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(10):
        loss = model(torch.randn(4, 8, device=local_rank)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
