"""A script whose own launch notes start more processes than the GPUs allow:
the Python is right, the launch written beside it is not.

Launch on one node, GPU 3 kept for the generation server:
"""

# CUDA_VISIBLE_DEVICES=0,1,2 torchrun --nproc_per_node=4 this_file.py  # expect: world-size-exceeds-devices
#
# On the cluster (sbatch):
#   #SBATCH --nodes=2
#   #SBATCH --ntasks-per-node=4
#   #SBATCH --gpus-per-node=4
#   srun torchrun --nnodes=2 --nproc_per_node=4 launch_lines_in_the_file_contradict.py  # expect: slurm-without-torchrun

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
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
