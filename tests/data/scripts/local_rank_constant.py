import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    local_rank = 0  # expect: local-rank-not-from-env
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = nn.Linear(64, 64).to(torch.device("cuda", local_rank))
    ddp = DDP(model, device_ids=[local_rank])
    ddp(torch.randn(2, 64).to(local_rank)).sum().backward()
    del ddp  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
