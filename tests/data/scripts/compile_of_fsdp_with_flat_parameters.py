"""torch.compile of a model FSDP wrapped with its default use_orig_params=False
(torch-compile-ddp): Dynamo does not trace FSDP1's flattened parameters, so the
distributed run fails where a one-GPU run compiles.

    torchrun --nproc_per_node=8 compile_of_fsdp_with_flat_parameters.py
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).cuda()
    model = FSDP(model, device_id=local_rank, sync_module_states=True)
    model = torch.compile(model)  # expect: torch-compile-ddp
    loss = model(torch.randn(4, 64, device="cuda")).sum()
    loss.backward()
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
