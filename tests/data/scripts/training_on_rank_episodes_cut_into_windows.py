"""Each rank takes every world-th episode and cuts it into training windows:
episodes have different lengths, so the ranks hold different numbers of
windows and batches, and the rank with the fewest stops first while the
others wait in backward."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


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
    train_set = WindowDataset(episodes[rank::world], horizon=8)
    loader = DataLoader(train_set, batch_size=64, shuffle=True, drop_last=True)  # expect: uneven-inputs
    model = DDP(nn.Linear(32, 4).cuda(local_rank), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for epoch in range(100):
        for obs, action in loader:
            loss = nn.functional.mse_loss(model(obs.cuda(local_rank)), action.cuda(local_rank))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
