"""A dataset that parses its annotations once and caches them in a file:
under torchrun every rank misses the file on the first run and writes it."""

import json
import os
import pickle

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Boxes(Dataset):
    def __init__(self, root):
        cache = os.path.join(root, "boxes.pkl")
        if os.path.isfile(cache):
            with open(cache, "rb") as f:
                self.items = pickle.load(f)
        else:
            self.items = [json.load(open(os.path.join(root, n))) for n in sorted(os.listdir(root))]
            with open(cache, "wb") as f:
                pickle.dump(self.items, f)  # expect: dataset-cache-race
        means = os.path.join(root, "means.npy")
        if not os.path.exists(means):
            np.save(means, np.zeros(4))  # expect: dataset-cache-race
        self.means = np.load(means)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return torch.tensor(self.items[i]["box"], dtype=torch.float32) - torch.from_numpy(self.means)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    data = Boxes("data/train")
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data))
    model = DDP(nn.Linear(4, 1).cuda(local_rank), device_ids=[local_rank])
    for boxes in loader:
        model(boxes.cuda(local_rank)).sum().backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
