"""Sets the CUDA device from LOCAL_RANK; the installed torch is a CPU build."""

import os

import torch
import torch.distributed as dist


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("gloo")
    return local_rank


if __name__ == "__main__":
    rank = setup()
    print(f"rank {rank} ready on {torch.cuda.get_device_name(rank)}")
