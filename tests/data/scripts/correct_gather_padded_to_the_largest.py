"""Gathering rows whose count differs per rank the right way: the sizes
first, then every rank pads to the largest (also a strided share built in
main() and padded to the common ceil(n / world) rows where it is gathered,
two calls down); per-sample scores whose function reuses their name and `_`
after the gather (the comprehension's `_` is its own); and per-sample logits, which a
DistributedSampler makes the same size on every rank, also when they come
batch by batch from its loader."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


@torch.no_grad()
def gather_confident(scores, world_size):
    confident = scores[scores > 0.5]
    size = torch.tensor([confident.shape[0]], device=scores.device)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size)
    largest = int(max(s.item() for s in sizes))
    padded = torch.zeros(largest, device=scores.device)
    padded[: confident.shape[0]] = confident
    parts = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded)
    return [part[: int(n.item())] for part, n in zip(parts, sizes)]


@torch.no_grad()
def gather_logits(model, batches, world_size):
    logits = torch.cat([model(x) for x in batches])
    everyone = [torch.zeros_like(logits) for _ in range(world_size)]
    dist.all_gather(everyone, logits)
    return torch.cat(everyone)


@torch.no_grad()
def gather_features(model, ds, world_size):
    loader = DataLoader(ds, batch_size=64, sampler=DistributedSampler(ds, shuffle=False))
    feats = []
    for x, _ in loader:
        feats.append(model(x))
    local = torch.cat(feats)
    everyone = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(everyone, local)
    return torch.cat(everyone)


@torch.no_grad()
def gather_scores(model, batches, world_size):
    scores = torch.cat([model(x).sigmoid() for x in batches])
    parts = [torch.empty_like(scores) for _ in range(world_size)]
    dist.all_gather(parts, scores)
    scores = torch.cat(parts)
    _, order = torch.unique(scores, return_inverse=True)
    return scores, order


@torch.no_grad()
def embed_share(model, texts, per, device):
    x = model(torch.stack(texts).to(device))
    pad = torch.zeros(per - x.size(0), x.size(1), device=device)
    x = torch.cat([x, pad])
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, x)
    return torch.stack(gathered, 1).reshape(-1, x.size(1))


def evaluate(model, texts, per, device):
    return embed_share(model, texts, per, device)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(nn.Linear(8, 3).cuda(local_rank), device_ids=[local_rank])
    batches = [torch.randn(4, 8, device=f"cuda:{local_rank}") for _ in range(2)]
    logits = gather_logits(model, batches, dist.get_world_size())
    gather_scores(model, batches, dist.get_world_size())
    gather_confident(logits.softmax(-1).max(-1).values, dist.get_world_size())
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = [torch.randn(8) for _ in range(101)]
    per = (len(corpus) + world - 1) // world
    evaluate(model.module, corpus[rank::world], per, f"cuda:{local_rank}")
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
