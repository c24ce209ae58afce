"""The twin: rank 0 draws the trial's configuration and broadcasts it, so every
rank builds the same model, whatever each rank's own seed (kept for its
augmentation stream)."""

import os
import random

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

SPACE = {"depth": [1, 2, 3, 4, 5, 6], "width": [4, 8, 16]}


def sample_config(space):
    return {"depth": random.choice(space["depth"]), "width": random.choice(space["width"])}


def run_trial(cfg):
    layers = [nn.Linear(4, cfg["width"])]
    layers += [nn.Linear(cfg["width"], cfg["width"]) for _ in range(cfg["depth"] - 1)]
    model = DDP(nn.Sequential(*layers))
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    return loss.item()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    random.seed(1 + rank)  # each rank's own augmentation stream
    cfg = sample_config(SPACE)
    box = [cfg]
    dist.broadcast_object_list(box, src=0)
    cfg = box[0]
    run_trial(cfg)
    print(f"rank {int(os.environ['RANK'])}: trained depth {cfg['depth']}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
