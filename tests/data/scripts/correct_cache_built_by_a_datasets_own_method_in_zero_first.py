"""The point-cloud dataset that indexes its scans through a method of its own,
built the YOLOv5 way (no finding expected): the training set inside the file's
`torch_distributed_zero_first` context (local rank 0 builds the cache while the
others wait in a barrier, then they read it), the validation set on rank 0 only."""

import json
import os
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Scenes(Dataset):
    def __init__(self, root):
        self.root = root
        self.scenes = sorted(n[:-4] for n in os.listdir(root) if n.endswith(".txt"))
        index_file = os.path.join(root, "cache", "index.json")
        if not os.path.exists(index_file):
            self._build_cache(index_file)
        with open(index_file) as f:
            self.sizes = json.load(f)

    def _build_cache(self, index_file):
        os.makedirs(os.path.dirname(index_file), exist_ok=True)
        sizes = {}
        for scene in self.scenes:
            points = np.loadtxt(os.path.join(self.root, scene + ".txt"), dtype=np.float32)
            np.save(os.path.join(self.root, "cache", scene + ".npy"), points)
            sizes[scene] = len(points)
        with open(index_file, "w") as f:
            json.dump(sizes, f)

    def __len__(self):
        return len(self.scenes)

    def __getitem__(self, i):
        points = np.load(os.path.join(self.root, "cache", self.scenes[i] + ".npy"))
        return torch.from_numpy(points[:64]).mean(0)


@contextmanager
def torch_distributed_zero_first(local_rank):
    if local_rank != 0:
        dist.barrier(device_ids=[local_rank])
    yield
    if local_rank == 0:
        dist.barrier(device_ids=[0])


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    with torch_distributed_zero_first(local_rank):
        data = Scenes("data/scans")
    if dist.get_rank() == 0:
        print("validation scenes:", len(Scenes("data/val_scans")))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data))
    model = DDP(nn.Linear(3, 1).cuda(local_rank), device_ids=[local_rank])
    for points in loader:
        model(points.cuda(local_rank)).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
