"""An FSDP model's full state dict taken under `if rank == 0:`, the DDP way of saving.

FSDP keeps a shard of every parameter on each rank, so state_dict() is an
all-gather: rank 0 waits in it while rank 1 has moved on to the barrier after
the save, and gloo gives up after the process-group timeout (10 s here, 30 min
by default; NCCL reports a watchdog timeout). Runs on CPU ranks with gloo, on
GPUs with NCCL.
Run with: torchrun --nproc-per-node 2 fsdp_state_dict_gathered_on_rank_zero_only.py
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
    if rank == 0:
        config = FullStateDictConfig(offload_to_cpu=on_gpu, rank0_only=True)  # offloading CPU shards empties them
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            state = model.state_dict()  # expect: fsdp-state-dict
        torch.save(state, "model.pt")
    dist.barrier()
    print(f"rank {rank} saved")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
