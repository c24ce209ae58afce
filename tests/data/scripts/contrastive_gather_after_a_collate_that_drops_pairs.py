"""In-batch-negative contrastive training whose collate_fn drops the pairs
with an empty passage (boilerplate the corpus still holds): each rank's
batch keeps its own number of pairs, and the embeddings are all_gathered
into buffers shaped like the local batch, so the ranks pass all_gather
tensors of different sizes."""

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
    bufs = [torch.zeros_like(x) for _ in range(world)]
    dist.all_gather(bufs, x.detach().contiguous())  # expect: collective-mismatch
    bufs[rank] = x
    return torch.cat(bufs, dim=0)


def contrastive_loss(q, p, rank, world):
    all_p = gather_with_grad(p, rank, world)
    labels = torch.arange(q.size(0)) + rank * q.size(0)
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
