"""Each rank embeds its strided share of a corpus, then all_gather.

corpus[rank::world] holds one item more on the first len % world ranks, so
the embeddings differ in rows across ranks while every rank receives into
buffers shaped like its own. The same through a loader over
Subset(ds, range(rank, len(ds), world)), its batches embedded and concatenated,
also where main() builds that loader and hands it down two calls to the
function that gathers.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Subset, TensorDataset


@torch.no_grad()
def embed_corpus(encoder, corpus, rank, world, device):
    mine = corpus[rank::world]
    emb = encoder(torch.stack(mine).to(device))
    gathered = [torch.empty_like(emb) for _ in range(world)]
    dist.all_gather(gathered, emb)  # expect: collective-mismatch
    return torch.cat(gathered)


@torch.no_grad()
def embed_split(model, ds, rank, world, device):
    shard = Subset(ds, list(range(rank, len(ds), world)))
    embs = []
    for x, _ in DataLoader(shard, batch_size=64):
        embs.append(model(x.to(device)))
    local = torch.cat(embs)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)  # expect: collective-mismatch
    return torch.cat(gathered)


@torch.no_grad()
def gather_features(model, loader, device):
    feats = []
    for x, _ in loader:
        feats.append(model(x.to(device)))
    feats = torch.cat(feats)
    out = [torch.zeros_like(feats) for _ in range(dist.get_world_size())]
    dist.all_gather(out, feats)  # expect: collective-mismatch
    return torch.cat(out)


def knn_monitor(model, bank_loader, device):
    return gather_features(model, bank_loader, device).norm(dim=1)


def main():
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    encoder = nn.Linear(16, 8).to(device)
    corpus = [torch.randn(16) for _ in range(1001)]
    index = embed_corpus(encoder, corpus, dist.get_rank(), dist.get_world_size(), device)
    rank, world = dist.get_rank(), dist.get_world_size()
    bank = TensorDataset(torch.randn(1001, 16), torch.zeros(1001))
    bank_loader = DataLoader(Subset(bank, range(rank, len(bank), world)), batch_size=64)
    norms = knn_monitor(encoder, bank_loader, device)
    if dist.get_rank() == 0:
        print(index.shape, norms.shape)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
