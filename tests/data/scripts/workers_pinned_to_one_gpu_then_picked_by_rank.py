"""A launcher that gives each worker one GPU through CUDA_VISIBLE_DEVICES, and a
worker that still picks its device by its local rank: inside worker k the GPU it
was given is cuda:0, its only device, so set_device(1) on the second worker fails
with "CUDA error: invalid device ordinal" (blind sets gg's 03 and gl's 20).

Needs GPUs (not run by the tests; the failure is CUDA's own, read from the text).
"""

import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(gpus: list[str]) -> int:
    port = free_port()
    workers = []
    for local_rank, gpu in enumerate(gpus):
        env = dict(
            os.environ,
            CUDA_VISIBLE_DEVICES=gpu,
            RANK=str(local_rank),
            LOCAL_RANK=str(local_rank),
            WORLD_SIZE=str(len(gpus)),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        workers.append(subprocess.Popen([sys.executable, __file__, "--worker"], env=env))
    return max(worker.wait() for worker in workers)


def worker() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)  # expect: cuda-visible-devices-mismatch
    dist.init_process_group("nccl")
    model = DDP(torch.nn.Linear(8, 2).cuda(), device_ids=[local_rank])
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        sys.exit(launch(os.environ.get("GPUS", "0,1").split(",")))
