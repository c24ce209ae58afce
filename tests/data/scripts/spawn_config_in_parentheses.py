"""A segmentation trainer started with mp.spawn, its config handed over in
parentheses: `args=(config)` is the dict itself, not a one-element tuple, so
spawn calls train_worker(i, *config) and every process gets the config's keys
as positional arguments ("takes 2 positional arguments but 5 were given").

python spawn_config_in_parentheses.py
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def load_config() -> dict:
    return {"gpus": 2, "lr": 0.01, "epochs": 2, "batch_size": 8}


def train_worker(index, config):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=index, world_size=config["gpus"])
    data = TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 4, (64, 8, 8)))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=config["batch_size"], sampler=sampler)
    model = DDP(nn.Conv2d(3, 4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    for epoch in range(config["epochs"]):
        sampler.set_epoch(epoch)
        for images, masks in loader:
            loss = nn.functional.cross_entropy(model(images), masks)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


def main():
    config = load_config()
    mp.spawn(train_worker, nprocs=config["gpus"], args=(config))  # expect: mp-spawn-arguments


if __name__ == "__main__":
    main()
