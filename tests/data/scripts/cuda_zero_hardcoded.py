import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda:0")  # expect: hardcoded-device
    model = nn.Linear(32, 2).to(device)
    model = DDP(model, device_ids=[0])  # expect: hardcoded-device
    state = torch.load("init.pt", map_location="cuda:0")  # expect: hardcoded-device
    model.module.load_state_dict(state)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
