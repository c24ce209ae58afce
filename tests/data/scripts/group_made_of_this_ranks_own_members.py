"""Sequence-parallel and data-parallel groups where each rank creates only the
groups it belongs to (collective-mismatch).

new_group is collective over the default group: every process must call it for
every group, in the same order. Here rank 0 asks for [0, 1] while rank 2 asks
for [2, 3] in the same call, so the ranks hang or pair wrong communicators.
"""

import os

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    sp = 2
    sp_rank, dp_rank = rank % sp, rank // sp
    sp_group = dist.new_group([dp_rank * sp + i for i in range(sp)])  # expect: collective-mismatch
    dp_group = dist.new_group([j * sp + sp_rank for j in range(world // sp)])  # expect: collective-mismatch
    print(sp_group, dp_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
