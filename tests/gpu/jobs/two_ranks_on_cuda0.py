"""Two ranks that both pick cuda:0 (a hard-coded device) and wrap the model in DDP over NCCL."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    model = DDP(torch.nn.Linear(64, 8).cuda(), device_ids=[0])
    loss = model(torch.randn(32, 64, device="cuda")).sum()
    loss.backward()
    print(f"rank {dist.get_rank()}: step done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
