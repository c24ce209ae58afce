"""A helper wraps the model in FSDP, and main's own save() closure gathers the
full state dict on every rank (rank0_only keeps it on rank 0), then only
rank 0 writes the file."""

import functools
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy


def wrap(model, device):
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=1_000)
    return FSDP(model, auto_wrap_policy=policy, device_id=device)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    model = wrap(model, torch.device("cuda", local_rank))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def save(path):
        config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            state = model.state_dict()
        if rank == 0:
            torch.save(state, path)
        dist.barrier()

    for step in range(1, 1001):
        x = torch.randn(32, 512, device="cuda")
        loss = model(x).logsumexp(dim=-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 500 == 0:
            save(f"checkpoint_{step}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
