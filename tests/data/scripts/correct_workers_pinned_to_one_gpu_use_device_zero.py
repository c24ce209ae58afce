"""The twin of workers_pinned_to_one_gpu_then_picked_by_rank.py: each worker, given
one GPU through CUDA_VISIBLE_DEVICES, uses device 0, the GPU it was given.

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
    torch.cuda.set_device(0)  # the one GPU this worker sees
    dist.init_process_group("nccl")
    model = DDP(torch.nn.Linear(8, 2).cuda(), device_ids=[0])
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        sys.exit(launch(os.environ.get("GPUS", "0,1").split(",")))
