"""A dp x tp device mesh sized from LOCAL_WORLD_SIZE, in a job of two 8-GPU nodes
(world-size-mismatch).

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 train.py

The mesh holds one node's eight ranks; ranks 8-15 have no place in it and
init_device_mesh fails. Lint only: it needs GPUs on two nodes.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    gpus_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    tp = 2
    mesh = init_device_mesh("cuda", (gpus_per_node // tp, tp), mesh_dim_names=("dp", "tp"))  # expect: world-size-mismatch
    print(mesh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
