"""The twin of contrastive_gather_after_a_collate_that_drops_pairs.py: the
collate_fn still drops the pairs with an empty passage, so each rank's batch
keeps its own number of pairs; the ranks exchange their sizes first, pad
to the largest, and cut the padding off the gathered rows (the labels
offset by the pairs of the ranks before)."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Pairs(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        passage_chars = 0 if i % 3 == 0 else 40  # every third passage is empty
        return torch.full((8,), float(i)), torch.full((8,), -float(i)), passage_chars


def collate(batch):
    batch = [(q, p) for q, p, chars in batch if chars > 0]  # drop junk pairs
    return torch.stack([q for q, _ in batch]), torch.stack([p for _, p in batch])


def gather_with_grad(x, rank, world):
    size = torch.tensor([x.shape[0]])
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    counts = [int(s.item()) for s in sizes]
    padded = torch.cat([x.detach(), x.new_zeros(max(counts) - x.shape[0], x.shape[1])])
    bufs = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(bufs, padded.contiguous())
    parts = [buf[:n] for buf, n in zip(bufs, counts)]
    parts[rank] = x
    return torch.cat(parts, dim=0), sum(counts[:rank])


def contrastive_loss(q, p, rank, world):
    all_p, before = gather_with_grad(p, rank, world)
    labels = torch.arange(q.size(0)) + before
    return F.cross_entropy(q @ all_p.T, labels)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 4))
    ds = Pairs()
    loader = DataLoader(
        ds, batch_size=4, sampler=DistributedSampler(ds, shuffle=False), collate_fn=collate
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    for q, p in loader:
        loss = contrastive_loss(model(q), model(p), rank, world)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    print(f"rank {int(os.environ['RANK'])}: trained {steps} steps", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
