"""An FSDP model's full state dict gathered by every rank, written by rank 0 alone.

Every rank enters state_dict() (an all-gather); with rank0_only=True only rank 0
gets the tensors back, and only the torch.save sits under the rank test.
Runs on CPU ranks with gloo, on GPUs with NCCL.
Run with: torchrun --nproc-per-node 2 correct_fsdp_state_dict_gathered_on_every_rank.py
"""

import datetime
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def main():
    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=datetime.timedelta(seconds=10))
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    model = FSDP(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)), device_id=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _step in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 16, device=device)).sum().backward()
        optimizer.step()
    config = FullStateDictConfig(offload_to_cpu=on_gpu, rank0_only=True)  # offloading CPU shards empties them
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        state = model.state_dict()
    if rank == 0:
        torch.save(state, "model.pt")
    dist.barrier()
    print(f"rank {rank} saved")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
