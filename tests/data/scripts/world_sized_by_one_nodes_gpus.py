"""Two 8-GPU nodes under torchrun (`torchrun --nnodes=2 --nproc_per_node=8 ...` on
each): the rank is the launcher's, 0..15, but the world is sized by this node's
GPUs, 8, so ranks 8-15 are outside it and the rendezvous fails. Lint only: it
needs GPUs on two nodes."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend="nccl",
        init_method="env://",
        world_size=torch.cuda.device_count(),  # expect: world-size-mismatch
        rank=int(os.environ["RANK"]),
    )
    model = DDP(nn.Linear(8, 2).cuda(), device_ids=[local_rank])
    model(torch.randn(4, 8).cuda()).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
