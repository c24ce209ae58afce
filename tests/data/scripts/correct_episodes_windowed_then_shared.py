"""Every rank cuts all episodes into windows and a DistributedSampler gives
each rank the same number of them (the tail that does not share out dropped), so every
rank runs the same number of steps in each epoch."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class WindowDataset(Dataset):
    def __init__(self, episodes, horizon):
        self.episodes = episodes
        self.index = [(e, t) for e, ep in enumerate(episodes) for t in range(len(ep) - horizon)]
        self.horizon = horizon

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        e, t = self.index[i]
        window = self.episodes[e][t : t + self.horizon + 1]
        return window[:-1].flatten(), window[-1]


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    episodes = torch.load("demos.pt")  # a list of [T_i, 4] tensors, T_i differs
    train_set = WindowDataset(episodes, horizon=8)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, drop_last=True)
    loader = DataLoader(train_set, batch_size=64, sampler=sampler, drop_last=True)
    model = DDP(nn.Linear(32, 4).cuda(local_rank), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for epoch in range(100):
        sampler.set_epoch(epoch)
        for obs, action in loader:
            loss = nn.functional.mse_loss(model(obs.cuda(local_rank)), action.cuda(local_rank))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
