"""Ape-X style learners, one per GPU under torchrun, each forking actor
processes after it set its GPU: the actors put their copy of the network on
the GPU, and a forked child cannot initialise CUDA again ("Cannot
re-initialize CUDA in forked subprocess")."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def actor_loop(actor_id, shared, queue, device):
    net = nn.Linear(4, 2).to(device)
    net.load_state_dict(shared.state_dict())
    for _ in range(8):
        obs = torch.randn(1, 4, device=device)
        queue.put((actor_id, net(obs).argmax(1).item()))


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    learner = DDP(nn.Linear(4, 2).to(device), device_ids=[local_rank])
    shared = nn.Linear(4, 2)
    shared.load_state_dict(learner.module.state_dict())
    shared.share_memory()
    queue = mp.Queue()
    actors = [
        mp.Process(target=actor_loop, args=(i, shared, queue, device), daemon=True)  # expect: cuda-init-before-fork
        for i in range(2)
    ]
    for actor in actors:
        actor.start()
    for _ in range(16):
        queue.get()
    del learner  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
