"""The annotation cache is built by rank 0 while the others wait, and a
per-rank file needs no turns at all."""

import json
import os
import pickle

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def build_cache(root, cache):
    if not os.path.exists(cache):
        items = [json.load(open(os.path.join(root, n))) for n in sorted(os.listdir(root))]
        with open(cache, "wb") as f:
            pickle.dump(items, f)


class Boxes(Dataset):
    def __init__(self, cache):
        with open(cache, "rb") as f:
            self.items = pickle.load(f)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return torch.tensor(self.items[i]["box"], dtype=torch.float32)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    if rank != 0:
        dist.barrier()  # wait for rank 0 to build the cache
    build_cache("data/train", "data/boxes.pkl")
    if rank == 0:
        dist.barrier()
    stats = f"data/stats_rank{rank}.pkl"
    if not os.path.exists(stats):
        with open(stats, "wb") as f:
            pickle.dump({"rank": rank}, f)
    data = Boxes("data/boxes.pkl")
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data))
    model = DDP(nn.Linear(4, 1).cuda(local_rank), device_ids=[local_rank])
    for boxes in loader:
        model(boxes.cuda(local_rank)).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
