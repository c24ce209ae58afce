"""A single-GPU config kept for a torchrun launch: the device is a config
field whose default is cuda:0 (a dataclass field, a config dict), or a
conditional that picks cuda:0 when a GPU is there."""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class Config:
    lr: float = 3e-4
    device: str = "cuda:0"  # expect: hardcoded-device


EVAL = {"batch_size": 64, "eval_device": "cuda:0"}  # expect: hardcoded-device


def evaluate(model, batches):
    with torch.no_grad():
        return sum(model(x.to(EVAL["eval_device"])).sum().item() for x in batches)


def main():
    cfg = Config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device(cfg.device)
    model = DDP(nn.Linear(32, 2).to(device), device_ids=[local_rank])
    spare = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")  # expect: hardcoded-device
    print(evaluate(model, [torch.randn(4, 32, device=spare)]))
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
