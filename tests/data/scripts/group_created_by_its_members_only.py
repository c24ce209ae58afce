"""Tensor x data parallel groups built the way that hangs: each rank calls
new_group only for the groups it belongs to, but new_group is collective over the
whole default group, members or not. Lint only (it needs eight processes)."""

import os

import torch
import torch.distributed as dist


def init_groups(tp_size: int):
    world, rank = dist.get_world_size(), dist.get_rank()
    tp_group = None
    for i in range(world // tp_size):
        ranks = list(range(i * tp_size, (i + 1) * tp_size))
        if rank in ranks:
            tp_group = dist.new_group(ranks)  # expect: collective-mismatch
    return tp_group


def main() -> None:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    group = init_groups(tp_size=2)
    t = torch.ones(1).cuda()
    dist.all_reduce(t, group=group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
